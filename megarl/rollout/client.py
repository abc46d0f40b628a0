"""Asyncio generation client for a cluster of SGLang-protocol rollout servers (real SGLang or
megarl-server). Generation only: admin calls (pause, weight updates, ...) are `AdminClient`'s
(admin.py), driven once per push by the manager's `RolloutCluster` (cluster.py). Runs in the
rollout manager's process, on the controller's event loop.

Generation: `await client.agenerate(ModelRequest) -> ModelResponse`.

    agenerate: while budget left:
        wait until the gate is open (closed by `hold()` while the weights change)
        POST /generate {input_ids: prompt + out_so_far, max_new_tokens: remaining}   (segment)
            -> to the request's previous server when alive (prefix cache), else least in-flight;
               connection errors / timeouts / 5xx: exponential back-off, next server
        append tokens, logprobs and per-token versions
        finish_reason stop|length -> done; abort -> resubmit (weight update), unless this client
        aborted the request or too many aborts in a row brought no token

    agenerate_n (a group): the n first segments in one batched POST /generate (lists of
    input_ids, sampling_params and rids), then each sample on its own as above if interrupted

Versions: each token gets the version the server reports for it - ``meta_info.weight_versions``
as SGLang's spans ``[{"version", "start", "end"}]`` or megarl-server's per-token list, else the
segment's ``meta_info.weight_version`` - parsed as an int; a non-numeric version maps to the
current policy version (``version_fn()``: the manager's cluster, which follows the trainer's).

MoE routing: a client made with ``routed_experts=(num_hidden_layers, num_experts_per_tok)`` asks
every segment for it (``return_routed_experts: true``) and returns it decoded and stitched across
segments in `ModelResponse.routed_experts` (`megarl.protocol.wire.RoutedExperts`: ids, and the weights
when the server sends them - megarl-server does, SGLang does not).

LoRA on SGLang: a client made with ``lora_adapters=True`` sends every segment with
``lora_path: megarl-policy-v<version>`` (`megarl.protocol.wire.policy_adapter`), the adapter the
trainer's push loaded for the current version (a push aborts running segments; they resume on the
new adapter).

Health: a server is marked dead after `dead_after` consecutive failures; a background probe
re-admits it when ``/health`` answers 200 and (given ``version_fn``) its ``weight_version``
equals the current policy version, so a server that missed an update never serves.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Callable, Optional

import numpy as np
from megarl.rollout.http import (AdminError, HttpClient, RolloutError, Server, ServerRequestError,
                                 Transient, backoff_delay, normalize_address)
from megarl.protocol.types import ModelRequest, ModelResponse, RoutedExperts, SamplingParams
from megarl.protocol.wire import policy_adapter

__all__ = ["RolloutClient", "RolloutError", "ServerRequestError", "AdminError"]

log = logging.getLogger("megarl.rollout.client")


class RolloutClient(HttpClient):
    """See module docstring. Use from one event loop; `close()` (or `async with`) when done."""

    def __init__(
        self,
        addresses: list[str],
        api_key: Optional[str] = None,
        *,
        version_fn: Optional[Callable[[], int]] = None,
        connect_timeout: float = 5.0,
        request_timeout: float = 3600.0,
        probe_timeout: float = 60.0,
        max_retries: int = 8,
        backoff_base: float = 0.05,
        backoff_max: float = 5.0,
        dead_after: int = 3,
        health_interval: float = 1.0,
        max_idle_aborts: int = 16,
        timeline=None,
        routed_experts: Optional[tuple[int, int]] = None,
        group_requests: bool = True,
        lora_adapters: bool = False,
    ):
        super().__init__(addresses, api_key, connect_timeout)
        self.version_fn = version_fn
        self.lora_adapters = lora_adapters  # requests select the policy's adapter (LoRA on SGLang)
        self.request_timeout, self.probe_timeout = request_timeout, probe_timeout
        self.max_retries, self.backoff_base, self.backoff_max = max_retries, backoff_base, backoff_max
        self.dead_after, self.health_interval = dead_after, health_interval
        self.max_idle_aborts = max_idle_aborts
        self._resumed: Optional[asyncio.Event] = None
        self._cancelled: set[str] = set()
        self._active: dict[str, tuple[Server, str]] = {}  # rid -> (server, segment rid)
        self._rr = 0
        self.stats: collections.Counter = collections.Counter()  # segments, retries, resubmits, ...
        self.timeline = timeline  # optional span recorder (megarl.common.timeline.Timeline)
        self.routed_experts = routed_experts  # (layers, top_k): ask for and decode MoE routing
        self.group_requests = group_requests  # a group's first segments in one batched /generate
        self._inflight = self._atomic_inflight = 0
        self._busy_since, self._busy_total = 0.0, 0.0
        self._drained: Optional[asyncio.Event] = None
        self._drain_atomic_only = False

    # ---- the gate ----------------------------------------------------------------------------------
    def _gate(self) -> asyncio.Event:
        if self._resumed is None:  # made lazily: an Event binds to the loop that first awaits it
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._resumed

    def hold(self) -> None:
        """No new segment is sent until `release()`: requests the servers abort for a weight
        update wait here instead of racing the update. Call on the client's loop."""
        self._gate().clear()

    def release(self) -> None:
        self._gate().set()

    @property
    def held(self) -> bool:
        return not self._gate().is_set()

    def _current_version(self) -> int:
        return self.version_fn() if self.version_fn is not None else 0

    def _options(self) -> dict:
        """What every /generate of this client asks for beside the sampling: the routes of each
        token (routing replay), and with LoRA on SGLang the adapter of the version the servers
        hold (the gate is open only while no push runs, so that version is the loaded one)."""
        out = {}
        if self.routed_experts is not None:
            out["return_routed_experts"] = True
        if self.lora_adapters:
            out["lora_path"] = policy_adapter(self._current_version())
        return out

    def _backoff(self, attempt: int) -> float:
        return backoff_delay(attempt, self.backoff_base, self.backoff_max)

    def _mark_ok(self, srv: Server) -> None:
        srv.failures = 0

    def _mark_failed(self, srv: Server, reason: str) -> None:
        if srv.removed:
            return  # the cluster's owner already dropped it; nothing to probe
        srv.failures += 1
        if srv.alive and srv.failures >= self.dead_after:
            srv.alive = False
            log.warning("rollout server %s marked dead after %d failures (%s)", srv.address, srv.failures, reason)
            if srv.probe is None or srv.probe.done():
                srv.probe = asyncio.get_running_loop().create_task(self._probe(srv))

    async def _probe(self, srv: Server) -> None:
        """Re-admit a dead server once /health is 200 and its weights are current."""
        while not srv.alive:
            await asyncio.sleep(self.health_interval)
            try:
                await self._call(srv, "GET", "/health", None, self.probe_timeout)
                if self.version_fn is not None:
                    info = await self._call(srv, "GET", "/model_info", None, self.probe_timeout)
                    if str(info.get("weight_version")) != str(self.version_fn()):
                        continue  # missed a weight update: keep it out
            except (Transient, ServerRequestError):
                continue
            srv.alive, srv.failures = True, 0
            log.warning("rollout server %s re-admitted", srv.address)

    def _pick(self, prefer: Optional[Server], avoid: Optional[Server] = None) -> Optional[Server]:
        # a continuing request goes back to its server: its prefix is still in that server's cache
        if prefer is not None and prefer.alive and prefer is not avoid:
            return prefer
        live = [s for s in self.servers if s.alive]
        if len(live) > 1 and avoid in live:  # a retry goes elsewhere unless nothing else is left
            live.remove(avoid)
        if not live:
            return None
        self._rr += 1
        start = self._rr % len(live)
        order = live[start:] + live[:start]  # round-robin among equally loaded servers
        return min(order, key=lambda s: s.inflight)

    # ---- generation ----------------------------------------------------------------------------------
    async def _segment(self, payload: dict, prefer: Optional[Server], rid: "str | list[str]",
                       atomic: bool = False) -> tuple[Server, dict]:
        attempt, avoid = 0, None
        while True:
            srv = self._pick(prefer, avoid)
            if srv is None:
                if attempt >= self.max_retries:
                    raise RolloutError(f"no healthy rollout server for {rid} after {attempt} attempts")
                await asyncio.sleep(self._backoff(attempt))
                attempt += 1
                continue
            srv.inflight += 1
            if isinstance(rid, list):  # a group's batch: each sample aborts by its own rid
                self._active.update(zip(rid, ((srv, r) for r in payload["rid"])))
            else:
                self._active[rid] = (srv, payload["rid"])
            self._busy(+1, atomic)
            t0 = time.time()
            call = asyncio.ensure_future(self._call(srv, "POST", "/generate", payload, self.request_timeout))
            srv.calls.add(call)
            try:
                try:
                    res = await call
                except asyncio.CancelledError:
                    # remove_server() cancelled the call, not our caller: retry elsewhere with the
                    # tokens so far (whatever the dead server produced in this segment is lost)
                    if srv.removed and not asyncio.current_task().cancelling():
                        raise Transient(f"{srv.address} was removed from the rollout cluster") from None
                    raise
                self._mark_ok(srv)
                if self.timeline is not None:
                    outs = res if isinstance(res, list) else [res]
                    n = sum(len(r.get("output_ids") or []) for r in outs if isinstance(r, dict))
                    self.timeline.record("generate", t0, time.time(), lane=srv.address, tokens=n)
                return srv, res
            except Transient as e:
                self._mark_failed(srv, str(e))
                self.stats["retries"] += 1
                attempt += 1
                if attempt > self.max_retries:
                    raise RolloutError(f"/generate for {rid} failed {attempt} times; last: {srv.address}: {e}") from e
                prefer, avoid = None, srv
                await asyncio.sleep(self._backoff(attempt - 1))
            finally:
                srv.calls.discard(call)
                srv.inflight -= 1
                self._busy(-1, atomic)

    # ---- the server set (owned by RolloutCluster; call on the client's loop) -------------------
    def remove_server(self, address: str) -> None:
        """Stop using ``address``: its in-flight segments are cancelled and resubmitted (prompt +
        tokens so far) to the other servers; it is never probed or picked again."""
        for srv in [s for s in self.servers if s.address == normalize_address(address)]:
            srv.removed, srv.alive = True, False
            self.servers.remove(srv)
            if srv.probe is not None:
                srv.probe.cancel()
            for call in list(srv.calls):
                call.cancel()

    def add_server(self, address: str) -> None:
        """A server that holds the current weights (RolloutCluster pushed them) joins."""
        address = normalize_address(address)
        if all(s.address != address for s in self.servers):
            self.servers.append(Server(address, len(self.servers)))

    def _busy(self, delta: int, atomic: bool) -> None:
        """Tracks segments in flight: busy time (some segment on some server) for the rollout
        idle ratio, and the atomic ones `drain` waits for."""
        now = time.perf_counter()
        if self._inflight == 0 and delta > 0:
            self._busy_since = now
        self._inflight += delta
        self._atomic_inflight += delta if atomic else 0
        if self._inflight == 0:
            self._busy_total += now - self._busy_since
        left = self._atomic_inflight if self._drain_atomic_only else self._inflight
        if self._drained is not None and left == 0:
            self._drained.set()

    def busy_seconds(self) -> float:
        """Wall seconds during which at least one segment was being generated."""
        open_s = time.perf_counter() - self._busy_since if self._inflight else 0.0
        return self._busy_total + open_s

    async def drain(self, atomic_only: bool = False) -> None:
        """Waits until no segment is in flight (``atomic_only``: no segment of a request marked
        ``metadata["atomic"]``, e.g. evaluation). Call with the gate held, or new segments start."""
        def done() -> bool:
            return (self._atomic_inflight if atomic_only else self._inflight) == 0

        while not done():
            self._drained, self._drain_atomic_only = asyncio.Event(), atomic_only
            await self._drained.wait()
        self._drained = None

    def _to_version(self, v: Any) -> int:
        # SGLang's default version string is "default": such tokens belong to the current policy
        try:
            return int(v)
        except (TypeError, ValueError):
            return self._current_version()

    def _parse(self, res: dict) -> tuple[list[int], list[float], list[int], dict]:
        if not isinstance(res, dict) or "output_ids" not in res or "meta_info" not in res:
            raise RolloutError(f"unexpected /generate response: {str(res)[:300]}")
        meta = res["meta_info"]
        ids = list(res["output_ids"])
        lps = [float(e[0]) for e in meta.get("output_token_logprobs") or []]
        if len(lps) != len(ids):
            raise RolloutError(f"{len(lps)} logprobs for {len(ids)} tokens in /generate response")
        vers = self._token_versions(meta, len(ids))
        return ids, lps, vers, meta.get("finish_reason") or {}

    def _token_versions(self, meta: dict, n: int) -> list[int]:
        """Per-token versions from ``weight_versions``: SGLang's spans
        ``[{"version", "start", "end"}, ...]`` or megarl-server's one-per-token list; else the
        segment's ``weight_version`` for every token."""
        given = meta.get("weight_versions")
        fallback = self._to_version(meta.get("weight_version"))
        if isinstance(given, list) and given and all(isinstance(s, dict) for s in given):
            # spans may not cover every token (SGLang reports one span per weight flip): the
            # uncovered ones were produced under the segment's final version
            vers = [fallback] * n
            for span in given:
                v = self._to_version(span.get("version"))
                for i in range(max(0, int(span.get("start", 0))), min(n, int(span.get("end", n)))):
                    vers[i] = v
            return vers
        if isinstance(given, list) and len(given) == n:
            return [self._to_version(v) for v in given]
        return [fallback] * n

    def _routes(self, res: dict, srv: Server) -> RoutedExperts:
        try:
            return RoutedExperts.from_meta(res["meta_info"], *self.routed_experts)
        except ValueError as e:
            raise RolloutError(f"/generate from {srv.address}: {e}") from None

    def _new_response(self, req: ModelRequest) -> ModelResponse:
        resp = ModelResponse(input_tokens=list(req.input_ids), rid=req.rid, num_segments=0)
        if self.routed_experts is not None:
            layers, top_k = self.routed_experts
            resp.routed_experts = RoutedExperts(np.zeros((0, layers, top_k), np.int32),
                                                np.zeros((0, layers, top_k), np.float32))
        return resp

    def _take(self, resp: ModelResponse, res: dict, srv: Server) -> tuple[str, dict, int]:
        """Appends one segment's tokens, logprobs, versions (and routes) to ``resp``; returns
        (finish type, finish_reason, tokens it brought)."""
        resp.server = srv.address
        resp.num_segments += 1
        self.stats["segments"] += 1
        ids, lps, vers, finish = self._parse(res)
        self.stats["tokens"] += len(ids)
        resp.output_tokens += ids
        resp.output_logprobs += lps
        resp.output_versions += vers
        resp.text = res.get("text")
        if resp.routed_experts is not None:
            resp.routed_experts = resp.routed_experts.extend(self._routes(res, srv))
        return finish.get("type"), finish, len(ids)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one sample to completion across interruptions (see module docstring)."""
        return await self._complete(req, self._new_response(req), time.perf_counter())

    async def _complete(self, req: ModelRequest, resp: ModelResponse, t0: float,
                        first: Optional[tuple[Server, dict]] = None) -> ModelResponse:
        """Segments until ``resp`` is finished; ``first``: a segment already answered (the
        group's shared first request) to take before sending any."""
        sp: SamplingParams = req.sampling
        prefer: Optional[Server] = None
        idle_aborts = 0
        try:
            while True:
                if first is not None:
                    srv, res = first
                    first = None
                else:
                    remaining = sp.max_new_tokens - len(resp.output_tokens)
                    if remaining <= 0:
                        resp.stop_reason = "length"
                        break
                    await self._gate().wait()
                    # a resubmission is prompt + every token so far: the new segment continues the
                    # sample, and its tokens are stamped with the version the server now holds
                    payload = {
                        "input_ids": resp.input_tokens + resp.output_tokens,
                        "sampling_params": sp.to_json(max_new_tokens=remaining),
                        "return_logprob": True,
                        "rid": f"{req.rid}#{resp.num_segments}",
                        **self._options(),
                    }
                    srv, res = await self._segment(payload, prefer, req.rid, bool(req.metadata.get("atomic")))
                prefer = srv
                kind, finish, brought = self._take(resp, res, srv)
                if kind in ("stop", "length"):
                    resp.stop_reason, resp.stop_matched = kind, finish.get("matched")
                    break
                if kind != "abort":
                    raise RolloutError(f"unknown finish_reason {finish!r} from {srv.address}")
                if req.rid in self._cancelled:
                    resp.stop_reason = "abort"
                    break
                # aborts that bring no token mean the server keeps pausing before this request
                # runs; give up after max_idle_aborts instead of spinning through every push
                idle_aborts = 0 if brought else idle_aborts + 1
                if idle_aborts > self.max_idle_aborts:
                    log.warning("%s: %d aborts in a row without progress (%s)", req.rid, idle_aborts, finish)
                    resp.stop_reason = "abort"
                    break
                self.stats["resubmits"] += 1
                if idle_aborts:
                    await asyncio.sleep(self._backoff(min(idle_aborts, 6)))
        finally:
            self._active.pop(req.rid, None)
            self._cancelled.discard(req.rid)
        resp.latency = time.perf_counter() - t0
        return resp

    async def agenerate_n(self, req: ModelRequest, n: int) -> list[ModelResponse]:
        """Group sampling: n independent samples of one prompt (seeds derived when seeded).

        The group's first segments go out as one batched /generate (``input_ids`` and
        ``sampling_params`` as lists, one ``rid`` per sample: SGLang's batch form, which
        megarl-server takes too): one HTTP request and one response parse per group instead of
        per sample. A sample a weight update interrupts continues on its own, as in `agenerate`."""
        reqs = []
        for i in range(n):
            sp = SamplingParams(**{**req.sampling.__dict__})
            if sp.seed is not None:
                sp.seed = sp.seed * 1_000_003 + i
            reqs.append(ModelRequest(list(req.input_ids), sp, f"{req.rid}-{i}", dict(req.metadata)))
        if n == 1 or not self.group_requests or req.sampling.max_new_tokens <= 0:
            return list(await asyncio.gather(*(self.agenerate(r) for r in reqs)))
        t0 = time.perf_counter()
        resps = [self._new_response(r) for r in reqs]
        await self._gate().wait()
        payload = {"input_ids": [list(r.input_ids) for r in reqs],
                   "sampling_params": [r.sampling.to_json(max_new_tokens=r.sampling.max_new_tokens) for r in reqs],
                   "return_logprob": True, "rid": [f"{r.rid}#0" for r in reqs], **self._options()}
        rids = [r.rid for r in reqs]
        try:
            srv, res = await self._segment(payload, None, rids, bool(req.metadata.get("atomic")))
        except BaseException:
            for rid in rids:
                self._active.pop(rid, None)
                self._cancelled.discard(rid)
            raise
        if not isinstance(res, list) or len(res) != n:
            for rid in rids:
                self._active.pop(rid, None)
            raise RolloutError(f"batched /generate from {srv.address}: expected a list of {n} results, "
                               f"got {type(res).__name__}")
        return list(await asyncio.gather(*(self._complete(r, resp, t0, (srv, one))
                                           for r, resp, one in zip(reqs, resps, res))))

    async def abort(self, rid: str) -> None:
        """Stop one request: it returns with stop_reason 'abort' and its partial output."""
        self._cancelled.add(rid)
        active = self._active.get(rid)
        if active is not None:
            srv, seg_rid = active
            try:
                await self._call(srv, "POST", "/abort_request", {"rid": seg_rid}, self.probe_timeout)
            except Transient as e:
                self._mark_failed(srv, str(e))
