"""GPU tier: the Transformer Engine spec and bf16 (skipped without CUDA; never faked)."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_te_spec_selected_and_bf16_config(tmp_path):
    from megarl import compat
    from megarl.models import builder
    from megarl.models.random_hf import tiny_config, write_random_hf
    from megarl.models.registry import read_model_args

    args = read_model_args(write_random_hf(str(tmp_path), tiny_config()))
    use_te = builder.resolve_spec("auto")
    assert use_te == compat.HAVE_TE
    cfg = builder.transformer_config(args, tp=1, pp=1, dtype="bfloat16", use_te=use_te)
    assert cfg.bf16 and cfg.params_dtype == torch.bfloat16 and not cfg.use_cpu_initialization


def test_te_logprobs_match_local_spec(tmp_path):
    """TE spec vs local spec on the same HF weights, fp32, one GPU: same per-token logprobs."""
    import os
    import subprocess
    import sys

    pytest.importorskip("transformer_engine")
    from megarl.models.random_hf import tiny_config, write_random_hf

    hf = write_random_hf(str(tmp_path / "hf"), tiny_config())
    script = os.path.join(os.path.dirname(__file__), "te_vs_local_worker.py")
    proc = subprocess.run([sys.executable, script, hf], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff = float(proc.stdout.strip().splitlines()[-1])
    assert diff <= 1e-4
