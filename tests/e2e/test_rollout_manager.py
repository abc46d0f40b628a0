"""The rollout side runs in the rollout manager, a process of its own (real megarl-train, real
local server): the controller's HTTP traffic, the workflow and the reward run there, never in the
trainer, whose update runs with no other Python thread; a SIGKILLed manager stops the job with one
line within 30 s and a resume trains every prompt exactly once."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil

from test_resume_exactly_once import check_exactly_once, command, latest_checkpoint_step, read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **extra)


def _manager(trainer: psutil.Process) -> psutil.Process:
    found = [c for c in trainer.children() if "megarl.rollout.manager" in " ".join(c.cmdline())]
    assert len(found) == 1, [c.cmdline() for c in trainer.children()]
    return found[0]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_controller_rewards_and_http_run_in_the_manager_not_the_trainer(tmp_path):
    run, pids = tmp_path / "run", tmp_path / "reward_pids.txt"
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo.yaml"),
           f"model.hf_path={REPO}/examples/tiny/model", f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl",
           "data.eval_path=", f"train.run_dir={run}", "checkpoint.hf_export_dir=", "train.global_batch_size=64",
           "rollout.eval_at_start=false", "train.steps=400", "checkpoint.save_interval=0",
           "rollout.reward_fn=reward_plugins:pid_reward"]
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=_env(MEGARL_TEST_PID_FILE=str(pids)),
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "w"), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while len(read_jsonl(run / "metrics.jsonl")) < 3:
            assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        trainer = psutil.Process(proc.pid)
        manager = _manager(trainer)
        server_port = _port(json.loads((run / "servers" / "servers.json").read_text())[0]["url"])
        # the generation requests (HTTP to the server's port) come from the manager only
        seen_manager = seen_trainer = 0
        for _ in range(50):
            seen_manager += sum(bool(c.raddr) and c.raddr.port == server_port for c in manager.net_connections("tcp"))
            seen_trainer += sum(bool(c.raddr) and c.raddr.port == server_port for c in trainer.net_connections("tcp"))
            time.sleep(0.02)
        assert seen_manager > 0 and seen_trainer == 0, (seen_manager, seen_trainer)
        manager_pid = manager.pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    rows = read_jsonl(run / "metrics.jsonl")
    # the update ran with the main thread alone: no controller, admin, health or reward thread
    assert {r["trainer/python_threads"] for r in rows} == {1}, [r["trainer/python_threads"] for r in rows]
    # every reward call of the workflow ran in the manager process
    called = {int(x) for x in pids.read_text().split()}
    assert called == {manager_pid}, (called, manager_pid, proc.pid)


def test_sigkilled_manager_stops_the_job_and_a_resume_trains_every_prompt_once(tmp_path):
    data = tmp_path / "prompts.jsonl"
    lines = open(f"{REPO}/examples/tiny/data/rl_prompts.jsonl").read().splitlines()[:24]
    data.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    proc = subprocess.Popen(command(run, data), cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not any(r["step"] >= 3 for r in read_jsonl(run / "metrics.jsonl")):
            assert proc.poll() is None
            assert time.monotonic() < deadline, "never reached step 3"
            time.sleep(0.05)
        _manager(psutil.Process(proc.pid)).kill()
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        stopped_in = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode not in (0, None)
    assert stopped_in < 30, stopped_in
    errors = [line for line in out.splitlines() if line.startswith("megarl-train:")]
    assert len(errors) == 1 and "rollout manager" in errors[0], out[-3000:]
    assert "Traceback" not in out
    saved = latest_checkpoint_step(run)
    assert saved >= 2
    rows1 = read_jsonl(run / "metrics.jsonl")
    gens1 = [g for g in read_jsonl(run / "generations.jsonl") if g["step"] <= saved]
    os.rename(run / "generations.jsonl", tmp_path / "generations_run1.jsonl")
    os.rename(run / "metrics.jsonl", tmp_path / "metrics_run1.jsonl")

    done = subprocess.run(command(run, data), cwd=str(tmp_path), env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows2 = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows2] == list(range(saved + 1, 10))
    check_exactly_once(gens1 + read_jsonl(run / "generations.jsonl"), rows1 + rows2)
