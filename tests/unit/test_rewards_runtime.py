"""Running rewards: RewardCaller (async awaited, sync in a thread, timeouts, on_error_value) and
HttpReward against a real aiohttp scoring server on loopback (batching, errors, deadlines)."""
import asyncio
import threading

import pytest
from aiohttp import web

from megarl.rewards import HttpReward, RewardCaller, RewardError


def run(coro):
    return asyncio.run(coro)


def test_sync_rewards_run_off_the_event_loop():
    loop_thread = []

    def sync_fn(prompt, completion, meta):
        loop_thread.append(threading.current_thread().name)
        return len(completion) + meta["bonus"]

    async def main():
        caller = RewardCaller(sync_fn, timeout_s=5)
        out = await caller.many("p", ["a", "bcd"], {"bonus": 0.5})
        await caller.aclose()
        return caller, out

    caller, out = run(main())
    assert out == [1.5, 3.5] and not caller.is_async
    assert all(name.startswith("megarl-reward") for name in loop_thread)
    assert caller.stats() == {"reward/calls": 2, "reward/errors": 0, "reward/timeouts": 0}


def test_async_rewards_are_awaited_and_timeouts_map_to_on_error_value():
    async def slow(prompt, completion, meta):
        if completion == "hang":
            await asyncio.Event().wait()  # never set: only the deadline ends it
        return 1.0

    async def main():
        lenient = RewardCaller(slow, timeout_s=0.2, on_error_value=-1.0)
        assert lenient.is_async
        assert await lenient.many("p", ["ok", "hang", "ok"], {}) == [1.0, -1.0, 1.0]
        strict = RewardCaller(slow, timeout_s=0.2)
        with pytest.raises(RewardError, match="reward timed out after 0.2 s"):
            await strict("p", "hang", {})
        return lenient, strict

    lenient, strict = run(main())
    assert lenient.stats() == {"reward/calls": 3, "reward/errors": 0, "reward/timeouts": 1}
    assert strict.counts["timeouts"] == 1


def test_errors_and_bad_values():
    def bad(prompt, completion, meta):
        if completion == "raise":
            raise KeyError("answer")
        return {"nan": float("nan"), "str": "high"}[completion]

    async def main():
        lenient = RewardCaller(bad, on_error_value=0.0)
        assert await lenient.many("p", ["raise", "nan", "str"], {}) == [0.0, 0.0, 0.0]
        with pytest.raises(RewardError, match="reward failed: KeyError: 'answer'"):
            await RewardCaller(bad)("p", "raise", {})
        with pytest.raises(RewardError, match="non-finite reward nan"):
            await RewardCaller(bad)("p", "nan", {})
        return lenient

    assert run(main()).stats()["reward/errors"] == 3


class ScoringServer:
    """A real aiohttp scoring service on a free loopback port: reward = len(completion) + meta
    "bonus"; records every batch; `hang` makes it never answer, `fail` answers 500."""

    def __init__(self):
        self.batches: list[list[dict]] = []
        self.mode = "ok"
        self.release = asyncio.Event()

    async def score(self, request):
        body = await request.json()
        self.batches.append(body["items"])
        if self.mode == "hang":
            await self.release.wait()
        if self.mode == "fail":
            return web.json_response({"error": "model not loaded"}, status=500)
        if self.mode == "short":
            return web.json_response({"rewards": [1.0]})
        return web.json_response({"rewards": [len(i["completion"]) + i["meta"].get("bonus", 0) for i in body["items"]]})

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/score", self.score)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/score"
        return self

    async def __aexit__(self, *exc):
        self.release.set()
        await self.runner.cleanup()


def test_http_reward_batches_up_to_max_batch():
    async def main():
        async with ScoringServer() as server:
            # max_wait is long: only full batches are sent while 8 callers wait
            reward = HttpReward(server.url, max_batch=4, max_wait_ms=60_000)
            completions = ["x" * k for k in range(8)]
            out = await asyncio.gather(*(reward("p", c, {"bonus": 0.25}) for c in completions))
            await reward.aclose()
            return server.batches, out, reward.batches_sent

    batches, out, sent = run(main())
    assert out == [k + 0.25 for k in range(8)]
    assert [len(b) for b in batches] == [4, 4] and sent == 2
    assert batches[0][1] == {"prompt": "p", "completion": "x", "meta": {"bonus": 0.25}}


def test_http_reward_flushes_a_partial_batch_after_max_wait():
    async def main():
        async with ScoringServer() as server:
            reward = RewardCaller(HttpReward(server.url, max_batch=32, max_wait_ms=20), timeout_s=30)
            out = await reward.many("p", ["a", "bb", "ccc"], {})
            await reward.aclose()
            return server.batches, out

    batches, out = run(main())
    assert out == [1.0, 2.0, 3.0] and [len(b) for b in batches] == [3]


def test_http_reward_timeout_and_server_errors():
    async def main():
        async with ScoringServer() as server:
            server.mode = "hang"
            hung = RewardCaller(HttpReward(server.url, max_batch=2, max_wait_ms=0), timeout_s=0.3,
                                on_error_value=-1.0)
            assert await hung.many("p", ["a", "b"], {}) == [-1.0, -1.0]
            assert hung.stats()["reward/timeouts"] == 2
            server.release.set()
            await hung.aclose()  # the abandoned batch is still in flight until the server answers
            server.mode, server.batches = "fail", []
            failing = RewardCaller(HttpReward(server.url, max_batch=1, retries=2), on_error_value=0.0)
            assert await failing("p", "a", {}) == 0.0
            assert len(server.batches) == 3  # first try + 2 retries
            strict = RewardCaller(HttpReward(server.url, max_batch=2, retries=0))
            with pytest.raises(RewardError, match=r"answered 500: .*model not loaded"):
                await strict.many("p", ["a", "b"], {})
            server.mode = "short"
            with pytest.raises(RewardError, match=r"expected \{'rewards': \[2 numbers\]\}"):
                await strict.many("p", ["a", "b"], {})
            for r in (failing, strict):
                await r.aclose()

    run(main())


def test_http_reward_unreachable_and_bad_args():
    async def main():
        reward = RewardCaller(HttpReward("http://127.0.0.1:9/score", max_batch=1, retries=0, timeout_s=5),
                              on_error_value=0.5)
        assert await reward("p", "a", {}) == 0.5 and reward.stats()["reward/errors"] == 1
        await reward.aclose()

    run(main())
    with pytest.raises(ValueError, match="expected http"):
        HttpReward("scorer:8000")


def test_a_hung_sync_reward_does_not_keep_the_process_alive():
    """The reward threads are daemons: after a timeout the run can still exit (a thread pool's
    workers would be joined at exit and hang it forever)."""
    import subprocess
    import sys

    code = ("import asyncio, threading\n"
            "from megarl.rewards import RewardCaller\n"
            "hang = lambda p, c, m: threading.Event().wait()\n"
            "print(asyncio.run(RewardCaller(hang, timeout_s=0.2, on_error_value=-1.0)('p', 'c', {})))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "-1.0", proc.stderr


def test_reward_threads_are_reused_and_a_hung_call_keeps_only_its_own():
    """A returned call's thread takes the next call (a busy run does not start a thread per
    sample); a hung call holds its own thread only, so the calls after it still run."""
    release = threading.Event()
    names = []

    def fn(prompt, completion, meta):
        names.append(threading.current_thread().ident)
        if completion == "hang":
            release.wait()
        return 1.0

    async def main():
        caller = RewardCaller(fn, timeout_s=0.3, on_error_value=-1.0)
        for _ in range(20):  # one at a time: one thread serves all 20
            assert await caller("p", "ok", {}) == 1.0
        first = set(names)
        assert await caller.many("p", ["hang", "ok", "ok"], {}) == [-1.0, 1.0, 1.0]
        busy = caller._threads.threads()
        release.set()
        return first, busy

    first, busy = run(main())
    assert len(first) == 1
    assert busy <= 3  # the hung call's thread plus at most two for the others


def test_more_calls_than_threads_wait_for_one_instead_of_failing():
    """A group larger than the thread cap (megarl-eval's rollout.eval_k=100000 made 100000 calls
    at once; the 257th failed as a "hung verifier"): the calls beyond the cap wait in order and
    all return, never more than the cap running at once."""
    running, peak, lock = [0], [0], threading.Lock()

    def fn(prompt, completion, meta):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        threading.Event().wait(0.01)
        with lock:
            running[0] -= 1
        return float(completion)

    async def main():
        caller = RewardCaller(fn, max_threads=3)
        out = await caller.many("p", [str(i) for i in range(40)], {})
        return out, caller._threads.threads()

    out, threads = run(main())
    assert out == [float(i) for i in range(40)]
    assert peak[0] == 3 and threads == 3
