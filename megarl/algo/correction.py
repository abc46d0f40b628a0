"""Training-inference mismatch corrections (rollout corrections).

The rollout engine samples from pi_behave (its own kernels, precision and, in async RL, possibly
older weights); the trainer scores the same tokens with pi_prox (the trainer's weights at the start
of the step, recomputed or approximated). Every correction here is a function of ONE ratio

    rho_t = pi_prox(y_t) / pi_behave(y_t) = exp(prox_logp_t - behave_logp_t)      (detached)

("pi_old / pi_behave" with pi_old = pi_prox), computed only on loss tokens. A correction returns a
per-token importance weight (or None when it only masks) and a keep mask:

    none       weight None,                                  keep all
    tis_token  weight min(rho_t, C)                           keep all            C = high
    tis_seq    weight min(rho_seq, C) on every token of seq   keep all
    mis_token  weight None  (rejection, no reweighting)       keep lo <= rho_t <= hi
    mis_seq    weight None                                    keep seq if lo <= rho_seq <= hi
    icepop     weight rho_t                                   keep lo <= rho_t <= hi

with rho_seq = exp(sum_{t in seq} log rho_t). How the weight combines with the policy loss (it
replaces the decoupled-PPO behaviour weight, it is the only weight in standard PPO) is decided in
`megarl.algo.losses`.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from megarl.algo.stats import Stat

# exp(80) ~ 5.5e34 is still finite in fp32; larger log-ratios are already far outside any cap.
_MAX_LOG_RATIO = 80.0


class RolloutCorrection(str, Enum):
    """`algo.rollout_correction`."""

    NONE = "none"
    TIS_TOKEN = "tis_token"
    TIS_SEQ = "tis_seq"
    MIS_TOKEN = "mis_token"
    MIS_SEQ = "mis_seq"
    ICEPOP = "icepop"


@dataclass
class CorrectionOutput:
    """weight: [B, S] importance weight or None (= 1); keep: [B, S] bool, already AND-ed with
    loss_mask; rho: [B, S] the raw token ratio pi_prox / pi_behave (1.0 off the loss mask)."""

    weight: torch.Tensor | None
    keep: torch.Tensor
    rho: torch.Tensor
    stats: dict[str, Stat]


def behave_log_ratio(prox_logp: torch.Tensor, behave_logp: torch.Tensor,
                     loss_mask: torch.Tensor) -> torch.Tensor:
    """log rho_t = log pi_prox(y_t) - log pi_behave(y_t) on loss tokens, 0 elsewhere (detached,
    clamped to +-80 so that exp() stays finite)."""
    m = loss_mask.bool()
    diff = (prox_logp - behave_logp).detach()
    diff = torch.where(m, diff, torch.zeros_like(diff))
    return diff.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def seq_log_ratio(log_rho: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """log rho_seq = sum_{t: loss_mask} log rho_t, broadcast back to [B, S]."""
    m = loss_mask.bool()
    s = torch.where(m, log_rho, torch.zeros_like(log_rho)).sum(dim=-1, keepdim=True)
    return s.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).expand_as(log_rho)


def rollout_correction(prox_logp: torch.Tensor, behave_logp: torch.Tensor,
                       loss_mask: torch.Tensor, kind: RolloutCorrection,
                       low: float, high: float) -> CorrectionOutput:
    """Importance weight / keep mask for the rollout correction `kind` (table in module docstring).

    rho_t = pi_prox(y_t) / pi_behave(y_t); `low`/`high` are the band [lo, hi] for mis_*/icepop and
    `high` is the truncation C for tis_*. Stats: `rollout_corr_rho` (mean rho_t),
    `rollout_corr_weight` (mean weight over kept tokens), `rollout_corr_dropped_frac`,
    `rollout_corr_truncated_frac` (tis only).
    """
    m = loss_mask.bool()
    log_rho = behave_log_ratio(prox_logp, behave_logp, loss_mask)
    rho = torch.exp(log_rho)
    weight: torch.Tensor | None = None
    keep = m
    stats: dict[str, Stat] = {"rollout_corr_rho": Stat.masked_mean(rho, m)}
    if kind == RolloutCorrection.NONE:
        return CorrectionOutput(None, keep, rho, stats)

    if kind in (RolloutCorrection.TIS_SEQ, RolloutCorrection.MIS_SEQ):
        ratio = torch.exp(seq_log_ratio(log_rho, loss_mask))
    else:
        ratio = rho

    if kind in (RolloutCorrection.TIS_TOKEN, RolloutCorrection.TIS_SEQ):
        weight = ratio.clamp(max=high)
        stats["rollout_corr_truncated_frac"] = Stat.masked_mean((ratio > high).float(), m)
    else:
        in_band = (ratio >= low) & (ratio <= high)
        keep = m & in_band
        if kind == RolloutCorrection.ICEPOP:
            weight = ratio
    stats["rollout_corr_dropped_frac"] = Stat.masked_mean((m & ~keep).float(), m)
    w = weight if weight is not None else torch.ones_like(rho)
    stats["rollout_corr_weight"] = Stat.masked_mean(w, keep)
    return CorrectionOutput(weight, keep, rho, stats)
