"""The rollout controller: runs on global rank 0 in a background thread with its own event loop.

    prompts (ResumableSampler over PromptDataset)
        |  n = staleness.try_start()          (bounded off-policyness + max concurrency)
        v
    executor: asyncio tasks  workflow.arun_episode(client, prompt)  ---> rollout servers
        |  group of Trajectory  (rejected: failed, or all-equal rewards under dynamic sampling)
        v
    buffer (FIFO of groups) --------> trainer thread: next_batch(n_groups)  (blocks)
                                         |
    RolloutCluster (trainer side) <------+   weight push: hold() closes the client's gate so
      version: the staleness clock           aborted requests wait; on_version(v) widens the
                                             staleness window; release() lets them resume as
                                             partial rollouts under the new version.

The trainer thread only talks to the controller through these thread-safe methods; every call
into the event loop goes through ``run_coroutine_threadsafe`` with a deadline. The policy version
is not stored here: it is read from the cluster (``versions.get_version()``).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Optional

from megarl.data.datasets import PromptDataset, ResumableSampler
from megarl.rollout.client import RolloutClient
from megarl.rollout.staleness import EpisodeState, StalenessManager, VersionProvider
from megarl.rollout.types import Trajectory

log = logging.getLogger("megarl.controller")


class RolloutController:
    def __init__(self, dataset: PromptDataset, workflow, servers: list[str], versions: VersionProvider,
                 *, batch_groups: int, max_staleness: int, max_concurrent: int, seed: int = 0,
                 api_key: Optional[str] = None, dynamic_sampling: bool = False,
                 client_kwargs: Optional[dict] = None):
        self.dataset, self.workflow, self.versions = dataset, workflow, versions
        self.sampler = (dataset.make_sampler(seed) if hasattr(dataset, "make_sampler")  # honours data.shuffle
                        else ResumableSampler(len(dataset), seed=seed))
        self.staleness = StalenessManager(batch_groups, max_staleness, max_concurrent, versions)
        self.dynamic_sampling = dynamic_sampling
        self._servers, self._api_key, self._client_kwargs = servers, api_key, client_kwargs or {}
        self._episode = 0
        self._consumed = 0
        self._buffer: collections.deque[list[Trajectory]] = collections.deque()
        self._ready = threading.Condition()
        self._errors: collections.deque[str] = collections.deque(maxlen=5)
        self._loop = asyncio.new_event_loop()
        self._thread: Optional[threading.Thread] = None
        self._wake: Optional[asyncio.Event] = None
        self._stopping = False
        self.client: Optional[RolloutClient] = None
        self.counters = collections.Counter()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop.run_forever, name="megarl-controller", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)

    async def _start(self) -> None:
        self.client = RolloutClient(self._servers, self._api_key, version_fn=self.versions.get_version,
                                    **self._client_kwargs)
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._executor())

    def stop(self) -> None:
        self._stopping = True
        if self._thread is None:
            return

        async def shutdown():
            self._wake.set()
            self._task.cancel()
            for t in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                t.cancel()
            await self.client.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._thread = None

    # ------------------------------------------------------------------ executor
    async def _executor(self) -> None:
        while not self._stopping:
            for _ in range(self.staleness.try_start(self.staleness.max_concurrent)):
                sample = self.dataset[self.sampler.next_index()]
                self._episode += 1
                asyncio.ensure_future(self._run_episode(sample, self._episode))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass

    async def _run_episode(self, sample, episode_id: int) -> None:
        state = EpisodeState.REJECTED
        try:
            group = await self.workflow.arun_episode(self.client, sample)
            for t in group or ():  # None: the workflow rejected the sample
                t.group_id = episode_id
            if group is None or (self.dynamic_sampling and len({t.reward for t in group}) == 1):
                self.counters["filtered"] += 1
            else:
                state = EpisodeState.ACCEPTED
                with self._ready:
                    self._buffer.append(group)
                    self._ready.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - one bad episode must not stop the executor
            self.counters["failed"] += 1
            self._errors.append(f"{type(e).__name__}: {e}")
            log.warning("episode %d failed: %s", episode_id, e)
        finally:
            self.staleness.finish(state)
            self._wake.set()

    # ------------------------------------------------------------------ trainer-thread API
    def next_batch(self, n_groups: int, timeout_s: float = 600.0) -> list[Trajectory]:
        """The oldest ``n_groups`` finished groups, flattened; blocks until they exist."""
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while len(self._buffer) < n_groups:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rollout: {len(self._buffer)}/{n_groups} groups after "
                                       f"{timeout_s:.0f} s; recent errors: {list(self._errors)}")
                self._ready.wait(timeout=min(left, 1.0))
            groups = [self._buffer.popleft() for _ in range(n_groups)]
        self._consumed += n_groups
        return [t for g in groups for t in g]

    def _call(self, coro_fn, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self._loop).result(timeout=timeout_s)

    # ------------------------------------------------------------------ ClusterListener
    def hold(self) -> None:
        """Closes the client's gate before the servers pause: no segment is sent meanwhile."""
        if self._thread is not None:
            self._call(self._async(lambda: self.client.hold()))

    def release(self) -> None:
        if self._thread is not None:
            self._call(self._async(lambda: self.client.release()))

    def on_version(self, version: int) -> None:
        """The staleness window moved: wake the executor so more episodes may start."""
        if self._thread is not None:
            self._call(self._async(lambda: self._wake.set()))

    @staticmethod
    def _async(fn):
        async def run():
            fn()
        return run

    def stats(self) -> dict:
        s = self.staleness.stats()
        return {"rollout/running": s.running, "rollout/buffered": len(self._buffer),
                "rollout/accepted": s.accepted, "rollout/rejected": s.rejected,
                "rollout/filtered": self.counters["filtered"], "rollout/failed": self.counters["failed"]}

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """Sampler position of the consumed prompts and the counters the staleness bound uses.
        Buffered and running episodes are not saved: on resume they are generated again."""
        sampler = self.sampler.state_dict()
        in_flight = self._episode - self._consumed
        pos = sampler["epoch"] * sampler["n"] + sampler["position"] - in_flight
        return {"sampler": {**sampler, "epoch": pos // sampler["n"], "position": pos % sampler["n"]},
                "staleness": {"accepted": self._consumed, "rejected": 0},
                "episodes": self._consumed}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.staleness.load_state_dict(state["staleness"])
        self._episode = self._consumed = int(state["episodes"])
