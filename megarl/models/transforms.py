"""Pure tensor transforms between HF and Megatron layouts (no distributed state, no Megatron).

Megatron fuses q, k, v into ``linear_qkv`` with rows grouped per query group:

    for g in range(num_query_groups):   [ q heads of group g (heads/groups * head_dim rows),
                                          k of group g (head_dim rows),
                                          v of group g (head_dim rows) ]

so a TP shard is a contiguous block of groups. ``linear_fc1`` holds gate and up, but each TP
shard is ``[gate_shard; up_shard]``: the fused full tensor is the concatenation of the shards,
not ``[gate; up]``.
"""
from __future__ import annotations

import torch


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int
              ) -> torch.Tensor:
    """HF q [heads*d, ...], k/v [groups*d, ...] -> Megatron fused [(heads + 2*groups)*d, ...]."""
    head_dim = q.shape[0] // num_heads
    per_group = num_heads // num_groups
    rest = q.shape[1:]
    q = q.reshape(num_groups, per_group * head_dim, *rest)
    k = k.reshape(num_groups, head_dim, *rest)
    v = v.reshape(num_groups, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_qkv`; also valid on a TP shard when given the shard's counts."""
    rest = qkv.shape[1:]
    per_group = num_heads // num_groups
    head_dim = qkv.shape[0] // (num_heads + 2 * num_groups)
    grouped = qkv.reshape(num_groups, (per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def gate_up_to_shard(gate: torch.Tensor, up: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """HF gate/up [ffn, hidden] -> this TP rank's ``linear_fc1`` shard [2*ffn/tp, hidden]."""
    return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)


def shards_to_gate_up(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """All TP shards of ``linear_fc1`` (in TP-rank order) -> HF gate, up."""
    gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
    return torch.cat(gates, dim=0), torch.cat(ups, dim=0)


def shard(t: torch.Tensor, dim: int | None, tp: int, tp_rank: int) -> torch.Tensor:
    """The TP shard of a full tensor along ``dim`` (None = replicated)."""
    if dim is None or tp == 1:
        return t
    if t.shape[dim] % tp:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} is not divisible by tp={tp}")
    return t.chunk(tp, dim=dim)[tp_rank].contiguous()


def unshard(shards: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    """Concatenates TP shards along ``dim`` (None = replicated: the first shard)."""
    if dim is None or len(shards) == 1:
        return shards[0]
    return torch.cat(shards, dim=dim)
