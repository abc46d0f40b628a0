"""An external server outlives its trainer (issue 40): a run SIGKILLed after its first push
leaves its weight-update group registered on the server; the next run against the same server
starts and trains (each run names its groups anew), and one server listed under two names is
refused at load. Real trainer, real megarl-server started apart."""
from __future__ import annotations

import json
import signal
import time

import harness
from e2e_servers import ServerProc

ARGS = ("train.global_batch_size=32", "rollout.eval_at_start=false", "checkpoint.save_interval=0")


def test_a_dead_runs_group_on_an_external_server_does_not_block_the_next_run(tmp_path):
    server = ServerProc(str(harness.TINY / "model")).wait_ready()
    try:
        first = tmp_path / "first"

        def kill_after_first_step(proc):
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                rows = first / "metrics.jsonl"
                if rows.exists() and rows.read_text().strip():
                    proc.send_signal(signal.SIGKILL)  # no close(): the group stays on the server
                    return
                time.sleep(0.1)

        dead = harness.train(first, "train.steps=50", f"rollout.servers=[{server.url}]", *ARGS,
                             during=kill_after_first_step)
        assert dead.returncode == -signal.SIGKILL, dead.log[-2000:]
        run = harness.train(tmp_path / "second", "train.steps=2", f"rollout.servers=[{server.url}]", *ARGS).check()
        assert [r["step"] for r in run.rows] == [1, 2]
        names = [line.split("weight-update group ")[1].split()[0] for line in (dead.stdout + run.stdout).splitlines()
                 if "weight-update group" in line]
        assert len(names) == 2 and len(set(names)) == 2, names  # one per run, never the same
    finally:
        server.stop()


def test_one_server_under_two_names_is_refused_at_load(tmp_path):
    run = harness.train(tmp_path / "run", "rollout.servers=[http://localhost:30111,http://127.0.0.1:30111/]")
    assert run.returncode == 2, run.log[-2000:]
    assert run.last_line == ("megarl-train: rollout.servers[1]: http://127.0.0.1:30111/ is listed twice "
                             "(also rollout.servers[0]: http://localhost:30111)"), run.last_line
    assert not (tmp_path / "run").exists()


def test_a_session_left_open_by_a_dead_run_is_ended_by_the_next_run(tmp_path):
    """A trainer killed between /begin_weight_update and /end_weight_update leaves the session
    open on a server that outlives it (seen when the kill above lands mid-push): the next run's
    first push ends it, says so, and trains."""
    from e2e_servers import http

    server = ServerProc(str(harness.TINY / "model")).wait_ready()
    try:
        code, out = http("POST", server.url + "/begin_weight_update", {})  # the dead run's open session
        assert code == 200, out
        run = harness.train(tmp_path / "run", "train.steps=2", f"rollout.servers=[{server.url}]", *ARGS).check()
        assert [r["step"] for r in run.rows] == [1, 2]
        log = (run.dir / "manager.log").read_text()  # the push's admin calls are the rollout manager's
        assert f"weight-update session left open on {server.url}" in log and "this push begins its own" in log
    finally:
        server.stop()
