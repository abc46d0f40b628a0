"""Shard-to-shard refit plan (pure): which rows of which trainer TP shard go to which rows of which
server TP shard, so that no rank ever holds a full tensor (NeMo-RL's refit, Megatron's resharding).
Executed by ``weights.refit: shard`` (`megarl.weights.shard_push`) into megarl-server ``--tp N``
(`megarl.server.weights.receive_shards`): both sides derive the same slices from the announced
units (`unit_slices`), the trainer ranks send theirs point to point, each server rank receives
into its own storages.

Coordinates are rows along the tensor-parallel dimension of each side's *local fused* shard:

- trainer (Megatron): rank i of t holds block i of every column-parallel tensor; its fused QKV
  shard interleaves its query groups, ``[q_g, k_g, v_g]`` per group g (per = heads/groups query
  heads, then one k and one v head); its ``linear_fc1`` shard is ``[gate_i; up_i]``.
- server (SGLang's QKVParallelLinear / MergedColumnParallelLinear): rank j of s holds
  ``[q_j; k_j; v_j]`` (its query heads, then its kv heads, then the same v heads) and
  ``[gate_j; up_j]``. With s > groups each kv head is replicated on s/groups ranks.

Row-parallel tensors (o, down) are the plain case along dim 1, replicated ones (norms) need no plan.
A slice is ``(src_rank, dst_rank, src_row, dst_row, rows)``; adjacent slices are merged.
"""
from __future__ import annotations

from typing import NamedTuple


class Slice(NamedTuple):
    src_rank: int
    dst_rank: int
    src_row: int
    dst_row: int
    rows: int


def _merge(slices: list[Slice]) -> list[Slice]:
    """Sorted by (src, dst, src_row); a slice that continues the previous one on both sides joins it."""
    out: list[Slice] = []
    for s in sorted(slices):
        p = out[-1] if out else None
        if (p and p.src_rank == s.src_rank and p.dst_rank == s.dst_rank
                and p.src_row + p.rows == s.src_row and p.dst_row + p.rows == s.dst_row):
            out[-1] = p._replace(rows=p.rows + s.rows)
        else:
            out.append(s)
    return out


def _blocks(length: int, parts: int, name: str) -> int:
    if length % parts:
        raise ValueError(f"{name}: {length} rows do not split into {parts} TP shards")
    return length // parts


def _plain(length: int, t: int, s: int, src_base=lambda i: 0, dst_base=lambda j: 0) -> list[Slice]:
    """Block i of t -> block j of s wherever they overlap (global rows), at the given local bases."""
    bt, bs = _blocks(length, t, "trainer"), _blocks(length, s, "server")
    out = []
    for i in range(t):
        for j in range(s):
            lo, hi = max(i * bt, j * bs), min((i + 1) * bt, (j + 1) * bs)
            if lo < hi:
                out.append(Slice(i, j, src_base(i) + lo - i * bt, dst_base(j) + lo - j * bs, hi - lo))
    return out


def plain_plan(length: int, t: int, s: int) -> list[Slice]:
    """A column-parallel (rows) or row-parallel (columns) tensor of ``length`` along its TP dim."""
    return _merge(_plain(length, t, s))


def gate_up_plan(ffn: int, t: int, s: int) -> list[Slice]:
    """Fused gate/up of ``ffn`` rows each: gate lands at the top of each side's shard, up below
    its gate part (``ffn / t`` rows down on the trainer, ``ffn / s`` on the server)."""
    gate = _plain(ffn, t, s)
    up = _plain(ffn, t, s, src_base=lambda i: ffn // t, dst_base=lambda j: ffn // s)
    return _merge(gate + up)


def qkv_plan(heads: int, groups: int, head_dim: int, t: int, s: int) -> list[Slice]:
    """Fused QKV, head by head (the finest unit either side may split at)."""
    per = heads // groups
    gt = _blocks(groups, t, "trainer query groups")  # whole groups per trainer rank
    hs = _blocks(heads, s, "server query heads")
    kv_s = groups // s if s <= groups else 1  # kv heads per server rank (1 when replicated)
    if s <= groups:
        _blocks(groups, s, "server kv heads")
    elif s % groups:
        raise ValueError(f"server TP {s} must divide or be a multiple of {groups} kv heads")
    out = []
    for g in range(groups):
        i, gl = divmod(g, gt)
        base = gl * (per + 2) * head_dim  # group g's [q, k, v] rows in trainer shard i
        for h in range(g * per, (g + 1) * per):  # query heads: one server rank each
            j = h // hs
            out.append(Slice(i, j, base + (h - g * per) * head_dim, (h - j * hs) * head_dim, head_dim))
        # kv head g: every server rank that holds it (s/groups of them when replicated)
        holders = [g // kv_s] if s <= groups else range(g * s // groups, (g + 1) * s // groups)
        for j in holders:
            local = g - j * kv_s if s <= groups else 0
            k_row = hs * head_dim + local * head_dim
            out.append(Slice(i, j, base + per * head_dim, k_row, head_dim))
            out.append(Slice(i, j, base + (per + 1) * head_dim, k_row + kv_s * head_dim, head_dim))
    return _merge(out)


# ---- units: what the shard push announces, and the slices both sides derive from it -------------
# A unit is one trainer parameter as the server stores it: [key, kind, dim, length, padded].
# kind "qkv" / "gate_up": fused, planned above (length = heads*head_dim rows / ffn rows);
# "split": plain TP split of ``length`` along ``dim``; "replicated": every server rank gets trainer
# rank 0's whole tensor; "vocab": the trainer's vocab-parallel rows (``padded`` in all, the
# padding last) -> ``length`` real rows, on every server rank (servers replicate embeddings).
UNIT_KINDS = ("qkv", "gate_up", "split", "replicated", "vocab")


def unit_slices(kind: str, dim: int, length: int, padded: int, t: int, s: int, heads: int, groups: int,
                head_dim: int) -> list[Slice]:
    """The slices of one unit (rows along ``dim``), in an order both sides iterate alike."""
    if kind == "qkv":
        return qkv_plan(heads, groups, head_dim, t, s)
    if kind == "gate_up":
        return gate_up_plan(length, t, s)
    if kind == "split":
        return plain_plan(length, t, s)
    if kind == "replicated":
        return [Slice(0, j, 0, 0, length) for j in range(s)]
    if kind == "vocab":
        bt = _blocks(padded, t, "trainer vocab rows")
        return [Slice(i, j, 0, i * bt, min(bt, length - i * bt)) for i in range(t) for j in range(s)
                if length - i * bt > 0]
    raise ValueError(f"unknown refit unit kind {kind!r}; known: {UNIT_KINDS}")
