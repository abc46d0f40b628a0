"""Tensor parallelism for megarl-server (``--tp N``, dense Llama/Mistral/Qwen2/Qwen3 on CPU, gloo).

Design: rank 0 (the leader) is the whole server as at TP=1 - HTTP, the engine thread, sampling,
the weight-update groups. Ranks 1..N-1 (followers, started by the leader as child processes of
``python -m megarl.server ... --tp-rank r``) hold a shard of the model and a KV cache of their
heads, and do only what the leader tells them: every model call that touches sharded state
(prefill, decode, cache move/clear, weight load, gather of a parameter) is first broadcast as a
small command over the server's own gloo group, then run on every rank in the same order. Why
this and not a lock-step engine on every rank: the engine's inputs (HTTP arrivals, pauses,
aborts, the sampler's random stream) exist only on the leader; forwarding the forward's inputs
keeps one engine and one source of truth, and the followers' loop is ~20 lines.

Megatron-style split of rank j of N (`shard_spec`): q/k/v and gate/up are column-parallel (rank j
holds its query heads, its kv heads - replicated on N/kv ranks when N > kv heads - and rows
[j I/N, (j+1) I/N) of gate and of up); o_proj and down_proj are row-parallel (their input
columns), followed by an all-reduce of the partial outputs, then the bias (added once). Norms,
embeddings and lm_head are replicated (the simplest correct choice: vocab-parallel logits would
need a gather before sampling). Each rank's forward is the TP=1 code on a `shard_config` whose
head and MLP counts are the local ones; only the two row-parallel products differ.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

GROUP_NAME = "megarl-server-tp"


def shard_config(cfg, tp: int):
    """The DecoderConfig rank-local forward code runs on: heads, kv heads and MLP width / ``tp``
    (one kv head per rank when ``tp`` > kv heads). Unsupported layouts are a ValueError naming --tp."""
    if tp == 1:
        return cfg
    if cfg.moe is not None:
        raise ValueError(f"--tp {tp}: {cfg.architecture} is a mixture-of-experts model; server tensor "
                         "parallelism supports dense Llama/Mistral/Qwen2/Qwen3 only (use --tp 1)")
    kv = cfg.num_kv_heads
    if cfg.num_heads % tp or cfg.intermediate_size % tp or (kv % tp and tp % kv):
        raise ValueError(f"--tp {tp}: must divide num_attention_heads={cfg.num_heads} and "
                         f"intermediate_size={cfg.intermediate_size}, and divide or be a multiple of "
                         f"num_key_value_heads={kv}")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=max(1, kv // tp),
                               intermediate_size=cfg.intermediate_size // tp)


def shard_spec(name: str, cfg, rank: int, tp: int) -> Optional[tuple[int, int, int, int]]:
    """(dim, start, length, full length) of rank ``rank``'s slice of HF tensor ``name`` (full
    ``cfg``), or None for a replicated tensor (norms, embeddings, lm_head, o/down biases)."""
    if tp == 1:
        return None
    d, kv = cfg.head_dim, cfg.num_kv_heads
    q = cfg.num_heads * d
    leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
    proj, kind = leaf[0], leaf[1] if len(leaf) > 1 else ""
    if proj == "q_proj":
        return 0, rank * q // tp, q // tp, q
    if proj in ("k_proj", "v_proj"):
        if kv >= tp:
            return 0, rank * kv * d // tp, kv * d // tp, kv * d
        return 0, (rank * kv // tp) * d, d, kv * d  # the kv head this rank's query heads share
    if proj in ("gate_proj", "up_proj"):
        i = cfg.intermediate_size
        return 0, rank * i // tp, i // tp, i
    if proj in ("o_proj", "down_proj") and kind == "weight":
        n = q if proj == "o_proj" else cfg.intermediate_size
        return 1, rank * n // tp, n // tp, n
    return None


def full_shape(name: str, local_shape, cfg, tp: int) -> tuple[int, ...]:
    spec = shard_spec(name, cfg, 0, tp)
    shape = list(local_shape)
    if spec is not None:
        shape[spec[0]] = spec[3]
    return tuple(shape)


def local_slice(name: str, full: torch.Tensor, cfg, rank: int, tp: int) -> torch.Tensor:
    spec = shard_spec(name, cfg, rank, tp)
    return full if spec is None else full.narrow(spec[0], spec[1], spec[2])


def assemble(name: str, parts: list[torch.Tensor], cfg, tp: int) -> torch.Tensor:
    """The full tensor from every rank's local slice (the inverse of `local_slice`)."""
    spec = shard_spec(name, cfg, 0, tp)
    if spec is None:
        return parts[0]
    if name.rsplit(".", 2)[-2] in ("k_proj", "v_proj") and cfg.num_kv_heads < tp:
        parts = parts[:: tp // cfg.num_kv_heads]  # one holder of each replicated kv head
    return torch.cat(parts, dim=spec[0])


class TPGroup:
    """This rank's place in the server's TP group and its two kinds of traffic: the leader's
    commands (pickled, small except weight loads) and the row-parallel all-reduces."""

    def __init__(self, pg, rank: int, size: int):
        self.pg, self.rank, self.size = pg, rank, size

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def command(self, op: str, *args) -> None:
        """Leader: tell every follower to run ``op(*args)`` next (then run it here too)."""
        dist.broadcast_object_list([(op, args)], src=0, group=self.pg)

    def receive(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def send_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Leader: ``load`` a dict of full tensors on every follower: the names, dtypes and shapes
        as a command, the bytes as one tensor broadcast each (no pickling of tensor data)."""
        tensors = {n: t.contiguous() for n, t in tensors.items()}
        self.command("load", [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
        works = [dist.broadcast(t, src=0, group=self.pg, async_op=True) for t in tensors.values()]
        for w in works:
            w.wait()

    def receive_tensors(self, meta: list) -> dict[str, torch.Tensor]:
        out = {n: torch.empty(shape, dtype=dtype) for n, dtype, shape in meta}
        works = [dist.broadcast(t, src=0, group=self.pg, async_op=True) for t in out.values()]
        for w in works:
            w.wait()
        return out

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.pg)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t.contiguous(), group=self.pg)
        return out


def follow(model, cache, group: TPGroup) -> None:
    """A follower's life: run the leader's commands until it says stop (or its socket dies)."""
    from megarl.common.net import new_process_group
    from megarl.server.weights import WeightGroup, receive_shards

    groups: dict[str, WeightGroup] = {}  # weight-update groups this rank joined (shard refit)
    with torch.inference_mode():
        while True:
            try:
                op, args = group.receive()
            except RuntimeError:  # the leader closed the group: it exited (its SIGKILL follows)
                return
            if op == "stop":
                return
            if op == "prefill":
                model.prefill(args[0], args[1], cache, args[2])
            elif op == "decode":
                model.decode(args[0], args[1], cache)
            elif op == "cache_move":
                cache.move(*args)
            elif op == "cache_clear":
                cache.clear()
            elif op == "load":
                model.load_local(group.receive_tensors(args[0]))
            elif op == "gather":
                model.gather_full(args[0])
            elif op == "join":  # addr, port, the leader's rank, world, name, backend, timeout
                addr, port, rank, world, name, backend, timeout = args
                groups[name] = WeightGroup(new_process_group(addr, port, rank + group.rank, world, name,
                                                             backend, timeout))
            elif op == "destroy":
                pg = groups.pop(args[0], None)
                if pg is not None:
                    dist.destroy_process_group(pg.pg)
            elif op == "receive_shards":  # name, units, trainer TP
                receive_shards(model, groups[args[0]], args[1], args[2])
            else:
                raise RuntimeError(f"server TP rank {group.rank}: unknown command {op!r}")
