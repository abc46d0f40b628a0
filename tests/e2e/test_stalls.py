"""Runs that cannot progress end within train.stall_timeout_s (or sooner) with one line, exit 1,
and nothing half-written (real trainer, rollout manager and megarl-servers):

- a reward that never returns, on the thread executor with no reward timeout: the stall names
  the reward phase;
- a server that refuses every request (HTTP 400: top_k past the vocabulary): the run stops after
  rollout.max_consecutive_failures prompts with the server's own message, each prompt tried once;
- an external server SIGSTOPped in the middle of a step: the stall names the generate phase and
  the server holding the requests.
"""
import json
import os
import signal

import harness
from e2e_servers import ServerProc

MODEL = str(harness.TINY / "model")


def train(tmp_path, *extra, env=None) -> tuple[harness.Run, float]:
    """3 small steps, a checkpoint every step, a 5 s stall deadline; the plugins of this
    directory importable. Returns the run and its wall time."""
    run = harness.train(tmp_path / "run", "checkpoint.save_interval=1", "train.steps=3",
                        "train.global_batch_size=16", "rollout.group_size=4", "rollout.max_concurrent=4",
                        "rollout.max_staleness=0", "train.stall_timeout_s=5", *extra, timeout=120,
                        env=harness.plugin_env(env))
    return run, run.wall_s


def last_line(proc) -> str:
    """The run's error: exactly one line of stderr starts with the program's name."""
    lines = [x for x in proc.stderr.splitlines() if x.startswith("megarl-train: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def assert_nothing_saved(tmp_path) -> None:
    run = tmp_path / "run"
    assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints")
    metrics = run / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""


def test_reward_that_never_returns_stops_the_run_as_a_reward_stall(tmp_path):
    proc, took = train(tmp_path, "rollout.reward_fn=reward_plugins:never_returns", "reward.timeout_s=0",
                       "reward.executor=thread")
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = last_line(proc)
    assert "rollout stalled: 0/4 groups after 5 s of waiting for the step" in line, line
    assert "(train.stall_timeout_s); phase: reward (16 call(s) running" in line, line
    assert "requests in flight: none" in line
    assert took < 60
    assert_nothing_saved(tmp_path)


def test_refused_requests_stop_the_run_with_the_servers_message(tmp_path):
    proc, took = train(tmp_path, "rollout.workflow=workflow_plugins:RefusedTopK",
                       "rollout.max_consecutive_failures=6", "train.stall_timeout_s=600")
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = last_line(proc)
    assert "rollout: 6 prompts in a row failed with the same error (rollout.max_consecutive_failures)" in line
    assert "HTTP 400: sampling_params.top_k=1000 out of range [-1, 16]" in line, line
    assert took < 60  # not the 600 s deadline
    failed = [json.loads(x) for x in (tmp_path / "run" / "failed_prompts.jsonl").read_text().splitlines()]
    assert len(failed) >= 6 and {f["attempts"] for f in failed} == {1}  # a 4xx is not retried
    assert_nothing_saved(tmp_path)


def test_server_hung_mid_step_is_a_stall_naming_it(tmp_path):
    server = ServerProc(MODEL, "--max-running-requests", "1").wait_ready()
    try:
        proc, took = train(tmp_path, f"rollout.servers=[{server.url}]",
                           "rollout.reward_fn=reward_plugins:stop_server_at_first_reward",
                           env={"MEGARL_TEST_STOP_PID": str(server.proc.pid)})
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = last_line(proc)
    assert "rollout stalled: " in line and "phase: generate (requests sent, no answer yet)" in line, line
    assert f"requests in flight: {server.url} (" in line
    assert took < 60
    assert_nothing_saved(tmp_path)
