"""GPU tier: context parallelism on the Transformer Engine spec (TE's attention with the CP group,
parallel.cp_comm_type p2p) gives the per-token logprobs, entropies, loss and grad norm of CP=1,
padded and packed (THD), through tests/dist/cp_worker.py on two GPUs over NCCL. Skipped without
CUDA, transformer-engine or a second GPU (two CP ranks cannot share one device under NCCL).

Never run yet (no machine with two GPUs was lent): the fp32 tolerance below is a first guess,
looser than the CPU tier's 1e-6 because TE's kernels may use TF32 and another summation order."""
import json
import os
import subprocess
import sys

import pytest
import torch

from gpu_support import REPO, child_env, make_hf, requires_cuda

pytestmark = requires_cuda

FP32_MAX_ABS = 1e-4
REF, LAYOUTS = "1,1,1,0", ["1,1,2,0", "1,1,2,1"]


def test_te_context_parallel_equals_cp1(tmp_path):
    pytest.importorskip("transformer_engine", reason="transformer-engine is not installed")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for CP=2 (found {torch.cuda.device_count()})")
    from megarl.common.net import free_port

    hf, out = make_hf(tmp_path / "hf", seed=3), tmp_path / "cp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(REPO, "tests", "dist", "cp_worker.py"), hf, str(out),
           REF, *LAYOUTS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    for layout in LAYOUTS:
        got, ref = r[layout], r[REF]
        for key in ("logp", "entropy"):
            diff = max(abs(x - y) for a, b in zip(got[key], ref[key]) for x, y in zip(a, b))
            assert diff <= FP32_MAX_ABS, (layout, key, diff)
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-4 * ref["grad_norm"], layout
