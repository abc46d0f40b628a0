"""The weight push: trainer shards -> rollout servers, one collective call per policy version.

Runs on the trainer ranks. The rollout side is a `megarl.weights.target.PushTarget`: in a run,
the trainer's `ManagerCluster`, which holds the policy version and forwards the protocol's HTTP
steps to the rollout manager (`push_once` below has the protocol)."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

from megarl.config import WeightSyncConfig

import torch
import torch.distributed as dist

from megarl.models.lora import adapter_bytes, merged_weight_names, stage_layers
from megarl.protocol.channel import ManagerStalled
from megarl.weights.resharder import Resharder, ReshardTimes
from megarl.weights.target import PushTarget
from megarl.weights.transports import (DiskTransport, DistributedTransport, PushError,
                                       SharedMemoryTransport, TensorTransport)
from megarl.protocol.wire import tensor_digest

log = logging.getLogger("megarl.push")


@dataclass(frozen=True)
class PushSpec:
    """What a `WeightPusher` is built from: the weights section and the run directory (the disk
    transport's default directory is <run_dir>/weights)."""

    weights: WeightSyncConfig
    run_dir: str
    colocated: bool = False  # rollout.placement: the servers share the trainer's devices

    @classmethod
    def from_config(cls, cfg) -> "PushSpec":
        return cls(cfg.weights, cfg.train.run_dir, cfg.rollout.placement == "colocated")

    @property
    def streams_buckets(self) -> bool:
        """Buckets go over the wire (the transport's own ``streams_buckets``, known before it is
        built): not the disk transport, which writes whole checkpoints through the engine's export,
        nor shard refit, where each TP rank sends its own slices without buckets."""
        return self.weights.transport != "disk" and self.weights.refit != "shard"


@dataclass
class PushMetrics:
    version: int
    bytes: int
    buckets: int
    gather_s: float
    convert_s: float
    send_s: float
    total_s: float
    pause_s: float = 0.0  # the driver's wait for the servers to pause (step 1)
    digest_s: float = 0.0  # checksums of the sent tensors (pushes that weights.verify_interval checks)
    # wall time of step 2 (+ the transport's finish): gather/convert on the caller's thread overlap
    # the sender thread's send_s and digest_s, so the four sum to more than this
    stream_s: float = 0.0
    adapter_bytes: int = 0  # LoRA: the adapters' bytes in the serving dtype (+ the 4-byte scale), all stages

    @property
    def fixed_s(self) -> float:
        """The protocol's share of the trainer's push time: everything but streaming the bytes
        (pause, the tail when it is awaited, agreement all-reduces)."""
        return max(0.0, self.total_s - self.stream_s)

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.stream_s, 1e-9) / 1e9

    def as_dict(self) -> dict:
        return {"push/bytes": self.bytes, "push/buckets": self.buckets, "push/gather_s": self.gather_s,
                "push/convert_s": self.convert_s, "push/send_s": self.send_s,
                "push/total_s": self.total_s, "push/gbps": self.gbps, "push/pause_s": self.pause_s,
                "push/fixed_s": self.fixed_s, "push/digest_s": self.digest_s,
                "push/stream_s": self.stream_s,
                **({"push/adapter_bytes": self.adapter_bytes} if self.adapter_bytes else {})}


def _resolved(tensor_format: str) -> str:
    if tensor_format == "auto":  # guessing here is what once sent megarl's wire to real SGLang
        raise PushError("weights.tensor_format: auto was not resolved against the servers "
                        "(megarl.config.server_wire.resolve_wire, run by megarl-train's preflight)")
    return tensor_format


class WeightPusher:
    """Collective over all trainer ranks. Build once after the engine with the job's push target
    (`ManagerCluster`: the trainer's mirror of the server set and the policy-version counter);
    call :meth:`push`."""

    def __init__(self, spec: PushSpec, engine, cluster: PushTarget):
        w = spec.weights
        self.spec, self.engine, self.ps, self.cluster = spec, engine, engine.ps, cluster
        self.timeout_s = w.timeout_s
        self.dtype = None if w.dtype == "auto" else getattr(torch, w.dtype)
        self.resharder = Resharder(engine, bucket_bytes=w.bucket_mb * 2**20, dtype=self.dtype)
        self.admin, self.transport = None, None  # transport: a `Transport`, made by _connect
        self._own_admin = False
        self.verify_every = w.verify_every
        # {name: (dtype, sha256)} of what this rank sent, kept across pushes (a delta push's
        # skipped tensors keep the digest of the push that last sent them)
        self.digests: dict[str, tuple[str, str]] = {}
        # weights.delta: only a trainable engine's frozen rows are known not to change (a
        # forward-only engine has no optimizer to tell: its weights may be set by hand); not the
        # disk transport, which writes whole checkpoints
        # (shard refit sends every tensor: it has no buckets to leave out)
        self.delta = w.delta and getattr(engine, "optimizer", None) is not None and spec.streams_buckets
        self._frozen_sent: frozenset = frozenset()  # rows frozen at the last push that reached every server
        self.digest_s, self._recording = 0.0, False
        lora = getattr(engine.spec, "lora", None)
        # LoRA on SGLang: every push writes the adapters as a PEFT directory that each server loads
        # (/load_lora_adapter) under the version's name; the buckets carry the base rows only
        self._peft_dir = f"{spec.run_dir}/lora_adapters" if lora is not None and w.tensor_format == "sglang" else None
        self._loaded: list[int] = []  # driver: the versions whose adapters the servers hold
        self.resharder.adapters = self._peft_dir is None
        # LoRA on megarl-server: the servers hold these base weights merged with the pushed
        # adapters (W0 + s B A), so their checksums are checked through the adapters' and the
        # scale's, not against W0
        self._merged = frozenset() if lora is None or self._peft_dir else merged_weight_names(engine.args, lora)
        self._connect()

    @property
    def version(self) -> int:
        return self.cluster.version

    def _connect(self) -> None:
        """Transport for the cluster's current server list. The driver (rank 0) sends through the
        cluster's admin connection; other pipeline-stage sources announce their own buckets."""
        w, ps = self.spec.weights, self.ps
        if self.cluster.driver:
            self.admin, self._own_admin = self.cluster.admin, False
        elif ps.is_pp_source and self.spec.streams_buckets:  # disk: the export is collective, rank 0 announces
            self.admin = self.cluster.stage_admin(ps.rank)
            self._own_admin = True
        if self._merged and w.tensor_format != "megarl":  # LoRA: only megarl-server merges pushed adapters
            raise PushError("weights.tensor_format: lora.rank > 0 pushes adapters that only megarl-server "
                            f"merges; the servers resolved to {w.tensor_format!r} (real SGLang?)")
        self.refit = w.refit == "shard"
        if self.refit:  # every trainer TP rank sends its own slices (megarl.weights.shard_push)
            from megarl.weights.shard_push import ShardRefitTransport

            backend = "nccl" if ps.device.type == "cuda" else "gloo"
            self.transport = ShardRefitTransport(self.admin, self.engine, w.master_address, w.timeout_s,
                                                 backend, self.dtype)
        elif w.transport == "distributed":
            backend = "nccl" if ps.device.type == "cuda" else "gloo"
            self.transport = DistributedTransport(self.admin, w.master_address, w.timeout_s, backend,
                                                  wire=_resolved(w.tensor_format))
        elif w.transport == "tensor":
            wire = _resolved(w.tensor_format)
            if wire == "sglang" and self.spec.colocated and ps.device.type == "cuda":
                wire = "sglang_ipc"  # SGLang on the trainer's GPU: hand over memory, not bytes
            self.transport = TensorTransport(self.admin, w.timeout_s, wire)
        elif w.transport == "shm":
            self.transport = SharedMemoryTransport(self.admin, w.timeout_s)
        else:
            directory = w.disk_dir or f"{self.spec.run_dir}/weights"
            if w.disk_delta != "off":  # records against the last push
                from megarl.weights.disk_delta import DiskDeltaTransport

                self.transport = DiskDeltaTransport(self.admin, directory, w.keep_versions, w.timeout_s,
                                                    self.dtype, w.disk_delta == "xor")
            else:
                self.transport = DiskTransport(self.admin, directory, w.keep_versions, w.timeout_s, self.dtype)
        self._ready = False
        self._frozen_sent = frozenset()  # a new server set (or a retry) gets every tensor

    def forget_sent(self) -> None:
        """The servers' weights were released (colocated placement, a weights wake): the next push
        sends every tensor, frozen rows too."""
        self._frozen_sent = frozenset()

    def add_server(self, address: str) -> "PushMetrics":
        """A server that (re)joins gets the current weights before it receives work: the update
        groups are rebuilt to include it, the current version is pushed again (the other
        servers pause meanwhile), and only then does the cluster hand it rollouts. Collective."""
        self.close()
        self.cluster.add_server(address)
        self._connect()
        metrics = self.push(bump=False)
        if address in self.cluster.addresses:  # the push may have dropped it again
            self.cluster.admitted(address)
        return metrics

    def _recover(self, error: PushError) -> None:
        """After a failed push: the driver health-checks the servers; every rank drops the same
        dead or hung ones (rebuilding the update groups without them), or re-raises when all
        answer (the failure was not a server's). Collective."""
        dead = [self.cluster.unhealthy() if self.cluster.driver else None]
        dist.broadcast_object_list(dead, src=0)
        if not dead[0]:
            raise error
        print(f"[weights] push failed ({error}); dropping {', '.join(dead[0])} and retrying", flush=True)
        self.close()
        for address in dead[0]:
            self.cluster.remove_server(address)  # raises when fewer than min_live_servers remain
        self._connect()

    def _agree(self, error: Optional[BaseException]) -> None:
        """Every rank learns whether any rank failed (no rank is left waiting in a barrier)."""
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=self.ps.device)
        dist.all_reduce(flag)
        if error is not None:  # always a PushError, so every rank takes the same recovery path
            raise error if isinstance(error, PushError) else PushError(f"{type(error).__name__}: {error}") from error
        if int(flag.item()):
            raise PushError("weight push failed on another rank (see its log)")

    def _setup(self) -> None:
        if self.refit:  # one group: DP rank 0's TP ranks and every server TP rank
            err = None
            try:
                self.transport.setup()
            except Exception as e:  # noqa: BLE001
                err = e
            self._agree(err)
            self._ready = True
            return
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
        """`push_once`, retried on the remaining servers when some died or hung (`_recover`);
        training goes on while ``rollout.min_live_servers`` are left."""
        while True:
            try:
                return self.push_once(bump)
            except PushError as e:
                self._recover(e)

    def push_once(self, bump: bool = True) -> PushMetrics:
        """Push the current weights as version ``cluster.version + 1`` (``bump=False``: re-push
        the current version, e.g. to a server that joined late). The protocol, run once:

        1. driver: the tail of the previous push must have succeeded (``settle``); the cluster
           closes its listeners' gates (aborted requests wait in the client), then
           ``/pause_generation`` {mode: weights.pause_mode} on every server (abort returns
           in-flight requests with finish_reason abort; the client resubmits them after step 5
           with the tokens so far, stamping new tokens with the new version),
           ``/flush_cache`` (cached prefixes were computed by the old weights) and
           ``/begin_weight_update``.
        2. stage by stage (pipeline rank 0, 1, ...): the stage's TP group gathers and converts
           its parameters into byte-capped buckets (Resharder), leaving out rows frozen since the
           last push (``weights.delta``); the stage source's sender thread sends bucket k while
           bucket k+1 is built (at most 2 alive): distributed = announce names/dtypes/shapes over
           HTTP + broadcast the tensors over the stage's weight-update group (megarl-server: large
           tensors one by one straight into its parameters, small ones packed, one wait per
           bucket); tensor = POST the bucket; disk = (after all stages) write the HF checkpoint
           atomically and POST ``/update_weights_from_disk``. With
           ``weights.refit: shard`` there are no buckets: every TP rank of DP rank 0 sends its own
           slices point to point to the server TP ranks that hold them (`shard_push`).
        3. driver, ``cluster.end_push``: once every bucket is loaded, ``/update_weight_version``
           {new_version} (servers flip version atomically), ``/end_weight_update``, the version
           committed on the rollout side (the staleness window moves), then - also after a
           failure - ``/continue_generation`` and the gates open. Through the rollout manager
           this step is submitted and not awaited: the next update starts while the servers
           finish; its errors surface at the next push's step 1.
        4. every rank: ``cluster.commit(new_version)`` (the trainer's version counter advances).

        Every HTTP call and broadcast has a deadline (``weights.timeout_s``). After each phase the
        ranks agree on success with one all-reduce, so a failure anywhere raises everywhere; the
        error names the step and the server.
        """
        t0 = time.perf_counter()
        new_version = self.cluster.version + int(bump)
        if not self._ready:
            self._setup()
        self.digest_s = 0.0
        self._recording = self.verify_due(new_version)
        frozen = self._frozen_now() if self.delta else frozenset()
        # a row frozen now and at the last push has not changed since: the servers keep it
        self._skip = frozen & self._frozen_sent
        ok, pause_s, stream_s, adapter_nbytes = False, 0.0, 0.0, 0
        try:
            tp = time.perf_counter()
            self._driver(self.cluster.pause_for_update, "pause_generation")  # settles the last push first
            pause_s = time.perf_counter() - tp
            ts = time.perf_counter()
            send_s = self._send_stages(str(new_version))
            tf = time.perf_counter()
            err = None
            try:
                self.transport.finish(str(new_version), self.engine)
            except Exception as e:  # noqa: BLE001
                err = e
            self._agree(err)
            if self._peft_dir is not None:
                adapter_nbytes = self._load_adapter(new_version)
            send_s += time.perf_counter() - tf
            stream_s = time.perf_counter() - ts
            ok = True
        finally:
            tail = None
            if self.cluster.driver:
                try:
                    self.cluster.end_push(new_version if ok else None)
                except Exception as e:  # noqa: BLE001 - agreed below, so every rank raises
                    tail = PushError(f"update_weight_version: {e}")
        if ok:
            self._agree(tail)
            self.cluster.commit(new_version)
            self._frozen_sent = frozen
        t = self.resharder.times
        nbytes = t.bytes
        if not self.transport.streams_buckets and not self.refit and self.ps.rank == 0:
            nbytes = getattr(self.transport, "written", None) or self.resharder.total_bytes()
        adapter_nbytes = adapter_nbytes or self._adapter_bytes()
        stats = torch.tensor([nbytes + (adapter_nbytes if self._peft_dir else 0), t.buckets, t.gather_s,
                              t.convert_s, send_s, self.digest_s, adapter_nbytes], dtype=torch.float64)
        dist.all_reduce(stats)  # sources hold the counts; times summed over stages
        b, n, g, c, s, h, a = stats.tolist()
        return PushMetrics(new_version, int(b), int(n), g, c, s, time.perf_counter() - t0, pause_s, h, stream_s,
                           int(a))

    def _load_adapter(self, version: int) -> int:
        """LoRA on SGLang, after the base rows: the adapters as a PEFT directory
        ``<run_dir>/lora_adapters/v<version>`` (collective; global rank 0 writes it, so the servers
        must see the trainer's run directory: local servers, or a shared filesystem), loaded by
        every server as `policy_adapter` (version) - the name the rollout manager's requests carry
        once the push is published. The previous version's adapter is unloaded and its directory
        removed: the pause (weights.pause_mode abort) returned every request that used it. A
        re-push of the same version (a server rejoined) unloads and loads it again everywhere.
        Returns the adapters' bytes on rank 0 (0 elsewhere)."""
        import os
        import shutil

        from megarl.models.lora import export_peft
        from megarl.protocol.wire import policy_adapter

        path = os.path.join(self._peft_dir, f"v{version}")
        nbytes = export_peft(self.engine.chunks, self.engine.args, self.ps, self.engine.spec.lora, path,
                             dtype=self.dtype)
        err = None
        if self.cluster.driver:
            try:
                if version in self._loaded:  # a re-push: a rejoined server lacks it, the others hold it
                    try:
                        self.admin.call(lambda c: c.unload_lora_adapter(policy_adapter(version)))
                    except Exception as e:  # noqa: BLE001 - the servers that do not hold it say so
                        log.info("re-push of %s: %s", policy_adapter(version), e)
                self.admin.call(lambda c: c.load_lora_adapter(policy_adapter(version), os.path.abspath(path)))
                for old in [v for v in self._loaded if v != version]:
                    self.admin.call(lambda c: c.unload_lora_adapter(policy_adapter(old)))
                    shutil.rmtree(os.path.join(self._peft_dir, f"v{old}"), ignore_errors=True)
                self._loaded = [version]
            except Exception as e:  # noqa: BLE001 - agreed below, so every rank raises
                err = PushError(f"/load_lora_adapter {policy_adapter(version)}: {e}")
        self._agree(err)
        return nbytes

    def _adapter_bytes(self) -> int:
        """LoRA: this stage's adapters in the serving dtype, from their shapes (stage sources only)."""
        lora = getattr(self.engine.spec, "lora", None)
        if lora is None or not self.ps.is_pp_source or not self.transport.streams_buckets:
            return 0
        return adapter_bytes(self.engine.args, lora.target_modules, lora.rank, stage_layers(self.engine.chunks),
                             self.resharder.serving_dtype)

    def _send_stages(self, version: str) -> float:
        """Step 2, pipelined: this thread gathers/converts bucket k+1 while a sender thread
        announces and broadcasts bucket k (and hashes it, when recording). A slot is taken before
        each bucket is built and freed once it is sent, so at most ``PIPELINE_DEPTH`` buckets are
        alive. Returns the sender's busy time."""
        send_s = 0.0
        if self.refit:  # no buckets: each TP rank sends its own slices (megarl.weights.shard_push)
            err = None
            try:
                send_s = self.transport.push(version)
            except Exception as e:  # noqa: BLE001
                err = e
            self.resharder.times = ReshardTimes(bytes=self.transport.bytes, buckets=int(self.ps.tp_rank == 0
                                                                                      and self.ps.first_replica))
            self._agree(err)
            return send_s
        for stage in range(self.ps.pp):
            err = None
            if self.ps.pp_rank == stage and self.transport.streams_buckets:
                sender = _Sender(self.transport, version, self._record if self._recording else None,
                                 self._forget)
                try:
                    buckets = self.resharder.iter_buckets(self._skip)
                    while True:
                        sender.slots.acquire()  # blocks while PIPELINE_DEPTH buckets are alive
                        bucket = next(buckets, None)
                        if bucket is None:
                            sender.slots.release()
                            break
                        sender.submit(bucket)  # after a failure it only frees the slot: the TP
                        # peers still gather with us, so the walk goes on to its end
                except Exception as e:  # noqa: BLE001 - agreed below
                    err = e
                finally:
                    sender.close()
                err = err or sender.error
                send_s += sender.busy_s
            self._agree(err)
        return send_s
    def _frozen_now(self) -> frozenset:
        """Rows frozen on every rank that holds a shard of them (one all-gather of small dicts per
        push), so every rank skips the same gathers even if freezing was not symmetric."""
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, self.resharder.frozen_rows())
        verdict: dict[str, bool] = {}
        for part in parts:
            for name, frozen in part.items():
                verdict[name] = verdict.get(name, True) and frozen
        return frozenset(n for n, f in verdict.items() if f)

    def _driver(self, fn, step: str) -> None:
        """``fn()`` on the driver rank; every rank learns whether it failed."""
        err = None
        if self.cluster.driver:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                err = PushError(f"{step}: {e}")
        self._agree(err)

    def verify(self) -> list[str]:
        """Checks that the servers hold exactly what the last push sent, without reading tensors
        back: the trainer's sha256 of every pushed tensor (recorded from the buckets as they were
        sent; the disk transport gathers them again here) against the checksums the servers
        compute of what they hold, in the pushed dtype (megarl-server's ``/weights_checksum``).
        One HTTP call per server, from the driver. Collective; returns ``["addr:name", ...]``, one
        entry per differing tensor and server, on every rank; raises `PushError` when a server
        cannot answer (real SGLang has no such endpoint)."""
        # disk and shard refit never see buckets: hash the tensors again here
        local = self.digests if self.transport.streams_buckets else self._gather_digests()
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        want = {name: d for part in parts for name, d in part.items()}
        if not want:  # same on every rank
            raise PushError("weights.verify_interval: verify() needs a push that recorded checksums "
                            "(one whose version verify_due)")
        box: list = [None]
        if self.cluster.driver:
            try:
                box = [("ok", self._compare(want))]
            except ManagerStalled as e:  # the manager, not the endpoint: its own line on every rank
                box = [("stalled", str(e))]
            except Exception as e:  # noqa: BLE001 - every rank raises the same error below
                box = [("error", f"{type(e).__name__}: {e}")]
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "stalled":
            raise ManagerStalled(value)
        if kind == "error":
            raise PushError(f"weights.verify_interval: /weights_checksum failed ({value}); a server "
                            "without it (real SGLang) needs weights.verify_interval=0")
        return value

    def _compare(self, want: dict[str, tuple[str, str]]) -> list[str]:
        """Driver: the servers' checksums of every name in ``want`` ({name: (dtype, hex)})."""
        names = sorted(want)
        dtypes = [want[n][0] for n in names]
        got = self.admin.call(lambda c: c.weights_checksum(names, dtypes), self.timeout_s)
        return [f"{addr}:{n}" for addr in sorted(got) for n in names if got[addr].get(n) != want[n][1]]

    def verify_due(self, version: int) -> bool:
        """Whether the push of ``version`` is checked (``weights.verify_interval``)."""
        return bool(self.verify_every) and version % self.verify_every == 0

    def _record(self, bucket) -> None:
        """Checksums of a bucket once it is sent (stage sources, pushes that `verify_due`; runs on
        the sender thread, which alone writes ``digests`` during step 2)."""
        t0 = time.perf_counter()
        for name, dtype, t in zip(bucket.names, bucket.dtypes, bucket.tensors):
            if name not in self._merged:
                self.digests[name] = (dtype, tensor_digest(t.cpu()))
        self.digest_s += time.perf_counter() - t0

    def _forget(self, bucket) -> None:
        """A push that does not record: the digests of what it sent are stale, drop them (a later
        delta push that skips those tensors leaves them unchecked rather than falsely differing)."""
        for name in bucket.names:
            self.digests.pop(name, None)

    def _gather_digests(self) -> dict[str, tuple[str, str]]:
        """The checksums of every tensor the resharder yields (stage by stage; TP peers gather
        with their source, which hashes). For the disk transport, whose push never sees buckets."""
        out: dict[str, tuple[str, str]] = {}
        for stage in range(self.ps.pp):
            if self.ps.pp_rank == stage:
                for bucket in self.resharder.iter_buckets():
                    if self.ps.is_pp_source:
                        out.update((n, (d, tensor_digest(t.cpu())))
                                   for n, d, t in zip(bucket.names, bucket.dtypes, bucket.tensors))
            dist.barrier()
        return out

    def close(self) -> None:
        self.transport.close()
        if self._own_admin and self.admin is not None:
            self.admin.close()
        self.admin = None



# Buckets alive at once during step 2: the one on the wire and the one being built. A third would
# only help if building a bucket took longer than sending it, at one more bucket of memory.
PIPELINE_DEPTH = 2


class _Sender:
    """One background thread that sends buckets in submission order (the servers receive
    announces in that order: one HTTP call at a time per server). Collectives on the weight-update
    group run only here, on the TP group only on the caller's thread, so they never interleave."""

    def __init__(self, transport, version: str, record: Optional[Callable] = None,
                 forget: Optional[Callable] = None):
        self.transport, self.version, self.record, self.forget = transport, version, record, forget
        self.slots = threading.Semaphore(PIPELINE_DEPTH)
        self.error: Optional[BaseException] = None
        self.busy_s = 0.0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="megarl-push")

    def submit(self, bucket) -> None:
        self._pool.submit(self._run, bucket)

    def _run(self, bucket) -> None:
        try:
            if self.error is None:  # after a failure: skip, the caller reports the first error
                ts = time.perf_counter()
                try:
                    self.transport.send(bucket, self.version)
                finally:
                    self.busy_s += time.perf_counter() - ts
                if self.record is not None:
                    self.record(bucket)
                elif self.forget is not None:
                    self.forget(bucket)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's agreement step
            self.error = e
        finally:
            self.slots.release()  # the bucket's tensors are dropped with this frame

    def close(self) -> None:
        self._pool.shutdown(wait=True)
