"""Synchronous access to the rollout servers' admin endpoints from trainer ranks.

Training ranks are plain synchronous code; the rollout client is asyncio. ``AdminRunner`` owns a
private event loop in a daemon thread with one :class:`RolloutClient`, and turns each admin call
into a blocking call with a deadline (or a future, for calls that must overlap a broadcast).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Callable, Optional

from megarl.rollout.client import RolloutClient


class AdminRunner:
    def __init__(self, addresses: list[str], api_key: Optional[str] = None, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="megarl-admin", daemon=True)
        self._thread.start()
        self.client: RolloutClient = self._wait(self._make(addresses, api_key), timeout_s)

    async def _make(self, addresses, api_key) -> RolloutClient:
        return RolloutClient(addresses, api_key, admin_timeout=self.timeout_s,
                             weight_timeout=self.timeout_s, max_retries=1)

    def _wait(self, coro: Awaitable, timeout: Optional[float]) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"admin call did not finish within {timeout:.0f} s") from None

    def call(self, fn: Callable[[RolloutClient], Awaitable], timeout: Optional[float] = None) -> Any:
        """Runs ``fn(client)`` on the admin loop and waits for it. The client's own per-server
        deadline (``timeout_s``) fires first, so its error names the server; the extra second
        here only guards against a stuck loop."""
        return self._wait(fn(self.client), (timeout or self.timeout_s) + 1.0)

    def submit(self, fn: Callable[[RolloutClient], Awaitable]) -> concurrent.futures.Future:
        """Starts ``fn(client)`` and returns at once (for calls that overlap a broadcast)."""
        return asyncio.run_coroutine_threadsafe(fn(self.client), self._loop)

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.client.servers]

    def close(self) -> None:
        try:
            self._wait(self.client.close(), 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
