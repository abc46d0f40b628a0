"""The real entry: `python -m megarl.train` saves on its interval, keeps keep_last, and a second
invocation with more steps resumes from the latest checkpoint instead of starting over."""
import json
import os

import harness
from distrun import free_port
from megarl.checkpoint import find_latest, read_meta
from test_checkpoint import make_run_inputs


def train(work, steps):
    run = harness.train(f"{work}/run", "train.global_batch_size=8", "train.micro_batch_tokens=64",
                        "train.max_seq_len=32", "checkpoint.save_interval=2", "checkpoint.keep_last=1",
                        "optim.lr_decay_steps=4", f"train.steps={steps}", f"checkpoint.hf_export_dir={work}/export",
                        recipe="tiny_sft.yaml", model=f"{work}/hf", data=f"{work}/sft.jsonl",
                        env={"PYTHONWARNINGS": "ignore", "MASTER_PORT": str(free_port())}, check=True)
    return run.log


def test_train_entry_saves_and_resumes(tmp_path):
    work = str(tmp_path)
    make_run_inputs(work)
    train(work, 3)
    ckpts = os.path.join(work, "run", "checkpoints")
    assert sorted(os.listdir(ckpts)) == ["latest", "step_00000003"]  # step 2 retired (keep_last=1)
    log = train(work, 4)
    assert "resumed from" in log and "step_00000003" in log
    steps = [json.loads(line)["step"] for line in open(os.path.join(work, "run", "metrics.jsonl"))]
    assert steps == [1, 2, 3, 4]
    latest = find_latest(ckpts)
    assert latest.endswith("step_00000004") and read_meta(latest)["state"]["data"]["sampler"]["position"] == 32
    assert os.path.isfile(os.path.join(work, "export", "model.safetensors"))
