"""Core attention of the local (non-TE) layer spec through torch's fused
``scaled_dot_product_attention`` (``model.attention: sdpa``, the default).

megatron-core's local `DotProductAttention` computes attention unfused: it repeats the KV heads for
GQA, writes [b*np, sq, sk] scores with ``baddbmm``, builds and applies the causal (or sliding
window) mask, runs softmax and a second ``bmm``, then copies the context back. On CPU that is ~1.7x
the time of torch's fused kernel, which needs none of the copies.

`SDPAttention` keeps Megatron's module (its constructor computes the per-partition heads, scale and
window) and replaces only the arithmetic of ``forward``: causal self-attention of full sequences,
GQA without repeating KV, the window (left, 0) as a boolean mask. Anything else Megatron's module
supports but this does not (an explicit attention mask or bias, a softmax offset, query-key layer
scaling, attention dropout while training, sq != sk) runs the original ``forward``.
GPU runs use the TE spec and never reach this.

Packed sequences (``train.pack_sequences``, `megarl.trainer.packing`): megatron-core hands the
core attention [T, heads, dim] and the sequence boundaries (``packed_seq_params.cu_seqlens_q``,
THD; Megatron's own module refuses them). Each sequence attends to itself only: its tokens are
scattered into a [n_seq, longest, ...] block (one ``index_copy``; the rest zeros), attended
causally in one fused call, and gathered back (one ``index_select``). A sequence's padding sits
after its real keys, so the causal mask alone keeps it out. Attention is the one place that pays
for the longest sequence; every linear layer, norm and the head run on the T real tokens.

Context parallelism (``parallel.cp > 1``): the local rows are this rank's two chunks of each
sequence; K and V are gathered over the CP group and each chunk attends piecewise
(`megarl.mcore.context_parallel`). Megatron's own module refuses CP (only TE's attention has it),
so the constructor builds it from a copy of the config at CP=1 and keeps the real one.

It lives in `megarl.mcore` because it depends on `DotProductAttention`'s instance attributes and the
layout of the local layer spec (pinned in `megarl.mcore.pins.ATTENTION_PINS`).
"""
from __future__ import annotations

from typing import Optional

import copy

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megarl.mcore import context_parallel as cpar
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

__all__ = ["SDPAttention", "use_sdpa_core_attention", "window_mask"]


def window_mask(s: int, left: int, device) -> torch.Tensor:
    """[s, s] bool, True where query i may attend key j: i - left <= j <= i."""
    i = torch.arange(s, device=device)[:, None]
    j = torch.arange(s, device=device)[None, :]
    return (j <= i) & (j >= i - left)


class SDPAttention(DotProductAttention):
    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, *args, **kwargs):
        self.cp = config.context_parallel_size
        if self.cp > 1:  # DotProductAttention asserts CP == 1: build it at 1, keep the real config
            at_one = copy.copy(config)
            at_one.context_parallel_size = 1
            super().__init__(at_one, layer_number, attn_mask_type, *args, **kwargs)
            self.config = config
            self.cp_group = parallel_state.get_context_parallel_group()
        else:
            super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                             self.layer_number)
        self.window = config.window_size if windowed else None
        if self.window is not None and self.window[1] != 0:
            self.window = "unsupported"  # a right context: Megatron's own forward handles it
        if self.cp > 1 and self.window is not None:
            raise ValueError("parallel.cp: context parallelism with sliding-window attention is not supported")

    def _fused_ok(self, query, key, attention_mask, attention_bias, packed_seq_params, mask_type) -> bool:
        packed = packed_seq_params is not None
        if packed and (packed_seq_params.qkv_format != "thd" or packed_seq_params.cu_seqlens_q_padded is not None
                       or packed_seq_params.cu_seqlens_q is not packed_seq_params.cu_seqlens_kv):
            return False
        return (attention_mask is None and attention_bias is None
                and self.softmax_offset is None and not self.config.apply_query_key_layer_scaling
                and not (self.training and self.attention_dropout.p > 0)
                and query.size(0) == key.size(0) and self.window != "unsupported"
                and mask_type in (AttnMaskType.causal, AttnMaskType.no_mask))

    def forward(self, query, key, value, attention_mask, attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias=None, packed_seq_params=None):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        ok = self._fused_ok(query, key, attention_mask, attention_bias, packed_seq_params, mask_type)
        if self.cp > 1:
            if not ok or mask_type != AttnMaskType.causal:
                raise ValueError("parallel.cp: the CPU attention splits causal self-attention without masks, "
                                 "biases or dropout only")
            return self._context_parallel(query, key, value, packed_seq_params)
        if not ok:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, mask_type)
        sq, b, heads, hn = query.shape
        # [s, b, n, hn] -> [b, n, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        return self._attend(q, k, v, mask_type).permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    def _context_parallel(self, query, key, value, params):
        """This rank's rows [s/cp, b, n, hn] (THD: [T/cp, n, hn]) against the whole sequences' K/V
        gathered over the CP group -> [s/cp, b, n * hn] ([T/cp, n * hn])."""
        if params is None:
            layout = cpar.padded_layout(query.shape[0], self.cp, self.cp_group.rank(), query.device)
        else:
            layout = cpar.thd_layout(params, self.cp, self.cp_group.rank())
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))  # THD as b = 1
        key, value = (cpar.gather_kv(t, layout, self.cp_group, self.cp) for t in (key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, hn] -> [b, n, s, hn]
        out = cpar.cp_attention(q, k, v, layout, self.softmax_scale)
        sq, b, heads, hn = query.shape
        out = out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)
        return out if params is None else out.squeeze(1)

    def _packed(self, query, key, value, params, mask_type):
        """THD: [T, n, hn] each, sequences back to back (``params.cu_seqlens_q``) -> [T, n * hn]."""
        t, heads, hn = query.shape
        index, n_seq, longest = _block_index(params, t)

        def blocks(x):  # [T, n, hn] -> [n_seq, n, longest, hn], zeros past each sequence
            out = x.new_zeros(n_seq * longest, x.shape[1], x.shape[2]).index_copy(0, index, x)
            return out.view(n_seq, longest, x.shape[1], x.shape[2]).transpose(1, 2)

        out = self._attend(blocks(query), blocks(key), blocks(value), mask_type)
        # [n_seq, n, longest, hn] -> [n_seq * longest, n * hn] -> the T real rows
        return out.transpose(1, 2).reshape(n_seq * longest, heads * hn).index_select(0, index)

    def _attend(self, q, k, v, mask_type):
        """[b, n, s, hn] -> [b, n, s, hn]: causal (or windowed) fused attention, GQA kept grouped."""
        sq, heads = q.shape[2], q.shape[1]
        causal, mask = mask_type == AttnMaskType.causal, None
        if self.window is not None:
            mask = window_mask(sq, self.window[0], q.device)
            if not causal:  # a window without causality would see the future: not a Megatron mode
                raise ValueError("a sliding window needs causal attention")
            causal = False  # the window mask is causal already
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale,
            enable_gqa=heads != self.num_query_groups_per_partition)


def _block_index(params, t: int) -> tuple[torch.Tensor, int, int]:
    """(for each of the T packed tokens its row in a [n_seq * longest] block layout, n_seq,
    longest), computed once per forward pass and kept on ``params`` (every layer shares it)."""
    cached = getattr(params, "_megarl_block_index", None)
    if cached is not None and cached[0].numel() == t:
        return cached
    cu = params.cu_seqlens_q.long()
    lengths = cu[1:] - cu[:-1]
    n_seq, longest = len(lengths), int(params.max_seqlen_q)
    seq = torch.repeat_interleave(torch.arange(n_seq, device=cu.device), lengths)
    index = seq * longest + (torch.arange(t, device=cu.device) - cu[:-1][seq])
    params._megarl_block_index = (index, n_seq, longest)
    return params._megarl_block_index


def use_sdpa_core_attention(spec):
    """The local layer ``spec`` with its core attention replaced by :class:`SDPAttention`."""
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec
