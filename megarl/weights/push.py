"""The weight push: trainer shards -> rollout servers, one collective call per policy version."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megarl.weights.admin import AdminRunner
from megarl.weights.resharder import Resharder
from megarl.weights.transports import (DiskTransport, DistributedTransport, PushError,
                                       TensorTransport)


@dataclass
class PushMetrics:
    version: int
    bytes: int
    buckets: int
    gather_s: float
    convert_s: float
    send_s: float
    total_s: float

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.send_s + self.gather_s + self.convert_s, 1e-9) / 1e9

    def as_dict(self) -> dict:
        return {"push/bytes": self.bytes, "push/buckets": self.buckets, "push/gather_s": self.gather_s,
                "push/convert_s": self.convert_s, "push/send_s": self.send_s,
                "push/total_s": self.total_s, "push/gbps": self.gbps}


class WeightPusher:
    """Collective over all trainer ranks. Build once after the engine; call :meth:`push`."""

    def __init__(self, cfg, engine, servers: Optional[list[str]] = None):
        w = cfg.weights
        self.cfg, self.engine, self.ps = cfg, engine, engine.ps
        self.timeout_s, self.pause_mode = w.timeout_s, w.pause_mode
        self.version = 0
        self.dtype = None if w.dtype == "auto" else getattr(torch, w.dtype)
        self.resharder = Resharder(engine, bucket_bytes=w.bucket_mb * 2**20, dtype=self.dtype)
        self.servers = list(servers if servers is not None else cfg.rollout.servers)
        self.admin, self.transport = None, None
        self._connect()

    def _connect(self) -> None:
        """Admin client and transport for the current server list."""
        w, ps = self.cfg.weights, self.ps
        # rank 0 drives pause/continue; each stage source talks to the servers for its buckets
        needs_admin = ps.rank == 0 or (ps.is_pp_source and w.transport != "disk")
        self.admin = AdminRunner(self.servers, self.cfg.rollout.api_key or None, w.timeout_s) if needs_admin else None
        if w.transport == "distributed":
            backend = "nccl" if ps.device.type == "cuda" else "gloo"
            self.transport = DistributedTransport(self.admin, w.master_address, w.timeout_s, backend)
        elif w.transport == "tensor":
            self.transport = TensorTransport(self.admin, w.timeout_s, w.tensor_format)
        else:
            directory = w.disk_dir or f"{self.cfg.train.run_dir}/weights"
            self.transport = DiskTransport(self.admin, directory, w.keep_versions, w.timeout_s, self.dtype)
        self._ready = False

    def add_server(self, address: str) -> "PushMetrics":
        """A server that joins later gets the current weights before it receives work: the
        update groups are rebuilt to include it and the current version is pushed again (the
        other servers pause meanwhile). Collective; the caller admits the server to rollouts
        only after this returns."""
        self.close()
        self.servers.append(address)
        self._connect()
        return self.push(bump=False)

    def _agree(self, error: Optional[BaseException]) -> None:
        """Every rank learns whether any rank failed (no rank is left waiting in a barrier)."""
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=self.ps.device)
        dist.all_reduce(flag)
        if error is not None:
            raise error
        if int(flag.item()):
            raise PushError("weight push failed on another rank (see its log)")

    def _setup(self) -> None:
        for stage in range(self.ps.pp):  # stage by stage: groups form in a fixed order
            err = None
            if self.ps.pp_rank == stage and self.ps.is_pp_source:
                try:
                    self.transport.setup(stage)
                except Exception as e:  # noqa: BLE001
                    err = e
            self._agree(err)
        self._ready = True

    def push(self, bump: bool = True) -> PushMetrics:
        """Push the current weights as version ``self.version + 1`` (``bump=False``: re-push the
        current version, e.g. to a server that joined late). The protocol:

        1. rank 0: ``/pause_generation`` {mode: weights.pause_mode} on every server (abort returns
           in-flight requests with finish_reason abort; the rollout client resubmits them after
           step 7 with the tokens so far, stamping new tokens with the new version).
        2. rank 0: ``/flush_cache`` (cached prefixes were computed by the old weights).
        3. rank 0: ``/begin_weight_update``.
        4. stage by stage (pipeline rank 0, 1, ...): the stage's TP group gathers and converts
           its parameters into byte-capped buckets (Resharder); the stage source sends each one:
           distributed = announce names/dtypes/shapes over HTTP + broadcast the tensors over the
           stage's weight-update group; tensor = POST the bucket; disk = (after all stages) write
           the HF checkpoint atomically and POST ``/update_weights_from_disk``.
        5. rank 0: ``/update_weight_version`` {new_version} (servers flip version atomically).
        6. rank 0: ``/end_weight_update``.
        7. rank 0: ``/continue_generation``; ``self.version += 1``.

        Every HTTP call and broadcast has a deadline (``weights.timeout_s``). After each phase the
        ranks agree on success with one all-reduce, so a failure anywhere raises everywhere; the
        error names the step and the server. Servers are resumed even when the push fails.
        """
        t0 = time.perf_counter()
        new_version = str(self.version + int(bump))
        if not self._ready:
            self._setup()
        self._rank0(lambda c: c.pause(self.pause_mode), "pause_generation")
        try:
            self._rank0(lambda c: c.flush_cache(), "flush_cache")
            self._rank0(lambda c: c.begin_weight_update(), "begin_weight_update")
            send_s = self._send_stages(new_version)
            ts = time.perf_counter()
            err = None
            try:
                self.transport.finish(new_version, self.engine)
            except Exception as e:  # noqa: BLE001
                err = e
            self._agree(err)
            send_s += time.perf_counter() - ts
            self._rank0(lambda c: c._admin("/update_weight_version", {"new_version": new_version}),
                        "update_weight_version")
            self._rank0(lambda c: c.end_weight_update(), "end_weight_update")
        finally:
            self._resume()
        self.version = int(new_version)
        t = self.resharder.times
        nbytes = t.bytes
        if isinstance(self.transport, DiskTransport) and self.ps.rank == 0:
            nbytes = self.resharder.total_bytes()
        stats = torch.tensor([nbytes, t.buckets, t.gather_s, t.convert_s, send_s], dtype=torch.float64)
        dist.all_reduce(stats)  # sources hold the counts; times summed over stages
        b, n, g, c, s = stats.tolist()
        return PushMetrics(self.version, int(b), int(n), g, c, s, time.perf_counter() - t0)

    def _send_stages(self, version: str) -> float:
        send_s = 0.0
        for stage in range(self.ps.pp):
            err = None
            if self.ps.pp_rank == stage and not isinstance(self.transport, DiskTransport):
                for bucket in self.resharder.iter_buckets():
                    if err is not None:
                        continue  # keep gathering with the TP peers, send nothing
                    ts = time.perf_counter()
                    try:
                        self.transport.send(bucket, version)
                    except Exception as e:  # noqa: BLE001
                        err = e
                    send_s += time.perf_counter() - ts
            self._agree(err)
        return send_s

    def _rank0(self, fn, step: str) -> None:
        err = None
        if self.ps.rank == 0:
            try:
                self.admin.call(fn, self.timeout_s)
            except Exception as e:  # noqa: BLE001
                err = PushError(f"{step}: {e}")
        self._agree(err)

    def _resume(self) -> None:
        if self.ps.rank == 0:
            try:
                self.admin.call(lambda c: c.continue_generation(), self.timeout_s)
            except Exception as e:  # noqa: BLE001 - a dead server must not keep the others paused
                print(f"[weights] continue_generation: {e}", flush=True)

    def verify(self) -> dict[str, bool]:
        """Opt-in check that the servers hold what the trainer holds: for every HF tensor, the
        first 64 rows the server reports equal the trainer's. Collective; result on rank 0."""
        mismatches: list[str] = []
        for stage in range(self.ps.pp):
            if self.ps.pp_rank == stage:
                for bucket in self.resharder.iter_buckets():
                    for name, t in zip(bucket.names, bucket.tensors):
                        got = self.admin.call(lambda c: c.get_weights_by_name(name, 64), self.timeout_s)
                        want = t[:64].float()
                        for addr, values in got.items():
                            if not torch.equal(torch.tensor(values, dtype=torch.float32), want):
                                mismatches.append(f"{addr}:{name}")
            dist.barrier()
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, mismatches)
        return {m: False for ms in out for m in ms}

    def close(self) -> None:
        self.transport.close()
        if self.admin is not None:
            self.admin.close()
            self.admin = None

