"""The weight push: trainer shards -> rollout servers, one collective call per policy version.

Runs on the trainer ranks. The rollout side is a `megarl.weights.target.PushTarget`: in a run,
the trainer's `ManagerCluster`, which holds the policy version and forwards the protocol's HTTP
steps to the rollout manager (`WeightPusher.push_once` has the protocol). An asynchronous run
overlaps the push with the next update (``weights.overlap``, `megarl.weights.flight`); what a
push names and how it is checked live beside it (`megarl.weights.checksums`,
`megarl.weights.adapters`, the transports of `megarl.weights.transports`)."""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch
import torch.distributed as dist

from megarl.models.lora import merged_weight_names
from megarl.weights.adapters import AdapterDelivery, stage_adapter_bytes
from megarl.protocol.channel import ChannelError
from megarl.weights.checksums import Checksums, judge_mismatches
from megarl.weights.spec import PushMetrics, PushSpec
from megarl.weights.flight import Flight, Sender, stage_buckets
from megarl.weights.resharder import Resharder, ReshardTimes
from megarl.weights.target import PushTarget
from megarl.weights.factory import open_transport
from megarl.weights.transports import PushError


class WeightPusher:
    """Collective over all trainer ranks. Build once after the engine with the job's push target
    (`ManagerCluster`: the trainer's mirror of the server set and the policy-version counter);
    call :meth:`push`."""

    def __init__(self, spec: PushSpec, engine, cluster: PushTarget):
        w, wire = spec.weights, spec.wire
        self.spec, self.engine, self.ps, self.cluster = spec, engine, engine.ps, cluster
        self.timeout_s = w.timeout_s
        self.dtype = None if w.dtype == "auto" else getattr(torch, w.dtype)
        self.resharder = Resharder(engine, bucket_bytes=w.bucket_mb * 2**20, dtype=self.dtype)
        self.admin, self.transport = None, None  # transport: a `Transport`, made by _connect
        self._own_admin = False
        lora = getattr(engine.spec, "lora", None)
        # LoRA on megarl-server: the servers hold these base weights merged with the pushed
        # adapters (W0 + s B A), so their checksums are checked through the adapters' and the
        # scale's, not against W0
        merged = frozenset() if lora is None or wire.peft else merged_weight_names(engine.args, lora)
        self.checksums = Checksums(wire.verify_every, merged)
        # weights.delta: only a trainable engine's frozen rows are known not to change (a
        # forward-only engine has no optimizer to tell: its weights may be set by hand); not the
        # disk transport, which writes whole checkpoints
        # (shard refit sends every tensor: it has no buckets to leave out)
        self.delta = w.delta and getattr(engine, "optimizer", None) is not None and wire.streams_buckets
        self._frozen_sent: frozenset = frozenset()  # rows frozen at the last push that reached every server
        self._recording = False
        self.adapters = AdapterDelivery(spec.run_dir) if lora is not None and wire.peft else None
        self.resharder.adapters = self.adapters is None
        # weights.overlap: the flight's thread agrees over a group of its own (the trainer's groups
        # stay the trainer thread's), and the driver speaks to the manager over a link of its own
        self.overlap = wire.overlap and hasattr(cluster, "push_lane")
        self.flight_group = dist.new_group(backend="gloo") if self.overlap else None
        self.flight: Optional[Flight] = None
        self._mismatches: Optional[list] = None  # the last checked flight's differing tensors
        self.lane = None  # the driver's protocol steps: the cluster, or (overlap) its push lane
        self._connect()

    @property
    def version(self) -> int:
        return self.cluster.version

    @property
    def digests(self) -> dict:
        return self.checksums.digests

    def verify_due(self, version: int) -> bool:
        """Whether the push of ``version`` is checked (``weights.verify_interval``)."""
        return self.checksums.due(version)

    def _connect(self) -> None:
        """Transport for the cluster's current server list. The driver (rank 0) sends through the
        cluster's admin connection (overlapped: its push lane's); other pipeline-stage sources
        announce their own buckets."""
        wire, ps = self.spec.wire, self.ps
        self.lane = self.cluster  # the driver's steps (other ranks only name them)
        if self.cluster.driver:
            self.lane = self.cluster.push_lane() if self.overlap else self.cluster
            self.admin, self._own_admin = self.lane.admin, self.overlap
        elif ps.is_pp_source and wire.streams_buckets:  # disk: the export is collective, rank 0 announces
            self.admin = self.cluster.stage_admin(ps.rank)
            self._own_admin = True
        if self.checksums.merged and wire.tensor_format != "megarl":  # LoRA: only megarl-server merges adapters
            raise PushError("weights.tensor_format: lora.rank > 0 pushes adapters that only megarl-server "
                            f"merges; the servers resolved to {wire.tensor_format!r} (real SGLang?)")
        self.refit = wire.refit == "shard"
        self.transport = open_transport(wire, self.spec.weights, self.admin, self.engine, self.dtype,
                                        self.spec.run_dir)
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
        self._land_recovering()  # a failed flight: its version is pushed below with everyone's
        self._disconnect()
        self.cluster.add_server(address)
        self._connect()
        metrics = self.push(bump=False)
        if address in self.cluster.addresses:  # the push may have dropped it again
            self.cluster.admitted(address)
        return metrics

    def _recover(self, error: PushError, group=None) -> None:
        """After a failed push: the driver health-checks the servers; every rank drops the same
        dead or hung ones (rebuilding the update groups without them), or re-raises when all
        answer (the failure was not a server's). Collective; ``group``: a flight's own recovery
        (its group, and the manager through its push lane: the trainer is training meanwhile)."""
        steps = self.lane if group is not None else self.cluster
        dead = [steps.unhealthy() if self.cluster.driver else None]
        dist.broadcast_object_list(dead, src=0, group=group)
        if not dead[0]:
            raise error
        print(f"[weights] push failed ({error}); dropping {', '.join(dead[0])} and retrying", flush=True)
        self.transport.close()  # the update groups, left through this server set's connections
        for address in dead[0]:  # raises when fewer than min_live_servers remain
            self.cluster.remove_server(address, lane=self.lane) if group is not None else \
                self.cluster.remove_server(address)
        self._disconnect()
        self._connect()

    def _agree(self, error: Optional[BaseException], group=None) -> None:
        """Every rank learns whether any rank failed (no rank is left waiting in a barrier).
        ``group``: the flight's own (gloo, host memory), or the trainer's world."""
        device = "cpu" if group is not None else self.ps.device
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, group=group)
        if error is not None:  # always a PushError, so every rank takes the same recovery path
            raise error if isinstance(error, PushError) else PushError(f"{type(error).__name__}: {error}") from error
        if int(flag.item()):
            raise PushError("weight push failed on another rank (see its log)")

    def _setup(self, group=None) -> None:
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
            self._agree(err, group)
        self._ready = True

    def push(self, bump: bool = True) -> PushMetrics:
        """`push_once` (overlapped: `launch`), retried on the remaining servers when some died or
        hung (`_recover`); training goes on while ``rollout.min_live_servers`` are left. An
        overlapped push returns once its buckets are staged; the previous flight lands first."""
        while True:
            try:
                t0 = time.perf_counter()
                landed = self.land()
                if self.overlap and bump:
                    return self.launch(t0, landed)
                return self.push_once(bump)
            except PushError as e:
                if isinstance(e.__cause__, ChannelError):  # the manager gone or stopped: no recovery
                    raise e.__cause__ from None
                self._recover(e)

    def _begin(self, bump: bool) -> tuple[int, frozenset]:
        """A push's start on every rank: its version, the update groups, whether it records
        checksums, and the rows a delta push leaves out (frozen now and at the last push: the
        servers keep them)."""
        new_version = self.cluster.version + int(bump)
        if not self._ready:
            self._setup()
        self.checksums.digest_s = 0.0
        self._recording = self.checksums.due(new_version)
        frozen = self.resharder.agreed_frozen() if self.delta else frozenset()
        self._skip = frozen & self._frozen_sent
        return new_version, frozen

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
        error names the step and the server. An overlapped push (`launch`) runs step 2's gather
        and convert first, on the trainer's thread, and steps 1-3 on the flight's.
        """
        t0 = time.perf_counter()
        new_version, frozen = self._begin(bump)
        ok, pause_s, stream_s, adapter_nbytes = False, 0.0, 0.0, 0
        try:
            tp = time.perf_counter()
            self._driver(self.lane.pause_for_update, "pause_generation")  # settles the last push first
            pause_s = time.perf_counter() - tp
            ts = time.perf_counter()
            send_s = self._send_stages(str(new_version)) + self._finish_transport(new_version)
            if self.adapters is not None:
                adapter_nbytes = self.adapters.deliver(new_version, self.engine, self.dtype, self.cluster.driver,
                                                       self.admin, self._agree)
            stream_s = time.perf_counter() - ts
            ok = True
        finally:
            self._end(new_version, ok)
        self.cluster.commit(new_version)
        self._frozen_sent = frozen
        nbytes = self.resharder.times.bytes
        if not self.transport.streams_buckets and not self.refit and self.ps.rank == 0:
            nbytes = getattr(self.transport, "written", None) or self.resharder.total_bytes()
        adapter_nbytes = adapter_nbytes or stage_adapter_bytes(self.engine, self.transport.streams_buckets,
                                                                  self.resharder.serving_dtype)
        if self.adapters is not None:
            nbytes += adapter_nbytes
        return PushMetrics.summed(new_version, nbytes, self.resharder.times, send_s, self.checksums.digest_s,
                                  pause_s, stream_s, time.perf_counter() - t0, adapter_nbytes)

    def _finish_transport(self, version: int) -> float:
        """The transport's last step on every rank (disk: the collective export); its time."""
        tf = time.perf_counter()
        err = None
        try:
            self.transport.finish(str(version), self.engine)
        except Exception as e:  # noqa: BLE001
            err = e
        self._agree(err)
        return time.perf_counter() - tf

    def _end(self, version: int, ok: bool, group=None) -> None:
        """Step 3 (driver: publish ``version``, or after a failure only resume); every rank learns
        whether it was submitted (the caller commits: step 4)."""
        tail = None
        if self.cluster.driver:
            try:
                self.lane.end_push(version if ok else None)
            except Exception as e:  # noqa: BLE001 - agreed below, so every rank raises
                tail = PushError(f"update_weight_version: {e}")
        if ok:
            self._agree(tail, group)

    # ------------------------------------------------------------------ overlapped pushes
    def launch(self, t0: float, landed: Optional[PushMetrics]) -> PushMetrics:
        """An overlapped push (``weights.overlap``): this version taken here, before any server
        pauses - with one TP shard and no expert parallelism a copy of the parameters (the
        flight builds the buckets from it), else the buckets gathered, converted and copied on
        the trainer's thread and groups - the version committed on the trainer's side (its
        weights are that version; the servers' tokens carry it only once the flight publishes
        it), and the flight started: steps 1-3 of `push_once` on a thread of its own, which the
        trainer meets again at `land`. Returns the metrics of the flight that landed first
        (``landed``, if any) with this call's ``blocking_s``."""
        new_version, frozen = self._begin(True)
        if self.resharder.local_only:  # nothing to gather: the flight converts the copy
            snapshot = self.resharder.snapshot(frozen) if self.ps.is_pp_source else None
            staged, times = None, None
        else:
            snapshot = None
            staged, times = stage_buckets(self.resharder, self._skip, self.ps, self._agree)
        self.cluster.commit(new_version)
        self.flight = Flight(self._fly, new_version, frozen, self._skip, snapshot, staged, times, self._recording)
        blocking_s = time.perf_counter() - t0
        return PushMetrics.waited(blocking_s) if landed is None else dataclasses.replace(landed, blocking_s=blocking_s)

    def _fly(self, version: int, skip: frozenset, snapshot: Optional[list], staged: Optional[list],
             times: Optional[ReshardTimes], recording: bool) -> PushMetrics:
        """The flight's thread, on every rank: `_fly_once`, and after a failure the push's own
        recovery right here (`_recover` over the flight's group: dead servers dropped, update
        groups rebuilt, the version sent again) - the trainer may be waiting for a batch that
        needs the rollout side whole again. A failure no server is to blame for lands with the
        flight."""
        waited = False
        while True:
            try:
                return self._fly_once(version, skip, snapshot, staged, times, recording)
            except PushError as e:
                if isinstance(e.__cause__, ChannelError):  # the manager gone or stopped: the trainer sees it too
                    raise
                if staged is not None and skip:  # the staged copy lacks rows a new server set needs
                    self._give_up(e)
                try:
                    self._recover(e, self.flight_group)
                except PushError:
                    if waited:
                        self._give_up(e)
                    # every server answers /health: one caught in the failed transfer (a broadcast a
                    # hung peer never relayed) answers its other calls once its receive times out
                    waited = True
                    time.sleep(self.timeout_s)
                    self._disconnect()
                    self._connect()
                skip = frozenset()  # a new server set gets every tensor
                self._setup(self.flight_group)

    def _give_up(self, error: PushError) -> None:
        """A flight that cannot recover: the step the trainer waits for fails with its error at once
        (not after train.stall_timeout_s, waiting on servers that never resume); it lands too."""
        if self.cluster.driver:
            try:
                self.lane.fail(str(error))
            except Exception as e:  # noqa: BLE001 - the flight's own error is the one raised
                print(f"[weights] could not fail the waiting step: {e}", flush=True)
        raise error

    def _fly_once(self, version: int, skip: frozenset, snapshot: Optional[list], staged: Optional[list],
                  times: Optional[ReshardTimes], recording: bool) -> PushMetrics:
        """Pause, send the buckets (staged, or built from the snapshot as they go) stage by stage,
        publish and wait until the servers hold ``version`` (so that a landed flight is a version
        every server serves), then the checksums when due. Every agreement is over the flight's
        own group."""
        g = self.flight_group
        t0 = time.perf_counter()
        ok, pause_s, send_s, stream_s = False, 0.0, 0.0, 0.0
        buckets = staged if staged is not None else (self.resharder.iter_buckets(skip, snapshot)
                                                     if snapshot is not None else [])
        try:
            self._driver(self.lane.pause_for_update, "pause_generation", g)
            pause_s = time.perf_counter() - t0
            ts = time.perf_counter()
            send_s = self._send_staged(buckets, str(version), recording, g)
            stream_s = time.perf_counter() - ts
            ok = True
        finally:
            self._end(version, ok, g)
        self._driver(self.lane.settle, "update_weight_version", g)
        bad = (self.checksums.verify(self.checksums.digests, self.cluster.driver, self.admin, self.timeout_s, g)
               if recording else None)
        times = times or (self.resharder.times if snapshot is not None else ReshardTimes())
        adapters = stage_adapter_bytes(self.engine, True, self.resharder.serving_dtype)  # LoRA: in the buckets
        metrics = PushMetrics.summed(version, times.bytes, times, send_s, self.checksums.digest_s, pause_s, stream_s,
                                     time.perf_counter() - t0, adapters, group=g)
        metrics.verify_mismatches = None if bad is None else len(bad)
        self._mismatches = bad
        return metrics

    def _send_staged(self, staged: list, version: str, recording: bool, group) -> float:
        """Step 2 of a flight: the stage source sends its staged buckets, stage by stage."""
        send_s = 0.0
        for stage in range(self.ps.pp):
            err = None
            if self.ps.pp_rank == stage:
                try:
                    for bucket in staged:
                        ts = time.perf_counter()
                        self.transport.send(bucket, version)
                        send_s += time.perf_counter() - ts
                        (self.checksums.record if recording else self.checksums.forget)(bucket)
                except Exception as e:  # noqa: BLE001 - agreed below
                    err = e
            self._agree(err, group)
        return send_s

    def land_or_repush(self) -> Optional[PushMetrics]:
        """`land`; a flight that failed is recovered from (its dead servers dropped) and its
        version pushed again, synchronously - the caller (the last step, an evaluating one) made
        no update since it launched. The metrics of what landed."""
        try:
            return self.land()
        except PushError as e:
            self._recover(e)
            return self.push(bump=False)

    def _land_recovering(self) -> None:
        try:
            self.land()
        except PushError as e:
            self._recover(e)

    def land(self) -> Optional[PushMetrics]:
        """Wait for the flight in the air, if any, and take its outcome on every rank: its
        metrics (``overlapped_s``: its time that ran beside the trainer's work), or its error -
        a `PushError` that `push` recovers from as from a synchronous push's. A checked flight's
        differing checksums are judged here (``weights.verify_mode``)."""
        if self.flight is None:
            return None
        flight, self.flight = self.flight, None
        tw = time.perf_counter()
        metrics = flight.result(4 * self.timeout_s + 60.0)
        metrics.overlapped_s = max(0.0, metrics.total_s - (time.perf_counter() - tw))
        self._frozen_sent = flight.frozen
        if self._mismatches:
            judge_mismatches(self._mismatches, self.spec.weights.verify_mode, metrics.version, self.ps.rank)
        return metrics

    # ------------------------------------------------------------------ the synchronous path
    def _send_stages(self, version: str) -> float:
        """Step 2, pipelined: this thread gathers/converts bucket k+1 while a sender thread
        announces and broadcasts bucket k (and hashes it, when recording). A slot is taken before
        each bucket is built and freed once it is sent, so at most `PIPELINE_DEPTH` buckets are
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
                sender = Sender(self.transport, version,
                                 self.checksums.record if self._recording else None, self.checksums.forget)
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

    def _driver(self, fn, step: str, group=None) -> None:
        """``fn()`` on the driver rank; every rank learns whether it failed."""
        err = None
        if self.cluster.driver:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                err = PushError(f"{step}: {e}")
                err.__cause__ = e
        self._agree(err, group)

    def verify(self) -> list[str]:
        """Checks that the servers hold exactly what the last push sent (`Checksums.verify`; the
        disk transport and shard refit, which never see buckets, hash the tensors again here).
        Collective; returns ``["addr:name", ...]`` on every rank."""
        self.land()
        local = (self.checksums.digests if self.transport.streams_buckets
                 else self.checksums.gather(self.resharder, self.ps))
        return self.checksums.verify(local, self.cluster.driver, self.admin, self.timeout_s)

    def close(self) -> None:
        if self.flight is not None:  # a run ending on an error: the flight is not waited for long
            flight, self.flight = self.flight, None
            try:
                flight.result(5.0)
            except Exception as e:  # noqa: BLE001
                print(f"[weights] the last overlapped push did not land: {e}", flush=True)
        self._disconnect()

    def _disconnect(self) -> None:
        """The update groups left and the driver's own connections closed (`_connect` makes new)."""
        self.transport.close()
        if self._own_admin and self.admin is not None:
            self.admin.close()
        self.admin = None
