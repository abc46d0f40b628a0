"""The rollout side runs in the rollout manager, a process of its own (real megarl-train, real
local server): the controller's HTTP traffic, the workflow and the reward run there, never in the
trainer, whose update runs with no other Python thread; a SIGKILLed manager stops the job with one
line within 30 s and a resume trains every prompt exactly once."""
import contextlib
import json
import os
import signal
import time

import psutil

import harness
import pytest
from test_resume_exactly_once import OVERRIDES, PLACEMENTS, prompts, resume_and_check, until_step

pytestmark = pytest.mark.xdist_group("sigusr1_run")  # reads the shared run made by the first test to ask (conftest.py)

RESUMABLE = (*OVERRIDES, *PLACEMENTS["disaggregated"])


def _env(**extra):
    """reward_plugins / workflow_plugins (this directory) importable by the run."""
    return harness.plugin_env(extra)


def _manager(trainer: psutil.Process) -> psutil.Process:
    found = [c for c in trainer.children() if "megarl.rollout.manager" in " ".join(c.cmdline())]
    assert len(found) == 1, [c.cmdline() for c in trainer.children()]
    return found[0]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# One run serves the manager test below and test_stop_resume.py's SIGUSR1 test: the demo recipe,
# rewards by pid_reward (MEGARL_TEST_PID_FILE relative: the run's cwd, harness's run_dir.parent),
# watched by `watch_then_sigusr1` and stopped by SIGUSR1 to its process group.
SIGUSR1_RUN = ("train.global_batch_size=64", "rollout.eval_at_start=false", "train.steps=1000",
               "checkpoint.save_interval=0", "rollout.reward_fn=reward_plugins:pid_reward")


def watch_then_sigusr1(proc) -> None:
    """Once step 3 is logged: notes the rollout manager(s) among the trainer's children, the
    servers among all its descendants, and for 1 s which of trainer and manager hold connections
    to the server's port; then SIGUSR1 to the whole process group (trainer, manager and server
    alike, as SLURM signals every process). Returns the notes (Run.probe) for the tests to assert
    on: a shared run's probe never fails (a failed one would be rerun by the next test); on an
    error it notes it and kills the run."""
    run_dir = harness.run_dir_of(proc)
    notes = {}
    try:
        until_step(proc, run_dir)
        trainer = psutil.Process(proc.pid)
        managers = [c for c in trainer.children() if "megarl.rollout.manager" in " ".join(c.cmdline())]
        notes["managers"] = [m.pid for m in managers]
        notes["servers"] = [(c.pid, c.create_time()) for c in trainer.children(recursive=True)
                            if "megarl.server" in " ".join(c.cmdline())]
        server_port = _port(json.loads((run_dir / "servers" / "servers.json").read_text())[0]["url"])
        # the generation requests (HTTP to the server's port): who holds them
        notes["manager_conns"] = notes["trainer_conns"] = 0
        for _ in range(50):
            for who, p in (("manager_conns", managers[0]), ("trainer_conns", trainer)):
                notes[who] += sum(bool(c.raddr) and c.raddr.port == server_port for c in p.net_connections("tcp"))
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGUSR1)
    except Exception as e:  # noqa: BLE001 - noted for the tests
        notes["error"] = repr(e)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return notes


def sigusr1_run(shared_train) -> tuple[harness.Run, dict]:
    """The shared run and its probe's notes."""
    run = shared_train(*SIGUSR1_RUN, env=_env(MEGARL_TEST_PID_FILE="reward_pids.txt"), during=watch_then_sigusr1,
                       start_new_session=True)
    notes = run.probe
    assert "error" not in notes, (notes, run.log[-3000:])
    return run, notes


def test_controller_rewards_and_http_run_in_the_manager_not_the_trainer(shared_train):
    run, notes = sigusr1_run(shared_train)
    assert len(notes["managers"]) == 1, notes
    # the generation requests (HTTP to the server's port) come from the manager only
    assert notes["manager_conns"] > 0 and notes["trainer_conns"] == 0, notes
    rows = run.rows
    # the update ran with the main thread alone: no controller, admin, health or reward thread
    assert {r["trainer/python_threads"] for r in rows} == {1}, [r["trainer/python_threads"] for r in rows]
    # every reward call of the workflow ran in the manager process
    called = {int(x) for x in (run.dir.parent / "reward_pids.txt").read_text().split()}
    assert called == set(notes["managers"]), (called, notes)


def test_sigkilled_manager_stops_the_job_and_a_resume_trains_every_prompt_once(tmp_path):
    data, run_dir = prompts(tmp_path), tmp_path / "run"
    seen = {}

    def kill_the_manager(proc):
        until_step(proc, run_dir)
        _manager(psutil.Process(proc.pid)).kill()
        seen["killed"] = time.monotonic()

    run = harness.train(run_dir, *RESUMABLE, data=data, env=_env(), during=kill_the_manager, start_new_session=True)
    assert run.returncode not in (0, None)
    stopped_in = run.ended - seen["killed"]  # exited, and no process of the job holds its output
    assert stopped_in < 30, stopped_in
    errors = [line for line in run.log.splitlines() if line.startswith("megarl-train:")]
    assert len(errors) == 1 and "rollout manager" in errors[0], run.log[-3000:]
    assert "Traceback" not in run.log
    resume_and_check(run_dir, data, *RESUMABLE, env=_env())
