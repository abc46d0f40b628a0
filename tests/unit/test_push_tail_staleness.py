"""The staleness hard cap when a server dies in a push's deferred tail (issue 39: the flaky
staleness assertion of tests/e2e/test_sglang_fault.py, made deterministic here).

Through the rollout manager the tail of a push (``FinishPush``: /update_weight_version,
/end_weight_update, the manager's commit) is submitted, not awaited; the trainer commits the new
version at once. A server SIGKILLed after the buckets loaded fails the publish: the live servers
flipped to the new version, the trainer committed it, but the manager's cluster did not (its
commit follows a successful publish). The next `BatchRequest` then found the manager's clock one
version behind the trainer's, so a straggler (a request of the dead server, resubmitted
elsewhere with its old tokens) passed the hard cap by the manager's count and was trained one
version past it by the trainer's: staleness 2 under max_staleness 1 with staleness_hard_cap 0.

The servers here are a test double of the admin connection (`DyingAdmin`): the fault must land
in the few milliseconds between the buckets loading and the publish, which a real server cannot
be killed into deterministically; the manager, its cluster, its controller and the batch packing
are the real ones.
"""
import asyncio
import contextlib

from megarl.data.datasets import PromptSample
from megarl.protocol.messages import BatchRequest
from megarl.protocol.types import Trajectory
from megarl.rollout.cluster import RolloutCluster
from megarl.rollout.controller import Group, RolloutController
from megarl.rollout.http import AdminError
from megarl.rollout.manager import RolloutManager
from megarl.trainer.rollout_stats import sample_versions

A, B = "http://127.0.0.1:9", "http://127.0.0.1:10"


def traj(reward: float, version: int) -> Trajectory:
    return Trajectory([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, version, version], reward, -1)


class DyingAdmin:
    """`AdminRunner.call` against servers A and B; A was SIGKILLed after the buckets loaded, so
    the publish (/update_weight_version) fails on it. Records every operation."""

    def __init__(self):
        self.ops: list[str] = []

    def call(self, fn, timeout_s=None):
        admin = self

        class Ops:
            def __getattr__(self, name):
                def op(*args, **kwargs):
                    admin.ops.append(name)
                    if name == "update_weight_version":
                        raise AdminError("/update_weight_version", {A: "Connection refused"})
                    return {A: None, B: None}
                return op

        return fn(Ops())


class CurrentWorkflow:
    """Regenerated prompts come back from live server B, which flipped to version 2."""

    async def arun_episode(self, client, sample):
        await asyncio.sleep(0.001)
        return [traj(1.0, 2), traj(0.0, 2)]


def test_a_failed_push_tail_does_not_let_a_straggler_past_the_hard_cap():
    cluster = RolloutCluster([A, B], driver=False, pause_mode="retract", version=1)
    cluster.admin = DyingAdmin()  # the driver's admin connection (driver=False: none of its own)
    data = [PromptSample(i, f"p{i}", {}, [1]) for i in range(8)]
    # max_staleness 1 and staleness_hard_cap 0: every trained token within 1 version (stale_cap 1)
    c = RolloutController(data, CurrentWorkflow(), [B], cluster, batch_groups=1, max_staleness=1,
                          max_concurrent=1, stale_cap=1)
    cluster.subscribe(c)
    m = RolloutManager(spec=None)
    m.cluster, m.controller = cluster, c
    # steps 1 and 2 trained; buffered, in finish order: a straggler of dead server A (its version-0
    # tokens resubmitted to B, finished late), then a group B made under version 1
    c.trained_groups = 2
    c._buffer.extend([Group(0, 0, [traj(1.0, 0), traj(0.0, 1)]), Group(1, 1, [traj(1.0, 1), traj(0.0, 1)])])
    c.start()
    c.staleness.rebase(4)  # the two trained and the two buffered were accepted
    try:
        # push 2: pause, buckets loaded, then the deferred tail runs while A is dead
        cluster.pause_for_update()
        try:
            m.finish_push(2)
            raise AssertionError("the publish should have failed on the dead server")
        except AdminError:
            pass
        trainer_version = 2  # the trainer committed version 2: its FinishPush was not awaited
        assert cluster.version == 1 and "continue_generation" in cluster.admin.ops  # resumed, not committed
        batch = m.handle(BatchRequest(1, 20.0, trainer_version))
    finally:
        c.stop()
    _, oldest, _ = sample_versions(batch.arrays)
    staleness = trainer_version - oldest  # what the trainer logs as staleness_max (batch_metrics)
    assert staleness.max() <= 1, f"trained staleness {staleness.tolist()} past the hard cap 1"
    assert c.counters["regenerated/too_stale"] == 1  # the straggler goes back to be generated
    assert [0, 0] in c.state_dict()["pending"]  # its prompt is not lost: still to be trained once


def test_the_trainer_asks_for_its_batch_with_its_own_version():
    """The other half: the trainer's step sends the version it trains the batch with (the
    manager's fallback, its own clock, is the one that lags)."""
    from types import SimpleNamespace

    from megarl.trainer.rl import StepRunner

    asked = []

    class Side:
        def next_batch(self, *args):
            asked.append(args)
            return SimpleNamespace(rejoin=[])

    cfg = SimpleNamespace(train=SimpleNamespace(step_batch_size=8, stall_timeout_s=30.0),
                          rollout=SimpleNamespace(group_size=4))
    timer = SimpleNamespace(phase=lambda name: contextlib.nullcontext())
    runner = StepRunner(cfg, None, SimpleNamespace(version=7), Side(), None, None, None, timer)
    runner._next_batch()
    assert asked == [(2, 30.0, 7)]
