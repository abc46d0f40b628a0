"""Packed sequences (``train.pack_sequences``): a micro-batch's rows fed to the model end to end,
without padding, in Megatron's THD layout.

A padded micro-batch is [b, s] with s its longest row; every linear layer, norm and the logit
head run on all b * s positions. Packed, the model sees one row of T = sum(lengths) tokens,
positions restarting at 0 in every sequence, and a `PackedSeqParams` (``qkv_format="thd"``,
``cu_seqlens`` = [0, l0, l0+l1, ...]): megatron-core applies RoPE per sequence
(``_apply_rotary_pos_emb_thd``) and hands the core attention [T, heads, dim] with the sequence
boundaries; `megarl.mcore.sdpa.SDPAttention` (CPU) and Transformer Engine's attention (GPU) keep
each sequence's attention to itself.

Only the model runs packed: the per-token output (logprobs, entropies, values) is computed on
the packed row and scattered back to the micro-batch's [b, s] layout (`unpack`), so the loss,
the masks and every caller see exactly the padded path's tensors; equal within float rounding
(tests/dist/test_packed_sequences.py).

With pipeline parallelism every micro-batch's activations between stages must have one shape:
each pack is padded at its end to the longest pack of the step (``total``) by one filler
sequence, whose outputs are dropped. Sequence parallelism needs T divisible by the TP size
(``multiple``), done the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megarl.mcore.packed import thd_params


@dataclass
class Pack:
    """One micro-batch packed end to end."""

    tokens: torch.Tensor  # [1, T'] long: the real tokens of every row, then any filler
    position_ids: torch.Tensor  # [1, T'] long: 0.. per sequence
    params: Any  # megatron-core's PackedSeqParams (megarl.mcore.packed.thd_params)
    valid: torch.Tensor  # [b, s] bool: where the packed tokens sit in the micro-batch
    real: int  # T: packed positions that belong to rows (the rest is filler)

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


def packed_length(lengths: torch.Tensor, multiple: int = 1) -> int:
    """T rounded up to ``multiple``."""
    t = int(lengths.sum())
    return -(-t // multiple) * multiple


def pack(tokens: torch.Tensor, lengths: torch.Tensor, total: Optional[int] = None) -> Pack:
    """``tokens`` [b, s] right-padded, ``lengths`` [b] -> a `Pack` of T' = ``total`` (>= T) or T
    positions; a filler sequence of token 0 covers T..T'."""
    b, s = tokens.shape
    device = tokens.device
    valid = torch.arange(s, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    real = int(lengths.sum())
    total = real if total is None else total
    if total < real:
        raise ValueError(f"pack: {real} tokens do not fit in a pack of {total}")
    seq_lens = lengths[lengths > 0]
    if total > real:
        seq_lens = torch.cat([seq_lens, seq_lens.new_tensor([total - real])])
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=device)
    torch.cumsum(seq_lens, 0, out=cu[1:])
    flat = tokens[valid]
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)[valid]
    if total > real:
        flat = torch.cat([flat, flat.new_zeros(total - real)])
        positions = torch.cat([positions, torch.arange(total - real, device=device)])
    longest = int(seq_lens.max()) if len(seq_lens) else 1
    return Pack(flat.unsqueeze(0), positions.unsqueeze(0), thd_params(cu, longest), valid, real)


def unpack(values: Optional[torch.Tensor], pk: Pack) -> Optional[torch.Tensor]:
    """A token-aligned output on the packed row ([1, T'], entry i from the outputs before token i)
    -> the micro-batch's [b, s], 0 at each row's first position and past its length (the padded
    path's layout). Differentiable (one masked assignment)."""
    if values is None:
        return None
    row = values[0, :pk.real]
    # entry 0 of a sequence came from the previous sequence's last output: the padded path's 0
    row = torch.where(pk.position_ids[0, :pk.real] == 0, torch.zeros_like(row), row)
    out = row.new_zeros(pk.valid.shape)
    out[pk.valid] = row
    return out
