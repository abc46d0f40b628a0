"""The controller's prompt ledger: every drawn prompt ends trained, filtered or failed; retries;
exactly-once across a checkpoint. The workflows here are test doubles for the rollout servers
(this tier checks the controller's own bookkeeping; tests/e2e runs it against real servers)."""
import asyncio
import json
import time

from megarl.data.datasets import PromptSample
from megarl.rollout.cluster import RolloutCluster
from megarl.rollout.controller import RolloutController
from megarl.rollout.staleness import StalenessManager
from megarl.protocol.types import Trajectory


def traj(reward: float, version: int = 0) -> Trajectory:
    return Trajectory([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, version, version], reward, -1)


class ScriptedWorkflow:
    """Prompt 3 raises twice then succeeds; prompt 5 always raises; prompt 7 is rejected (None)."""

    def __init__(self, delay: float = 0.005):
        self.attempts: dict[int, int] = {}
        self.delay = delay
        self.version = lambda: 0  # set to the cluster's clock: tokens carry the version they were made at

    async def arun_episode(self, client, sample):
        await asyncio.sleep(self.delay)
        n = self.attempts[sample.index] = self.attempts.get(sample.index, 0) + 1
        if sample.index == 3 and n <= 2 or sample.index == 5:
            raise RuntimeError(f"boom {sample.index}")
        if sample.index == 7:
            return None
        return [traj(0.0, self.version()), traj(1.0, self.version())]


def make(tmp_path, n_prompts=12, **kw):
    data = [PromptSample(i, f"p{i}", {}, [1]) for i in range(n_prompts)]
    cluster = RolloutCluster([], driver=False)  # the version clock only
    args = dict(batch_groups=2, max_staleness=1, max_concurrent=3, seed=0, max_retries=2,
                failed_log=str(tmp_path / "failed.jsonl"))
    args.update(kw)
    workflow = ScriptedWorkflow()
    workflow.version = cluster.get_version
    c = RolloutController(data, workflow, ["http://127.0.0.1:9"], cluster, **args)
    cluster.subscribe(c)
    return c, cluster


def drain_epoch(c, cluster, n_batches: int) -> list[Trajectory]:
    """n_batches trainer steps: take a batch, then the push moves the version on."""
    out = []
    for _ in range(n_batches):
        out += c.next_batch(2, timeout_s=20)
        cluster.commit(cluster.version + 1)
    return out


def test_every_prompt_ends_trained_filtered_or_failed(tmp_path):
    c, cluster = make(tmp_path, n_prompts=12)
    c.start()
    try:
        trained = drain_epoch(c, cluster, 5)  # 12 prompts - 1 filtered - 1 failed = 10 groups
    finally:
        c.stop()
    first_epoch = sorted(t.info["prompt_index"] for t in trained if t.info["draw"] < 12)
    assert first_epoch == sorted(2 * [i for i in range(12) if i not in (5, 7)])
    assert c.workflow.attempts[3] == 3 and c.workflow.attempts[5] == 3  # max_retries + 1
    assert c.counters["retries"] >= 4 and c.counters["failed"] >= 1
    assert c.counters["filtered/workflow"] >= 1
    failed = [json.loads(line) for line in (tmp_path / "failed.jsonl").read_text().splitlines()]
    assert failed[0]["prompt_index"] == 5 and "boom 5" in failed[0]["error"]
    assert failed[0]["attempts"] == 3


def test_checkpoint_reissues_exactly_the_untrained_prompts(tmp_path):
    c, cluster = make(tmp_path, n_prompts=40, max_concurrent=4)
    c.start()
    try:
        trained = drain_epoch(c, cluster, 3)
        time.sleep(0.2)  # let the executor run ahead into the staleness window
        state = json.loads(json.dumps(c.state_dict()))  # must survive the JSON checkpoint meta
    finally:
        c.stop()
    draws_trained = {t.info["draw"] for t in trained}
    pending = {d for d, _ in state["pending"]}
    assert not draws_trained & pending
    assert state["trained_groups"] == 6
    # every draw so far is trained, pending, or was rejected (filtered/failed) for good
    rejected = {d for d in range(state["draws"]) if d not in draws_trained | pending}
    assert len(rejected) == c.counters["failed"] + c.counters["filtered/workflow"]

    # a new controller from the checkpoint issues the pending draws first, then new ones
    c2, cluster2 = make(tmp_path, n_prompts=40, max_concurrent=4)
    c2.load_state_dict(state)
    cluster2.version = 3
    c2.start()
    try:
        again = drain_epoch(c2, cluster2, 3)
    finally:
        c2.stop()
    draws_again = [t.info["draw"] for t in again]
    assert not set(draws_again) & draws_trained  # nothing trained twice
    assert pending <= set(draws_again) | {d for d in pending if d in rejected}
    assert min(d for d in draws_again if d not in pending) >= state["draws"]  # then fresh draws


def test_a_group_older_than_the_bound_is_generated_again_not_trained(tmp_path):
    c, cluster = make(tmp_path, n_prompts=12, max_staleness=1)
    c.workflow.version = lambda: 0  # every group claims version 0, however late it finishes
    c.start()
    try:
        first = c.next_batch(2, timeout_s=20)  # version 0: fresh
        deadline = time.monotonic() + 20
        while len(c._buffer) < 2 and time.monotonic() < deadline:  # two more made at version 0
            time.sleep(0.01)
        cluster.commit(1)
        cluster.commit(2)  # two pushes later, version-0 groups are 2 > max_staleness old
        c.workflow.version = cluster.get_version  # from now on generation is current
        later = c.next_batch(2, timeout_s=20)
    finally:
        c.stop()
    assert all(t.min_version == 0 for t in first)
    assert all(2 - t.min_version <= 1 for t in later)  # the bound holds in the batch
    assert c.counters["regenerated/too_stale"] >= 1  # the stale ones went back to be generated
    assert c.stats()["rollout/regenerated/too_stale"] == c.counters["regenerated/too_stale"]


def _late_groups(c, cluster, pushes: int):
    """Two groups made at version 0 that finish ``pushes`` versions later, then one batch."""
    c.workflow.version = lambda: 0  # every group claims version 0, however late it finishes
    c.start()
    try:
        c.next_batch(2, timeout_s=20)
        deadline = time.monotonic() + 20
        while len(c._buffer) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        for v in range(1, pushes + 1):
            cluster.commit(v)
        c.workflow.version = cluster.get_version
        return c.next_batch(2, timeout_s=20)
    finally:
        c.stop()


def test_a_group_past_the_bound_is_trained_up_to_the_hard_cap(tmp_path):
    # started within the bound (max_staleness 1), finished 3 versions later (a long answer):
    # trained, not regenerated - the bound is kept at the start, not by dropping long groups
    c, cluster = make(tmp_path, n_prompts=12, max_staleness=1, stale_cap=4)
    later = _late_groups(c, cluster, pushes=3)
    assert sorted(t.min_version for t in later) == [0] * len(later)
    assert c.counters["regenerated/too_stale"] == 0
    # past the hard cap (a straggler): generated again, counted
    c, cluster = make(tmp_path, n_prompts=12, max_staleness=1, stale_cap=4)
    later = _late_groups(c, cluster, pushes=5)
    assert all(5 - t.min_version <= 4 for t in later)
    assert c.counters["regenerated/too_stale"] >= 1


def test_the_hard_cap_is_never_below_the_bound_and_off_on_policy():
    from megarl.config import RolloutConfig

    assert RolloutConfig(max_staleness=2, staleness_hard_cap=16).stale_cap == 16
    assert RolloutConfig(max_staleness=2, staleness_hard_cap=0).stale_cap == 2  # the strict rule
    assert RolloutConfig(max_staleness=0, staleness_threshold=0.5, staleness_hard_cap=0).stale_cap == 1
    assert RolloutConfig(max_staleness=0, staleness_hard_cap=16).stale_cap == 0  # on-policy stays on-policy


def test_rebase_restarts_the_window_from_what_was_trained():
    class V:
        def get_version(self):
            return 3

    m = StalenessManager(batch_size=4, max_staleness=0.5, max_concurrent=100, versions=V())
    m.rebase(12)  # 3 versions x 4 groups trained, nothing buffered or running
    assert m.capacity() == 6  # floor((0.5 + 3 + 1) * 4) - 12 = 18 - 12
