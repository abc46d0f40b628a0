"""A real SGLang server SIGKILLed in the middle of a `megarl-train` run that started it
(``rollout.engine=sglang``, two local servers, fp32 on CPU): it is dropped, restarted on its port
(SGLang's scheduler and detokenizer, orphaned by the kill, go with the process group), given the
current weights and re-admitted, and the run completes every step with every drawn prompt trained
exactly once. Once the restarted server has the current weights and the run has gone on for
AFTER more steps with both servers, the test stops the run with SIGTERM (the trainer finishes its
step, saves and exits 0): what follows would only repeat those steps. The megarl-server
counterpart is test_fault_tolerance.py.
"""
import collections
import json
import os
import signal
import time

import pytest

import harness
from e2e_servers import model_version, wait_for
from sglang_runs import MEGARL_ONLY_PATHS, demo_model, received, require_sglang, train

pytestmark = pytest.mark.sglang

STEPS = 400  # a bound only: ~1.2-3 s a step (a group per /generate) while the restarted server
# needs 40-120 s to start; the run must still be going when it rejoins (60 steps once ended first)
AFTER = 3  # steps trained after the rejoin before the test stops the run


def servers(run: str) -> list[dict]:
    with open(os.path.join(run, "servers", "servers.json")) as f:
        return json.load(f)


def test_killed_sglang_server_is_restarted_with_current_weights(tmp_path):
    require_sglang()
    model, run = demo_model(str(tmp_path / "model")), str(tmp_path / "run")
    seen = {}

    def kill_the_leader(proc):
        wait_for(lambda: len(harness.rows_so_far(run)) >= 2, "step 2", proc, timeout=600)
        victim = servers(run)[0]
        os.kill(victim["pid"], signal.SIGKILL)  # the leader, mid-generation (staleness 1 keeps them busy)
        killed_at, killed_t = len(harness.rows_so_far(run)), time.monotonic()
        wait_for(lambda: [s for s in servers(run) if s["url"] == victim["url"] and s["pid"] != victim["pid"]],
                 "the restart", proc, timeout=600)
        key = os.path.join(run, "servers", "api_key")  # the run's own servers answer only with its key
        version = wait_for(lambda: (v := model_version(victim["url"], open(key).read())) not in (None, "default") and v,
                           "current weights on the restarted server", proc, timeout=600)
        seen.update(killed_at=killed_at, version=version, rejoin_s=time.monotonic() - killed_t,
                    rejoined_at=len(harness.rows_so_far(run)))
        assert int(version) >= killed_at
        wait_for(lambda: len(harness.rows_so_far(run)) >= seen["rejoined_at"] + AFTER, "steps after the rejoin",
                 proc, timeout=600)
        proc.send_signal(signal.SIGTERM)  # finish the step, save, exit 0

    done = train(run, model, f"train.steps={STEPS}", "rollout.local_servers=2", "data.eval_path=",
                 "rollout.eval_at_start=false", "logging.dump_generations=true",
                 "rollout.staleness_hard_cap=0",  # the strict rule: every trained token within 1
                 timeout=2400, during=kill_the_leader)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = done.rows
    last = rows[-1]["step"]
    print(f"\n[sglang-fault] killed at step {seen['killed_at']}, back with weights v{seen['version']} after "
          f"{seen['rejoin_s']:.0f} s (step {seen['rejoined_at']}); stopped at step {last}, {done.wall_s:.0f} s wall")
    assert "[megarl] stopped by SIGTERM; checkpoint saved, rerun to resume" in done.log
    assert seen["rejoined_at"] + AFTER <= last < STEPS
    assert [r["step"] for r in rows] == list(range(1, last + 1))  # every step completed, in order
    assert max(r["rollout/dead_servers"] for r in rows) == 1
    assert rows[-1]["rollout/live_servers"] == 2 and rows[-1]["rollout/restarts"] == 1
    assert rows[-1]["rollout/dead_servers"] == 0
    assert all(r["staleness_max"] <= 1 for r in rows)
    draws = collections.defaultdict(set)
    for g in done.generations:
        draws[g["draw"]].add(g["step"])
    assert len(draws) == last * 32 and all(len(s) == 1 for s in draws.values())
    assert not os.path.exists(os.path.join(run, "failed_prompts.jsonl"))
    # the restarted server's log (appended to its predecessor's) shows the second start's weight group
    log = received(run)["server0.log"]
    assert log["POST /init_weights_update_group 200"] >= 2, log
    assert not {k.split()[1] for k in log} & MEGARL_ONLY_PATHS
