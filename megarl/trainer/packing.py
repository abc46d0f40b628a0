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
(``multiple``), done the same way. Context parallelism splits every sequence in 2 x cp chunks:
each sequence is padded to a multiple of 2 x cp (``seq_multiple``, token 0 after its real
tokens, which causal attention keeps out of them), and so is the filler.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megarl.mcore.packed import thd_params


@dataclass
class Pack:
    """One micro-batch packed end to end."""

    tokens: torch.Tensor  # [1, T'] long: every row's sequence (each padded to seq_multiple), then any filler
    position_ids: torch.Tensor  # [1, T'] long: 0.. per sequence
    params: Any  # megatron-core's PackedSeqParams (megarl.mcore.packed.thd_params)
    valid: torch.Tensor  # [b, s] bool: where the packed tokens sit in the micro-batch
    real: int  # T: packed positions that belong to rows (the rest is padding and filler)
    index: torch.Tensor  # [T] long: the packed position of each real token, in the rows' order

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


def _round_up(n, multiple: int):
    return -(-n // multiple) * multiple


def packed_length(lengths: torch.Tensor, multiple: int = 1, seq_multiple: int = 1) -> int:
    """T (each sequence rounded up to ``seq_multiple``) rounded up to ``multiple``."""
    t = int(_round_up(lengths[lengths > 0], seq_multiple).sum())
    return _round_up(t, multiple)


def pack(tokens: torch.Tensor, lengths: torch.Tensor, total: Optional[int] = None, seq_multiple: int = 1) -> Pack:
    """``tokens`` [b, s] right-padded, ``lengths`` [b] -> a `Pack` of T' = ``total`` (>= T) or T
    positions; a filler sequence of token 0 covers T..T'. With ``seq_multiple`` (context
    parallelism: 2 x cp) each sequence is padded with token 0 to a multiple of it, and so must the
    filler be."""
    b, s = tokens.shape
    device = tokens.device
    valid = torch.arange(s, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    real = int(lengths.sum())
    seq_lens = lengths[lengths > 0]
    spans = _round_up(seq_lens, seq_multiple)
    used = int(spans.sum())
    total = used if total is None else total
    if total < used:
        raise ValueError(f"pack: {used} tokens do not fit in a pack of {total}")
    if (total - used) % seq_multiple:
        raise ValueError(f"pack: a filler of {total - used} tokens is not a multiple of {seq_multiple}")
    if total > used:
        spans = torch.cat([spans, spans.new_tensor([total - used])])
    cu = torch.zeros(len(spans) + 1, dtype=torch.int32, device=device)
    torch.cumsum(spans, 0, out=cu[1:])
    starts = cu[:-1].long()
    seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), seq_lens)
    first = torch.cumsum(seq_lens, 0) - seq_lens  # each sequence's first real token among the T
    index = starts[seq] + torch.arange(real, device=device) - first[seq]
    flat = tokens.new_zeros(total)
    flat[index] = tokens[valid]
    owner = torch.repeat_interleave(torch.arange(len(spans), device=device), spans)
    positions = torch.arange(total, device=device) - starts[owner]
    longest = int(spans.max()) if len(spans) else 1
    return Pack(flat.unsqueeze(0), positions.unsqueeze(0), thd_params(cu, longest), valid, real, index)


def unpack(values: Optional[torch.Tensor], pk: Pack) -> Optional[torch.Tensor]:
    """A token-aligned output on the packed row ([1, T'], entry i from the outputs before token i)
    -> the micro-batch's [b, s], 0 at each row's first position and past its length (the padded
    path's layout). Differentiable (one masked assignment)."""
    if values is None:
        return None
    row = values[0].index_select(0, pk.index)
    # entry 0 of a sequence came from the previous sequence's last output: the padded path's 0
    row = torch.where(pk.position_ids[0].index_select(0, pk.index) == 0, torch.zeros_like(row), row)
    out = row.new_zeros(pk.valid.shape)
    out[pk.valid] = row
    return out
