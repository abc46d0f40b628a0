"""verl's fully-async knobs on the real trainer and a real local server: `rollout.staleness_threshold`
alone (a fraction of a version's samples generated ahead by the previous version) and
`train.require_batches` (a step takes require_batches x ppo_mini_batch_size sequences, one
optimizer step per mini-batch). Counts versions, staleness and trained groups."""
import collections

import harness
from test_async_modes import LONG


def test_staleness_threshold_alone_bounds_the_stale_fraction(tmp_path):
    steps, group, per_step = 6, 4, 8  # 8 groups of 4 per step (global batch 32)
    run = harness.train(tmp_path / "run", f"train.steps={steps}", *LONG, "rollout.staleness_threshold=0.5",
                        check=True)
    rows, gens = run.rows, run.generations
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # one push per step: the version the step trains at advances by one each step
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    by_step = collections.defaultdict(list)
    for g in gens:
        by_step[g["step"]].append(g["version"] - min(g["versions"]))
    stale_fracs = []
    for step, stalenesses in sorted(by_step.items()):
        assert len(stalenesses) == per_step * group  # whole groups, the step's full batch
        assert max(stalenesses) <= 1  # a fraction < 1 never lets a sample be two versions old
        stale_fracs.append(sum(s > 0 for s in stalenesses) / len(stalenesses))
    # at most half of a version's samples were generated ahead by the previous version ...
    assert max(stale_fracs) <= 0.5, stale_fracs
    # ... and generation did run ahead (the trainer is slower than the server here)
    assert max(stale_fracs) > 0, stale_fracs
    assert all(r["staleness_max"] <= 1 for r in rows)


def test_require_batches_sets_what_a_step_trains(tmp_path):
    steps, group = 4, 4
    run = harness.train(tmp_path / "run", f"train.steps={steps}", *LONG, "train.require_batches=2",
                        "train.ppo_mini_batch_size=8", "train.global_batch_size=32", "rollout.max_staleness=1",
                        "rollout.staleness_hard_cap=0", check=True)  # strict: within 1
    rows, gens = run.rows, run.generations
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    per_step = collections.Counter(g["step"] for g in gens)
    # 2 x 8 = 16 sequences a step (not the 32 of train.global_batch_size): 4 groups of 4
    assert set(per_step.values()) == {16}, per_step
    assert all(r["trained_samples"] == 16 for r in rows), [r["trained_samples"] for r in rows]
    groups = collections.Counter((g["step"], g["group_id"]) for g in gens)
    assert len(groups) == steps * 16 // group and set(groups.values()) == {group}
    # one optimizer step per mini-batch of 8, and one push per step
    assert all(r["optimizer_steps"] == 2 for r in rows), [r["optimizer_steps"] for r in rows]
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
