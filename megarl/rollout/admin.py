"""Admin access to the rollout servers: pause/continue, cache, weight updates, model info.

`AdminClient` is asyncio (one call goes to every target server at once, each with a deadline;
any failure raises `AdminError` naming each failed address). `AdminRunner` wraps one in a private
event loop on a daemon thread so synchronous callers (the manager's cluster and link threads,
and tests that push without a manager) can call it with a deadline, or get a future for calls
that must overlap a collective (a weight broadcast). It has the `megarl.weights.target.StageAdmin`
interface the weight transports use; trainer ranks reach it through the manager channel
(`megarl.trainer.rollout_link.RemoteAdmin`), never by importing it.

Who calls what: the manager's `RolloutCluster` runs the pause/flush/version/continue protocol
once per push; the transports' bucket announces arrive over the channel and are made here;
nothing on the generation path uses it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Callable, Collection, Optional

import aiohttp

from megarl.rollout.http import AdminError, HttpClient, Server, ServerRequestError, Transient
from megarl.protocol.types import (DiskWeightsUpdate, DistributedWeightsMeta, PauseMode, PauseRequest,
                                   TensorWeightsUpdate, WeightsChecksumRequest, WeightsUpdateGroup)
from megarl.protocol.wire import LoRAAdapterLoad, LoRAAdapterUnload
from megarl.protocol.messages import (ADMIN_MESSAGES, DestroyWeightsGroup, InitWeightsGroup, LoadLoRA, ServerInfo,
                                      SetThreads, ShardAnnounce, ShardJoin, UnloadLoRA, UpdateFromDisk,
                                      UpdateFromDistributed, UpdateFromTensor, WeightsChecksum)


class AdminClient(HttpClient):
    """One method per SGLang admin endpoint; every call targets all servers of this client."""

    def __init__(self, addresses: list[str], api_key: Optional[str] = None, *,
                 timeout: float = 60.0, weight_timeout: float = 600.0, connect_timeout: float = 5.0):
        super().__init__(addresses, api_key, connect_timeout)
        # weight loads get their own, longer deadline (weights.timeout_s): a large model's load
        # takes minutes where a pause or a version flip takes milliseconds
        self.timeout, self.weight_timeout = timeout, weight_timeout

    def _http(self) -> aiohttp.ClientSession:
        """A fresh connection per call (a few per push): a kept-alive one can be reset when reused -
        the server closed it idle (uvicorn's 5 s keep-alive) or was killed and restarted on the same
        port - and an admin call cannot be retried blindly (a second /begin_weight_update is refused)."""
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True), headers=headers)
        return self._session

    async def _admin(self, path: str, body: Any = None, *, method: str = "POST",
                     timeout: Optional[float] = None, bodies: Optional[dict] = None,
                     skip: Collection[str] = ()) -> dict[str, Any]:
        """``path`` on every server (but ``skip``) concurrently; {address: reply}, or AdminError
        naming each server that failed (also a 200 reply saying ``success: false``)."""
        tmo = timeout or self.timeout
        # skip: servers the caller knows are hung, so one of them cannot stall every later call
        targets = [s for s in self.servers if s.address not in skip]

        async def one(s: Server):
            return await self._call(s, method, path, bodies[s.address] if bodies else body, tmo)

        # all at once, each with its own deadline: a push pauses N servers in one round trip
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
        return await self._admin("/pause_generation", PauseRequest(mode).to_json())

    async def continue_generation(self, skip: Collection[str] = ()) -> dict:
        return await self._admin("/continue_generation", {}, skip=skip)

    async def release_memory_occupation(self, tags: list[str]) -> dict:
        return await self._admin("/release_memory_occupation", {"tags": list(tags)})

    async def resume_memory_occupation(self, tags: list[str]) -> dict:
        return await self._admin("/resume_memory_occupation", {"tags": list(tags)})

    async def flush_cache(self) -> dict:
        return await self._admin("/flush_cache", {})

    async def abort_all(self) -> dict:
        return await self._admin("/abort_request", {"rid": "", "abort_all": True})

    async def begin_weight_update(self, skip: Collection[str] = ()) -> dict:
        return await self._admin("/begin_weight_update", {}, skip=skip)

    async def flush_and_begin(self) -> None:
        """``/flush_cache`` and ``/begin_weight_update`` at once (after a pause; neither depends on
        the other): one round trip of a push's fixed cost instead of two."""
        results = await asyncio.gather(self.flush_cache(), self.begin_weight_update(), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def end_weight_update(self, skip: Collection[str] = ()) -> dict:
        return await self._admin("/end_weight_update", {}, skip=skip)

    async def update_weight_version(self, version: str) -> dict:
        """Servers flip their reported ``weight_version`` at once (after every bucket landed).
        ``abort_all_requests: false`` always: SGLang's default is true, which ends every request
        it holds - also those ``pause_mode: retract`` (or in_place) kept to continue under the new
        weights, returned as aborts without their tokens so far, so no sample ever spanned two
        versions; the pause already decided what happens to them (megarl-server defaults false)."""
        return await self._admin("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    async def init_weights_update_group(self, group: WeightsUpdateGroup,
                                        rank_offsets: Optional[list[int]] = None) -> dict:
        """Every server joins; server i gets rank_offsets[i] (default 1 + i; the trainer is 0)."""
        offs = rank_offsets or [1 + s.index for s in self.servers]  # rank 0 is the trainer's source
        bodies = {s.address: {**group.to_json(), "rank_offset": o} for s, o in zip(self.servers, offs)}
        return await self._admin("/init_weights_update_group", bodies=bodies, timeout=self.weight_timeout)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._admin("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(self, meta: DistributedWeightsMeta) -> dict:
        """Announce one bucket; the trainer must broadcast it concurrently (src=0)."""
        return await self._admin("/update_weights_from_distributed", meta.to_json(), timeout=self.weight_timeout)

    async def get_server_info(self) -> dict[str, dict]:
        return await self._admin("/get_server_info", method="GET")

    async def shard_refit_call(self, path: str, bodies: dict[str, dict]) -> dict:
        """A shard-refit step (megarl-server extension, `megarl.weights.shard_push`): ``path`` with
        each server's own JSON body ({address: body})."""
        return await self._admin(path, bodies=bodies, timeout=self.weight_timeout)

    async def update_weights_from_disk(self, update: DiskWeightsUpdate) -> dict:
        return await self._admin("/update_weights_from_disk", update.to_json(), timeout=self.weight_timeout)

    async def update_weights_from_tensor(self, update: TensorWeightsUpdate) -> dict:
        return await self._admin("/update_weights_from_tensor", update.to_json(), timeout=self.weight_timeout)

    async def get_model_info(self) -> dict[str, dict]:
        return await self._admin("/model_info", method="GET")

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict[str, list]:
        return await self._admin("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    async def weights_checksum(self, names: list[str], dtypes: list[str]) -> dict[str, dict[str, str]]:
        """{address: {name: sha256 hex}} of the named tensors as each server holds them, in the
        pushed dtypes (megarl-server's /weights_checksum; real SGLang answers 404)."""
        body = WeightsChecksumRequest(list(names), list(dtypes)).to_json()
        # weight_timeout: the servers hash every tensor they hold, which takes as long as a load reads them
        replies = await self._admin("/weights_checksum", body, timeout=self.weight_timeout)
        return {addr: r.get("checksums", {}) for addr, r in replies.items()}

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> dict:
        """SGLang's /load_lora_adapter: the PEFT adapter directory ``path`` under ``name`` (requests
        select it with ``lora_path: name``; megarl-server merges it into its weights)."""
        return await self._admin("/load_lora_adapter", LoRAAdapterLoad(name, path, pinned).to_json(),
                                 timeout=self.weight_timeout)

    async def unload_lora_adapter(self, name: str) -> dict:
        return await self._admin("/unload_lora_adapter", LoRAAdapterUnload(name).to_json(),
                                 timeout=self.weight_timeout)

    async def set_threads(self, threads: int) -> dict:
        """megarl-server's /set_threads (`wire.EXT_THREADS`; SGLang answers 404): generation's torch
        threads from the next step on."""
        return await self._admin("/set_threads", {"threads": int(threads)})

    async def health(self) -> dict[str, bool]:
        """{address: /health answered 200} (never raises)."""
        async def one(s):
            try:
                await self._call(s, "GET", "/health", None, self.timeout)
                return True
            except (Transient, ServerRequestError):
                return False

        return {s.address: ok for s, ok in zip(self.servers, await asyncio.gather(*(one(s) for s in self.servers)))}


# The one admin table: each admin message (`megarl.protocol.messages.ADMIN_MESSAGES`, what the
# weight transports send) is one fixed `AdminClient` call - nothing on the wire picks the method.
# `AdminRunner.request` runs it here; the rollout manager runs the messages trainer links relay.
ADMIN_CALLS = {
    InitWeightsGroup: lambda m, c: c.init_weights_update_group(m.group, m.rank_offsets),
    DestroyWeightsGroup: lambda m, c: c.destroy_weights_update_group(m.group_name),
    UpdateFromDistributed: lambda m, c: c.update_weights_from_distributed(m.meta),
    UpdateFromTensor: lambda m, c: c.update_weights_from_tensor(m.update),
    UpdateFromDisk: lambda m, c: c.update_weights_from_disk(m.update),
    ServerInfo: lambda m, c: c.get_server_info(),
    ShardJoin: lambda m, c: c.shard_refit_call("/init_weights_update_group", m.bodies),
    ShardAnnounce: lambda m, c: c.shard_refit_call("/update_weights_from_distributed", m.bodies),
    WeightsChecksum: lambda m, c: c.weights_checksum(m.names, m.dtypes),
    LoadLoRA: lambda m, c: c.load_lora_adapter(m.name, m.path),
    UnloadLoRA: lambda m, c: c.unload_lora_adapter(m.name),
    SetThreads: lambda m, c: c.set_threads(m.threads),
}
assert set(ADMIN_CALLS) == set(ADMIN_MESSAGES)


class AdminRunner:
    """A synchronous `AdminClient` for trainer ranks: a private loop on a daemon thread."""

    def __init__(self, addresses: list[str], api_key: Optional[str] = None, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="megarl-admin", daemon=True)
        self._thread.start()
        self.client: AdminClient = self._wait(self._make(addresses, api_key), timeout_s)

    async def _make(self, addresses, api_key) -> AdminClient:
        return AdminClient(addresses, api_key, timeout=self.timeout_s, weight_timeout=self.timeout_s)

    def _wait(self, coro: Awaitable, timeout: Optional[float]) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"admin call did not finish within {timeout:.0f} s") from None

    def call(self, fn: Callable[[AdminClient], Awaitable], timeout: Optional[float] = None) -> Any:
        """Runs ``fn(client)`` on the admin loop and waits for it. The client's own per-server
        deadline (``timeout_s``) fires first, so its error names the server; the extra second
        here only guards against a stuck loop."""
        return self._wait(fn(self.client), (timeout or self.timeout_s) + 1.0)

    def submit(self, fn: Callable[[AdminClient], Awaitable]) -> concurrent.futures.Future:
        """Starts ``fn(client)`` and returns at once (for calls that overlap a broadcast)."""
        # the announce must be in flight while this thread broadcasts: the server receives only inside it
        return asyncio.run_coroutine_threadsafe(fn(self.client), self._loop)

    def request(self, msg, timeout: Optional[float] = None) -> Any:
        """An admin message (`ADMIN_CALLS`) run and waited for (``timeout``, else the message's)."""
        return self.call(lambda c: ADMIN_CALLS[type(msg)](msg, c), timeout or msg.timeout_s)

    def send(self, msg) -> concurrent.futures.Future:
        """An admin message started, not waited for (an announce the broadcast then overlaps)."""
        return self.submit(lambda c: ADMIN_CALLS[type(msg)](msg, c))

    @property
    def addresses(self) -> list[str]:
        return self.client.addresses

    def close(self) -> None:
        try:
            self._wait(self.client.close(), 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
