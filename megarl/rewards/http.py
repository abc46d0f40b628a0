"""A reward served over HTTP: batches of {prompt, completion, meta} POSTed to a scoring service.

    rollout.reward_fn: megarl.rewards:HttpReward
    reward.args: {url: http://scorer:8000/score, max_batch: 32, max_wait_ms: 20, timeout_s: 30}

Wire format (JSON both ways):

    POST url  {"items": [{"prompt": str, "completion": str, "meta": {...}}, ...]}
    200       {"rewards": [float, ...]}        one per item, same order

Batching: concurrent calls queue their item; a batch is sent when `max_batch` items wait or
`max_wait_ms` after the first one arrived, whichever is first. A batch that fails (connection
error, non-200, a malformed body) is retried up to `retries` times, then every caller in it gets
the error (the `RewardCaller` around it maps errors and ``reward.timeout_s`` to
``reward.on_error_value``). One instance serves one event loop (the controller's); its HTTP
session is made on first use and closed by `aclose()`.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

import aiohttp

__all__ = ["HttpReward", "HttpRewardError"]


class HttpRewardError(RuntimeError):
    """The scoring service failed or answered something other than {"rewards": [...]}."""


class HttpReward:
    def __init__(self, url: str, max_batch: int = 32, max_wait_ms: float = 10.0, timeout_s: float = 30.0,
                 retries: int = 1, headers: Optional[dict[str, str]] = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward.args.url: expected http(s)://..., got {url!r}")
        if max_batch < 1 or max_wait_ms < 0 or timeout_s <= 0 or retries < 0:
            raise ValueError("reward.args: need max_batch >= 1, max_wait_ms >= 0, timeout_s > 0, retries >= 0")
        self.url, self.max_batch, self.max_wait_s = url, max_batch, max_wait_ms / 1000.0
        self.timeout_s, self.retries, self.headers = timeout_s, retries, dict(headers or {})
        self._pending: list[tuple[dict, asyncio.Future]] = []
        self._timer: Optional[asyncio.TimerHandle] = None
        self._session: Optional[aiohttp.ClientSession] = None
        self._inflight: set[asyncio.Task] = set()
        self.batches_sent = 0  # POSTs that got an answer (for tests and metrics)

    async def __call__(self, prompt: str, completion: str, meta: dict[str, Any]) -> float:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append(({"prompt": prompt, "completion": completion, "meta": meta}, fut))
        if len(self._pending) >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.max_wait_s, self._flush)
        return await fut

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            task = asyncio.ensure_future(self._send(batch))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _send(self, batch: list[tuple[dict, asyncio.Future]]) -> None:
        items = [item for item, _ in batch]
        try:
            rewards = await self._post(items)
        except Exception as e:  # noqa: BLE001 - delivered to every caller of the batch
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (_, fut), r in zip(batch, rewards):
            if not fut.done():
                fut.set_result(r)

    async def _post(self, items: list[dict]) -> list[float]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        last: Exception = HttpRewardError("no attempt made")
        for _ in range(self.retries + 1):
            try:
                async with self._session.post(self.url, json={"items": items}, headers=self.headers) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        raise HttpRewardError(f"{self.url} answered {resp.status}: {text[:200]}")
                rewards = json.loads(text).get("rewards")
                if not isinstance(rewards, list) or len(rewards) != len(items):
                    raise HttpRewardError(f"{self.url}: expected {{'rewards': [{len(items)} numbers]}}, "
                                          f"got {text[:200]}")
                self.batches_sent += 1
                return [float(r) for r in rewards]
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError, HttpRewardError) as e:
                last = e if isinstance(e, HttpRewardError) else HttpRewardError(f"{self.url}: {type(e).__name__}: {e}")
        raise last

    async def aclose(self) -> None:
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
