"""LoRA GRPO end to end (real megatron-core trainer, a real local megarl-server, distributed
pushes) at TP=1 and TP=2: after the first full push every push carries exactly the adapters (their
bytes computed here from the model's config), the server merges them, and the trainer's logprobs
of the server's tokens stay within train.mismatch_gate's fp32 threshold after every push
(synchronous rollouts, rollout.max_staleness=0, so every step's tokens come from the weights the
step starts from: the adapters pushed one step earlier)."""
import json
import os
import subprocess
import sys

import pytest

from megarl.models.lora import hf_adapter_shapes
from megarl.protocol.hf_model import read_model_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = f"{REPO}/examples/tiny/model"


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_pushes_adapters_only_and_server_matches_trainer(tmp_path, tp):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo_lora.yaml"),
           f"model.hf_path={MODEL}", f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl",
           "data.eval_path=", f"train.run_dir={run}", "checkpoint.hf_export_dir=", "checkpoint.save_interval=0",
           "train.steps=3", "train.global_batch_size=32", "rollout.eval_at_start=false",
           "rollout.max_staleness=0", f"parallel.tp={tp}", "lora.rank=8", "lora.alpha=16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    shapes = hf_adapter_shapes(read_model_args(MODEL), ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], 8)
    adapters = sum(r * c for r, c in shapes.values()) * 4 + 4  # fp32 adapters + the fp32 scale
    assert len(shapes) == 4 * 7 * 2
    model_bytes = os.path.getsize(f"{MODEL}/model.safetensors")
    for r in rows:
        assert r["push/bytes"] == r["push/adapter_bytes"] == adapters < model_bytes / 4
        assert r["mismatch/onpolicy_frac"] == 1.0  # every token from the weights the step starts from
        assert r["mismatch/mean"] <= 1e-5 and r["mismatch/max"] <= 1e-4, r  # gate: 1e-4 mean
        assert r["push/verify_mismatches"] == 0  # the adapters the server holds are the pushed ones
        assert r["grad_norm"] > 0 and r["update_ok"] == 1.0
