"""The algorithm knobs in the real loop: short megarl-train runs of the tiny demo (real trainer,
real rollout manager and server), each asserting the metric that shows its knob acted (kl and
dapo read one run, tis runs its own: it needs stale samples, dapo on-policy ones).

  kl         algo.kl_coef > 0 with the reference = the start weights: kl_ref is 0 at step 1
             (policy = reference) and > 0 after the policy moved, and the step's loss is the
             policy loss plus kl_coef x kl_ref (the term is in the loss)
  dapo       algo.overlong_buffer_len with algo.dynamic_sampling, in DAPO's order (shaped, then
             filtered): groups were dropped (rollout/filtered/dynamic_sampling), every trained
             group has unequal *shaped* rewards, and groups of equal verifier rewards were trained
             because the shaping told their samples apart (the old order dropped them)
  tis        algo.rollout_correction=tis_token with C = 1 on an asynchronous run (stale samples):
             tokens whose rho = pi_prox / pi_behave exceeded C were truncated, so on the stale
             steps the mean weight fell below the mean rho by far more than on the on-policy
             first step (fp noise)
"""
import collections

import harness
import pytest

# every run: batch 32 (8 groups of 4), lr 1e-3 without warm-up (the knobs' effects show in a few steps)
COMMON = ("checkpoint.save_interval=0", "train.global_batch_size=32", "rollout.group_size=4", "optim.lr=1e-3",
          "optim.lr_warmup_steps=0", "logging.dump_generations=true")
KL_COEF = 0.5
# kl and dapo read one run (shared_train): the KL term is in the loss of any batch (a filtered one
# too), and DAPO's shaping and filter act on the rollouts of any policy. Seeded and on-policy: the
# same batches every run (measured: 2 groups of equal verifier rewards trained, at steps 2 and 4;
# kl_ref 0.14-0.27 after step 1). For dapo: answers are 2-3 characters + EOS (3-4 tokens); max 6
# new tokens, buffer 4: lengths above 2 are penalised -0.25 per token, so equal verifier rewards
# of different lengths differ once shaped
KL_DAPO = (*COMMON, "train.steps=4", "rollout.max_staleness=0", "rollout.seed=1",
           f"algo.kl_coef={KL_COEF}", "algo.kl_estimator=k3",
           "rollout.max_new_tokens=6", "algo.overlong_buffer_len=4", "algo.dynamic_sampling=true")


def test_reference_kl_is_measured_and_in_the_loss(shared_train):
    rows = shared_train(*KL_DAPO).check().rows
    kl = [r["kl_ref"] for r in rows]
    assert kl[0] == pytest.approx(0.0, abs=1e-6), kl  # step 1: the policy is the reference
    assert min(kl[1:]) > 1e-4, kl  # the policy moved away from it
    for r in rows:  # one mini-batch, token_mean: loss = policy loss + kl_coef * mean k3
        assert r["loss"] == pytest.approx(r["pg_loss"] + KL_COEF * r["kl_ref"], abs=1e-6), r


def test_dynamic_sampling_filters_on_overlong_shaped_rewards(shared_train):
    run = shared_train(*KL_DAPO).check()
    rows, gens = run.rows, run.generations
    assert rows[-1]["rollout/filtered/dynamic_sampling"] > 0, rows[-1]  # the filter acted
    assert all(r["overlong_frac"] > 0 for r in rows) and all(r["overlong_penalty_mean"] < 0 for r in rows)
    groups = collections.defaultdict(list)
    for g in gens:
        assert g["reward"] == pytest.approx(g["reward_raw"] - 0.25 * max(0, len(g["response_ids"]) - 2))
        groups[(g["step"], g["group_id"])].append(g)
    assert len(groups) == 4 * 8 and all(len(v) == 4 for v in groups.values())
    # every trained group has unequal shaped rewards (nothing all-equal got through) ...
    assert all(len({g["reward"] for g in v}) > 1 for v in groups.values())
    # ... and some had equal verifier rewards: kept only because shaping came first
    kept_by_shaping = [k for k, v in groups.items() if len({g["reward_raw"] for g in v}) == 1]
    assert kept_by_shaping, "no group of equal verifier rewards was trained"


def test_tis_rollout_correction_truncates_stale_tokens(tmp_path):
    rows = harness.train(tmp_path / "run", *COMMON, "train.steps=5", "algo.rollout_correction=tis_token",
                         "algo.rollout_correction_high=1.0", "algo.prox_logp_mode=recompute",
                         "rollout.max_staleness=1", timeout=300, check=True).rows
    # mean rho - mean min(rho, C) = mean (rho - 1)+ : what the truncation at C = 1 took off the weights
    cut = [r["rollout_corr_rho"] - r["rollout_corr_weight"] for r in rows]
    assert rows[0]["staleness_max"] == 0 and cut[0] < 1e-5, rows[0]  # step 1 is on-policy: rho = 1 up to fp noise
    stale = [r for r in rows if r["staleness_max"] >= 1]
    assert stale, [r["staleness_max"] for r in rows]  # async: pi_behave (an older version) != pi_prox
    # measured: 0.06-0.11 on the stale steps
    assert max(r["rollout_corr_rho"] - r["rollout_corr_weight"] for r in stale) > 1e-2, stale
    assert all(r["rollout_corr_truncated_frac"] > 0 for r in stale)
    assert all(r["rollout_corr_weight"] <= 1.0 + 1e-9 for r in rows)


def test_gspo_trains_with_one_ratio_per_sequence(tmp_path):
    """algo.policy_loss=gspo in the real loop (formulas checked in tests/unit/test_gspo.py): on-policy,
    two mini-batches a step; the first mini-batch starts at pi_old = pi_prox, so every sequence
    ratio is 1 there and nothing is clipped; the step's mean ratio moves off 1 with the second."""
    run = harness.train(tmp_path / "run", *COMMON, "train.steps=3", "train.ppo_mini_batch_size=16",
                        "rollout.max_staleness=0", "algo.policy_loss=gspo", "algo.loss_agg=seq_mean_token_mean",
                        "algo.eps_clip_low=3e-4", "algo.eps_clip_high=4e-4").check()
    rows = run.rows
    assert [r["step"] for r in rows] == [1, 2, 3]
    print("\n[gspo] " + "; ".join(f"{r['step']}: ratio {r['gspo/seq_ratio_mean']:.4f} clipped "
                                  f"{r['gspo/seq_clip_frac']:.3f}" for r in rows))
    groups = collections.defaultdict(set)  # (step, group) -> the group's rewards
    for g in run.generations:
        groups[g["step"], g["group_id"]].add(g["reward"])
    for r in rows:
        assert r["optimizer_steps"] == 2
        # a step whose groups all have equal rewards has no advantage to follow: its gradient is 0
        # (seen once in CI); any other may be 0 too when its unequal groups all fell in the clipped
        # second mini-batch, so only the run as a whole is required to have trained
        if all(len(v) == 1 for (step, _), v in groups.items() if step == r["step"]):
            assert r["grad_norm"] == 0.0, r
        # half the sequences (the first mini-batch) at ratio exactly 1, unclipped; the other half
        # after an lr 1e-3 step, far outside a 3e-4 / 4e-4 band: clipped
        assert 0 < r["gspo/seq_clip_frac"] <= 0.5 and r["gspo/seq_ratio_mean"] != 1.0
    assert any(r["grad_norm"] > 0 for r in rows), rows
