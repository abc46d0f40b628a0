"""megatron-core's description of packed sequences (THD), built for `megarl.trainer.packing`:
the one place megarl names `PackedSeqParams` (pinned in `megarl.mcore.pins.ATTENTION_PINS`)."""
from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def thd_params(cu_seqlens: torch.Tensor, longest: int) -> PackedSeqParams:
    """Self-attention over sequences back to back: ``cu_seqlens`` int32 [n + 1] (0, l0, l0+l1, ...)
    for queries and keys alike, ``longest`` = max(l_i) (the RoPE table's length)."""
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)
