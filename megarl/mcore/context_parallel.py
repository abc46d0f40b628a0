"""Context parallelism on the local (CPU) layer spec: each sequence split over the CP group,
attention exchanging keys and values between its ranks.

Layout (megatron-core's, so its RoPE slicing and Transformer Engine agree): a sequence of L
tokens, L a multiple of 2 x cp, is cut into 2 x cp chunks of c = L / (2 cp); CP rank r holds
chunks r and 2cp-1-r, in that order. Under causal attention chunk j costs j + 1/2 chunk-pairs of
work, so every rank gets (2cp - 1 + 1) / 2 of them: the split is balanced.

Attention (`cp_attention`): each rank all-gathers K and V of the whole sequence (the collective's
backward sums every rank's key gradients and keeps its own rows), then each of its two query
chunks j attends to

    keys [0, j c)          all visible   (one fused call without a mask)
    keys [j c, (j+1) c)    causal        (one fused call, square, the usual causal mask)

and the two partial results are merged by their log-sum-exps:
lse = logaddexp(lse_1, lse_2), out = sum_p exp(lse_p - lse) out_p. The backward runs the fused
kernel's backward once per piece with the merged ``out`` and ``lse`` (the softmax of the whole
row), which gives each piece's exact share of dq, dk, dv. No [queries, keys] mask is ever built
and no masked block is computed: the work per rank is 1/cp of the sequence's.

Packed micro-batches (THD) do the same per sequence: ``cu_seqlens`` describe the whole
sequences (each padded to a multiple of 2 x cp), the local rows hold each sequence's two chunks
back to back (megatron-core's ``_apply_rotary_pos_emb_thd`` reads them the same way).

Per-token outputs (logprobs, entropies, values) are gathered over the group the other way round
(`gather_tokens`): every rank then holds the whole sequence's values and computes the same loss;
the backward keeps only this rank's rows (no sum), so summing parameter gradients over the CP
group (megatron-core's DDP reduces over data x context parallel ranks) gives the CP=1 gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CPLayout", "padded_length", "chunk_positions", "local_positions", "padded_layout",
           "thd_layout", "gather_kv", "gather_tokens", "cp_attention"]


def padded_length(length: int, cp: int) -> int:
    """``length`` rounded up to a multiple of 2 x cp (a sequence must split in 2 x cp chunks)."""
    m = 2 * cp
    return -(-length // m) * m


def chunk_positions(length: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions (0..length-1) of a sequence held by ``cp_rank``: chunk r, then chunk 2cp-1-r."""
    c = length // (2 * cp)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c, device=device)
    return torch.cat([first, second])


def local_positions(lengths: list[int], cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """For sequences of ``lengths`` (each a multiple of 2 x cp) laid end to end, the global row of
    each of this rank's local rows (its two chunks of every sequence, sequence by sequence)."""
    out, start = [], 0
    for length in lengths:
        out.append(chunk_positions(length, cp, cp_rank, device) + start)
        start += length
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=device)


@dataclass
class CPLayout:
    """Where the local rows sit and what each query chunk attends to."""

    order: torch.Tensor  # [cp * local] long: gathered row (rank-major) -> global row (argsort'ed)
    pieces: list  # (q_lo, q_hi, k_lo, k_hi, causal) over local query rows and global key rows
    local: int  # local rows per rank


def _layout(lengths: list[int], cp: int, cp_rank: int, device) -> CPLayout:
    gathered = torch.cat([local_positions(lengths, cp, r, device) for r in range(cp)])
    pieces, q, start = [], 0, 0
    for length in lengths:
        c = length // (2 * cp)
        for j in (cp_rank, 2 * cp - 1 - cp_rank):
            k0 = start + j * c
            if j:
                pieces.append((q, q + c, start, k0, False))  # the chunks before: all visible
            pieces.append((q, q + c, k0, k0 + c, True))  # its own chunk: causal
            q += c
        start += length
    return CPLayout(torch.argsort(gathered), pieces, q)


_PADDED_CACHE: dict = {}


def padded_layout(local_len: int, cp: int, cp_rank: int, device) -> CPLayout:
    """Layout of a padded micro-batch whose rows hold ``local_len`` = L / cp positions each."""
    key = (local_len, cp, cp_rank, str(device))
    if key not in _PADDED_CACHE:
        _PADDED_CACHE[key] = _layout([local_len * cp], cp, cp_rank, device)
    return _PADDED_CACHE[key]


def thd_layout(params, cp: int, cp_rank: int) -> CPLayout:
    """Layout of a packed micro-batch (``params.cu_seqlens_q``: whole sequences, each a multiple
    of 2 x cp), computed once per forward pass and kept on ``params`` (every layer shares it)."""
    cached = getattr(params, "_megarl_cp_layout", None)
    if cached is not None:
        return cached
    cu = params.cu_seqlens_q.long()
    params._megarl_cp_layout = _layout((cu[1:] - cu[:-1]).tolist(), cp, cp_rank, cu.device)
    return params._megarl_cp_layout


def _all_gather(x: torch.Tensor, group, cp: int, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _own_rows(grad: torch.Tensor, group, cp: int, dim: int) -> torch.Tensor:
    n = grad.shape[dim] // cp
    return grad.narrow(dim, dist.get_rank(group) * n, n)


class _GatherSumGrad(torch.autograd.Function):
    """All-gather along ``dim``; backward: the gradients of every rank summed, this rank's rows."""

    @staticmethod
    def forward(ctx, x, group, cp, dim):
        ctx.group, ctx.cp, ctx.dim = group, cp, dim
        return _all_gather(x, group, cp, dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return _own_rows(grad, ctx.group, ctx.cp, ctx.dim).contiguous(), None, None, None


class _GatherOwnGrad(torch.autograd.Function):
    """All-gather along ``dim``; backward: this rank's rows of its own gradient (every rank
    computes the same function of the gathered tensor, so nothing is summed)."""

    @staticmethod
    def forward(ctx, x, group, cp, dim):
        ctx.group, ctx.cp, ctx.dim = group, cp, dim
        return _all_gather(x, group, cp, dim)

    @staticmethod
    def backward(ctx, grad):
        return _own_rows(grad, ctx.group, ctx.cp, ctx.dim).contiguous(), None, None, None


def gather_kv(x: torch.Tensor, layout: CPLayout, group, cp: int) -> torch.Tensor:
    """Local K or V [local, ...] -> the whole sequences' [cp * local, ...] in global row order."""
    return _GatherSumGrad.apply(x, group, cp, 0).index_select(0, layout.order)


def gather_tokens(x: torch.Tensor, order: torch.Tensor, group, cp: int) -> torch.Tensor:
    """A per-token output [b, local] -> [b, cp * local] in global position order (``order``:
    `CPLayout.order`); every rank gets the same tensor, gradients stay with their rows' owner."""
    return _GatherOwnGrad.apply(x, group, cp, 1).index_select(1, order)


class _PiecewiseAttention(torch.autograd.Function):
    """q [B, H, Sq, D], k/v [B, H, Sk, D]; each piece (q_lo, q_hi, k_lo, k_hi, causal) one fused
    CPU flash-attention call, merged by log-sum-exp (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, pieces, scale):
        fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out = torch.zeros_like(q)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # the kernel's
        lse = torch.full(q.shape[:3], float("-inf"), dtype=lse_dtype, device=q.device)
        for q0, q1, k0, k1, causal in pieces:
            o, l = fwd(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], 0.0, causal, scale=scale)
            prev = lse[:, :, q0:q1]
            merged = torch.logaddexp(prev, l)
            out[:, :, q0:q1] = (out[:, :, q0:q1] * torch.exp(prev - merged).unsqueeze(-1).to(q.dtype)
                                + o * torch.exp(l - merged).unsqueeze(-1).to(q.dtype))
            lse[:, :, q0:q1] = merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pieces, ctx.scale = pieces, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for q0, q1, k0, k1, causal in ctx.pieces:
            gq, gk, gv = bwd(grad[:, :, q0:q1].contiguous(), q[:, :, q0:q1].contiguous(),
                             k[:, :, k0:k1].contiguous(), v[:, :, k0:k1].contiguous(),
                             out[:, :, q0:q1].contiguous(), lse[:, :, q0:q1].contiguous(), 0.0, causal,
                             scale=ctx.scale)
            dq[:, :, q0:q1] += gq
            dk[:, :, k0:k1] += gk
            dv[:, :, k0:k1] += gv
        return dq, dk, dv, None, None


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout, scale: float
                 ) -> torch.Tensor:
    """q [B, H, local, D] (this rank's rows), k/v [B, G, S, D] (the gathered, globally ordered
    sequences; G query groups, H a multiple of G: the kernel reads group h // (H / G) for query
    head h itself, so K/V are kept and saved unexpanded) -> [B, H, local, D], causal."""
    return _PiecewiseAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), layout.pieces, scale)
