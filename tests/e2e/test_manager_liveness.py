"""A rollout manager that stops running (SIGSTOP) is caught by the channel's heartbeat: the
trainer exits non-zero within train.stall_timeout_s (plus the step it was in) with one line naming
the stall, the stopped manager and its servers are gone, and a resume trains every prompt exactly
once, as after a SIGKILL (real megarl-train, real manager, real local server)."""
import os
import signal
import subprocess
import time

import psutil

from test_resume_exactly_once import check_exactly_once, command, latest_checkpoint_step, read_jsonl
from test_rollout_manager import _env, _manager

STALL_S = 15


def _stacks(proc, manager) -> str:
    """Every process of the run (but the stopped manager) prints its threads' stacks
    (megarl.common.signals: SIGUSR2), and the process tree: what a hang leaves to diagnose."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    lines = [f"{p.pid} {p.status()} {' '.join(p.cmdline()[:4])}" for p in tree if p.is_running()]
    for p in tree:  # the trainer's processes (a server has no SIGUSR2 handler: it would die)
        if p.pid != manager.pid and p.is_running() and "megarl.train" in p.cmdline():
            p.send_signal(signal.SIGUSR2)
    time.sleep(3.0)
    os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    return "\n".join(lines) + "\n" + err[-12000:]


def test_sigstopped_manager_stops_the_run_within_the_stall_deadline_and_resumes_once(tmp_path):
    data = tmp_path / "prompts.jsonl"
    lines = open(os.path.join(os.path.dirname(__file__), "../../examples/tiny/data/rl_prompts.jsonl")).read()
    data.write_text("\n".join(lines.splitlines()[:24]) + "\n")
    run = tmp_path / "run"
    cmd = command(run, data) + [f"train.stall_timeout_s={STALL_S}"]
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    manager = None
    try:
        deadline = time.monotonic() + 300
        while not any(r["step"] >= 3 for r in read_jsonl(run / "metrics.jsonl")):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "never reached step 3"
            time.sleep(0.05)
        manager = _manager(psutil.Process(proc.pid))
        servers = manager.children(recursive=True)
        manager.suspend()  # SIGSTOP: the process is there, its socket open, nothing runs
        stopped = time.monotonic()
        try:
            _, err = proc.communicate(timeout=STALL_S + 60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit {STALL_S + 60} s after SIGSTOP; where it was:\n{_stacks(proc, manager)}")
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if manager is not None and manager.is_running():
            manager.resume()
            manager.kill()
    print(f"stall reported {took:.1f} s after SIGSTOP (train.stall_timeout_s={STALL_S})")
    assert proc.returncode == 1, err[-3000:]
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
    assert not [s for s in servers if s.is_running() and s.status() != psutil.STATUS_ZOMBIE]

    saved = latest_checkpoint_step(run)
    assert saved >= 2
    rows1 = read_jsonl(run / "metrics.jsonl")
    gens1 = [g for g in read_jsonl(run / "generations.jsonl") if g["step"] <= saved]
    os.rename(run / "generations.jsonl", tmp_path / "generations_run1.jsonl")
    os.rename(run / "metrics.jsonl", tmp_path / "metrics_run1.jsonl")
    done = subprocess.run(cmd, cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows2 = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows2] == list(range(saved + 1, 10))
    check_exactly_once(gens1 + read_jsonl(run / "generations.jsonl"), rows1 + rows2)
