"""A micro-batch split over the context-parallel group (``parallel.cp > 1``), and the per-token
outputs put back together.

Each rank feeds the model its two chunks of every sequence (`megarl.mcore.context_parallel`: chunk
r and 2cp-1-r of 2 x cp); padded rows are first padded to a multiple of 2 x cp, packed sequences
are each padded so (`megarl.trainer.packing.pack` with ``seq_multiple``). The model's output at a
local position p is about the token after it, so each rank computes its positions' next-token
quantity (log p(token p+1), the entropy at p, a value) against the whole row's tokens; the CP group
then all-gathers those [b, L/cp] values into the whole [b, L] row (`gather_tokens`: every rank the
same tensor, each gradient back to the rank that computed it) and shifts them by one, which is the
CP=1 layout: entry p = the quantity computed at p - 1, entry 0 = 0. Everything downstream (the
loss, its reductions, `megarl.algo`) sees the tensors of CP=1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.mcore import context_parallel as cpar


@dataclass
class CPLocal:
    """This rank's share of a micro-batch's rows (padded: [b, L/cp]; packed: [1, T/cp])."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor  # the token after each local position (0 past the row's end)
    order: torch.Tensor  # `CPLayout.order`: gathered (rank-major) rows -> positions
    width: int  # L (T): the whole row the local positions come from


def _local(tokens: torch.Tensor, position_ids: torch.Tensor, layout: cpar.CPLayout, rows: torch.Tensor) -> CPLocal:
    width = tokens.shape[1]
    nxt = torch.cat([tokens[:, 1:], tokens.new_zeros(tokens.shape[0], 1)], dim=1)
    return CPLocal(tokens[:, rows], position_ids[:, rows], nxt[:, rows], layout.order, width)


def split_padded(tokens: torch.Tensor, cp: int, cp_rank: int) -> CPLocal:
    """Right-padded ``tokens`` [b, s] -> this rank's two chunks of each row (padded to L, a multiple
    of 2 x cp, with token 0)."""
    b, s = tokens.shape
    width = cpar.padded_length(s, cp)
    if width > s:
        tokens = torch.cat([tokens, tokens.new_zeros(b, width - s)], dim=1)
    rows = cpar.chunk_positions(width, cp, cp_rank, tokens.device)
    pos = torch.arange(width, device=tokens.device).unsqueeze(0).expand(b, width)
    return _local(tokens, pos, cpar.padded_layout(width // cp, cp, cp_rank, tokens.device), rows)


def split_packed(pk, cp: int, cp_rank: int) -> CPLocal:
    """A `megarl.trainer.packing.Pack` built with ``seq_multiple = 2 cp`` -> this rank's rows."""
    layout = cpar.thd_layout(pk.params, cp, cp_rank)  # kept on params: the attention reuses it
    cu = pk.params.cu_seqlens_q.long()
    rows = cpar.local_positions((cu[1:] - cu[:-1]).tolist(), cp, cp_rank, pk.tokens.device)
    return _local(pk.tokens, pk.position_ids, layout, rows)


def gather_shifted(values, local: CPLocal, group, cp: int):
    """Next-token values at the local positions [b, L/cp] -> token-aligned [b, L] (entry p = the
    value computed at p - 1, entry 0 = 0), identical on every CP rank; None stays None."""
    if values is None:
        return None
    full = cpar.gather_tokens(values, local.order, group, cp)
    return torch.cat([torch.zeros_like(full[:, :1]), full[:, :-1]], dim=1)
