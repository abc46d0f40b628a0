"""KL estimators between pi_theta and a frozen reference pi_ref, and the entropy bonus.

With d_t = log pi_theta(y_t) - log pi_ref(y_t) on tokens sampled from the policy
(`algo.kl_estimator`):

    k1      d_t                                 unbiased for KL(pi_theta || pi_ref), high variance
    k2      0.5 d_t^2                           ("mse")
    k2_abs  |d_t|                               ("abs")
    k3      exp(-d_t) - 1 + d_t                 ("low_var_kl", Schulman): >= 0, unbiased;
                                                -d_t is clamped to [-20, 20] before exp and the
                                                result to [-10, 10] so that one token cannot blow up

Used either as a loss term, L_t += kl_coef * k_t (`algo.kl_in_reward=false`), or folded into
the reward, r_t -= kl_coef * k_t with k_t detached (`algo.kl_in_reward=true`, see
`megarl.algo.advantages`). All values are 0 off `loss_mask`; aggregate them with the same
step-level weights as the policy loss.
"""
from __future__ import annotations

import torch

from megarl.algo.choices import KLEstimator
from megarl.algo.stats import Stat

_K3_LOG_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, loss_mask: torch.Tensor,
               estimator: KLEstimator) -> torch.Tensor:
    """Per-token KL estimate k_t (table in the module docstring) of pi_theta against pi_ref,
    0 off the mask. Differentiable in `logp`; `ref_logp` is detached."""
    m = loss_mask.bool()
    d = torch.where(m, logp - ref_logp.detach(), torch.zeros_like(logp))
    if estimator == KLEstimator.K1:
        k = d
    elif estimator == KLEstimator.K2:
        k = 0.5 * d.square()
    elif estimator == KLEstimator.K2_ABS:
        k = d.abs()
    elif estimator == KLEstimator.K3:
        neg = (-d).clamp(-_K3_LOG_CLAMP, _K3_LOG_CLAMP)
        k = (torch.exp(neg) - 1.0 - neg).clamp(-_K3_VALUE_CLAMP, _K3_VALUE_CLAMP)
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    return torch.where(m, k, torch.zeros_like(k))


def kl_loss(logp: torch.Tensor, ref_logp: torch.Tensor, loss_mask: torch.Tensor,
            estimator: KLEstimator, coef: float) -> tuple[torch.Tensor, dict[str, Stat]]:
    """Per-token loss term L_t = coef * k_t (add it to the policy loss before aggregation).
    Stats: `kl_ref` = masked mean of k_t."""
    k = kl_penalty(logp, ref_logp, loss_mask, estimator)
    return coef * k, {"kl_ref": Stat.masked_mean(k, loss_mask)}


def entropy_loss(entropy: torch.Tensor, loss_mask: torch.Tensor,
                 coef: float) -> tuple[torch.Tensor, dict[str, Stat]]:
    """Entropy bonus as a per-token loss term L_t = -coef * H_t, H_t = -sum_v pi_theta(v) log
    pi_theta(v) supplied by the caller. Stats: `entropy` = masked mean of H_t."""
    m = loss_mask.bool()
    h = torch.where(m, entropy, torch.zeros_like(entropy))
    return -coef * h, {"entropy": Stat.masked_mean(h, m)}
