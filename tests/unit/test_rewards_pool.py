"""reward.executor=process: sync rewards in real worker processes (RewardProcessPool behind
RewardCaller). Results come back in order from other processes; a hung verifier is killed at its
deadline (counted from when a worker takes the call) and its worker replaced; a crashing worker is
replaced; raises map to on_error_value; close() leaves no process behind; the workers ignore the
stop signals a preempted trainer receives."""
import asyncio
import os
import signal
import textwrap
import time

import psutil
import pytest

from megarl.config import ConfigError, RewardConfig
from megarl.rewards import RewardCaller, RewardError
from megarl.rewards.pool import RewardProcessPool

PLUGIN = """
import os, sys, time

def pid(prompt, completion, meta):
    return float(os.getpid())

def imports_torch(prompt, completion, meta):
    return float("torch" in sys.modules)

def score(prompt, completion, meta):
    if completion == "hang":
        time.sleep(3600)
    if completion == "crash":
        os._exit(3)
    if completion == "raise":
        raise KeyError("answer")
    if completion == "nan":
        return float("nan")
    return len(completion) * meta["scale"]

class Scaled:
    def __init__(self, scale):
        self.scale = scale

    def __call__(self, prompt, completion, meta):
        return self.scale * len(completion)

async def coro(prompt, completion, meta):
    return 1.0
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    name = f"reward_plugin_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))  # workers get the parent's sys.path
    return name


def caller(plugin, fn="score", **cfg) -> RewardCaller:
    rc = RewardConfig(executor="process", **cfg)
    rc.validate()
    return RewardCaller.from_config(f"{plugin}:{fn}", rc)


def worker_pids(reward: RewardCaller) -> set[int]:
    return {w.proc.pid for w in reward.pool._workers if w.alive()}


def test_rewards_run_in_worker_processes_and_come_back_in_order(plugin):
    async def main():
        reward = caller(plugin, fn="pid", num_workers=2, timeout_s=60)
        pids = await asyncio.gather(*(reward("p", str(i), {}) for i in range(8)))
        scaled = caller(plugin, fn="Scaled", num_workers=1, args={"scale": 0.5})
        out = await scaled.many("p", ["a", "bcd", ""], {})
        lean = caller(plugin, fn="imports_torch", num_workers=1)
        assert await lean("p", "c", {}) == 0.0  # a worker imports the reward, not the trainer
        await lean.aclose()
        workers = worker_pids(reward)
        await reward.aclose()
        await scaled.aclose()
        return reward, pids, workers, out

    reward, pids, workers, out = asyncio.run(main())
    assert reward.pool is not None and len(workers) == 2
    assert {int(p) for p in pids} <= workers and os.getpid() not in workers
    assert out == [0.5, 1.5, 0.0]  # reward.args build the class inside each worker
    assert reward.stats() == {"reward/calls": 8, "reward/errors": 0, "reward/timeouts": 0,
                              "reward/worker_restarts": 0}


def test_a_hung_worker_is_killed_at_its_deadline_and_replaced(plugin):
    async def main():
        reward = caller(plugin, num_workers=1, timeout_s=1.0, on_error_value=-1.0)
        assert await reward("p", "ab", {"scale": 1.0}) == 2.0  # the worker is up
        first = worker_pids(reward)
        t0 = time.monotonic()
        # one worker: "ok" waits behind the hung call; only the time on a worker counts
        out = await asyncio.gather(reward("p", "hang", {}), reward("p", "abc", {"scale": 2.0}))
        took = time.monotonic() - t0
        second = worker_pids(reward)
        await reward.aclose()
        return reward, out, took, first, second

    reward, out, took, first, second = asyncio.run(main())
    assert out == [-1.0, 6.0]
    assert took < 30  # the hung call did not hold its worker for its hour
    assert first and second and first.isdisjoint(second)  # killed and replaced
    assert not psutil.pid_exists(next(iter(first))) or psutil.Process(next(iter(first))).status() == "zombie"
    assert reward.stats() == {"reward/calls": 3, "reward/errors": 0, "reward/timeouts": 1,
                              "reward/worker_restarts": 1}


def test_raises_crashes_and_nan_are_counted_and_the_pool_goes_on(plugin):
    async def main():
        lenient = caller(plugin, num_workers=1, on_error_value=0.0)
        out = [await lenient("p", c, {"scale": 1.0}) for c in ("raise", "crash", "nan", "abcd")]
        strict = caller(plugin, num_workers=1)
        errors = []
        for c in ("raise", "crash"):
            with pytest.raises(RewardError) as e:
                await strict("p", c, {})
            errors.append(str(e.value))
        for r in (lenient, strict):
            await r.aclose()
        return lenient, out, errors

    lenient, out, errors = asyncio.run(main())
    assert out == [0.0, 0.0, 0.0, 4.0]
    assert lenient.stats() == {"reward/calls": 4, "reward/errors": 3, "reward/timeouts": 0,
                               "reward/worker_restarts": 1}
    assert errors[0] == "reward failed: RuntimeError: KeyError: 'answer'"
    assert errors[1] == "reward failed: RewardWorkerDied: reward worker exited (code 3) during the call"


def test_close_kills_a_running_call_and_leaves_no_process(plugin):
    async def main():
        reward = caller(plugin, num_workers=2, timeout_s=0, on_error_value=-1.0)
        assert await reward("p", "a", {"scale": 1.0}) == 1.0
        hung = asyncio.ensure_future(reward("p", "hang", {}))
        await asyncio.sleep(0.5)
        pids = worker_pids(reward)
        t0 = time.monotonic()
        await reward.aclose()
        return pids, time.monotonic() - t0, await hung

    pids, took, hung_value = asyncio.run(main())
    assert len(pids) == 2 and took < 10
    assert hung_value == -1.0  # the killed call reports an error, it is not left waiting
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert alive == []


def test_workers_ignore_the_stop_signals_of_a_preempted_trainer(plugin):
    async def main():
        reward = caller(plugin, fn="pid", num_workers=1)
        before = int(await reward("p", "a", {}))
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            os.kill(before, sig)
        await asyncio.sleep(0.3)
        after = int(await reward("p", "a", {}))
        await reward.aclose()
        return before, after, reward.pool.restarts

    before, after, restarts = asyncio.run(main())
    assert before == after and restarts == 0


def test_executor_config_and_async_functions(plugin):
    for bad, match in (({"executor": "fork"}, "reward.executor: must be thread or process, got 'fork'"),
                       ({"num_workers": 0}, "reward.num_workers: must be >= 1, got 0")):
        with pytest.raises(ConfigError, match=match):
            RewardConfig(**bad).validate()
    assert caller(plugin, fn="coro").pool is None  # coroutines run on the loop: no processes
    assert RewardCaller.from_config(f"{plugin}:score", RewardConfig()).pool is None  # thread default
    with pytest.raises(ValueError, match="reward.num_workers: must be >= 1"):
        RewardProcessPool(f"{plugin}:score", workers=0)
    with pytest.raises(ImportError, match="has no attribute 'nope'"):  # fails at start-up, not per call
        caller(plugin, fn="nope")


def test_the_worker_pipe_speaks_typed_messages(plugin):
    # the worker's side of the protocol in a thread, over a real pipe: every message a dataclass
    import multiprocessing
    import threading

    from megarl.rewards.pool import RewardCall, RewardReply, WorkerReady, _serve

    ours, theirs = multiprocessing.Pipe()
    t = threading.Thread(target=_serve, args=(theirs, f"{plugin}:score", None), daemon=True)
    t.start()
    assert ours.recv() == WorkerReady()
    ours.send(RewardCall("p", "abc", {"scale": 2.0}))
    assert ours.recv() == RewardReply(True, 6.0)
    ours.send(RewardCall("p", "raise", {"scale": 1.0}))
    assert ours.recv() == RewardReply(False, "KeyError: 'answer'")
    ours.close()  # the worker sees EOF and returns
    t.join(10)
    assert not t.is_alive()
