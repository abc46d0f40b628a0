"""The real entry: `python -m megarl.train` saves on its interval, keeps keep_last, and a second
invocation with more steps resumes from the latest checkpoint instead of starting over."""
import json
import os
import subprocess
import sys

from distrun import free_port
from megarl.checkpoint import find_latest, read_meta
from test_checkpoint import make_run_inputs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(work, steps):
    overrides = [f"model.hf_path={work}/hf", f"data.train_path={work}/sft.jsonl", f"train.run_dir={work}/run",
                 "train.global_batch_size=8", "train.micro_batch_tokens=64", "train.max_seq_len=32",
                 "checkpoint.save_interval=2", "checkpoint.keep_last=1", "optim.lr_decay_steps=4",
                 f"train.steps={steps}", f"checkpoint.hf_export_dir={work}/export"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_sft.yaml"),
                           *overrides], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


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
