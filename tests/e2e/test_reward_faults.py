"""Rewards that raise, hang or return NaN inside a real run: each such sample gets the reward of
record (reward.on_error_value), the counts are reported, and the run completes; on threads and in
worker processes (reward.executor=process: a hung call's worker is killed and replaced)."""
import json
import os

import harness
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_raising_hanging_and_nan_rewards_do_not_stop_the_run(tmp_path, executor):
    run = tmp_path / "run"
    proc = harness.train(run, "train.global_batch_size=64", "rollout.eval_at_start=false", "train.steps=3",
                         "rollout.reward_fn=reward_plugins:faulty_reward", "reward.timeout_s=0.3",
                         "reward.on_error_value=-1.0", "logging.dump_generations=true", f"reward.executor={executor}",
                         env=harness.plugin_env(), check=True)
    rows = proc.rows
    assert [r["step"] for r in rows] == [1, 2, 3]
    last = rows[-1]
    assert last["reward/errors"] > 0 and last["reward/timeouts"] > 0  # cumulative counts
    if executor == "process":  # every timed-out call cost its worker
        assert last["reward/worker_restarts"] == last["reward/timeouts"]
    gens = proc.generations
    by_digit = {}
    for g in gens:
        prompt = open(f"{REPO}/examples/tiny/data/rl_prompts.jsonl").readlines()[g["prompt_index"]]
        by_digit.setdefault(json.loads(prompt)["prompt"][:1], set()).add(g["reward"])
    for digit in "1234":  # raised, raised, timed out, NaN: all scored with the reward of record
        assert by_digit.get(digit, {-1.0}) == {-1.0}, (digit, by_digit.get(digit))
    assert all(r in (0.0, 1.0) for d, rs in by_digit.items() if d not in "1234" for r in rs)
    assert not (run / "failed_prompts.jsonl").exists()  # no prompt lost
