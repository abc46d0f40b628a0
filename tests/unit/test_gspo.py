"""GSPO (`algo.policy_loss=gspo`) against the paper's sequence objective, computed here directly:

    J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),
    s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|)

megarl's per-token form (GSPO-token) aggregated with seq_mean_token_mean must give -J and its
gradient with respect to every token's log pi_theta (fp64, autograd on both sides)."""
import math

import pytest
import torch

from megarl.algo.aggregation import step_token_weights
from megarl.algo.choices import LossAgg, OldLogp, PolicyLossConfig, PolicyLossKind, RolloutCorrection
from megarl.algo.config import AlgoConfig
from megarl.algo.losses import policy_loss

EPS_LOW, EPS_HIGH = 0.02, 0.03


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 7, 1, 6, 4]
    B, S = len(lengths), 8
    mask = torch.zeros(B, S, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, 1:1 + n] = 1  # a prompt position first, padding after
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    # spread the sequence ratios across the clip band: some inside, some clipped low or high
    shift = torch.tensor([0.0, 0.05, -0.06, 0.01, -0.015, 0.2], dtype=torch.float64)[:, None]
    logp = old + shift + 0.02 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -0.5, 2.0, -1.5], dtype=torch.float64)[:, None].expand(B, S).clone()
    behave = old + 0.1 * torch.randn(B, S, generator=g, dtype=torch.float64)
    return logp, old, behave, adv, mask


def reference_objective(logp, old, adv, mask, weight=None):
    """-J of the GSPO paper, sequence by sequence."""
    terms = []
    for i in range(logp.shape[0]):
        m = mask[i].bool()
        s = torch.exp((logp[i][m] - old[i][m]).mean())
        a = adv[i][m][0]
        j = torch.minimum(s * a, s.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a)
        terms.append(j * (1.0 if weight is None else weight[i]))
    return -torch.stack(terms).mean()


def megarl_loss(logp, prox, behave, adv, mask, correction=RolloutCorrection.NONE, old_logp=OldLogp.PROX):
    cfg = PolicyLossConfig(kind=PolicyLossKind.GSPO, old_logp=old_logp, eps_clip_low=EPS_LOW,
                           eps_clip_high=EPS_HIGH, rollout_correction=correction, rollout_correction_high=1.5)
    out = policy_loss(logp, prox, behave, adv, mask, cfg)
    w = step_token_weights(mask, LossAgg.SEQ_MEAN_TOKEN_MEAN).to(out.loss.dtype)
    return (w * out.loss).sum(), out.stats


def test_loss_and_gradient_equal_the_sequence_objective():
    logp, old, behave, adv, mask = batch()
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    ours, stats = megarl_loss(a, old, behave, adv, mask)
    ref = reference_objective(b, old, adv, mask)
    ours.backward()
    ref.backward()
    assert abs(ours.item() - ref.item()) < 1e-12
    assert torch.allclose(a.grad, b.grad, atol=1e-12, rtol=0) and a.grad.abs().sum() > 0
    assert (a.grad[mask == 0] == 0).all()
    s = torch.stack([torch.exp((logp[i][mask[i].bool()] - old[i][mask[i].bool()]).mean()) for i in range(6)])
    clipped = ((s < 1 - EPS_LOW) | (s > 1 + EPS_HIGH)).double().mean().item()
    assert 0 < clipped < 1  # the batch has both: the clip decision really is per sequence
    assert stats["gspo/seq_clip_frac"].result() == pytest.approx(clipped)
    assert stats["gspo/seq_ratio_mean"].result() == pytest.approx(s.mean().item())


def test_by_hand_one_ratio_per_sequence_not_per_token():
    """Two tokens with ratios e^0.1 and e^-0.1: token PPO clips both at eps 0.05; GSPO's sequence
    ratio is exactly 1, nothing clipped, and the loss is -A."""
    logp = torch.tensor([[0.1, -0.1]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv, mask = torch.full((1, 2), 2.0, dtype=torch.float64), torch.ones(1, 2)
    cfg = PolicyLossConfig(kind=PolicyLossKind.GSPO, eps_clip_low=0.05, eps_clip_high=0.05)
    out = policy_loss(logp, old, old, adv, mask, cfg)
    assert out.loss.tolist() == [[-2.0, -2.0]]  # -A s_i on every token, s_i = exp(0) = 1
    out.loss.mean().backward()
    assert logp.grad.tolist() == [[-1.0, -1.0]]  # d/dlogp_t of -(A/2) sum_t s_i: -A s_i / 2 each
    ppo = policy_loss(logp.detach(), old, old, adv, mask, PolicyLossConfig(kind=PolicyLossKind.PPO,
                                                                         eps_clip_low=0.05, eps_clip_high=0.05))
    assert ppo.loss[0, 0].item() == pytest.approx(-2.0 * 1.05)  # token 0 clipped at 1 + eps
    assert ppo.loss[0, 1].item() == pytest.approx(-2.0 * math.exp(-0.1))


def test_sequence_correction_weights_each_sequence():
    """tis_seq: w_i = min(prod_t pi_prox / pi_behave, C) per sequence multiplies the sequence's loss."""
    logp, prox, behave, adv, mask = batch(1)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    ours, _ = megarl_loss(a, prox, behave, adv, mask, correction=RolloutCorrection.TIS_SEQ)
    w = torch.stack([torch.exp((prox[i] - behave[i])[mask[i].bool()].sum()).clamp(max=1.5) for i in range(6)])
    ref = reference_objective(b, prox, adv, mask, weight=w)
    ours.backward()
    ref.backward()
    assert abs(ours.item() - ref.item()) < 1e-12 and torch.allclose(a.grad, b.grad, atol=1e-12, rtol=0)


def test_old_logp_behave_takes_the_rollout_as_pi_old():
    logp, prox, behave, adv, mask = batch(2)
    ours, _ = megarl_loss(logp, None, behave, adv, mask, old_logp=OldLogp.BEHAVE)
    assert abs(ours.item() - reference_objective(logp, behave, adv, mask).item()) < 1e-12


@pytest.mark.parametrize("overrides,message", [
    (dict(loss_agg="token_mean"), "algo.loss_agg: token_mean with policy_loss=gspo weights sequences by their "
     "length; GSPO averages over sequences: set algo.loss_agg=seq_mean_token_mean"),
    (dict(rollout_correction="tis_token"), "algo.rollout_correction: tis_token is per token; policy_loss=gspo's "
     "ratio is per sequence: use tis_seq or mis_seq"),
    (dict(rollout_correction="icepop"), "algo.rollout_correction: icepop is per token; policy_loss=gspo's ratio "
     "is per sequence: use tis_seq or mis_seq"),
])
def test_combinations_gspo_refuses_in_one_line(overrides, message):
    cfg = AlgoConfig(policy_loss="gspo", **{"loss_agg": "seq_mean_token_mean", **overrides})
    with pytest.raises(ValueError) as e:
        cfg.validate()
    assert str(e.value) == message
    ok = AlgoConfig(policy_loss="gspo", loss_agg="seq_mean_token_mean", rollout_correction="mis_seq",
                    dual_clip_c=3.0, eps_clip_low=3e-4, eps_clip_high=4e-4)
    assert ok.build().policy_loss.kind == PolicyLossKind.GSPO
