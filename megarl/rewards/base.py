"""The reward plugin contract, its loader by import path, and the awaitable wrapper workflows use.

Contract: a reward is a callable

    fn(prompt: str, completion: str, meta: dict) -> float          (plain function), or
    async fn(prompt: str, completion: str, meta: dict) -> float    (coroutine function)

where `prompt` and `completion` are decoded text (completion without the prompt) and `meta` is the
prompt record's `meta` (every dataset field but the prompt, e.g. `meta["answer"]`). Configs name
it by import path, "package.module:function" (``rollout.reward_fn``); a path naming a class is
instantiated once with ``reward.args`` (e.g. `HttpReward(url=...)`), and the instance is the
callable. Sync functions may be called from worker threads, so they must be thread-safe.

Workflows never call the plugin directly: `RewardCaller` awaits coroutine functions, runs sync
ones on daemon threads or, with ``reward.executor: process``, in worker processes (`pool.py`), so
the event loop never blocks on reward code; it applies ``reward.timeout_s`` and maps failures to
``reward.on_error_value`` (or raises `RewardError`, failing the episode). A timed-out sync function
on a thread cannot be interrupted: its thread runs on until it returns (a daemon thread, so it
never keeps the process alive); a timed-out worker process is killed and replaced.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import math
import queue
import threading
import time
from typing import Any, Optional, Protocol

from megarl.rewards.loader import is_async_callable, load_reward_fn
from megarl.rewards.pool import RewardProcessPool, deliver

__all__ = ["RewardFn", "RewardError", "RewardCaller", "load_reward_fn", "is_async_callable"]


class RewardFn(Protocol):
    def __call__(self, prompt: str, completion: str, meta: dict[str, Any]) -> float: ...


class RewardError(RuntimeError):
    """A reward function raised, returned a non-number, or ran past its deadline."""


class _DaemonThreads:
    """Sync reward functions on daemon threads, one per running call: a call that hangs past its
    timeout keeps only its own thread (a fixed pool would let hung calls starve the ones queued
    behind them), and a daemon thread cannot keep the process alive after the run ends. A thread
    whose call returned parks for the next call (`idle_s` at most), so a busy run does not start
    a thread per sample. At most `cap` calls run at once; the calls beyond (a large group, or
    hung verifiers piling up) wait in order for a thread to come free; each caller's deadline
    counts from its submit, so a backlog behind hung calls times out instead of growing for ever."""

    def __init__(self, cap: int, name: str, idle_s: float = 30.0):
        self.cap, self.name, self.idle_s = cap, name, idle_s
        self._running = 0
        self._idle: list[queue.SimpleQueue] = []  # inboxes of parked threads
        self._backlog: collections.deque = collections.deque()  # calls waiting for a thread
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self._running >= self.cap:
                self._backlog.append((loop, fut, fn, args))  # the next thread to finish a call takes it
                return fut
            self._running += 1
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(inbox,), name=self.name, daemon=True).start()
        inbox.put((loop, fut, fn, args))
        return fut

    def _work(self, inbox: queue.SimpleQueue) -> None:
        while True:
            try:
                loop, fut, fn, args = inbox.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nobody took this thread meanwhile: it ends
                        self._idle.remove(inbox)
                        return
                loop, fut, fn, args = inbox.get()  # taken just now: its call is on the way
            try:
                value, ok = fn(*args), True
            except BaseException as e:  # noqa: BLE001 - delivered to the awaiting caller
                value, ok = e, False
            with self._lock:
                nxt = self._backlog.popleft() if self._backlog else None
                if nxt is None:
                    self._running -= 1
                    self._idle.append(inbox)
            deliver(loop, fut, ok, value)
            if nxt is not None:
                inbox.put(nxt)  # this thread runs the oldest waiting call next

    def threads(self) -> int:
        """Threads alive for reward calls: running ones plus parked ones."""
        with self._lock:
            return self._running + len(self._idle)

    def shutdown(self) -> None:
        pass  # parked threads end after idle_s; running calls are daemon threads


class RewardCaller:
    """``await caller(prompt, completion, meta) -> float`` around any reward callable.

    Chosen once at construction: coroutine functions are awaited on the caller's loop, plain
    functions run on `pool` (worker processes) when given, else on a daemon thread per call (at
    most `max_threads` at once). Every call gets `timeout_s` (0 = none; in a pool it counts from
    when a worker takes the call). A raise, a timeout or a non-finite / non-numeric result returns
    `on_error_value` when it is set and raises `RewardError` otherwise; `stats()` counts calls,
    errors and timeouts (and replaced workers, with a pool).
    """

    def __init__(self, fn: RewardFn, timeout_s: float = 0.0, on_error_value: Optional[float] = None,
                 max_threads: int = 256, pool: Optional[RewardProcessPool] = None):
        self.fn, self.timeout_s, self.on_error_value = fn, timeout_s, on_error_value
        self.is_async = is_async_callable(fn)
        self.pool = None if self.is_async else pool  # coroutines never block the loop
        self._threads = _DaemonThreads(max_threads, "megarl-reward")
        self.counts: collections.Counter = collections.Counter()
        self._calls: dict[int, float] = {}  # in-flight call -> start (monotonic): what a stall waits on
        self._ids = itertools.count()

    def in_flight(self) -> tuple[int, float]:
        """(reward calls running now, seconds the oldest of them has run)."""
        starts = list(self._calls.values())
        return len(starts), (time.monotonic() - min(starts)) if starts else 0.0

    @classmethod
    def from_config(cls, path: str, reward_cfg) -> "RewardCaller":
        """The caller a run uses: ``rollout.reward_fn`` = `path`, ``reward.*`` = `reward_cfg`. The
        function is loaded here too, so a bad path fails at start-up in every executor."""
        fn = load_reward_fn(path, reward_cfg.args)
        pool = None
        if reward_cfg.executor == "process" and not is_async_callable(fn):
            pool = RewardProcessPool(path, reward_cfg.args, reward_cfg.num_workers, reward_cfg.timeout_s)
        return cls(fn, reward_cfg.timeout_s, reward_cfg.on_error_value, pool=pool)

    def _run(self, prompt: str, completion: str, meta: dict):
        if self.is_async:
            return self.fn(prompt, completion, meta)
        if self.pool is not None:
            return self.pool.submit(prompt, completion, meta)
        return self._threads.submit(self.fn, prompt, completion, meta)

    async def __call__(self, prompt: str, completion: str, meta: dict) -> float:
        self.counts["calls"] += 1
        call_id = next(self._ids)
        self._calls[call_id] = time.monotonic()
        try:
            call = self._run(prompt, completion, meta)
            if self.timeout_s > 0 and self.pool is None:  # a pool times its calls itself
                call = asyncio.wait_for(call, self.timeout_s)
            value = await call
            reward = float(value)
            if not math.isfinite(reward):
                raise ValueError(f"non-finite reward {reward}")
            return reward
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            self.counts["timeouts"] += 1
            return self._failed(f"reward timed out after {self.timeout_s} s")
        except Exception as e:  # noqa: BLE001 - user code: any failure is mapped the same way
            self.counts["errors"] += 1
            return self._failed(f"reward failed: {type(e).__name__}: {e}")
        finally:
            self._calls.pop(call_id, None)

    def _failed(self, message: str) -> float:
        if self.on_error_value is None:
            raise RewardError(message)
        return float(self.on_error_value)

    async def many(self, prompt: str, completions: list[str], meta: dict) -> list[float]:
        """Scores of several completions of one prompt, concurrently."""
        return list(await asyncio.gather(*(self(prompt, c, meta) for c in completions)))

    def stats(self) -> dict[str, int]:
        out = {"reward/calls": self.counts["calls"], "reward/errors": self.counts["errors"],
               "reward/timeouts": self.counts["timeouts"]}
        if self.pool is not None:
            out["reward/worker_restarts"] = self.pool.restarts
        return out

    async def aclose(self) -> None:
        """Close the plugin (e.g. HttpReward's session), the threads and the worker processes."""
        close = getattr(self.fn, "aclose", None)
        if close is not None:
            await close()
        self._threads.shutdown()
        if self.pool is not None:
            await asyncio.to_thread(self.pool.close)
