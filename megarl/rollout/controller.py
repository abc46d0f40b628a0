"""The rollout controller: runs in the rollout manager's process (`megarl.rollout.manager`), on a
thread of its own with its own event loop; the trainer reaches it only over the manager channel.

    prompts: re-issued first (`pending`, restored from a checkpoint), then ResumableSampler
        |  n = staleness.try_start()          (bounded off-policyness + max concurrency)
        v
    executor: asyncio tasks  workflow.arun_episode(client, prompt)  ---> rollout servers
        |  group of Trajectory, or rejected: filtered (named filter) / failed (after retries)
        v
    buffer (FIFO of groups) --------> manager: next_batch(n_groups) for the trainer's BatchRequest
                                         |
    RolloutCluster (the manager's) <-----+   weight push: hold() closes the client's gate (and,
      version: the staleness clock           without partial rollouts, waits for in-flight
                                             requests to finish under the old weights);
                                             on_version(v) widens the staleness window;
                                             release() lets aborted requests resume as partial
                                             rollouts under the new version.

Every prompt the controller draws ends as exactly one of: trained (handed to the trainer),
filtered (counted per filter) or failed (the workflow raised ``max_retries + 1`` times, or once
when a server refused the request with a 4xx; recorded with its error). Until then it is
*pending*: running, buffered or waiting to be re-issued. A
checkpoint stores the pending prompt indices, so a restarted run re-issues exactly the prompts
that were not trained yet - none twice, none lost.

Nothing waits forever: ``max_consecutive_failures`` prompts failing in a row with the same error
stop the run with that error (a server refusing every request), and a batch not ready within
``next_batch``'s deadline raises `RolloutStalled`, whose message says what the rollouts were
doing (`diagnose`: the phase, requests in flight per server, reward calls, the last errors).

The manager's link threads (one per trainer link) only talk to the controller through these
thread-safe methods; every call into the event loop goes through ``run_coroutine_threadsafe`` with
a deadline. The policy version is not stored here: it is read from the manager's `RolloutCluster`
(``versions.get_version()``), which follows the trainer's counter push by push.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Optional

from megarl.data.datasets import PromptDataset, ResumableSampler
from megarl.rollout.client import RolloutClient, ServerRequestError
from megarl.rollout.failures import RolloutFailed, RolloutStalled, error_key
from megarl.rollout.shaping import GroupShaping
from megarl.rollout.staleness import EpisodeState, StalenessManager, VersionProvider
from megarl.protocol.types import Trajectory
from megarl.rollout.workflows.base import close_envs, workflow_envs

log = logging.getLogger("megarl.controller")


@dataclass
class Group:
    """One finished episode: the samples of one prompt (draw = which draw of the prompt stream)."""

    draw: int
    prompt_index: int
    trajectories: list[Trajectory]


class RolloutController:
    def __init__(self, dataset: PromptDataset, workflow, servers: list[str], versions: VersionProvider,
                 *, batch_groups: int, max_staleness: float, max_concurrent: int, seed: int = 0,
                 api_key: Optional[str] = None, dynamic_sampling: bool = False,
                 shaping: Optional[GroupShaping] = None,
                 partial_rollout: bool = True, max_retries: int = 2, failed_log: Optional[str] = None,
                 timeline=None, sampling_seed: Optional[int] = None, client_kwargs: Optional[dict] = None,
                 max_consecutive_failures: int = 8, hold_timeout_s: float = 600.0,
                 stale_cap: Optional[int] = None, teacher: Optional[dict] = None):
        self.dataset, self.workflow, self.versions = dataset, workflow, versions
        self.sampler = (dataset.make_sampler(seed) if hasattr(dataset, "make_sampler")  # honours data.shuffle
                        else ResumableSampler(len(dataset), seed=seed))
        self.staleness = StalenessManager(batch_groups, max_staleness, max_concurrent, versions)
        # None: the bound itself (every trained token within max_staleness versions)
        self.stale_cap = math.ceil(max_staleness) if stale_cap is None else stale_cap
        self.dynamic_sampling, self.partial_rollout = dynamic_sampling, partial_rollout
        # DAPO's order: overlong shaping first, then dynamic sampling on the shaped rewards
        self.shaping = shaping or GroupShaping(0, dynamic_sampling=dynamic_sampling)
        self.max_retries, self.failed_log, self.timeline = max_retries, failed_log, timeline
        self.sampling_seed = sampling_seed
        self.max_consecutive_failures, self.hold_timeout_s = max_consecutive_failures, hold_timeout_s
        self._failing: tuple[str, int] = ("", 0)  # (error key, prompts failed in a row with it)
        self._fatal: Optional[str] = None  # set once the failures in a row reach the bound
        self._servers, self._api_key, self._client_kwargs = servers, api_key, client_kwargs or {}
        self._episode = 0
        self._draws = 0  # prompts drawn from the sampler so far: draw d is epoch d // n, slot d % n
        # (draw, prompt index) pairs to (re-)issue before new ones; restored from a checkpoint
        self._pending: collections.deque[tuple[int, int]] = collections.deque()
        self._running: dict[int, tuple[int, int]] = {}  # episode id -> (draw, prompt index)
        self._buffer: collections.deque[Group] = collections.deque()
        self._ready = threading.Condition()
        self._errors: collections.deque[str] = collections.deque(maxlen=5)
        self._loop = asyncio.new_event_loop()
        self._thread: Optional[threading.Thread] = None
        self._wake: Optional[asyncio.Event] = None
        self._stopping = False
        self.client: Optional[RolloutClient] = None
        # on-policy distillation: TeacherClient(**teacher) scores each group (made on the loop)
        self._teacher_args, self.teacher = teacher, None
        self.counters = collections.Counter()  # trained, filtered/<name>, failed, retries
        self.also_close: list = []  # other workflows run on this loop (the evaluation's): closed at stop
        self.trained_groups = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        # Buffered and running episodes of a previous run are gone; the count restarts from what
        # was trained (their prompts are in _pending and will be issued again).
        self.staleness.rebase(self.trained_groups)
        self._thread = threading.Thread(target=self._loop.run_forever, name="megarl-controller", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)

    async def _start(self) -> None:
        self.client = RolloutClient(self._servers, self._api_key, version_fn=self.versions.get_version,
                                    timeline=self.timeline, **self._client_kwargs)
        if self._teacher_args:
            from megarl.rollout.teacher import TeacherClient

            self.teacher = TeacherClient(**self._teacher_args)
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._executor())

    @property
    def reward(self):
        """The workflow's `RewardCaller` (None for a workflow without one, and for a mixture of
        sources: each has its own, `rewards`)."""
        return getattr(getattr(self.workflow, "ctx", None), "reward", None)

    @property
    def rewards(self) -> list:
        """Every `RewardCaller` the rollouts call: the workflow's, or each source's."""
        if hasattr(self.workflow, "rewards"):
            return list(self.workflow.rewards)
        return [self.reward] if self.reward is not None else []

    def stop(self) -> None:
        self._stopping = True
        if self._thread is None:
            return

        async def shutdown():
            self._wake.set()
            self._task.cancel()
            for t in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                t.cancel()
            for reward in self.rewards:
                await reward.aclose()  # an HTTP reward's session, threads, worker processes
            if self.teacher is not None:
                await self.teacher.close()
            await close_envs(self.workflow, *self.also_close)  # environment servers' sessions (EnvironmentWorkflow)
            await self.client.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._thread = None

    # ------------------------------------------------------------------ executor
    def _next_prompt(self) -> tuple[int, int]:
        # prompts already drawn (a checkpoint's or a too-stale group's) go first: exactly once, none lost
        if self._pending:
            return self._pending.popleft()
        # a fresh draw: its number seeds the sampling of a seeded run, so it is counted before use
        self._draws += 1
        return self._draws - 1, self.sampler.next_index()

    async def _executor(self) -> None:
        while not self._stopping:
            # once prompts keep failing the run stops: no more prompts are spent on it
            for _ in range(0 if self._fatal else self.staleness.try_start(self.staleness.max_concurrent)):
                self._episode += 1
                draw, index = self._next_prompt()
                self._running[self._episode] = (draw, index)
                asyncio.ensure_future(self._run_episode(draw, index, self._episode))
            self._wake.clear()
            try:
                # woken by a finished episode or a new version; the 0.5 s poll only bounds a missed wake-up
                await asyncio.wait_for(self._wake.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass

    async def _run_episode(self, draw: int, index: int, episode_id: int) -> None:
        # the slot is released as rejected unless the group reaches the buffer (finally: never leaked)
        state = EpisodeState.REJECTED
        try:
            group = await self._attempts(index, draw)
            if group is None:
                pass  # filtered or failed: counted where decided
            # shaped, then equal rewards -> all-zero group-relative advantages: it would teach nothing
            elif not self.shaping(group):
                self.counters["filtered/dynamic_sampling"] += 1
                self._count_source("source_filtered", index)
            else:
                source = getattr(self.dataset[index], "source", "")
                for t in group:
                    t.group_id = episode_id
                    t.info["prompt_index"], t.info["draw"] = index, draw
                    if source:  # a mixture: the per-source metrics of the step (rollout_stats)
                        t.info["source"] = source
                state = EpisodeState.ACCEPTED
                with self._ready:
                    self._buffer.append(Group(draw, index, group))
                    self._ready.notify_all()
        finally:
            # no await between the buffer append and this pop, and state_dict runs on this loop: it never
            # sees the prompt both running and buffered (which would re-issue it twice)
            self._running.pop(episode_id, None)
            self.staleness.finish(state)
            self._wake.set()

    async def _attempts(self, index: int, draw: int) -> Optional[list[Trajectory]]:
        """The workflow on one prompt, retried when it raises (a transient server or reward
        error must not lose the prompt); None when filtered or failed for good. A request the
        server refused (4xx) fails at once: the same request would be refused again."""
        sample = self.dataset[index]
        if self.sampling_seed is not None:  # a seeded run: the draw decides the sampled tokens
            # 1_000_003 (a prime) spreads run seeds apart; % 2**62 keeps the seed a positive int64 for the server
            sample = dataclasses.replace(sample, seed=(self.sampling_seed * 1_000_003 + draw) % 2**62)
        for attempt in range(self.max_retries + 1):
            try:
                group = await self.workflow.arun_episode(self.client, sample)
                if group and self.teacher is not None:  # distillation: the teacher scores every generated token
                    await self.teacher.score(group)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - one bad episode must not stop the executor
                error = f"{type(e).__name__}: {e}"
                self._errors.append(error)
                # a 4xx is the request's fault, not the server's: retrying would be refused the same way
                if attempt < self.max_retries and not isinstance(e, ServerRequestError):
                    self.counters["retries"] += 1
                    log.warning("prompt %d attempt %d failed (retrying): %s", index, attempt + 1, error)
                    continue
                self._record_failure(index, error, attempt + 1, error_key(e))
                return None
            self._failing = ("", 0)  # a prompt got through: the failures are not systematic
            self._count_source("source_done", index)
            if group is None:  # the workflow's own filter
                self.counters["filtered/workflow"] += 1
                self._count_source("source_filtered", index)
            return group
        return None

    def _count_source(self, what: str, index: int) -> None:
        source = getattr(self.dataset[index], "source", "")
        if source:
            self.counters[f"{what}/{source}"] += 1

    def _record_failure(self, index: int, error: str, attempts: int, key: str) -> None:
        self.counters["failed"] += 1
        log.warning("prompt %d failed after %d attempt(s): %s", index, attempts, error)
        if self.failed_log:
            with open(self.failed_log, "a") as f:
                f.write(json.dumps({"prompt_index": index, "attempts": attempts,
                                    "error": error, "version": self.versions.get_version()}) + "\n")
        # only the same error in a row is systematic; any success or another error restarts the count
        same = self._failing[1] + 1 if self._failing[0] == key else 1
        self._failing = (key, same)
        if same >= self.max_consecutive_failures and self._fatal is None:
            # the trainer blocked in next_batch is woken below, so it raises RolloutFailed now, not at its deadline
            self._fatal = (f"rollout: {same} prompts in a row failed with the same error "
                           f"(rollout.max_consecutive_failures), last {' '.join(error.split())[:500]}")
            with self._ready:
                self._ready.notify_all()

    # ------------------------------------------------------------------ trainer-thread API
    def next_batch(self, n_groups: int, timeout_s: float = 600.0, version: Optional[int] = None) -> list[Trajectory]:
        """The oldest ``n_groups`` finished groups, flattened; blocks until they exist. The
        prompts of the returned groups count as trained from here on. Raises `RolloutFailed`
        when prompts keep failing, `RolloutStalled` after ``timeout_s`` without the batch.
        ``version``: the policy version that trains them (the trainer's; None: the servers'
        version here), from which the hard cap counts (`_too_stale`)."""
        deadline = time.monotonic() + timeout_s
        groups: list[Group] = []
        with self._ready:
            while len(groups) < n_groups:
                while not self._buffer:
                    left = deadline - time.monotonic()
                    if self._fatal is not None or left <= 0:
                        self._buffer.extendleft(reversed(groups))  # nothing taken: none trained
                    if self._fatal is not None:
                        raise RolloutFailed(self._fatal)
                    if left <= 0:
                        raise RolloutStalled(f"rollout stalled: {len(groups)}/{n_groups} groups after "
                                             f"{timeout_s:g} s of waiting for the step "
                                             f"(train.stall_timeout_s); {self.diagnose()}")
                    self._ready.wait(timeout=min(left, 1.0))
                # FIFO: the oldest finished group first, which bounds how stale a trained group can be
                group = self._buffer.popleft()
                if self._too_stale(group, version):
                    continue
                groups.append(group)
            # counted under the lock with the pops: a checkpoint sees the groups either buffered or trained
            self.trained_groups += n_groups
        # in draw order, not completion order: the same groups make the same batch (seeded runs)
        groups.sort(key=lambda g: g.draw)
        return [t for g in groups for t in g.trajectories]

    def fail(self, error: str) -> None:
        """The run cannot go on (an overlapped weight push failed for good): the step waiting in
        `next_batch` raises `RolloutFailed` with ``error`` now, and no episode starts."""
        with self._ready:
            if self._fatal is None:
                self._fatal = error
            self._ready.notify_all()

    def diagnose(self) -> str:
        """What the rollouts are doing now, in one line: the phase they wait in, the requests in
        flight per server, the reward calls running and the last errors."""
        c = self.client
        per_server = {s.address: s.inflight for s in c.servers if s.inflight} if c is not None else {}
        held = c is not None and c.held
        flights = [r.in_flight() for r in self.rewards]
        rewards, oldest = sum(n for n, _ in flights), max((t for _, t in flights), default=0.0)
        running = len(self._running)
        if held:
            phase = "held for a weight push (generation paused)"
        elif per_server:
            phase = "generate (requests sent, no answer yet)"
        elif rewards:
            phase = f"reward ({rewards} call(s) running, oldest {oldest:.0f} s)"
        elif running == 0:
            phase = "no episode running (staleness window or max_concurrent used up)"
        else:
            phase = "workflow (episodes running, no request or reward in flight)"
        servers = ", ".join(f"{a} ({n})" for a, n in per_server.items()) or "none"
        dead = [s.address for s in c.servers if not s.alive] if c is not None else []
        return (f"phase: {phase}; {running} episode(s) running, requests in flight: {servers}"
                + (f"; dead servers: {', '.join(dead)}" if dead else "")
                + f"; last errors: {self._last_errors()}")

    def _last_errors(self, n: int = 3) -> str:
        recent = list(dict.fromkeys(" ".join(e.split())[:200] for e in reversed(self._errors)))[:n]
        return "; ".join(recent) if recent else "none"

    def _too_stale(self, group: Group, version: Optional[int] = None) -> bool:
        """The staleness bound is kept when episodes start (`StalenessManager`); a started group
        is trained however long it ran, so long answers are not selected against. Only a
        straggler past the hard cap (its server died, its requests were resubmitted, say) is not
        trained: its prompt goes back to be generated again (still exactly once) and its slot is
        freed. Counted from ``version``, the policy that trains the group: the trainer's counter,
        which runs ahead of the servers' version here when a push's deferred tail failed to
        publish (a server died after the buckets loaded: the live servers flipped, the trainer
        committed, this side did not) - counting from the servers' then let a group one version
        past the cap be trained."""
        oldest = min((t.min_version for t in group.trajectories), default=-1)
        current = self.versions.get_version() if version is None else max(version, self.versions.get_version())
        # oldest < 0: no token carries a version (nothing generated)
        if oldest < 0 or current - oldest <= self.stale_cap:
            return False
        self._pending.appendleft((group.draw, group.prompt_index))
        # the group was counted accepted when it finished: give the slot back so a replacement can start
        self.staleness.unaccept()
        self.counters["regenerated/too_stale"] += 1
        self._wake_threadsafe()
        return True

    def _wake_threadsafe(self) -> None:
        if self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def submit(self, fn):
        """Runs coroutine ``fn(client)`` on the controller's loop (with its client, beside the
        training rollouts); returns a concurrent future. For work such as evaluation."""
        async def run():
            return await fn(self.client)

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    def _call(self, coro_fn, timeout_s: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self._loop).result(timeout=timeout_s)

    # ------------------------------------------------------------------ ClusterListener
    def hold(self) -> None:
        """Before the servers pause: close the client's gate; without partial rollouts also wait
        until every in-flight request finished under the old weights (evaluation requests are
        always let finish: they report one version). That wait ends after ``hold_timeout_s``
        (weights.timeout_s) with `RolloutStalled` naming the servers that still hold requests:
        the push fails, and its recovery drops the hung servers and retries."""
        if self._thread is None:
            return

        async def hold():
            self.client.hold()
            try:
                await asyncio.wait_for(self.client.drain(atomic_only=self.partial_rollout), self.hold_timeout_s)
            except asyncio.TimeoutError:
                raise RolloutStalled(f"weight push stalled: requests still running under the old "
                                     f"weights after {self.hold_timeout_s:g} s (weights.timeout_s); "
                                     f"{self.diagnose()}") from None

        # +5 s over the drain's own deadline so the RolloutStalled above, not a bare timeout, reaches the pusher
        self._call(hold, self.hold_timeout_s + 5.0)

    def release(self) -> None:
        if self._thread is not None:
            self._call(self._async(lambda: self.client.release()))

    def on_server_removed(self, address: str) -> None:
        """Its in-flight requests go to the other servers with the tokens generated so far."""
        if self._thread is not None:
            self._call(self._async(lambda: self.client.remove_server(address)))
        else:
            self._servers = [a for a in self._servers if a.rstrip("/") != address.rstrip("/")]

    def on_server_added(self, address: str) -> None:
        if self._thread is not None:
            self._call(self._async(lambda: self.client.add_server(address)))
        elif address not in self._servers:
            self._servers.append(address)

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
        out = {"rollout/running": s.running, "rollout/buffered": len(self._buffer),
               "rollout/accepted": s.accepted, "rollout/rejected": s.rejected,
               "rollout/failed": self.counters["failed"], "rollout/retries": self.counters["retries"],
               "rollout/filtered": sum(v for k, v in self.counters.items() if k.startswith("filtered/")),
               # how often the staleness hard cap fired: reported as 0 too
               "rollout/regenerated/too_stale": self.counters["regenerated/too_stale"]}
        out.update({f"rollout/{k}": v for k, v in self.counters.items()
                    if k.startswith(("filtered/", "regenerated/"))})
        if self.client is not None:
            out["rollout/busy_s"] = self.client.busy_seconds()
        envs = workflow_envs(self.workflow)
        if envs:  # environment episodes (EnvironmentWorkflow), cumulative
            for k in ("episodes", "steps", "episode_errors", "episode_retries", "episodes_failed", "reset_retries"):
                out[f"env/{k}"] = sum(e.stats[k] for e in envs)
        if self.teacher is not None:
            out.update(self.teacher.stats)
        out.update({f"data/{k}": v for k, v in getattr(self.dataset, "stats", {}).items()})
        for reward in self.rewards:  # a user workflow need not carry the system's context
            for k, v in reward.stats().items():  # counts: one sum over the sources' callers
                out[k] = out.get(k, 0) + v
        draws = getattr(self.sampler, "draws", None)
        if draws is not None:  # a mixture (data.sources): each source's share of the fresh draws
            for name, n in zip(self.sampler.names, draws):  # (the sampler's count: kept across a resume)
                out[f"source/{name}/draws"], out[f"source/{name}/draw_share"] = n, n / max(sum(draws), 1)
                # its groups that finished, and the share of them dropped (workflow or dynamic sampling)
                done = self.counters[f"source_done/{name}"]
                out[f"source/{name}/filtered_frac"] = self.counters[f"source_filtered/{name}"] / done if done else 0.0
        return out

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """Exactly-once bookkeeping: the sampler position (next fresh prompt) and every prompt
        drawn but not trained yet (waiting, running in start order, buffered in FIFO order)."""
        def snapshot() -> dict:
            with self._ready:
                buffered = [(g.draw, g.prompt_index) for g in self._buffer]
            running = [self._running[e] for e in sorted(self._running)]
            pending = sorted(list(self._pending) + running + buffered)  # by draw: the stream's order
            return {"sampler": self.sampler.state_dict(), "draws": self._draws,
                    "pending": [list(p) for p in pending],
                    "trained_groups": self.trained_groups, "episodes": self._episode,
                    "counters": dict(self.counters)}

        if self._thread is None:
            return snapshot()

        async def on_loop():  # the executor mutates the sampler and _running on the loop thread
            return snapshot()

        return self._call(on_loop, 60)

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self._pending = collections.deque((int(d), int(i)) for d, i in state["pending"])
        self._draws = int(state["draws"])
        self.trained_groups = int(state["trained_groups"])
        self._episode = int(state["episodes"])
        self.counters = collections.Counter(state.get("counters", {}))
