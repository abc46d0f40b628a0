"""Advantage estimators against plain-Python loops and hand numbers."""
import math

import pytest
import torch

from megarl.algo import (AdvantageConfig, AdvantageEstimator, compute_advantages,
                         discounted_returns, gae_advantages, grpo_advantages,
                         reinforce_pp_advantages, rloo_advantages, token_level_rewards)

D = torch.float64
# group 7: three samples; 3: two; 9: a single sample; 5: equal rewards (std 0)
GROUPS = [7, 7, 7, 3, 3, 9, 5, 5]
REWARDS = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 3.0, 0.1, 0.1])


def _mask(b=8, s=4):
    m = torch.ones(b, s)
    m[0, 0] = 0.0
    m[4] = 0.0                                        # all-masked row
    m[2, 3] = 0.0
    return m


def _group_ref(rewards, groups, fn):
    out = []
    for i, g in enumerate(groups):
        members = [r for r, h in zip(rewards, groups) if h == g]
        out.append(0.0 if len(members) < 2 or len(set(members)) == 1 else fn(rewards[i], members))
    return out


def _broadcast(values, mask):
    return torch.tensor([[v * m for m in row] for v, row in zip(values, mask.tolist())])


def _std(xs):
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def test_grpo_and_drgrpo_match_loop():
    mask = _mask()
    r = REWARDS.tolist()
    ref = _group_ref(r, GROUPS, lambda x, g: (x - sum(g) / len(g)) / (_std(g) + 1e-6))
    got = grpo_advantages(REWARDS, mask, GROUPS)
    torch.testing.assert_close(got, _broadcast(ref, mask))
    assert got[5].abs().sum() == 0 and got[6:].abs().sum() == 0 and not got.isnan().any()
    ref = _group_ref(r, GROUPS, lambda x, g: x - sum(g) / len(g))
    torch.testing.assert_close(grpo_advantages(REWARDS, mask, torch.tensor(GROUPS), False),
                               _broadcast(ref, mask))
    # hand: group 3 = {2, -1}: mean 0.5, unbiased std 2.1213 -> +-0.7071
    assert float(got[3, 0]) == pytest.approx(1.5 / math.sqrt(4.5), rel=1e-5)


def test_rloo_matches_loop():
    mask = _mask()
    ref = _group_ref(REWARDS.tolist(), GROUPS, lambda x, g: x - (sum(g) - x) / (len(g) - 1))
    torch.testing.assert_close(rloo_advantages(REWARDS, mask, GROUPS), _broadcast(ref, mask))
    assert float(rloo_advantages(REWARDS, mask, GROUPS)[1, 0]) == pytest.approx(0.0 - 0.75)


def test_token_level_rewards_and_discounted_returns_skip_masked_positions():
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0], [0.0] * 5])
    kl = torch.tensor([[9.0, 0.2, 9.0, 0.4, 9.0], [1.0] * 5])
    tr = token_level_rewards(torch.tensor([2.0, 5.0]), mask, kl, kl_coef=0.5)
    torch.testing.assert_close(tr, torch.tensor([[0.0, -0.1, 0.0, 1.8, 0.0], [0.0] * 5]))
    ret = discounted_returns(tr, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.0, -0.1 + 0.9, 0.0, 1.8, 0.0], [0.0] * 5]))


def test_reinforce_pp_whitens_returns_over_the_batch():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    tr = token_level_rewards(torch.tensor([1.0, -1.0, 4.0]), mask)
    out = reinforce_pp_advantages(tr, mask, gamma=0.5)
    g = [0.5, 1.0, -1.0]
    mu = sum(g) / 3
    sd = math.sqrt(sum((x - mu) ** 2 for x in g) / 3)
    a = [(x - mu) / (sd + 1e-6) for x in g]
    expect = torch.tensor([[a[0], a[1], 0.0], [a[2], 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(out.advantages, expect)
    torch.testing.assert_close(out.returns, torch.tensor([[0.5, 1.0, 0], [-1.0, 0, 0], [0, 0, 0]]))


def test_gae_hand_numbers_with_gap_and_loop_reference():
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    values = torch.tensor([[0.5, 99.0, 0.6, 0.7]])
    tr = token_level_rewards(torch.tensor([1.0]), mask)
    out = gae_advantages(tr, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.21712, 0.0, 0.246, 0.3]]))
    torch.testing.assert_close(out.returns, torch.tensor([[0.71712, 0.0, 0.846, 1.0]]))

    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(3, 6, generator=g) > 0.3).float()
    mask[1] = 0.0
    values, rewards = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    out = gae_advantages(rewards * mask, values, mask, gamma=0.95, lam=0.9)
    for i in range(3):
        idx = [t for t in range(6) if mask[i, t]]
        a_next = v_next = 0.0
        for t in reversed(idx):
            r, v = float(rewards[i, t]), float(values[i, t])
            a = r + 0.95 * v_next - v + 0.95 * 0.9 * a_next
            assert float(out.advantages[i, t]) == pytest.approx(a, abs=1e-5)
            assert float(out.returns[i, t]) == pytest.approx(a + v, abs=1e-5)
            a_next, v_next = a, v
    assert out.advantages[1].abs().sum() == 0 and out.advantages[mask == 0].abs().sum() == 0


def test_compute_advantages_dispatch_and_kl_folding():
    mask = _mask()
    kl = torch.full(mask.shape, 0.1)
    cfg = AdvantageConfig(AdvantageEstimator.GRPO, kl_coef=0.5)
    out = compute_advantages(cfg, REWARDS, mask, GROUPS, kl=kl)
    score = REWARDS.double() - 0.5 * (kl * mask).sum(-1).double()
    torch.testing.assert_close(out.advantages, grpo_advantages(score, mask, GROUPS))
    torch.testing.assert_close(out.returns, (score.float()[:, None] * mask))
    dr = compute_advantages(AdvantageConfig(AdvantageEstimator.DRGRPO), REWARDS, mask, GROUPS)
    torch.testing.assert_close(dr.advantages, grpo_advantages(REWARDS, mask, GROUPS, False))
    rl = compute_advantages(AdvantageConfig(AdvantageEstimator.RLOO), REWARDS, mask, GROUPS)
    torch.testing.assert_close(rl.advantages, rloo_advantages(REWARDS, mask, GROUPS))
    rpp = compute_advantages(AdvantageConfig(AdvantageEstimator.REINFORCE_PP, gamma=0.9,
                                             kl_coef=0.2), REWARDS, mask, kl=kl)
    tr = token_level_rewards(REWARDS, mask, kl, 0.2)
    torch.testing.assert_close(rpp.advantages, reinforce_pp_advantages(tr, mask, 0.9).advantages)
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    gae = compute_advantages(AdvantageConfig(AdvantageEstimator.GAE, norm_adv_by_std=False),
                             REWARDS, mask, values=values)
    plain = token_level_rewards(REWARDS, mask)                        # no kl passed: none folded
    torch.testing.assert_close(gae.advantages, gae_advantages(plain, values, mask).advantages)
    with pytest.raises(ValueError, match="group_id"):
        compute_advantages(AdvantageConfig(), REWARDS, mask)
    with pytest.raises(ValueError, match="values"):
        compute_advantages(AdvantageConfig(AdvantageEstimator.GAE), REWARDS, mask)
