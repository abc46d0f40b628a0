"""HF <-> Megatron layout of every weight-table row: shapes, names and tensor conversions.

The one place that knows what each table row (:mod:`megarl.protocol.hf_model`) looks like on either
side, used by the HF loader/exporter (``hf_io``), the resharder and its planner (``weights/``) and
the checkpoint converter (``megarl.commands``). Pure: torch and the table only, no distributed state, so
the planner stays testable without a process group.

Three Megatron views of a row:

* a TP *shard* (what a rank holds): ``linear_fc1`` is ``[gate_shard; up_shard]``;
* the *full* tensor (what a dist checkpoint stores per layer): ``linear_fc1`` is ``[gate; up]``,
  ``linear_qkv`` the fused QKV of all query groups (:mod:`megarl.models.transforms`);
* the checkpoint *key*: per-layer rows stacked on a leading layer axis under one name, norms under
  their TE-style names for either spec.

Vocabulary padding (``vocab`` rows: embedding and output layer): Megatron holds
``padded_vocab_size`` rows (a multiple of ``make_vocab_size_divisible_by * tp``, like Megatron's
own trainer), HF the original ``vocab_size``. Import appends zero rows, every export path (HF
export, mcore-to-hf, the resharder) drops them, and logprobs mask their logits
(:mod:`megarl.trainer.logits`), so the padding never reaches a user or a server.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Iterable, Optional, TypeVar

import torch

from megarl.models import transforms as T
from megarl.protocol.hf_model import GATE_UP, QKV, VOCAB, ModelArgs, ParamMap, param_table, te_name

Item = TypeVar("Item")


# ----------------------------------------------------------------------------- vocabulary padding

def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp``."""
    if divisible_by < 1:
        raise ValueError(f"model.make_vocab_size_divisible_by: must be >= 1, got {divisible_by}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def pad_vocab(args: ModelArgs, divisible_by: int, tp: int) -> ModelArgs:
    """``args`` with the Megatron-side vocabulary padded for this TP size."""
    return dataclasses.replace(args, padded_vocab_size=padded_vocab_size(args.vocab_size, divisible_by, tp))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))], dim=0)


# ----------------------------------------------------------------------------- shapes and names

def _shape_by_suffix(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    H, V, F, hd = args.hidden_size, args.vocab_size, args.ffn_hidden_size, args.head_dim
    if args.num_experts:  # every MLP is an MoE layer: gate/up/down are the experts'
        F = args.moe_ffn_hidden_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    return {"gate.weight": (args.num_experts, H),
        "embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "norm.weight": (H,),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "q_proj.weight": (q, H), "k_proj.weight": (kv, H), "v_proj.weight": (kv, H),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "o_proj.weight": (H, q),
        "q_norm.weight": (hd,), "k_norm.weight": (hd,), "gate_proj.weight": (F, H),
        "up_proj.weight": (F, H), "down_proj.weight": (H, F),
    }


def hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the model -> its full shape, from config.json alone (table order)."""
    by_suffix = _shape_by_suffix(args)
    # HF names end in "<module>.<weight|bias>"; those two parts alone fix the shape.
    return {name: by_suffix[".".join(name.split(".")[-2:])]
            for layer, pmap in param_table(args) for name in pmap.names(layer)[1]}


def expert_shape(pmap: ParamMap, args: ModelArgs) -> tuple[int, ...]:
    """Megatron shape of one MoE expert row (never TP-split): fc1 [2F, H], fc2 [H, F]."""
    F, H = args.moe_ffn_hidden_size, args.hidden_size
    return (2 * F, H) if pmap.kind == GATE_UP else (H, F)


def mcore_key(pmap: ParamMap) -> str:
    """The dist-checkpoint key of a table row (layers stacked, TE-style norm names; MoE experts
    stacked on a second axis under ``mlp.experts.experts.``, as Megatron's SequentialMLP saves)."""
    key = te_name(pmap.mcore.replace("{L}.", ""))
    if pmap.expert is not None:
        key = key.replace(f"local_experts.{pmap.expert}.", "experts.")
    return key


def mcore_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every model tensor of a Megatron dist checkpoint -> its global (stacked, unsharded) shape:
    [layers, ...] per layer, [layers, experts, ...] per expert."""
    hf = hf_shapes(args)
    out = {}
    for layer, pmap in param_table(args):
        if layer not in (None, 0) or pmap.expert not in (None, 0):  # one row describes a stacked key
            continue
        names = pmap.names(layer)[1]
        shape = hf[names[0]]
        if pmap.kind in (QKV, GATE_UP):  # fused along rows
            shape = (sum(hf[n][0] for n in names), *shape[1:])
        if pmap.kind == VOCAB:
            shape = (args.mcore_vocab_size, *shape[1:])
        if pmap.expert is not None:
            shape = (args.num_experts, *shape)
        out[mcore_key(pmap)] = (args.num_layers, *shape) if layer is not None else shape
    return out


# ----------------------------------------------------------------------------- full tensors

def hf_to_full(pmap: ParamMap, tensors: list[torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """HF tensors of one row (one layer) -> the full, unsharded Megatron tensor."""
    if pmap.kind == QKV:
        return T.merge_qkv(*tensors, args.num_heads, args.num_kv_heads)
    if pmap.kind == GATE_UP:
        return torch.cat(tensors, dim=0)
    if pmap.kind == VOCAB:
        return _pad_rows(tensors[0], args.mcore_vocab_size)
    return tensors[0]


def full_to_hf(pmap: ParamMap, full: torch.Tensor, args: ModelArgs) -> list[torch.Tensor]:
    """Inverse of :func:`hf_to_full`: the row's HF tensors, in the row's HF name order."""
    if pmap.kind == QKV:
        return list(T.split_qkv(full, args.num_heads, args.num_kv_heads))
    if pmap.kind == GATE_UP:
        return [t.contiguous() for t in full.chunk(2, dim=0)]
    if pmap.kind == VOCAB:  # the padded rows are not part of the model
        return [full[: args.vocab_size]]
    return [full]


# ----------------------------------------------------------------------------- TP shards

def hf_to_shard(pmap: ParamMap, tensors: list[torch.Tensor], args: ModelArgs, tp: int, tp_rank: int
                ) -> torch.Tensor:
    """Full HF tensor(s) of one row -> this TP rank's Megatron shard."""
    if pmap.kind == QKV:  # whole query groups per rank: a row block of the fused tensor
        return T.shard(hf_to_full(pmap, tensors, args), 0, tp, tp_rank)
    if pmap.kind == GATE_UP:  # NOT a row block of [gate; up]: each shard is [gate_r; up_r]
        return T.gate_up_to_shard(tensors[0], tensors[1], tp, tp_rank)
    if pmap.kind == VOCAB:  # padding sits at the end: the last rank(s) hold it
        return T.shard(hf_to_full(pmap, tensors, args), 0, tp, tp_rank)
    return T.shard(tensors[0], pmap.tp_dim, tp, tp_rank)


def shards_to_hf(pmap: ParamMap, shards: list[torch.Tensor], args: ModelArgs) -> list[torch.Tensor]:
    """All TP shards of one Megatron parameter (TP-rank order) -> the row's full HF tensor(s)."""
    if pmap.kind == QKV:
        return full_to_hf(pmap, T.unshard(shards, 0), args)  # one shard (TP=1): no copy
    if pmap.kind == GATE_UP:
        return list(T.shards_to_gate_up(shards))
    if pmap.kind == VOCAB:
        return full_to_hf(pmap, T.unshard(shards, 0), args)
    return [T.unshard(shards, pmap.tp_dim)]


# ----------------------------------------------------------------------------- byte-capped groups

def group_by_bytes(items: Iterable[Item], nbytes: Callable[[Item], int], max_bytes: int,
                   boundary: Optional[Callable[[Item], Hashable]] = None) -> list[list[Item]]:
    """Consecutive items grouped so a group holds at most ``max_bytes`` (an item larger than that
    gets a group of its own); a change of ``boundary(item)`` always starts a new group. Used for
    push buckets (boundary: pipeline stage) and HF safetensors files."""
    groups: list[list[Item]] = []
    size, key = 0, None
    for item in items:
        n = nbytes(item)
        k = boundary(item) if boundary is not None else None
        if not groups or k != key or (groups[-1] and size + n > max_bytes):
            groups.append([])
            size, key = 0, k
        groups[-1].append(item)
        size += n
    return groups


def safetensors_file_names(count: int) -> list[str]:
    """HF's names for a checkpoint of ``count`` files (``model.safetensors`` when one)."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
