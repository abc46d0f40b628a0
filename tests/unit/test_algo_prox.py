"""Log-linear proximal logprob approximation and its error metrics."""
import math

import pytest
import torch

from megarl.algo import loglinear_alpha, loglinear_prox_logp, prox_approx_stats, stats_results

D = torch.float64


def test_alpha_hand_numbers_including_equal_versions():
    versions = torch.tensor([[-1, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    alpha = loglinear_alpha(versions, prox_version=5, theta_version=6, loss_mask=mask)
    torch.testing.assert_close(alpha, torch.tensor([[0.0, 2 / 3, 0.5, 0.0, 0.0]], dtype=D))
    # v_theta == v_prox (first update of a step): alpha = 1 except where v_theta == v_behave
    alpha = loglinear_alpha(versions, prox_version=6, theta_version=6, loss_mask=mask)
    torch.testing.assert_close(alpha, torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]], dtype=D))


def test_loglinear_prox_matches_loop_and_is_detached():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g, dtype=D, requires_grad=True)
    behave = torch.randn(3, 5, generator=g, dtype=D)
    versions = torch.randint(0, 4, (3, 5), generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).to(D)
    got = loglinear_prox_logp(logp, behave, versions, 3, 4, mask)
    assert not got.requires_grad
    for i in range(3):
        for t in range(5):
            v = int(versions[i, t])
            a = 0.0 if v == 4 else (3 - v) / (4 - v)
            lb, lt = float(behave[i, t]), float(logp.detach()[i, t])
            expect = (lb + a * (lt - lb)) if mask[i, t] else 0.0
            assert float(got[i, t]) == pytest.approx(expect, abs=1e-12)


def test_approximation_error_metrics():
    approx = torch.tensor([[0.1, -0.5, 9.0]])
    true = torch.tensor([[0.0, -0.2, 0.0]])
    res = stats_results(prox_approx_stats(approx, true, torch.tensor([[1, 1, 0]])))
    assert res["prox_approx_abs_err"] == pytest.approx(0.2)
    assert res["prox_approx_abs_err_max"] == pytest.approx(0.3)
    assert math.isfinite(res["prox_approx_abs_err_max"])
