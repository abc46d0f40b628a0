"""KL estimators and the entropy bonus against element-wise math."""
import math

import pytest
import torch

from megarl.algo import KLEstimator, entropy_loss, kl_loss, kl_penalty, stats_results

D = torch.float64


def _ref(d, est):
    if est == KLEstimator.K1:
        return d
    if est == KLEstimator.K2:
        return 0.5 * d * d
    if est == KLEstimator.K2_ABS:
        return abs(d)
    x = max(-20.0, min(20.0, -d))
    return max(-10.0, min(10.0, math.exp(x) - 1 - x))


@pytest.mark.parametrize("est", list(KLEstimator))
def test_estimators_match_elementwise_math_and_mask(est):
    logp = torch.tensor([[-0.1, -2.0, -0.5, 3.0], [-30.0, -0.3, 0.0, -1.0]], dtype=D)
    ref = torch.tensor([[-0.4, -1.0, -0.5, -9.0], [0.0, -0.1, -50.0, -2.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=D)
    got = kl_penalty(logp, ref, mask, est)
    expect = [[_ref(a - b, est) * m for a, b, m in zip(*rows)]
              for rows in zip(logp.tolist(), ref.tolist(), mask.tolist())]
    torch.testing.assert_close(got, torch.tensor(expect, dtype=D))
    if est == KLEstimator.K3:
        assert float(got[1, 0]) == 10.0                  # d = -30: clamped, not e^30
        assert (got >= 0).all()


def test_gradients_and_loss_term():
    logp = torch.tensor([[-0.2, -1.0]], dtype=D, requires_grad=True)
    ref = torch.tensor([[-0.5, -1.0]], dtype=D)
    mask = torch.ones_like(ref)
    kl_penalty(logp, ref, mask, KLEstimator.K2).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.3, 0.0]], dtype=D))   # d/dlogp 0.5 d^2 = d
    logp.grad = None
    kl_penalty(logp, ref, mask, KLEstimator.K3).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[1 - math.exp(-0.3), 0.0]], dtype=D))
    loss, stats = kl_loss(logp, ref, mask, KLEstimator.K1, coef=0.1)
    torch.testing.assert_close(loss, torch.tensor([[0.03, 0.0]], dtype=D))
    assert stats_results(stats)["kl_ref"] == pytest.approx(0.15)


def test_entropy_bonus():
    ent = torch.tensor([[1.0, 2.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = entropy_loss(ent, mask, coef=0.01)
    torch.testing.assert_close(loss, torch.tensor([[-0.01, -0.02, 0.0]]))
    assert stats_results(stats)["entropy"] == pytest.approx(1.5)
