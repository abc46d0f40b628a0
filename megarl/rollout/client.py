"""Asyncio client for a cluster of SGLang-protocol rollout servers (real SGLang or megarl-server).

Generation: `await client.agenerate(ModelRequest) -> ModelResponse`.

    agenerate: while budget left:
        wait until generation is not paused by this client
        POST /generate {input_ids: prompt + out_so_far, max_new_tokens: remaining}   (segment)
            -> to the request's previous server when alive (prefix cache), else least in-flight;
               connection errors / timeouts / 5xx: exponential back-off, next server
        append tokens, logprobs and per-token versions
        finish_reason stop|length -> done; abort -> resubmit (weight update), unless this client
        aborted the request or too many aborts in a row brought no token

Versions: each token gets the version the server reports for it - ``meta_info.weight_versions``
as SGLang's spans ``[{"version", "start", "end"}]`` or megarl-server's per-token list, else the
segment's ``meta_info.weight_version`` - parsed as an int; a non-numeric version maps to the
client's `version` (set by `set_version` / a weight push).

Health: a server is marked dead after `dead_after` consecutive failures; a background probe
re-admits it when ``/health`` answers 200 and (once this client pushed a version) its
``weight_version`` equals the last pushed one, so a server that missed an update never serves.

Admin calls (trainer side) go to every live server at once with a timeout each and raise
`AdminError` naming each failed address. `pause()` also closes a client-side gate so no new
segment is sent until `continue_generation()`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

from megarl.rollout.types import (
    DiskWeightsUpdate,
    DistributedWeightsMeta,
    ModelRequest,
    ModelResponse,
    PauseMode,
    PauseRequest,
    SamplingParams,
    TensorWeightsUpdate,
    WeightsUpdateGroup,
)

log = logging.getLogger("megarl.rollout.client")


class RolloutError(RuntimeError):
    """Generation could not complete (no healthy server, retries exhausted)."""


class ServerRequestError(RolloutError):
    """A server rejected a request (4xx); retrying the same request cannot help."""

    def __init__(self, address: str, status: int, message: str):
        super().__init__(f"{address}: HTTP {status}: {message}")
        self.address, self.status, self.message = address, status, message


class AdminError(RolloutError):
    """An admin call failed on some servers: {address: reason}."""

    def __init__(self, path: str, failures: dict[str, str]):
        detail = "; ".join(f"{a}: {r}" for a, r in failures.items())
        super().__init__(f"{path} failed on {len(failures)} server(s): {detail}")
        self.path, self.failures = path, failures


class _Transient(Exception):
    """Connection error, timeout or 5xx: worth retrying elsewhere."""


@dataclass(eq=False)
class _Server:
    address: str
    index: int
    inflight: int = 0
    failures: int = 0
    alive: bool = True
    probe: Optional[asyncio.Task] = field(default=None, repr=False)


class RolloutClient:
    """See module docstring. Use from one event loop; `close()` (or `async with`) when done."""

    def __init__(
        self,
        addresses: list[str],
        api_key: Optional[str] = None,
        *,
        connect_timeout: float = 5.0,
        request_timeout: float = 3600.0,
        admin_timeout: float = 60.0,
        weight_timeout: float = 600.0,
        max_retries: int = 8,
        backoff_base: float = 0.05,
        backoff_max: float = 5.0,
        dead_after: int = 3,
        health_interval: float = 1.0,
        max_idle_aborts: int = 16,
    ):
        if not addresses:
            raise ValueError("RolloutClient needs at least one server address")
        self.servers = [_Server(_normalize(a), i) for i, a in enumerate(addresses)]
        self.api_key = api_key
        self.connect_timeout, self.request_timeout = connect_timeout, request_timeout
        self.admin_timeout, self.weight_timeout = admin_timeout, weight_timeout
        self.max_retries, self.backoff_base, self.backoff_max = max_retries, backoff_base, backoff_max
        self.dead_after, self.health_interval = dead_after, health_interval
        self.max_idle_aborts = max_idle_aborts
        self.version = 0  # client-side policy version (for non-numeric server versions)
        self.pushed_version: Optional[str] = None  # last weight_version pushed through this client
        self._session: Optional[aiohttp.ClientSession] = None
        self._resumed: Optional[asyncio.Event] = None
        self._cancelled: set[str] = set()
        self._active: dict[str, tuple[_Server, str]] = {}  # rid -> (server, segment rid)
        self._rr = 0
        self.stats: collections.Counter = collections.Counter()  # segments, retries, resubmits, ...

    # ---- plumbing ----------------------------------------------------------------------------------
    async def __aenter__(self) -> "RolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for s in self.servers:
            if s.probe is not None:
                s.probe.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _gate(self) -> asyncio.Event:
        if self._resumed is None:
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._resumed

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers=headers
            )
        return self._session

    async def _call(self, srv: _Server, method: str, path: str, body: Any, timeout: float) -> Any:
        """One HTTP call. 4xx -> ServerRequestError; network/timeout/5xx -> _Transient."""
        t = aiohttp.ClientTimeout(total=timeout, sock_connect=self.connect_timeout)
        try:
            async with self._http().request(method, srv.address + path, json=body, timeout=t) as r:
                text = await r.text()
                if r.status >= 500:
                    raise _Transient(f"HTTP {r.status}: {text[:300]}")
                data = _json_or_text(text, r.content_type)
                if r.status >= 400:
                    msg = data.get("message", text) if isinstance(data, dict) else text
                    raise ServerRequestError(srv.address, r.status, str(msg)[:500])
                return data
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            raise _Transient(f"{type(e).__name__}: {e}") from e

    def _backoff(self, attempt: int) -> float:
        d = min(self.backoff_max, self.backoff_base * (2 ** attempt))
        return d * (0.5 + random.random() / 2)

    def _mark_ok(self, srv: _Server) -> None:
        srv.failures = 0

    def _mark_failed(self, srv: _Server, reason: str) -> None:
        srv.failures += 1
        if srv.alive and srv.failures >= self.dead_after:
            srv.alive = False
            log.warning("rollout server %s marked dead after %d failures (%s)", srv.address, srv.failures, reason)
            if srv.probe is None or srv.probe.done():
                srv.probe = asyncio.get_running_loop().create_task(self._probe(srv))

    async def _probe(self, srv: _Server) -> None:
        """Re-admit a dead server once /health is 200 and its weights are current."""
        while not srv.alive:
            await asyncio.sleep(self.health_interval)
            try:
                await self._call(srv, "GET", "/health", None, self.admin_timeout)
                if self.pushed_version is not None:
                    info = await self._call(srv, "GET", "/model_info", None, self.admin_timeout)
                    if str(info.get("weight_version")) != self.pushed_version:
                        continue  # missed a weight update: keep it out
            except (_Transient, ServerRequestError):
                continue
            srv.alive, srv.failures = True, 0
            log.warning("rollout server %s re-admitted", srv.address)

    def _pick(self, prefer: Optional[_Server], avoid: Optional[_Server] = None) -> Optional[_Server]:
        if prefer is not None and prefer.alive and prefer is not avoid:
            return prefer
        live = [s for s in self.servers if s.alive]
        if len(live) > 1 and avoid in live:
            live.remove(avoid)
        if not live:
            return None
        self._rr += 1
        start = self._rr % len(live)
        order = live[start:] + live[:start]  # round-robin among equally loaded servers
        return min(order, key=lambda s: s.inflight)

    # ---- generation ----------------------------------------------------------------------------------
    async def _segment(self, payload: dict, prefer: Optional[_Server], rid: str) -> tuple[_Server, dict]:
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
            self._active[rid] = (srv, payload["rid"])
            try:
                res = await self._call(srv, "POST", "/generate", payload, self.request_timeout)
                self._mark_ok(srv)
                return srv, res
            except _Transient as e:
                self._mark_failed(srv, str(e))
                self.stats["retries"] += 1
                attempt += 1
                if attempt > self.max_retries:
                    raise RolloutError(f"/generate for {rid} failed {attempt} times; last: {srv.address}: {e}") from e
                prefer, avoid = None, srv
                await asyncio.sleep(self._backoff(attempt - 1))
            finally:
                srv.inflight -= 1

    def _to_version(self, v: Any) -> int:
        try:
            return int(v)
        except (TypeError, ValueError):
            return self.version

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
            vers = [fallback] * n
            for span in given:
                v = self._to_version(span.get("version"))
                for i in range(max(0, int(span.get("start", 0))), min(n, int(span.get("end", n)))):
                    vers[i] = v
            return vers
        if isinstance(given, list) and len(given) == n:
            return [self._to_version(v) for v in given]
        return [fallback] * n

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one sample to completion across interruptions (see module docstring)."""
        t0 = time.perf_counter()
        sp: SamplingParams = req.sampling
        resp = ModelResponse(input_tokens=list(req.input_ids), rid=req.rid, num_segments=0)
        prefer: Optional[_Server] = None
        idle_aborts = 0
        try:
            while True:
                remaining = sp.max_new_tokens - len(resp.output_tokens)
                if remaining <= 0:
                    resp.stop_reason = "length"
                    break
                await self._gate().wait()
                payload = {
                    "input_ids": resp.input_tokens + resp.output_tokens,
                    "sampling_params": sp.to_json(max_new_tokens=remaining),
                    "return_logprob": True,
                    "rid": f"{req.rid}#{resp.num_segments}",
                }
                srv, res = await self._segment(payload, prefer, req.rid)
                prefer, resp.server = srv, srv.address
                resp.num_segments += 1
                self.stats["segments"] += 1
                ids, lps, vers, finish = self._parse(res)
                resp.output_tokens += ids
                resp.output_logprobs += lps
                resp.output_versions += vers
                resp.text = res.get("text")
                kind = finish.get("type")
                if kind in ("stop", "length"):
                    resp.stop_reason, resp.stop_matched = kind, finish.get("matched")
                    break
                if kind != "abort":
                    raise RolloutError(f"unknown finish_reason {finish!r} from {srv.address}")
                if req.rid in self._cancelled:
                    resp.stop_reason = "abort"
                    break
                idle_aborts = 0 if ids else idle_aborts + 1
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
        """Group sampling: n independent samples of one prompt (seeds derived when seeded)."""
        reqs = []
        for i in range(n):
            sp = SamplingParams(**{**req.sampling.__dict__})
            if sp.seed is not None:
                sp.seed = sp.seed * 1_000_003 + i
            reqs.append(ModelRequest(list(req.input_ids), sp, f"{req.rid}-{i}", dict(req.metadata)))
        return list(await asyncio.gather(*(self.agenerate(r) for r in reqs)))

    async def abort(self, rid: str) -> None:
        """Stop one request: it returns with stop_reason 'abort' and its partial output."""
        self._cancelled.add(rid)
        active = self._active.get(rid)
        if active is not None:
            srv, seg_rid = active
            try:
                await self._call(srv, "POST", "/abort_request", {"rid": seg_rid}, self.admin_timeout)
            except _Transient as e:
                self._mark_failed(srv, str(e))

    # ---- admin (trainer side) ---------------------------------------------------------------------------
    async def _admin(self, path: str, body: Any = None, *, method: str = "POST", timeout: Optional[float] = None,
                     servers: Optional[list[_Server]] = None, bodies: Optional[dict] = None) -> dict[str, Any]:
        targets = servers if servers is not None else [s for s in self.servers if s.alive]
        if not targets:
            raise AdminError(path, {"*": "no live server"})
        tmo = timeout or self.admin_timeout

        async def one(s: _Server):
            b = bodies[s.address] if bodies is not None else body
            return await self._call(s, method, path, b, tmo)

        results = await asyncio.gather(*(one(s) for s in targets), return_exceptions=True)
        out, failures = {}, {}
        for s, r in zip(targets, results):
            if isinstance(r, BaseException):
                failures[s.address] = f"{type(r).__name__}: {r}"
            elif isinstance(r, dict) and r.get("success") is False:
                failures[s.address] = str(r.get("message"))
            else:
                out[s.address] = r
        if failures:
            raise AdminError(path, failures)
        return out

    async def pause(self, mode: PauseMode = "abort") -> dict:
        self._gate().clear()
        return await self._admin("/pause_generation", PauseRequest(mode).to_json())

    async def continue_generation(self) -> dict:
        try:
            return await self._admin("/continue_generation", {})
        finally:
            self._gate().set()

    async def flush_cache(self) -> dict:
        return await self._admin("/flush_cache", {})

    async def abort_all(self) -> dict:
        return await self._admin("/abort_request", {"rid": "", "abort_all": True})

    async def begin_weight_update(self) -> dict:
        return await self._admin("/begin_weight_update", {})

    async def end_weight_update(self) -> dict:
        return await self._admin("/end_weight_update", {})

    async def init_weights_update_group(self, group: WeightsUpdateGroup, rank_offsets: Optional[list[int]] = None) -> dict:
        """Every server joins; server i gets rank_offsets[i] (default 1 + i; the trainer is 0)."""
        offs = rank_offsets or [1 + s.index for s in self.servers]
        bodies = {s.address: {**group.to_json(), "rank_offset": o} for s, o in zip(self.servers, offs)}
        return await self._admin("/init_weights_update_group", servers=self.servers, bodies=bodies,
                                 timeout=self.weight_timeout)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._admin("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(self, meta: DistributedWeightsMeta) -> dict:
        """Announce one bucket; the trainer must broadcast it concurrently (src=0)."""
        out = await self._admin("/update_weights_from_distributed", meta.to_json(), timeout=self.weight_timeout)
        self._pushed(meta.weight_version)
        return out

    async def update_weights_from_disk(self, update: DiskWeightsUpdate) -> dict:
        out = await self._admin("/update_weights_from_disk", update.to_json(), timeout=self.weight_timeout)
        self._pushed(update.weight_version)
        return out

    async def update_weights_from_tensor(self, update: TensorWeightsUpdate) -> dict:
        out = await self._admin("/update_weights_from_tensor", update.to_json(), timeout=self.weight_timeout)
        self._pushed(update.weight_version)
        return out

    async def get_model_info(self) -> dict[str, dict]:
        return await self._admin("/model_info", method="GET")

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict[str, list]:
        return await self._admin("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    async def health(self) -> dict[str, bool]:
        async def one(s):
            try:
                await self._call(s, "GET", "/health", None, self.admin_timeout)
                return True
            except (_Transient, ServerRequestError):
                return False

        return {s.address: ok for s, ok in zip(self.servers, await asyncio.gather(*(one(s) for s in self.servers)))}

    def set_version(self, version: int) -> None:
        self.version = int(version)

    def _pushed(self, version: Optional[str]) -> None:
        if version is not None:
            self.pushed_version = str(version)
            try:
                self.version = int(version)
            except ValueError:
                pass


def _normalize(address: str) -> str:
    address = address.rstrip("/")
    return address if address.startswith(("http://", "https://")) else "http://" + address


def _json_or_text(text: str, content_type: str) -> Any:
    if content_type == "application/json" or text[:1] in ("{", "["):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text
