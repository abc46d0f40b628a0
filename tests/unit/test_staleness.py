"""StalenessManager against the formula, and the controller's executor/buffer with a workflow
that needs no server (a test double for the rollout servers: this tier checks the controller's
own bookkeeping; tests/e2e runs it against real servers)."""
import asyncio
import threading

import pytest

from megarl.data.datasets import PromptSample
from megarl.rollout.cluster import RolloutCluster
from megarl.rollout.controller import RolloutController
from megarl.rollout.staleness import EpisodeState, StalenessManager
from megarl.protocol.types import Trajectory


class Version:
    def __init__(self):
        self.v = 0

    def get_version(self):
        return self.v


def test_capacity_formula_by_hand():
    ver = Version()
    m = StalenessManager(batch_size=4, max_staleness=1, max_concurrent=6, versions=ver)
    # v=0: (1 + 0 + 1) * 4 - 0 = 8, concurrency 6 -> 6
    assert m.capacity() == 6 and m.try_start(10) == 6
    assert m.capacity() == 0  # 6 running
    for _ in range(4):
        m.finish(EpisodeState.ACCEPTED)
    # running 2, accepted 4: min(6 - 2, 8 - 6) = 2
    assert m.capacity() == 2 and m.try_start(5) == 2
    m.finish(EpisodeState.REJECTED)  # frees a slot without counting
    # running 3, accepted 4: min(3, 8 - 7) = 1
    assert m.capacity() == 1
    ver.v = 1  # (1 + 1 + 1) * 4 - 7 = 5; 6 - 3 = 3
    assert m.capacity() == 3
    s = m.stats()
    assert (s.running, s.accepted, s.rejected, s.version) == (3, 4, 1, 1)


def test_synchronous_mode_waits_for_the_next_version():
    ver = Version()
    m = StalenessManager(batch_size=2, max_staleness=0, max_concurrent=100, versions=ver)
    assert m.try_start(5) == 2
    m.finish(EpisodeState.ACCEPTED)
    m.finish(EpisodeState.ACCEPTED)
    assert m.capacity() == 0  # batch for version 0 done; the next needs version 1
    ver.v = 1
    assert m.capacity() == 2


def test_bad_use_raises():
    m = StalenessManager(1, 0, 1, Version())
    with pytest.raises(RuntimeError):
        m.finish(EpisodeState.ACCEPTED)
    with pytest.raises(ValueError):
        StalenessManager(0, 0, 1, Version())


class CountingWorkflow:
    """Returns a group of 2 trajectories after a short await; rewards equal when index % 3 == 0."""

    def __init__(self):
        self.running = 0
        self.max_running = 0
        self.lock = threading.Lock()

    async def arun_episode(self, client, sample):
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        await asyncio.sleep(0.01)
        with self.lock:
            self.running -= 1
        rewards = [1.0, 1.0] if sample.index % 3 == 0 else [0.0, 1.0]
        return [Trajectory([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 0, 0], r, -1) for r in rewards]


def make_controller(workflow, **kw):
    data = [PromptSample(i, f"p{i}", {}, [1]) for i in range(30)]
    defaults = dict(batch_groups=3, max_staleness=1, max_concurrent=4, seed=0)
    defaults.update(kw)
    cluster = RolloutCluster([], driver=False)  # holds the version only: no server to admin
    controller = RolloutController(data, workflow, ["http://127.0.0.1:9"], cluster, **defaults)
    cluster.subscribe(controller)
    return controller


def test_controller_respects_staleness_and_concurrency():
    wf = CountingWorkflow()
    c = make_controller(wf)
    c.start()
    try:
        batch = c.next_batch(3, timeout_s=10)
        assert len(batch) == 6 and len({t.group_id for t in batch}) == 3
        # at version 0 with max_staleness 1, no more than (1+0+1)*3 = 6 episodes may ever start
        import time
        time.sleep(0.2)
        s = c.staleness.stats()
        assert s.accepted + s.running <= 6 and wf.max_running <= 4
        c.versions.commit(1)  # what a weight push ends with
        batch2 = c.next_batch(3, timeout_s=10)
        assert len(batch2) == 6 and not {t.group_id for t in batch} & {t.group_id for t in batch2}
        time.sleep(0.2)
        s = c.staleness.stats()
        assert s.accepted + s.running <= 9
    finally:
        c.stop()


def test_dynamic_sampling_filters_equal_reward_groups_and_timeout_reports():
    c = make_controller(CountingWorkflow(), dynamic_sampling=True, max_staleness=3)
    c.start()
    try:
        batch = c.next_batch(4, timeout_s=10)
        groups = {}
        for t in batch:
            groups.setdefault(t.group_id, []).append(t.reward)
        assert all(len(set(r)) == 2 for r in groups.values())
        assert c.counters["filtered/dynamic_sampling"] >= 1
        with pytest.raises(TimeoutError, match="groups after"):
            c.next_batch(100, timeout_s=0.5)
    finally:
        c.stop()
