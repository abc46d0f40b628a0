"""A stop signal mid-run. SFT, PP=2, ranks self-launched under torchrun: SIGTERM to the parent,
which forwards it to the workers; both ranks agree to stop after the same step, save it, exit 0
and leave the stop marker; the rerun resumes from that checkpoint and finishes with every step in
metrics.jsonl exactly once. GRPO with the rollout server the trainer starts itself: SIGUSR1 to
the whole process group (as SLURM signals every process) leaves the server serving until the
trainer has saved, and the server is gone when the trainer exits."""
import json
import signal
import time

import psutil

import harness
import pytest
from test_rollout_manager import sigusr1_run

pytestmark = pytest.mark.xdist_group("sigusr1_run")  # reads the shared run made by the first test to ask (conftest.py)

SFT = dict(recipe="tiny_sft.yaml", model=harness.TINY / "hf", data=harness.TINY / "data" / "sft.jsonl")


def until_rows(proc, run_dir, n: int, timeout: float = 300) -> None:
    """Until the running trainer has logged `n` steps."""
    deadline = time.monotonic() + timeout
    while len(harness.rows_so_far(run_dir)) < n and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert len(harness.rows_so_far(run_dir)) >= n, (f"exited ({proc.returncode})" if proc.poll() is not None
                                                    else "no metrics")


def test_sigterm_saves_the_step_and_the_rerun_resumes(tmp_path):
    run_dir = tmp_path / "run"
    args = ("train.global_batch_size=64", "rollout.eval_at_start=false", "parallel.pp=2",
            "optim.lr_decay_style=constant")

    def sigterm_at_step_3(proc):
        until_rows(proc, run_dir, 3)
        proc.send_signal(signal.SIGTERM)

    run = harness.train(run_dir, *args, "train.steps=100000", **SFT, during=sigterm_at_step_3)
    out = run.log
    assert run.returncode == 0, out[-4000:]
    k = run.rows[-1]["step"]
    assert [r["step"] for r in run.rows] == list(range(1, k + 1))
    assert "[megarl] SIGTERM: finishing this step, then checkpoint and stop" in out
    assert "[megarl] stopped by SIGTERM; checkpoint saved, rerun to resume" in out
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{k:08d}"
    assert json.loads((run_dir / "stopped_by_signal.json").read_text()) == {"signal": "SIGTERM"}

    again = harness.train(run_dir, *args, f"train.steps={k + 3}", **SFT, check=True)
    assert f"[checkpoint] resumed from {run_dir}/checkpoints/step_{k:08d} (step {k})" in again.stdout
    assert [r["step"] for r in again.rows] == list(range(1, k + 4))
    assert not (run_dir / "stopped_by_signal.json").exists()


def test_sigusr1_to_the_process_group_saves_and_stops_the_owned_server(shared_train):
    """The run stopped by SIGUSR1 to its process group once step 3 is logged (shared with
    test_rollout_manager.py, which reads where its HTTP and rewards ran)."""
    run, notes = sigusr1_run(shared_train)
    # the rollout manager (a child of the trainer) started the server
    assert len(notes["servers"]) == 1, notes
    assert run.returncode == 0, run.log[-4000:]
    k = run.rows[-1]["step"]
    assert "[megarl] stopped by SIGUSR1; checkpoint saved, rerun to resume" in run.log
    assert (run.dir / "checkpoints" / "latest").read_text().strip() == f"step_{k:08d}"
    (pid, started), = notes["servers"]
    try:  # gone: no such process, another one with its pid, or a zombie
        server = psutil.Process(pid)
        assert server.create_time() != started or server.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass
