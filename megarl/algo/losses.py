"""Policy-gradient losses with three log-probabilities.

    logp         log pi_theta(y_t)   current policy, carries the gradient
    prox_logp    log pi_prox(y_t)    trainer weights at the start of the step (recomputed or
                                     approximated, see `megarl.algo.prox`); detached
    behave_logp  log pi_behave(y_t)  what the rollout engine reported when sampling; detached

All tensors are [batch, seq]; `loss_mask` is 1 on generated tokens. `policy_loss` returns the loss
contribution of every token (0 off the mask and on dropped tokens) so that the caller aggregates
it with step-level weights (`megarl.algo.aggregation`), plus `dict[str, Stat]` metrics (masked sums
with their token counts, see `megarl.algo.stats`).

Standard PPO (`algo.policy_loss=ppo`), pi_old = pi_prox or pi_behave (`algo.old_logp`):

    r_t  = pi_theta / pi_old
    S_t  = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
    dual clip (A_t < 0, c > 1):  S_t <- min(S_t, c |A_t|)
    L_t  = w_t * S_t,  w_t = rollout-correction weight (`megarl.algo.correction`), 1 when none

Decoupled PPO (`algo.policy_loss=decoupled_ppo`, AReaL):

    u_t  = pi_theta / pi_prox                       (the trust region is around pi_prox)
    w_t  = pi_prox / pi_behave                      (detached behaviour importance weight)
    L_t  = w_t * S_t,  S_t as above with r_t replaced by u_t (dual clip included)
    w_t > cap: the token is dropped (`mask`) or w_t = cap (`clamp`)

GSPO (`algo.policy_loss=gspo`, Qwen3's Group Sequence Policy Optimization), pi_old as in PPO:

    s_i  = (pi_theta(y_i) / pi_old(y_i))^(1 / |y_i|) = exp(mean_t log r_t)    (one ratio per sequence)
    L_it = w_it * max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)), the same for every t of i
    as GSPO-token: s_it = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t)), whose value is s_i and
    whose gradient is s_i grad log pi_theta(y_t), so with loss_agg seq_mean_token_mean the step's
    gradient is GSPO's (1/G) sum_i s_i A_i (1/|y_i|) sum_t grad log pi_theta(y_t) (unclipped i).
    w_it: a sequence-level rollout correction (tis_seq, mis_seq), 1 without; a per-token one is
    refused by the config (no meaning on one ratio per sequence).

A rollout correction that produces a weight (tis_*, icepop) replaces w_t = pi_prox / pi_behave in
decoupled PPO (both are importance weights for the same ratio, multiplying them would count it
twice); the cap then applies to that weight. A masking correction (mis_*) keeps w_t and drops
tokens. With pi_theta = pi_prox = pi_behave every variant gives grad L_t = -A_t grad log pi_theta.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algo.choices import CapMode, OldLogp, PolicyLossConfig, PolicyLossKind
from megarl.algo.correction import rollout_correction
from megarl.algo.stats import Stat


@dataclass
class PolicyLossOutput:
    """loss: [B, S] per-token loss contributions (0 off loss_mask and on dropped tokens);
    stats: metrics as masked sums with token counts."""

    loss: torch.Tensor
    stats: dict[str, Stat]


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
                      eps_low: float, eps_high: float,
                      dual_clip_c: float | None) -> tuple[torch.Tensor, dict[str, Stat]]:
    """Per-token clipped PPO surrogate loss (to minimise), r = ratio = pi_theta / pi_old:

        L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
        L_t = min(L_t, c |A_t|)  where A_t < 0 and dual_clip_c = c is set

    Stats: clip_frac_low (A < 0 and r < 1 - eps_low), clip_frac_high (A > 0 and r > 1 + eps_high),
    dual_clip_frac (A < 0 and the c |A| bound is active). Values off loss_mask are 0.
    """
    m = loss_mask.bool()
    adv = advantages.detach()
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    neg = adv < 0
    stats = {
        "clip_frac_low": Stat.masked_mean((neg & (ratio < 1.0 - eps_low)).float(), m),
        "clip_frac_high": Stat.masked_mean(((adv > 0) & (ratio > 1.0 + eps_high)).float(), m),
    }
    if dual_clip_c is not None:
        bound = -dual_clip_c * adv
        dual_active = neg & (pg > bound)
        pg = torch.where(neg, torch.minimum(pg, bound), pg)
        stats["dual_clip_frac"] = Stat.masked_mean(dual_active.float(), m)
    pg = torch.where(m, pg, torch.zeros_like(pg))
    return pg, stats


def gspo_ratio(log_ratio: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO-token's per-token ratio s_it (value s_i = exp(mean_t log r_t) of its sequence,
    gradient s_i grad log r_t) and the detached per-sequence log s_i [B, 1]; ``log_ratio`` is 0
    off the mask."""
    m = loss_mask.to(log_ratio.dtype)
    seq = ((log_ratio * m).sum(dim=-1, keepdim=True) / m.sum(dim=-1, keepdim=True).clamp(min=1)).detach()
    return torch.exp(seq + log_ratio - log_ratio.detach()), seq


def _importance_weight(cfg: PolicyLossConfig, corr_weight: torch.Tensor | None, rho: torch.Tensor,
                       keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Stat]]:
    """The detached per-token weight w_t and the updated keep mask (see module docstring)."""
    if cfg.kind in (PolicyLossKind.PPO, PolicyLossKind.GSPO):
        w = corr_weight if corr_weight is not None else torch.ones_like(rho)
        return w, keep, {}
    w = corr_weight if corr_weight is not None else rho
    stats: dict[str, Stat] = {}
    if cfg.behave_weight_cap is not None:
        over = keep & (w > cfg.behave_weight_cap)
        stats["behave_weight_capped_frac"] = Stat.masked_mean(over.float(), keep)
        if cfg.behave_weight_cap_mode == CapMode.MASK:
            keep = keep & ~over
        else:
            w = w.clamp(max=cfg.behave_weight_cap)
    return w, keep, stats


def policy_loss(logp: torch.Tensor, prox_logp: torch.Tensor | None, behave_logp: torch.Tensor,
                advantages: torch.Tensor, loss_mask: torch.Tensor,
                cfg: PolicyLossConfig) -> PolicyLossOutput:
    """Per-token PPO / decoupled-PPO loss (formulas in the module docstring).

    Shapes [B, S]; `prox_logp` may be None only for ppo with old_logp=behave and no correction.
    Stats (masked sums over loss tokens): clip_frac_low, clip_frac_high, dual_clip_frac (when
    on), approx_kl_k1 = E[log pi_old - log pi_theta], approx_kl_k3 = E[r - 1 - log r] (pi_old =
    pi_prox in decoupled PPO), behave_weight (mean applied weight w_t over kept tokens),
    behave_weight_max (max raw pi_prox / pi_behave), behave_weight_capped_frac, the rollout_corr_*
    stats of `rollout_correction`, and dropped_frac (tokens that contribute nothing).
    """
    if cfg.needs_prox_logp and prox_logp is None:
        raise ValueError(f"policy_loss: {cfg.kind.value} with old_logp={cfg.old_logp.value} and "
                         f"rollout_correction={cfg.rollout_correction.value} needs prox_logp")
    m = loss_mask.bool()
    use_prox = cfg.kind == PolicyLossKind.DECOUPLED_PPO or cfg.old_logp == OldLogp.PROX
    old = (prox_logp if use_prox else behave_logp).detach()
    # Zero the log-ratio off the mask before exp(): padding must never produce inf (inf * 0 = nan).
    log_ratio = torch.where(m, logp - old, torch.zeros_like(logp))
    if cfg.kind == PolicyLossKind.GSPO:
        ratio, seq_log = gspo_ratio(log_ratio, loss_mask)
    else:
        ratio = torch.exp(log_ratio)
    pg, stats = clipped_surrogate(ratio, advantages, loss_mask, cfg.eps_clip_low,
                                  cfg.eps_clip_high, cfg.dual_clip_c)
    if cfg.kind == PolicyLossKind.GSPO:  # the clip fractions above count tokens; these, sequences
        rows = m.any(dim=-1, keepdim=True)
        s = torch.exp(seq_log)
        stats["gspo/seq_ratio_mean"] = Stat.masked_mean(s, rows)
        stats["gspo/seq_clip_frac"] = Stat.masked_mean(((s < 1.0 - cfg.eps_clip_low)
                                                        | (s > 1.0 + cfg.eps_clip_high)).float(), rows)
    lr = log_ratio.detach()
    stats["approx_kl_k1"] = Stat.masked_mean(-lr, m)
    stats["approx_kl_k3"] = Stat.masked_mean(torch.exp(lr) - 1.0 - lr, m)

    if prox_logp is None:
        loss = pg
        keep = m
    else:
        corr = rollout_correction(prox_logp, behave_logp, loss_mask, cfg.rollout_correction,
                                  cfg.rollout_correction_low, cfg.rollout_correction_high)
        stats.update(corr.stats)
        w, keep, cap_stats = _importance_weight(cfg, corr.weight, corr.rho, corr.keep)
        stats.update(cap_stats)
        stats["behave_weight"] = Stat.masked_mean(w, keep)
        stats["behave_weight_max"] = Stat.masked_max(corr.rho, m)
        loss = torch.where(keep, w.detach() * pg, torch.zeros_like(pg))
    stats["dropped_frac"] = Stat.masked_mean((m & ~keep).float(), m)
    return PolicyLossOutput(loss, stats)
