"""Per-token logprobs and entropy from vocab-parallel logits, one micro-batch at a time.

With the vocabulary split over TP ranks (each holds logits z[..., V/tp]):

    lse      = m + log( sum_tp sum_v exp(z_v - m) ),    m = max over all shards (no grad)
    log p(y) = z_y - lse                                (z_y taken on the shard owning y)
    H        = lse - (sum_tp sum_v exp(z_v - m) z_v) / (sum_tp sum_v exp(z_v - m))

Megatron's vocabulary is padded (to a multiple of ``make_vocab_size_divisible_by * tp``); the
logits of the padded ids (global index >= ``vocab_size``) are set to -inf before anything else, so
p = 0 there and logprobs / entropies over the padded vocabulary equal the unpadded model's. (The
entropy's sum(exp(z - m) z) uses the unmasked logits with the padded entries zeroed: exp(-inf) * z
would be 0 * (-inf) = nan, and so would its gradient.)

The sums over shards are all-reduces whose backward is the identity (each shard's partial sum
contributes with gradient 1), so gradients flow through both outputs. No [tokens, vocab] tensor
is ever gathered.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sum_over_tp(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    return x if tp == 1 else _AllReduceSum.apply(x, group)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp_group, tp: int,
                            tp_rank: int, with_entropy: bool = False, vocab_size: Optional[int] = None
                            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits [b, s, V/tp] (this rank's vocab shard), targets [b, s] -> (logp, entropy) [b, s].
    ``vocab_size``: the real vocabulary; shard columns at or beyond it are padding (masked)."""
    logits = logits.float()
    shard = logits.shape[-1]
    lo = tp_rank * shard
    valid = None
    if vocab_size is not None and lo + shard > vocab_size:  # this shard holds padded ids
        valid = torch.arange(lo, lo + shard, device=logits.device) < vocab_size
        raw, logits = logits, logits.masked_fill(~valid, float("-inf"))
    local = targets - lo
    if tp == 1 and not with_entropy:  # one fused logsumexp instead of max, exp, sum, log
        picked = torch.gather(logits, -1, local.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1), None
    with torch.no_grad():
        m = logits.max(dim=-1).values  # -inf on a shard of padding only; finite after the MAX
        if tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    exp = (logits - m.unsqueeze(-1)).exp()
    sum_exp = _sum_over_tp(exp.sum(-1), tp_group, tp)
    lse = torch.log(sum_exp) + m
    owned = (local >= 0) & (local < shard)
    picked = torch.gather(logits, -1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    z_y = _sum_over_tp(torch.where(owned, picked, torch.zeros_like(picked)), tp_group, tp)
    logp = z_y - lse
    entropy = None
    if with_entropy:
        # E_p[z] = sum(exp(z - m) z) / sum(exp(z - m)), both sums reduced over TP first. Every
        # reduced value is then used identically on all TP ranks, which is what makes the
        # identity backward of _AllReduceSum exact (probs = exp(z - lse) would use the reduced
        # lse per shard, and its gradient would miss the other shards' contributions).
        z = logits if valid is None else raw.masked_fill(~valid, 0.0)
        entropy = lse - _sum_over_tp((exp * z).sum(-1), tp_group, tp) / sum_exp
    return logp, entropy


def shift_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, tp_group, tp: int, tp_rank: int,
                   with_entropy: bool = False, vocab_size: Optional[int] = None
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token-aligned: entry i = log p(token i | tokens < i); entry 0 = 0 (and entropy likewise,
    entry i = entropy of the distribution that produced token i)."""
    logp, ent = vocab_parallel_logprobs(logits[:, :-1], input_ids[:, 1:], tp_group, tp, tp_rank,
                                        with_entropy, vocab_size)
    pad = torch.zeros_like(logp[:, :1])
    logp = torch.cat([pad, logp], dim=1)
    if ent is not None:
        ent = torch.cat([pad, ent], dim=1)
    return logp, ent
