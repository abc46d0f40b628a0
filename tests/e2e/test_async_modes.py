"""Seed 003's four training modes, by config alone, on the real trainer and a real local server:
on-policy, stream off-policy (k steps per push), async with stale samples (no sample spans two
versions) and async with partial rollouts (samples continue across pushes). Generations are long
(ignore_eos) so pushes land while requests are in flight."""
import harness
import pytest

# every run (test_verl_knobs.py too): batch 32 (8 groups of 4), 48 tokens a sample whatever the
# model says (ignore_eos), every sample's versions and logprobs in generations.jsonl
LONG = ("train.global_batch_size=32", "rollout.group_size=4", "rollout.max_new_tokens=48", "rollout.ignore_eos=true",
        "logging.dump_generations=true")

# One episode of 8 x 56 tokens at a time, decoded 2 sequences at a time, makes generation several
# times slower than training on a quiet machine as on a loaded one, so the controller is always
# generating when a push lands (a faster generation fills the staleness window and waits idle, and
# then no request is in flight at the push: seen once on a quiet CI machine).
SLOW_ROLLOUT = ["rollout.max_concurrent=1", "rollout.group_size=8", "rollout.max_new_tokens=56",
                "rollout.server_args=[--max-running-requests,2]"]
MODES = {
    "on_policy": ["rollout.max_staleness=0"],
    "stream_off_policy": ["rollout.max_staleness=0", "train.trigger_parameter_sync_step=4"],
    # the strict rule (hard cap = the bound): every trained token within 2 versions
    "async_stale": ["rollout.max_staleness=2", "rollout.partial_rollout=false", "rollout.staleness_hard_cap=0",
                    *SLOW_ROLLOUT],
    # the default rule: the bound kept at the start, every started group trained (hard cap 64)
    "async_partial": ["rollout.max_staleness=2", "rollout.partial_rollout=true", *SLOW_ROLLOUT],
}


@pytest.mark.parametrize("mode", list(MODES))
def test_mode(tmp_path, mode):
    steps = 8 if mode == "stream_off_policy" else 4
    run = harness.train(tmp_path / "run", f"train.steps={steps}", *LONG, *MODES[mode], check=True)
    rows, gens = run.rows, run.generations
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    bound = {"on_policy": 0, "stream_off_policy": 0, "async_stale": 2, "async_partial": 64}[mode]
    for r in rows:
        assert r["staleness_max"] <= bound, (mode, r["step"], r["staleness_max"])
    if mode == "async_partial":  # nothing generated was thrown away for its age
        assert rows[-1]["rollout/regenerated/too_stale"] == 0, rows[-1]
    spans = [len(set(g["versions"])) for g in gens]
    if mode == "on_policy":
        # every batch comes from the weights the trainer holds: no training-inference gap
        assert all(r["logp_gap"] <= 1e-5 for r in rows), [r["logp_gap"] for r in rows]
        assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    if mode == "stream_off_policy":
        # one push per 4 optimizer steps: the version advances at steps 4 and 8 only
        assert [r["policy_version"] for r in rows] == [0, 0, 0, 1, 1, 1, 1, 2]
        assert all(r["optimizer_steps"] == 1 for r in rows)
        assert sum("push/total_s" in r for r in rows) == 2
    if mode == "async_stale":
        assert max(spans) == 1  # in-flight requests finished under the old weights
        assert max(r["max_partial_span"] for r in rows) == 1
    if mode == "async_partial":
        assert max(spans) >= 2  # interrupted by a push, continued under the new weights
        assert max(r["partial_frac"] for r in rows) > 0
        partial = [g for g in gens if len(set(g["versions"])) > 1]
        for g in partial:  # each token keeps the version (and logprob) that produced it
            assert g["versions"] == sorted(g["versions"])
            assert len(g["behave_logp"]) == len(g["versions"]) == len(g["response_ids"])
            assert all(lp <= 0.0 for lp in g["behave_logp"])
