"""A rollout manager that stops running (SIGSTOP) is caught by the channel's heartbeat: the
trainer exits non-zero within train.stall_timeout_s (plus the step it was in) with one line naming
the stall, the stopped manager and its servers are gone, and a resume trains every prompt exactly
once, as after a SIGKILL (real megarl-train, real manager, real local server)."""
import signal
import time

import psutil

import harness
from test_resume_exactly_once import prompts, resume_and_check, until_step
from test_rollout_manager import RESUMABLE, _env, _manager

STALL_S = 15


def _stacks(proc, manager) -> str:
    """Every process of the run (but the stopped manager) prints its threads' stacks
    (megarl.common.signals: SIGUSR2) into the run's stderr, and the process tree: what a hang
    leaves to diagnose (the harness kills the run and quotes its stderr when the probe fails)."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    lines = [f"{p.pid} {p.status()} {' '.join(p.cmdline()[:4])}" for p in tree if p.is_running()]
    for p in tree:  # the trainer's processes (a server has no SIGUSR2 handler: it would die)
        if p.pid != manager.pid and p.is_running() and "megarl.train" in p.cmdline():
            p.send_signal(signal.SIGUSR2)
    time.sleep(3.0)
    return "\n".join(lines)


def test_sigstopped_manager_stops_the_run_within_the_stall_deadline_and_resumes_once(tmp_path):
    data, run_dir = prompts(tmp_path), tmp_path / "run"
    args = (*RESUMABLE, f"train.stall_timeout_s={STALL_S}")
    seen = {}

    def stop_the_manager(proc):
        until_step(proc, run_dir)
        manager = seen["manager"] = _manager(psutil.Process(proc.pid))
        seen["servers"] = manager.children(recursive=True)
        manager.suspend()  # SIGSTOP: the process is there, its socket open, nothing runs
        seen["stopped"] = time.monotonic()
        try:
            proc.wait(timeout=STALL_S + 60)
        except Exception:
            raise AssertionError(f"no exit {STALL_S + 60} s after SIGSTOP; where it was:\n{_stacks(proc, manager)}")

    try:
        run = harness.train(run_dir, *args, data=data, env=_env(), during=stop_the_manager, start_new_session=True)
    finally:
        manager = seen.get("manager")
        if manager is not None and manager.is_running():
            manager.resume()
            manager.kill()
    took = run.ended - seen["stopped"]  # exited, and no process of the job holds its output
    err = run.stderr
    print(f"stall reported {took:.1f} s after SIGSTOP (train.stall_timeout_s={STALL_S})")
    assert run.returncode == 1, err[-3000:]
    # within the deadline, plus the step the trainer was in when the manager stopped and its exit
    assert STALL_S <= took < STALL_S + 10, took
    errors = [x for x in err.splitlines() if x.startswith("megarl-train:")]
    assert len(errors) == 1, err[-3000:]
    assert "rollout manager at 127.0.0.1:" in errors[0] and "stalled" in errors[0], errors[0]
    assert f"no reply and no heartbeat for {STALL_S} s (train.stall_timeout_s)" in errors[0], errors[0]
    assert "Traceback" not in err and "verify_interval" not in errors[0]  # the stall, not a wrapper's hint
    print(errors[0])
    # the stopped manager and the servers it started did not outlive the run
    time.sleep(1.0)
    assert not manager.is_running() or manager.status() == psutil.STATUS_ZOMBIE
    assert not [s for s in seen["servers"] if s.is_running() and s.status() != psutil.STATUS_ZOMBIE]
    resume_and_check(run_dir, data, *args, env=_env())
