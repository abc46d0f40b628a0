"""The async GRPO loop end to end on the tiny demo: real megatron-core trainer, a real local
megarl server, weight pushes every step, staleness bounded, rollouts in sync at step 1.

TP=1 reads the session's shared demo run (demo_run.py: test_listeners reads the same run); the
packed PP=2 layout is a run of its own."""
import os

import harness
import pytest
from demo_run import EVAL, GRPO_STEPS, demo_run
from metric_sinks import tensorboard_scalars, wandb_history

pytestmark = pytest.mark.xdist_group("demo_run")  # reads the shared run made by the first test to ask (conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_grpo_steps(run: harness.Run, sinks: bool) -> None:
    run.check()
    rows = run.rows
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    hf_bytes = os.path.getsize(f"{REPO}/examples/tiny/model/model.safetensors")
    for r in rows:
        assert 0.0 <= r["reward"] <= 1.0
        assert r["staleness_max"] <= 1  # bounded off-policyness
        assert r["optimizer_steps"] == 1
    # weights.overlap (staleness 1): the trainer only stages each push (a copy of the weights) and
    # a flight of its own sends it while the next update runs; a step reports the flight that landed
    # in it. The evaluating steps (2, 4) land their own push - the servers must hold it - so step 3's
    # flight lands at step 4's push and step 1's at step 2's, whose own flight is the one reported.
    landed = [r for r in rows if "push/version" in r]
    assert [(r["step"], r["push/version"]) for r in landed] == [(2, 2), (4, 4)], landed
    for r in landed:
        assert r["push/bytes"] > 0.99 * hf_bytes - 4096  # the whole model each push
    # the trainer's share of the push is reported every step (its size is a benchmark's:
    # tools/bench/bench_push_overlap.py)
    assert all(0 < r["push/blocking_s"] < r["step_time"] for r in rows)
    # step 1 trains on rollouts of the very weights it starts from: no training-inference gap
    assert rows[0]["logp_gap"] <= 1e-5 and rows[0]["staleness_max"] == 0
    # train.mismatch_gate (on by default) never trips on the demo: tokens of the version each step
    # starts from get the trainer's logprob to well under its fp32 threshold (1e-4 nats, mean)
    # (later steps hold tokens of their own version only when generation overlapped the push)
    assert rows[0]["mismatch/onpolicy_frac"] == 1.0
    assert all(r["mismatch/mean"] <= 1e-5 and r["mismatch/max"] <= 1e-4 for r in rows), rows
    # checksum verification (every push here, in its flight): every push holds exactly on the server
    assert all(r["push/verify_mismatches"] == 0 and r["push/digest_s"] > 0 for r in landed)
    # evaluations run beside training and are reported with the version they measured (each
    # evaluating step lands its push first): the one started at step 2 lands at step 2 or 3 - or,
    # on a loaded machine, finishes with step 4's, whose result is the one reported - and the last
    # step waits for its own
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["eval/step"] for r in evals] in ([2, 4], [4]) and evals[-1] is rows[3]
    assert all(r["eval/version"] == r["eval/step"] for r in evals)
    assert 0.0 <= rows[3]["eval_accuracy"] <= 1.0
    assert "policy version 4" in run.log
    if sinks:  # TensorBoard and W&B (offline) hold the same per-step metrics as metrics.jsonl
        tb = tensorboard_scalars(str(run.dir / "tensorboard"))
        wb = wandb_history(str(run.dir))
        for key in ("reward", "staleness_max", "trainer_idle_ratio", "time/update", "push/blocking_s"):
            assert [s for s, _ in tb[key]] == [1, 2, 3, 4], key
            assert [v for _, v in tb[key]] == pytest.approx([r[key] for r in rows], rel=1e-6), key
            assert [w[key] for w in wb] == pytest.approx([r[key] for r in rows], rel=1e-6), key
        assert [w["_step"] for w in wb] == [1, 2, 3, 4]
    files = set(os.listdir(run.dir / "model"))  # PP=2 writes one file per stage plus the index
    assert "model.safetensors" in files or "model.safetensors.index.json" in files


def test_grpo_steps_tp1(shared_train):
    check_grpo_steps(demo_run(shared_train), sinks=True)


def test_grpo_steps_pp2_packed_self_launched(tmp_path):
    """The model also runs packed (train.pack_sequences: THD, each pack padded to the step's longest
    by a filler sequence so every micro-batch crosses the pipeline in one shape); padded PP=2 is
    checked against TP=1 in tests/dist/test_parallel_equivalence.py."""
    run = harness.train(tmp_path / "run", *GRPO_STEPS, "checkpoint.hf_export_dir=model", "parallel.pp=2",
                        "train.pack_sequences=true", eval_data=EVAL)
    check_grpo_steps(run, sinks=False)


def test_grpo_learns_a_reward(tmp_path):
    """Behavioural check of the whole loop (advantage signs, loss, push, staleness): with a reward
    for answers starting with '1' (~0.6 of the demo model's samples at first: 60% of the sums are
    3-digit), the policy must learn it. Batch 64, no warmup and lr 5e-4: a short, fast-moving run
    (the demo recipe's batch 256 and 10-step warmup would spend the 14 steps warming up)."""
    run = harness.train(tmp_path / "run", "train.global_batch_size=64", "rollout.eval_at_start=false",
                        "train.steps=14", "optim.lr=1e-4", "optim.lr_warmup_steps=0",
                        "rollout.reward_fn=reward_plugins:starts_with_one", env=harness.plugin_env(), check=True)
    rewards = [r["reward"] for r in run.rows]
    last = sum(rewards[-5:]) / 5
    # step 1 is the untrained policy (its base rate depends on which prompts came first)
    assert last > 0.55 and last > rewards[0] + 0.15, rewards
