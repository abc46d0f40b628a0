"""``weights.refit: shard``: shard-to-shard refit into megarl-server ``--tp N`` (any N, also 1).

No rank gathers a full tensor. Every trainer TP rank of DP rank 0 joins the weight-update group
(trainer TP rank i is group rank i; server k's TP rank j is ``t + sum(tp of servers < k) + j``,
every server TP rank joins through its leader, ``server_tp_ranks``). Per push, TP rank 0
announces the units (one per Megatron parameter, `megarl.protocol.refit` units, keyed by the
server storage they land in) to every server, and each trainer rank sends the slices of its own
shard that `refit.unit_slices` assigns to it, point to point, to the server ranks that hold them:
when trainer TP == server TP each shard goes 1:1 to its peer rank. The servers receive straight
into their storages (`megarl.server.weights.receive_shards`).

Scope: dense models, one pipeline stage (``parallel.pp == 1``), megarl-server (the announce is a
megarl extension of ``/update_weights_from_distributed``); all units of a push are announced
at once (no buckets: peak extra memory is the cast/non-contiguous slices in flight, at most the
rank's own shard). ``weights.delta`` does not apply: every tensor is sent.
"""
from __future__ import annotations

import secrets
import time

import torch
import torch.distributed as dist

from megarl.models.hf_io import local_params
from megarl.protocol.hf_model import GATE_UP, QKV, VOCAB
from megarl.protocol.messages import ServerInfo, ShardAnnounce, ShardJoin
from megarl.common.net import advertised_address, listening_socket, new_process_group, url_host
from megarl.protocol.refit import unit_slices
from megarl.weights.transports import PushError, _finish, leave_update_group


def describe(lp, args, tp: int, dtype: torch.dtype) -> tuple[list, torch.Tensor]:
    """(unit ``[key, kind, dim, length, padded, dtype]``, the local shard to send from)."""
    _, hf = lp.pmap.names(lp.layer)
    shard = lp.param.detach()
    if dtype is not None:
        shard = shard.to(dtype)
    dt = str(shard.dtype).replace("torch.", "")
    kind = lp.pmap.kind
    bias = hf[0].endswith(".bias")
    if kind == QKV:
        key = hf[0].rsplit(".", 2)[0] + (".qkv_bias" if bias else ".qkv")
        return [key, "qkv", 0, shard.shape[0] * tp, shard.shape[0] * tp, dt], shard
    if kind == GATE_UP:
        key = hf[0].rsplit(".", 2)[0] + (".gate_up_bias" if bias else ".gate_up")
        return [key, "gate_up", 0, args.ffn_hidden_size, 0, dt], shard
    if kind == VOCAB:
        return [hf[0], "vocab", 0, args.vocab_size, shard.shape[0] * tp, dt], shard
    if lp.pmap.tp_dim is None:
        return [hf[0], "replicated", 0, shard.shape[0], 0, dt], shard
    d = lp.pmap.tp_dim
    return [hf[0], "split", d, shard.shape[d] * tp, 0, dt], shard


class ShardRefitTransport:
    """Built on every trainer rank; only DP rank 0's TP group takes part (others idle). Not a
    `Transport`: there are no buckets to `send`; `WeightPusher` calls `setup()` once per server
    set and `push(version)` once per push (``weights.refit: shard``; group ranks: module docstring)."""

    streams_buckets = False  # no buckets: push() sends each rank's own slices (WeightPusher.refit)

    def __init__(self, admin, engine, master_address: str, timeout_s: float, backend: str, dtype):
        self.admin, self.engine, self.ps = admin, engine, engine.ps
        self.addr, self.timeout_s, self.backend, self.dtype = master_address, timeout_s, backend, dtype
        self.group, self.group_name, self.bytes = None, "", 0
        self.server_tp: list[int] = []

    @property
    def active(self) -> bool:
        return self.ps.first_replica

    def setup(self) -> None:
        """Collective over DP rank 0's TP group: TP rank 0 learns each server's TP size, asks the
        servers to join, then every TP rank joins the group."""
        ps = self.ps
        if not self.active:
            return
        box, listener = [None], None
        if ps.tp_rank == 0:
            # each server's TP size decides how many ranks it adds to the group and how slices are cut
            infos = self.admin.request(ServerInfo(), self.timeout_s)
            self.server_tp = [int(infos[a].get("tp_size", 1)) for a in self.admin.addresses]
            addr = advertised_address(self.addr, url_host(self.admin.addresses[0]))
            listener = listening_socket(addr)  # group rank 0 serves the store there, nowhere else
            # a name of this run's (see transports): TP rank 0 picks it, every TP rank joins under it
            box = [(addr, listener.getsockname()[1], self.server_tp, f"megarl-weights-shard-{secrets.token_hex(4)}")]
        # every TP rank joins the same rendezvous, so TP rank 0's choice of address and port is shared
        dist.broadcast_object_list(box, group_src=0, group=ps.tp_group)
        addr, port, self.server_tp, self.group_name = box[0]
        world = ps.tp + sum(self.server_tp)
        joined = None
        if ps.tp_rank == 0:
            offsets = [ps.tp + sum(self.server_tp[:k]) for k in range(len(self.server_tp))]
            body = {"master_address": addr, "master_port": port, "world_size": world,
                    "group_name": self.group_name, "backend": self.backend, "server_tp_ranks": True,
                    "timeout": self.timeout_s}
            bodies = {a: {**body, "rank_offset": o} for a, o in zip(self.admin.addresses, offsets)}
            # submitted, not awaited: the servers' ranks block in the rendezvous until ours join below
            joined = self.admin.send(ShardJoin(bodies))
        try:
            self.group = new_process_group(addr, port, ps.tp_rank, world, self.group_name, self.backend,
                                           self.timeout_s, listener=listener)
        except Exception as e:  # noqa: BLE001
            raise PushError(f"init_weights_update_group (shard refit): rendezvous at {addr}:{port} "
                            f"failed: {e}") from e
        finally:
            if joined is not None:
                _finish(joined, self.timeout_s, "init_weights_update_group")

    def push(self, version: str) -> float:
        """Announce (TP rank 0) and send this rank's slices; returns the seconds it took."""
        ps, e = self.ps, self.engine
        self.bytes = 0
        if not self.active:
            return 0.0
        if e.ps.pp != 1:
            raise PushError("weights.refit=shard: needs parallel.pp=1 (one pipeline stage)")
        t0 = time.perf_counter()
        units, shards = [], []
        for lp in local_params(e.chunks, e.args, e.use_te):
            if lp.pmap.expert is not None:
                raise PushError("weights.refit=shard: MoE experts are not supported; use weights.refit=gather")
            if e.args.tie_word_embeddings and lp.local_name == "output_layer.weight":
                continue  # tied: the server's lm_head is its embedding, sent once
            unit, shard = describe(lp, e.args, ps.tp, self.dtype)
            units.append(unit)
            shards.append(shard)
        announced = None
        if ps.tp_rank == 0:  # one announce for the whole model: every unit, how it is split, who sends
            body = {"names": [u[0] for u in units], "dtypes": [u[5] for u in units],
                    "shapes": [[] for _ in units], "group_name": self.group_name,
                    "load_format": "shard_refit", "refit_units": units, "refit_src_tp": ps.tp,
                    "flush_cache": False}
            bodies = {a: body for a in self.admin.addresses}
            announced = self.admin.send(ShardAnnounce(bodies))
        args = e.args
        heads, groups, hd = args.num_heads, args.num_kv_heads, args.head_dim
        works, pieces, base = [], [], ps.tp
        try:
            for s in self.server_tp:
                # tags count every slice of the plan in the same order on both sides (the server
                # walks the same `unit_slices`), so a receive matches its send without metadata
                tag = 0
                for unit, shard in zip(units, shards):
                    _, kind, dim, length, padded, _ = unit
                    for sl in unit_slices(kind, dim, length, padded, ps.tp, s, heads, groups, hd):
                        tag += 1
                        if sl.src_rank != ps.tp_rank:
                            continue
                        piece = shard.narrow(dim, sl.src_row, sl.rows).contiguous()
                        self.bytes += piece.numel() * piece.element_size()
                        piece = piece.cpu() if self.backend == "gloo" else piece  # gloo moves host memory only
                        pieces.append(piece)  # alive until its send completes
                        works.append(dist.isend(piece, dst=base + sl.dst_rank, group=self.group, tag=tag))
                base += s
            for w in works:
                w.wait()
        except Exception as ex:  # noqa: BLE001
            if announced is not None:
                announced.cancel()
            raise PushError(f"update_weights_from_distributed (shard refit): send failed "
                            f"({type(ex).__name__}: {str(ex).splitlines()[0]})") from ex
        if announced is not None:
            _finish(announced, self.timeout_s, "update_weights_from_distributed (shard refit)")
        return time.perf_counter() - t0

    def finish(self, version: str, engine) -> None:
        pass

    def close(self) -> None:
        if self.group is not None:
            leave_update_group(self.admin, self.group, self.group_name, self.timeout_s,
                               tell_servers=self.ps.tp_rank == 0)
            self.group = None
