"""megatron-core's description of packed sequences (THD), built for `megarl.trainer.packing`:
the one place megarl names `PackedSeqParams` (pinned in `megarl.mcore.pins.ATTENTION_PINS`); and
RoPE over them in one gather (`rope_thd`) instead of megatron-core's loop over the sequences."""
from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def thd_params(cu_seqlens: torch.Tensor, longest: int) -> PackedSeqParams:
    """Self-attention over sequences back to back: ``cu_seqlens`` int32 [n + 1] (0, l0, l0+l1, ...)
    for queries and keys alike, ``longest`` = max(l_i) (the RoPE table's length)."""
    install_rope_thd()
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


_LOOPED = None  # megatron-core's own _apply_rotary_pos_emb_thd, once replaced


def rope_thd(t, cu_seqlens, freqs, rotary_interleaved: bool = False, multi_latent_attention: bool = False,
             mscale: float = 1.0, cp_group=None):
    """megatron-core's THD RoPE without its Python loop: it splits ``t`` [T, heads, dim] by
    sequence, takes ``freqs[:len]`` for each (positions restart per sequence) and concatenates
    them, a few small ops per sequence - 11% of the demo's update (256 sequences a step). The
    same table rows in one gather: position = index - its sequence's start. Context parallelism
    (each sequence's two chunks) and the per-token frequency table (``freqs`` as long as ``t``)
    keep megatron-core's path."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    if (cp_group is None or cp_group.size() != 1 or freqs.size(0) == int(cu_seqlens[-1])
            or t.size(0) != int(cu_seqlens[-1])):
        return _LOOPED(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                       multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
    starts = cu_seqlens[:-1].to(torch.long)
    lengths = cu_seqlens[1:].to(torch.long) - starts
    positions = torch.arange(t.size(0), device=t.device) - torch.repeat_interleave(starts, lengths)
    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[positions], rotary_interleaved=rotary_interleaved,
                                      multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)


def install_rope_thd() -> None:
    """`rope_thd` in place of megatron-core's ``_apply_rotary_pos_emb_thd`` (idempotent)."""
    global _LOOPED
    from megatron.core.models.common.embeddings import rope_utils

    if _LOOPED is None:
        _LOOPED = rope_utils._apply_rotary_pos_emb_thd
        rope_utils._apply_rotary_pos_emb_thd = rope_thd
