"""Advantage estimators (`algo.advantage`).

Inputs: `rewards` [B] (one outcome reward per sequence), `loss_mask` [B, S] (1 on generated
tokens), `group_id` [B] (samples of one prompt share it; list or tensor of ints). Outputs are
[B, S] and 0 off the mask. Call them on the WHOLE step batch (every group complete, before the
DP split): group baselines and batch whitening are statistics of the step, not of a shard.

    grpo          A_i = (r_i - mean_g r) / (std_g r + eps)   std unbiased (n_g - 1)
    drgrpo        A_i = r_i - mean_g r                       (Dr.GRPO: no std division)
    rloo          A_i = r_i - (sum_g r - r_i) / (n_g - 1)    (leave-one-out baseline)
    reinforce_pp  G_t = sum_{k >= t} gamma^(k-t) r_k over generated tokens, then
                  A_t = (G_t - mean G) / (std G + eps) over all generated tokens of the batch
    gae           delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},
                  returns R_t = A_t + V_t, V after the last generated token = 0

Where each estimator's statistics live, and what a DP split costs (the rollout manager gives every
DP rank whole groups, `megarl.protocol.packing`):

    grpo, drgrpo, rloo   group statistics only: each rank computes its own groups' advantages,
                         no collective
    reinforce_pp         masked_whiten over every generated token of the STEP: a step-wide
                         mean and std, so `reduce` sums three scalars over the DP shares
                         (N, sum G, then sum (G - mean)^2): two small all-reduces, no gather
    gae                  per-row recursion; with norm_adv_by_std the same step-wide whitening
    kl_in_reward         k_t is per token: local

`reduce` (a callable summing a small float64 tensor over the step's shards, None = this batch is
the whole step) is the only collective; the whitened numbers equal the single-batch ones up to
the order of float64 additions.

Sequence-level estimators broadcast A_i onto the generated tokens. Groups of one sample and groups
whose rewards are all equal get A = 0 (no relative signal; never NaN). For token-level estimators
r_t = outcome reward on the last generated token minus kl_coef * k_t on every generated token
when the KL is folded into the reward; for grpo/drgrpo/rloo the folded score is
r_i - kl_coef * sum_t k_t. "Next token" means next generated token: positions with loss_mask = 0
(prompt, tool output, padding) are skipped without discounting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from megarl.algo.choices import AdvantageConfig, AdvantageEstimator

Reduce = Optional[Callable[[torch.Tensor], torch.Tensor]]  # sums a float64 tensor over the step's shards


@dataclass
class AdvantageOutput:
    """advantages [B, S]; returns [B, S] (value targets for gae, discounted returns for
    reinforce_pp, the broadcast score for sequence-level estimators), both 0 off the mask."""

    advantages: torch.Tensor
    returns: torch.Tensor


@dataclass
class GroupStats:
    """Per-sample view of its group: size n_g, sum and mean of r, unbiased std, all-equal flag."""

    size: torch.Tensor
    total: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    all_equal: torch.Tensor


def group_stats(scores: torch.Tensor, group_id: Sequence[int] | torch.Tensor) -> GroupStats:
    """Group statistics of `scores` [B] gathered back to each sample (fp64)."""
    gid = torch.as_tensor(group_id, device=scores.device).reshape(-1)
    if gid.numel() != scores.numel():
        raise ValueError(f"group_id has {gid.numel()} entries for {scores.numel()} rewards")
    _, inv = torch.unique(gid, return_inverse=True)
    g = int(inv.max()) + 1 if inv.numel() else 0
    r = scores.to(torch.float64)
    size = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros_like(size).index_add_(0, inv, r)
    mean = total / size
    sq = torch.zeros_like(size).index_add_(0, inv, (r - mean[inv]).square())
    std = torch.sqrt(sq / (size - 1).clamp(min=1))
    gmax = torch.full_like(size, float("-inf")).scatter_reduce_(0, inv, r, "amax")
    gmin = torch.full_like(size, float("inf")).scatter_reduce_(0, inv, r, "amin")
    return GroupStats(size[inv], total[inv], mean[inv], std[inv], (gmax == gmin)[inv])


def broadcast_to_tokens(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, S]: value_i on every generated token of row i, 0 elsewhere."""
    m = loss_mask.bool()
    v = values.to(torch.float32).unsqueeze(-1).expand(m.shape)
    return torch.where(m, v, torch.zeros_like(v))


def grpo_advantages(rewards: torch.Tensor, loss_mask: torch.Tensor,
                    group_id: Sequence[int] | torch.Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + eps) (norm_by_std) or r_i - mean_g r (Dr.GRPO), with
    std_g unbiased; A_i = 0 for one-sample and all-equal groups; broadcast onto loss tokens."""
    st = group_stats(rewards, group_id)
    adv = rewards.to(torch.float64) - st.mean
    if norm_by_std:
        adv = adv / (st.std + eps)
    adv = torch.where(st.all_equal | (st.size < 2), torch.zeros_like(adv), adv)
    return broadcast_to_tokens(adv, loss_mask)


def rloo_advantages(rewards: torch.Tensor, loss_mask: torch.Tensor,
                    group_id: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """A_i = r_i - (sum_g r - r_i) / (n_g - 1); 0 for one-sample and all-equal groups."""
    st = group_stats(rewards, group_id)
    r = rewards.to(torch.float64)
    adv = r - (st.total - r) / (st.size - 1).clamp(min=1)
    adv = torch.where(st.all_equal | (st.size < 2), torch.zeros_like(adv), adv)
    return broadcast_to_tokens(adv, loss_mask)


def token_level_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor,
                        kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """r_t = rewards_i on the last generated token of row i, minus kl_coef * k_t (detached) on
    every generated token when `kl` is given. Rows without generated tokens get 0."""
    m = loss_mask.bool()
    seq = m.shape[-1]
    pos = torch.arange(seq, device=m.device).expand(m.shape)
    last = torch.where(m, pos, torch.full_like(pos, -1)).amax(dim=-1)
    out = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = rewards.to(torch.float32)[rows]
    if kl is not None:
        out = out - kl_coef * torch.where(m, kl.detach().float(), torch.zeros_like(out))
    return out


def masked_whiten(x: torch.Tensor, loss_mask: torch.Tensor, eps: float = 1e-6,
                  reduce: Reduce = None) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of the whole step (biased std); 0 off
    the mask and everywhere when fewer than 2 entries are masked in. With `reduce` the step is
    the union of every shard's `x`: (N, sum x) and then sum (x - mean)^2 are summed by it (every
    shard must call this, with or without masked entries)."""
    m = loss_mask.bool()
    xs = torch.where(m, x, torch.zeros_like(x)).to(torch.float64)
    n, total = m.sum().to(torch.float64), xs.sum()
    if reduce is not None:
        n, total = reduce(torch.stack([n, total]))
    if int(n) < 2:  # the same verdict on every shard: n is the step's
        return torch.zeros_like(x)
    mean = total / n
    sq = torch.where(m, (xs - mean).square(), torch.zeros_like(xs)).sum()
    if reduce is not None:
        sq = reduce(sq.reshape(1))[0]
    var = sq / n
    out = ((xs - mean) / (var.sqrt() + eps)).to(x.dtype)
    return torch.where(m, out, torch.zeros_like(out))


def discounted_returns(token_rewards: torch.Tensor, loss_mask: torch.Tensor,
                       gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_{next generated token}; positions off the mask get 0 and are skipped."""
    m = loss_mask.bool()
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[-1] - 1, -1, -1):
        g = token_rewards[:, t] + gamma * running
        running = torch.where(m[:, t], g, running)
        out[:, t] = torch.where(m[:, t], g, torch.zeros_like(g))
    return out


def reinforce_pp_advantages(token_rewards: torch.Tensor, loss_mask: torch.Tensor,
                            gamma: float = 1.0, eps: float = 1e-6, reduce: Reduce = None) -> AdvantageOutput:
    """REINFORCE++: A = masked_whiten(G) over the step, G = `discounted_returns` (gamma) of the
    token rewards (outcome + KL penalty, see `token_level_rewards`)."""
    returns = discounted_returns(token_rewards, loss_mask, gamma)
    return AdvantageOutput(masked_whiten(returns, loss_mask, eps, reduce), returns)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor,
                   gamma: float = 1.0, lam: float = 1.0, whiten: bool = False,
                   eps: float = 1e-6, reduce: Reduce = None) -> AdvantageOutput:
    """GAE over generated tokens, V_t = values[:, t] (critic estimate before emitting token t):

        delta_t = r_t + gamma V_{t'} - V_t,  A_t = delta_t + gamma lam A_{t'},  R_t = A_t + V_t

    t' = next generated token (V = A = 0 after the last). `whiten` standardises A over the step
    (`masked_whiten`, `reduce`); returns are always from the raw A."""
    m = loss_mask.bool()
    v = torch.where(m, values.detach().float(), torch.zeros_like(token_rewards))
    adv = torch.zeros_like(token_rewards)
    next_v = torch.zeros_like(token_rewards[:, 0])
    next_a = torch.zeros_like(next_v)
    for t in range(token_rewards.shape[-1] - 1, -1, -1):
        delta = token_rewards[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        mt = m[:, t]
        adv[:, t] = torch.where(mt, a, torch.zeros_like(a))
        next_v = torch.where(mt, v[:, t], next_v)
        next_a = torch.where(mt, a, next_a)
    returns = torch.where(m, adv + v, torch.zeros_like(adv))
    if whiten:
        adv = masked_whiten(adv, loss_mask, eps, reduce)
    return AdvantageOutput(adv, returns)


def compute_advantages(cfg: AdvantageConfig, rewards: torch.Tensor, loss_mask: torch.Tensor,
                       group_id: Sequence[int] | torch.Tensor | None = None,
                       values: torch.Tensor | None = None,
                       kl: torch.Tensor | None = None, reduce: Reduce = None) -> AdvantageOutput:
    """The one dispatch point: advantages/returns for `cfg.estimator` (module docstring).

    `kl` [B, S] is the per-token KL estimate to fold into the reward with `cfg.kl_coef` (pass it
    only when algo.kl_in_reward); `group_id` is required by grpo/drgrpo/rloo, `values` by gae;
    `reduce` makes the step-wide statistics (whitening) those of every shard's batch together.
    """
    est = cfg.estimator
    if est in (AdvantageEstimator.GRPO, AdvantageEstimator.DRGRPO, AdvantageEstimator.RLOO):
        if group_id is None:
            raise ValueError(f"advantage={est.value} needs group_id")
        score = rewards.to(torch.float64)
        if kl is not None:
            kl_sum = torch.where(loss_mask.bool(), kl.detach(), torch.zeros_like(kl)).sum(-1)
            score = score - cfg.kl_coef * kl_sum.to(torch.float64)
        if est == AdvantageEstimator.RLOO:
            adv = rloo_advantages(score, loss_mask, group_id)
        else:
            norm = cfg.norm_adv_by_std and est == AdvantageEstimator.GRPO
            adv = grpo_advantages(score, loss_mask, group_id, norm, cfg.eps)
        return AdvantageOutput(adv, broadcast_to_tokens(score, loss_mask))
    token_rewards = token_level_rewards(rewards, loss_mask, kl, cfg.kl_coef)
    if est == AdvantageEstimator.REINFORCE_PP:
        return reinforce_pp_advantages(token_rewards, loss_mask, cfg.gamma, cfg.eps, reduce)
    if est == AdvantageEstimator.GAE:
        if values is None:
            raise ValueError("advantage=gae needs critic values")
        return gae_advantages(token_rewards, values, loss_mask, cfg.gamma, cfg.lam,
                              cfg.norm_adv_by_std, cfg.eps, reduce)
    raise ValueError(f"unknown advantage estimator {est!r}")
