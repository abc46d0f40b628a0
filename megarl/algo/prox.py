"""The proximal log-probability log pi_prox without a forward pass (`algo.prox_logp_mode`).

    recompute  prox_logp from a forward pass of the trainer weights at the start of the step
    loglinear  log pi_prox ~= log pi_behave + alpha_t (log pi_theta - log pi_behave)
    metrics    recompute and use the true value, and report how far loglinear would have been

The log-linear rule interpolates in log space between the behaviour policy and the current policy
using the policy versions as the clock (versions are stamped per token by the rollout engine):

    alpha_t = (v_prox - v_behave_t) / (v_theta - v_behave_t)

v_behave_t is the version that generated token t, v_prox the trainer's version at the start of the
step, v_theta the version of the weights being trained (v_theta >= v_prox >= v_behave_t). Where
v_theta == v_behave_t the token is on-policy for both and alpha_t = 0, i.e. pi_prox = pi_behave
(then v_prox == v_behave_t too, so this is the only consistent choice). alpha is clamped to [0, 1],
so out-of-order versions never extrapolate.
"""
from __future__ import annotations

import torch

from megarl.algo.stats import Stat


def loglinear_alpha(versions: torch.Tensor, prox_version: int | torch.Tensor,
                     theta_version: int | torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """alpha_t = (v_prox - v_behave_t) / (v_theta - v_behave_t) in [0, 1]; 0 where
    v_theta == v_behave_t and off the loss mask. `versions` is [B, S] (v_behave_t)."""
    v_b = versions.to(torch.float64)
    v_p = torch.as_tensor(prox_version, dtype=torch.float64, device=versions.device)
    v_t = torch.as_tensor(theta_version, dtype=torch.float64, device=versions.device)
    den = v_t - v_b
    valid = loss_mask.bool() & (den != 0)
    safe_den = torch.where(valid, den, torch.ones_like(den))
    alpha = torch.where(valid, (v_p - v_b) / safe_den, torch.zeros_like(den))
    return alpha.clamp(0.0, 1.0)


def loglinear_prox_logp(logp: torch.Tensor, behave_logp: torch.Tensor, versions: torch.Tensor,
                        prox_version: int | torch.Tensor, theta_version: int | torch.Tensor,
                        loss_mask: torch.Tensor) -> torch.Tensor:
    """log pi_prox_t ~= log pi_behave_t + alpha_t (log pi_theta_t - log pi_behave_t), detached.

    alpha_t from `loglinear_alpha`; 0 off the loss mask. With v_prox == v_theta (the first update
    of a step) this returns log pi_theta exactly, as a recompute would.
    """
    alpha = loglinear_alpha(versions, prox_version, theta_version, loss_mask).to(logp.dtype)
    lt, lb = logp.detach(), behave_logp.detach()
    prox = lb + alpha * (lt - lb)
    return torch.where(loss_mask.bool(), prox, torch.zeros_like(prox))


def prox_approx_stats(approx_prox_logp: torch.Tensor, prox_logp: torch.Tensor,
                      loss_mask: torch.Tensor, behave_logp: torch.Tensor | None = None) -> dict[str, Stat]:
    """How far an approximation is from the recomputed log pi_prox (prox_logp_mode=metrics):

        prox_approx_abs_err      masked mean  |log pi_prox_approx - log pi_prox|
        prox_approx_abs_err_max  masked max   |log pi_prox_approx - log pi_prox|
        prox_behave_abs_gap      masked mean  |log pi_behave - log pi_prox|: the error of using
                                 no approximation at all (pi_prox = pi_behave), the scale the
                                 approximation's error is judged against
    """
    err = (approx_prox_logp.detach() - prox_logp.detach()).abs()
    m = loss_mask.bool()
    out = {"prox_approx_abs_err": Stat.masked_mean(err, m),
           "prox_approx_abs_err_max": Stat.masked_max(err, m)}
    if behave_logp is not None:
        out["prox_behave_abs_gap"] = Stat.masked_mean((behave_logp.detach() - prox_logp.detach()).abs(), m)
    return out
