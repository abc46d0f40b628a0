"""Environment servers as processes: the megarl-env command (keys, one-line refusals), the job's
own servers SIGKILLed mid-run (restarted on their port, the episodes they held run again, every
prompt trained exactly once) - real megarl-env and megarl-train processes on loopback."""
from __future__ import annotations

import asyncio
import collections
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

import harness
from megarl.envs import Action, EnvClient, Task

UNIT = pathlib.Path(__file__).resolve().parents[1] / "unit"  # env_plugins lives there
GUESS = "megarl.envs.examples:GuessNumber"


def env_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "megarl.envs", *args]


def plugin_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(UNIT), os.environ.get("PYTHONPATH")))))


def start(tmp_path, *args: str) -> tuple[subprocess.Popen, str]:
    log = open(tmp_path / "env.log", "w")
    proc = subprocess.Popen(env_cmd(*args, "--port", "0"), stdout=log, stderr=subprocess.STDOUT, env=plugin_env())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = re.search(r"megarl-env ready on (http://\S+)", (tmp_path / "env.log").read_text())
        if m:
            return proc, m.group(1)
        assert proc.poll() is None, (tmp_path / "env.log").read_text()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("megarl-env did not start")


def test_megarl_env_serves_with_a_key(tmp_path):
    key = tmp_path / "key"
    key.write_text("s" * 32)
    key.chmod(0o600)
    proc, url = start(tmp_path, "env_plugins:Echo", "--api-key-file", str(key), "--step-timeout-s", "2")
    try:
        assert urllib.request.urlopen(url + "/health", timeout=10).status == 200
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/info", timeout=10)
        assert e.value.code == 401

        async def episode():
            async with EnvClient([url], "s" * 32) as env:
                ep = await env.reset(Task("p", {}))
                first = await env.step(ep, Action("hi"))
                last = await env.step(ep, Action("stop"))
                return first, last

        first, last = asyncio.run(episode())
        assert first.observation == [{"role": "user", "content": "echo: hi []"}] and last.done and last.reward == 1.0
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("args, line", [
    (["env_plugins:Nope"], "megarl-env: error: environment 'env_plugins:Nope': cannot load it"),
    (["env_plugins.Echo"], "megarl-env: error: environment 'env_plugins.Echo': expected 'package.module:Class'"),
    (["env_plugins:Echo", "--args", "[1]"], "megarl-env: error: --args: expected a JSON object, got '[1]'"),
    (["env_plugins:Echo", "--args", "{bad"], "megarl-env: error: Expecting property name"),
    (["env_plugins:Echo", "--args", '{"colour": 1}'],
     "megarl-env: error: env_plugins:Echo(**{\"colour\": 1}): TypeError:"),
    (["env_plugins:Echo", "--host", "0.0.0.0"], "megarl-env: error: --host 0.0.0.0: a non-loopback bind needs"),
    (["env_plugins:Echo", "--max-episodes", "0"], "megarl-env: error: --max-episodes and --threads must be >= 1"),
])
def test_bad_input_is_one_line(args, line):
    proc = subprocess.run(env_cmd(*args), capture_output=True, text=True, env=plugin_env(), timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr


def test_a_world_readable_key_is_refused(tmp_path):
    key = tmp_path / "key"
    key.write_text("s" * 32)
    key.chmod(0o644)
    proc = subprocess.run(env_cmd("env_plugins:Echo", "--api-key-file", str(key)), capture_output=True, text=True,
                          env=plugin_env(), timeout=60)
    assert proc.returncode == 2 and "is readable by others (mode 644); chmod 600 it" in proc.stderr


# ---- the job's own environment servers, one SIGKILLed mid-run -------------------------------------

STEPS, GROUP, PROMPTS_PER_STEP = 10, 4, 8


def kill_env_server_at_step_3(proc) -> dict | None:
    """SIGKILLs the run's environment server once step 3 is logged; its servers.json entry."""
    run = harness.run_dir_of(proc)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if any(r.get("step", 0) >= 3 and "reward" in r for r in harness.rows_so_far(run)):
            # the push after the step opens the staleness window: new episodes start and take
            # >= 2 s (two 1 s environment steps), so 0.7 s later some are open
            time.sleep(0.7)
            killed = json.loads((run / "env_servers" / "servers.json").read_text())[0]
            os.kill(killed["pid"], signal.SIGKILL)
            return killed
        time.sleep(0.05)
    return None


def test_a_killed_environment_server_is_restarted_and_no_prompt_is_lost(tmp_path):
    """Guess-the-number (two turns: a wrong first guess is answered "higher"/"lower") on the demo's
    addition prompts, served by the job's megarl-env; each step takes 1 s (delay_s: the rollout, not
    the trainer, is the bottleneck, so episodes are open when the server dies); killed at step 3."""
    run = harness.train(
        tmp_path / "run", f"train.steps={STEPS}", f"rollout.group_size={GROUP}",
        f"train.global_batch_size={GROUP * PROMPTS_PER_STEP}", "train.max_seq_len=48",
        "rollout.workflow=megarl.rollout.workflows:EnvironmentWorkflow",
        'rollout.workflow_args={"max_turns": 2}', f"env.cls={GUESS}", 'env.args={"delay_s": 1.0}',
        "env.health_interval_s=0.5",
        "rollout.eval_at_start=false", "rollout.eval_interval=0", "checkpoint.save_interval=0",
        "logging.dump_generations=true", "logging.log_interval=1", timeout=900, during=kill_env_server_at_step_3)
    run.check()
    killed = run.probe
    assert killed is not None, "the run ended before step 3"
    now = json.loads((run.dir / "env_servers" / "servers.json").read_text())[0]
    assert now["url"] == killed["url"] and now["pid"] != killed["pid"]  # the same port, a new process
    rows = run.rows
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    last = rows[-1]
    assert last["env/server_restarts"] >= 1 and last["rollout/failed"] == 0, last
    # the episodes the dead server held failed and were run again (or, on a loaded machine where
    # the trainer is the bottleneck, the kill found only resets, which waited for the restart), none for good
    assert last["env/episode_errors"] + last["env/reset_retries"] >= 1, last
    assert last["env/episode_errors"] <= last["env/episode_retries"] + last["env/episodes_failed"], last
    assert last["rollout/retries"] >= (last["env/episodes_failed"] > 0), last  # out of re-runs: the group re-runs
    assert last["env/episodes"] >= STEPS * PROMPTS_PER_STEP * GROUP and last["env/steps"] >= last["env/episodes"]
    assert all(1.0 <= r["episode/turns"] <= 2.0 for r in rows)
    # exactly once: every trained draw in one step with its whole group, and no prompt failed
    gens = run.generations
    steps_of, samples_of = collections.defaultdict(set), collections.Counter()
    for g in gens:
        steps_of[g["draw"]].add(g["step"])
        samples_of[g["draw"]] += 1
    assert all(len(s) == 1 for s in steps_of.values()) and set(samples_of.values()) == {GROUP}
    assert len(steps_of) == STEPS * PROMPTS_PER_STEP
    assert not (run.dir / "failed_prompts.jsonl").exists() or not (run.dir / "failed_prompts.jsonl").read_text()
    # pushes landed in the middle of episodes: their generated tokens carry two policy versions
    assert any(len(set(g["versions"])) > 1 for g in gens)
    # two-turn episodes exist, and their reward is the environment's (1 for a right guess, else 0)
    assert {g["reward"] for g in gens} <= {0.0, 1.0} and any(r["episode/turns"] > 1 for r in rows)
