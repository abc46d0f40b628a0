"""LoRA GRPO end to end (real megatron-core trainer, a real local megarl-server, distributed
pushes) at TP=1 and TP=2: after the first full push every push carries exactly the adapters (their
bytes computed here from the model's config), the server merges them, and the trainer's logprobs
of the server's tokens stay within train.mismatch_gate's fp32 threshold after every push
(synchronous rollouts, rollout.max_staleness=0, so every step's tokens come from the weights the
step starts from: the adapters pushed one step earlier). The same run's exports: the trainer's
merged HF model + PEFT adapter, and megarl-convert's from the final LoRA checkpoint, agree; at TP=2
megarl-logprobs of that checkpoint (read at TP=1, adapters included) equals transformers on the
merged export."""
import json
import os
import subprocess
import sys

import harness
import pytest
import torch
from safetensors.torch import load_file

from megarl.models.lora import hf_adapter_shapes
from megarl.protocol.hf_model import read_model_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = f"{REPO}/examples/tiny/model"


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_pushes_adapters_only_and_server_matches_trainer(tmp_path, tp):
    run = tmp_path / "run"
    rows = harness.train(run, "checkpoint.hf_export_dir=model", "checkpoint.save_interval=0",
                         "train.steps=3", "train.global_batch_size=32", "rollout.eval_at_start=false",
                         "rollout.max_staleness=0", f"parallel.tp={tp}", "lora.rank=8", "lora.alpha=16",
                         "weights.verify_interval=1",  # checksums of every push (auto: every 10th)
                         recipe="tiny_grpo_lora.yaml", timeout=300, check=True).rows
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
        assert r["grad_norm"] > 0 and r["optimizer_steps"] == 1

    # exports: the trainer merges shard by shard (checkpoint.hf_export_dir), megarl-convert from the
    # checkpoint's full tensors; both give the same merged model and the same PEFT adapter
    out = tmp_path / "converted"
    conv = subprocess.run([sys.executable, "-m", "megarl.commands.convert", "mcore-to-hf",
                           "--ckpt", str(run / "checkpoints"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert conv.returncode == 0, conv.stderr[-3000:]
    trainer, converted = load_file(str(run / "model" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    base = load_file(f"{MODEL}/model.safetensors")
    assert trainer.keys() == converted.keys() == base.keys()
    assert max((trainer[k] - converted[k]).abs().max().item() for k in trainer) < 1e-6
    merged = [k for k in base if not torch.equal(base[k], trainer[k])]
    assert len(merged) == 4 * 7  # exactly the adapted weights moved; embeddings and norms are the base's
    for d in (run / "model" / "adapter", out / "adapter"):
        peft = load_file(str(d / "adapter_model.safetensors"))
        assert {k.removeprefix("base_model.model.") for k in peft} == set(shapes)
        assert json.loads((d / "adapter_config.json").read_text())["r"] == 8
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (run / "model", out))
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    if tp == 2:  # the TP=2 checkpoint read back at TP=1 by megarl-logprobs, adapters on the base
        import transformers

        rows_in = [[1, 5, 6, 7, 3, 9, 2], [1, 4, 4, 8, 10, 11, 12, 3]]
        (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows_in))
        lp = subprocess.run([sys.executable, "-m", "megarl.commands.logprobs", "--ckpt", str(run / "checkpoints"),
                             "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert lp.returncode == 0, lp.stderr[-3000:]
        got = [json.loads(line)["logprobs"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(run / "model")).float().eval()
        base_hf = transformers.AutoModelForCausalLM.from_pretrained(MODEL).float().eval()
        for ids, mine in zip(rows_in, got):
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1], -1)
                base = torch.log_softmax(base_hf(torch.tensor([ids])).logits[0, :-1], -1)
            ref = [0.0] + ref.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
            base = [0.0] + base.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
            assert max(abs(a - b) for a, b in zip(mine, ref)) < 1e-4
            assert max(abs(a - b) for a, b in zip(mine, base)) > 1e-3  # the adapters, not the base
