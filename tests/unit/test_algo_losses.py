"""Policy losses and rollout corrections against hand numbers and an element-wise reference."""
import itertools
import math

import pytest
import torch

from megarl.algo import (CapMode, LossAgg, OldLogp, PolicyLossConfig, PolicyLossKind,
                         RolloutCorrection, aggregate, merge_stats, policy_loss, stats_results,
                         step_token_weights)

D = torch.float64


def _ref_loss(lp, px, bh, adv, mask, cfg):
    """Plain-Python per-token loss, written from the formulas, not from the implementation."""
    out = [[0.0] * len(lp[0]) for _ in lp]
    for i in range(len(lp)):
        seq_log_rho = sum(px[i][t] - bh[i][t] for t in range(len(lp[i])) if mask[i][t])
        for t in range(len(lp[i])):
            if not mask[i][t]:
                continue
            use_prox = cfg.kind == PolicyLossKind.DECOUPLED_PPO or cfg.old_logp == OldLogp.PROX
            r = math.exp(lp[i][t] - (px[i][t] if use_prox else bh[i][t]))
            a = adv[i][t]
            clipped = min(max(r, 1 - cfg.eps_clip_low), 1 + cfg.eps_clip_high)
            s = max(-a * r, -a * clipped)
            if cfg.dual_clip_c is not None and a < 0:
                s = min(s, -cfg.dual_clip_c * a)
            rho = math.exp(px[i][t] - bh[i][t])
            rho_seq = math.exp(seq_log_rho)
            lo, hi = cfg.rollout_correction_low, cfg.rollout_correction_high
            kind = cfg.rollout_correction
            weight, keep = None, True
            if kind == RolloutCorrection.TIS_TOKEN:
                weight = min(rho, hi)
            elif kind == RolloutCorrection.TIS_SEQ:
                weight = min(rho_seq, hi)
            elif kind == RolloutCorrection.MIS_TOKEN:
                keep = lo <= rho <= hi
            elif kind == RolloutCorrection.MIS_SEQ:
                keep = lo <= rho_seq <= hi
            elif kind == RolloutCorrection.ICEPOP:
                keep, weight = lo <= rho <= hi, rho
            if cfg.kind == PolicyLossKind.PPO:
                w = 1.0 if weight is None else weight
            else:
                w = rho if weight is None else weight
                if cfg.behave_weight_cap is not None and keep and w > cfg.behave_weight_cap:
                    if cfg.behave_weight_cap_mode == CapMode.MASK:
                        keep = False
                    else:
                        w = cfg.behave_weight_cap
            out[i][t] = w * s if keep else 0.0
    return out


def _random_inputs(seed=0, b=4, s=6):
    g = torch.Generator().manual_seed(seed)
    behave = -torch.rand(b, s, generator=g, dtype=D) * 3
    prox = behave + torch.randn(b, s, generator=g, dtype=D) * 0.6   # rho spans ~[0.2, 5]
    logp = prox + torch.randn(b, s, generator=g, dtype=D) * 0.4
    adv = torch.randn(b, s, generator=g, dtype=D)
    mask = (torch.rand(b, s, generator=g) > 0.25).to(D)
    mask[1] = 0.0                                                    # an all-masked row
    mask[0, :3] = 1.0
    return logp, prox, behave, adv, mask


CFGS = [
    PolicyLossConfig(kind=k, old_logp=o, eps_clip_low=0.2, eps_clip_high=0.28, dual_clip_c=c,
                     behave_weight_cap=cap, behave_weight_cap_mode=cm, rollout_correction=rc,
                     rollout_correction_low=0.6, rollout_correction_high=1.8)
    for k, o, c, cap, cm, rc in itertools.product(
        (PolicyLossKind.PPO, PolicyLossKind.DECOUPLED_PPO), OldLogp, [None, 2.0], [None, 1.5], CapMode,
        RolloutCorrection)  # gspo's ratio is per sequence: its reference is tests/unit/test_gspo.py
    if not (k == PolicyLossKind.PPO and (cap is not None or cm == CapMode.CLAMP))
]


def test_policy_loss_matches_elementwise_reference_for_every_variant():
    logp, prox, behave, adv, mask = _random_inputs()
    lists = [x.tolist() for x in (logp, prox, behave, adv, mask)]
    hit_cap = hit_band = 0
    for cfg in CFGS:
        out = policy_loss(logp, prox, behave, adv, mask, cfg)
        ref = torch.tensor(_ref_loss(*lists, cfg), dtype=D)
        torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-12, msg=str(cfg))
        res = stats_results(out.stats)
        hit_cap += res.get("behave_weight_capped_frac", 0.0) > 0
        hit_band += res.get("rollout_corr_dropped_frac", 0.0) > 0
    assert hit_cap and hit_band                                       # the edge cases were exercised


def test_policy_loss_hand_numbers_decoupled_dual_clip_and_caps():
    # t0: A=1, u=1.5 -> clipped at 1.2, w=2  => -2.4
    # t1: A=-1, u=5 -> max(5, 1.2)=5, dual clip c=3 => 3, w=1
    # t2: A=2, u=1, w=10 > cap 5 -> masked (mask) or w=5 (clamp) => 0 / -10
    # t3: off the loss mask
    logp = torch.tensor([[math.log(1.5), math.log(5.0), 0.0, 7.0]], dtype=D)
    prox = torch.tensor([[0.0, 0.0, 0.0, -9.0]], dtype=D)
    behave = torch.tensor([[math.log(0.5), 0.0, math.log(0.1), 0.0]], dtype=D)
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=D)
    base = dict(kind=PolicyLossKind.DECOUPLED_PPO, dual_clip_c=3.0, behave_weight_cap=5.0)
    out = policy_loss(logp, prox, behave, adv, mask, PolicyLossConfig(**base))
    torch.testing.assert_close(out.loss, torch.tensor([[-2.4, 3.0, 0.0, 0.0]], dtype=D))
    res = stats_results(out.stats)
    assert res["clip_frac_high"] == pytest.approx(1 / 3)
    assert res["clip_frac_low"] == 0.0
    assert res["dual_clip_frac"] == pytest.approx(1 / 3)
    assert res["behave_weight_capped_frac"] == pytest.approx(1 / 3)
    assert res["behave_weight_max"] == pytest.approx(10.0)
    assert res["behave_weight"] == pytest.approx(1.5)                 # (2 + 1) / 2 kept tokens
    assert res["dropped_frac"] == pytest.approx(1 / 3)
    k1 = -(math.log(1.5) + math.log(5.0)) / 3
    assert res["approx_kl_k1"] == pytest.approx(k1)
    assert res["approx_kl_k3"] == pytest.approx(((0.5 - math.log(1.5)) + (4 - math.log(5.0))) / 3)

    clamp = PolicyLossConfig(**base, behave_weight_cap_mode=CapMode.CLAMP)
    out = policy_loss(logp, prox, behave, adv, mask, clamp)
    torch.testing.assert_close(out.loss, torch.tensor([[-2.4, 3.0, -10.0, 0.0]], dtype=D))


def test_ppo_clip_low_and_negative_advantage_without_dual_clip():
    logp = torch.log(torch.tensor([[0.5, 0.5, 1.5]], dtype=D))
    zeros = torch.zeros_like(logp)
    adv = torch.tensor([[-1.0, 1.0, -2.0]], dtype=D)
    cfg = PolicyLossConfig(kind=PolicyLossKind.PPO, old_logp=OldLogp.BEHAVE)
    out = policy_loss(logp, None, zeros, adv, torch.ones_like(logp), cfg)
    # A<0, r=0.5: max(0.5, 0.8) = 0.8 (clipped low); A>0, r=0.5: max(-0.5, -0.8) = -0.5;
    # A=-2, r=1.5: max(3.0, 2.4) = 3.0 (unbounded without dual clip)
    torch.testing.assert_close(out.loss, torch.tensor([[0.8, -0.5, 3.0]], dtype=D))
    assert stats_results(out.stats)["clip_frac_low"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="prox_logp"):
        policy_loss(logp, None, zeros, adv, torch.ones_like(logp), PolicyLossConfig())


ON_POLICY_CFGS = [
    PolicyLossConfig(kind=PolicyLossKind.PPO, old_logp=OldLogp.PROX),
    PolicyLossConfig(kind=PolicyLossKind.PPO, old_logp=OldLogp.BEHAVE),
    PolicyLossConfig(kind=PolicyLossKind.DECOUPLED_PPO, dual_clip_c=3.0),
    PolicyLossConfig(kind=PolicyLossKind.PPO, rollout_correction=RolloutCorrection.TIS_TOKEN),
    PolicyLossConfig(kind=PolicyLossKind.PPO, rollout_correction=RolloutCorrection.TIS_SEQ),
    PolicyLossConfig(kind=PolicyLossKind.DECOUPLED_PPO, rollout_correction=RolloutCorrection.ICEPOP),
    PolicyLossConfig(kind=PolicyLossKind.DECOUPLED_PPO, rollout_correction=RolloutCorrection.MIS_SEQ),
]


@pytest.mark.parametrize("agg", list(LossAgg))
def test_on_policy_variants_agree_and_give_vanilla_policy_gradient(agg):
    _, _, behave, adv, mask = _random_inputs(seed=3)
    weights = step_token_weights(mask, agg, norm_len=6).to(D)
    expected_grad = -adv * weights                                    # d/dlogp of -A logp, agg'd
    expected_value = (-adv * weights).sum()
    for cfg in ON_POLICY_CFGS:
        logp = behave.clone().requires_grad_(True)
        out = policy_loss(logp, behave.clone(), behave.clone(), adv, mask, cfg)
        loss = aggregate(out.loss, weights)
        loss.backward()
        torch.testing.assert_close(loss.detach(), expected_value, msg=str(cfg))
        torch.testing.assert_close(logp.grad, expected_grad, msg=str(cfg))


def test_padding_with_extreme_logprobs_gives_finite_loss_and_grad():
    logp = torch.tensor([[-0.5, 1e4], [-1e4, -0.1]], dtype=D, requires_grad=True)
    prox = torch.tensor([[-0.4, -1e4], [0.0, -0.2]], dtype=D)
    behave = torch.tensor([[-0.3, 0.0], [1e4, -0.2]], dtype=D)
    mask = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=D)
    adv = torch.ones_like(mask)
    for cfg in CFGS[:: max(1, len(CFGS) // 12)]:
        out = policy_loss(logp, prox, behave, adv, mask, cfg)
        aggregate(out.loss, step_token_weights(mask, LossAgg.TOKEN_MEAN)).backward()
        assert torch.isfinite(out.loss).all() and torch.isfinite(logp.grad).all()
        assert logp.grad[0, 1] == 0 and logp.grad[1, 0] == 0
        logp.grad = None


def test_stats_merged_over_micro_batches_equal_whole_batch():
    logp, prox, behave, adv, mask = _random_inputs(seed=5)
    cfg = PolicyLossConfig(dual_clip_c=2.0, behave_weight_cap=1.5,
                           rollout_correction=RolloutCorrection.MIS_TOKEN)
    whole = policy_loss(logp, prox, behave, adv, mask, cfg).stats
    merged = {}
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
        part = policy_loss(logp[rows], prox[rows], behave[rows], adv[rows], mask[rows], cfg)
        merged = merge_stats(merged, part.stats)
    assert merged.keys() == whole.keys()
    for name, value in stats_results(whole).items():
        assert stats_results(merged)[name] == pytest.approx(value, abs=1e-12), name
