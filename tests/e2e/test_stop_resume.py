"""A stop signal mid-run. SFT, PP=2, ranks self-launched under torchrun: SIGTERM to the parent,
which forwards it to the workers; both ranks agree to stop after the same step, save it, exit 0
and leave the stop marker; the rerun resumes from that checkpoint and finishes with every step in
metrics.jsonl exactly once. GRPO with the rollout server the trainer starts itself: SIGUSR1 to
the whole process group (as SLURM signals every process) leaves the server serving until the
trainer has saved, and the server is gone when the trainer exits."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rows(run):
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_rows(proc: subprocess.Popen, run, n: int, timeout: float = 300) -> None:
    """Until the running trainer has logged `n` steps (its output in the message if it exited)."""
    deadline = time.monotonic() + timeout
    while len(rows(run)) < n and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert len(rows(run)) >= n, proc.stdout.read() if proc.poll() is not None else "no metrics"


def test_sigterm_saves_the_step_and_the_rerun_resumes(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_sft.yaml"),
           f"model.hf_path={REPO}/examples/tiny/hf", f"data.train_path={REPO}/examples/tiny/data/sft.jsonl",
           f"train.run_dir={run}", "checkpoint.hf_export_dir=", "train.global_batch_size=64", "rollout.eval_at_start=false", "parallel.pp=2", "optim.lr_decay_style=constant"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd + ["train.steps=100000"], cwd=str(tmp_path), env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_rows(proc, run, 3)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    k = rows(run)[-1]["step"]
    assert [r["step"] for r in rows(run)] == list(range(1, k + 1))
    assert "[megarl] SIGTERM: finishing this step, then checkpoint and stop" in out
    assert "[megarl] stopped by SIGTERM; checkpoint saved, rerun to resume" in out
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{k:08d}"
    assert json.loads((run / "stopped_by_signal.json").read_text()) == {"signal": "SIGTERM"}

    again = subprocess.run(cmd + [f"train.steps={k + 3}"], cwd=str(tmp_path), env=env, text=True,
                           capture_output=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"[checkpoint] resumed from {run}/checkpoints/step_{k:08d} (step {k})" in again.stdout
    assert [r["step"] for r in rows(run)] == list(range(1, k + 4))
    assert not (run / "stopped_by_signal.json").exists()


def test_sigusr1_to_the_process_group_saves_and_stops_the_owned_server(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo.yaml"),
           f"model.hf_path={REPO}/examples/tiny/model", f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl",
           "data.eval_path=", f"train.run_dir={run}", "checkpoint.hf_export_dir=", "train.global_batch_size=64", "rollout.eval_at_start=false", "train.steps=1000",
           "checkpoint.save_interval=0"]
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=dict(os.environ, OMP_NUM_THREADS="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_rows(proc, run, 2)
        # the rollout manager (a child of the trainer) started the server
        servers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "megarl.server" in " ".join(c.cmdline())]
        assert len(servers) == 1
        os.killpg(proc.pid, signal.SIGUSR1)  # trainer and server alike
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    k = rows(run)[-1]["step"]
    assert "[megarl] stopped by SIGUSR1; checkpoint saved, rerun to resume" in out
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{k:08d}"
    assert not servers[0].is_running() or servers[0].status() == psutil.STATUS_ZOMBIE
