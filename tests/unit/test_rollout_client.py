"""RolloutClient (generation) and AdminClient against in-process fake SGLang servers
(SGLang-shaped JSON, no per-token versions): resubmission after abort, version stamping, retries,
dead servers, admin errors, the gate."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from megarl.rollout.admin import AdminClient
from megarl.rollout.client import AdminError, RolloutClient, ServerRequestError
from megarl.rollout.types import DiskWeightsUpdate, ModelRequest, SamplingParams


class Fake:
    """A scripted server: `script(body) -> (status, json)` for /generate."""

    def __init__(self, script):
        self.script, self.calls, self.admin = script, [], []
        self.version, self.healthy = "0", True

    async def start(self):
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", lambda r: web.Response(status=200 if self.healthy else 503))
        app.router.add_get("/model_info", lambda r: web.json_response({"weight_version": self.version}))
        app.router.add_post("/{name}", self._admin)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def _generate(self, request):
        body = await request.json()
        self.calls.append(body)
        status, out = self.script(self, body)
        return web.json_response(out, status=status)

    async def _admin(self, request):
        name = request.match_info["name"]
        self.admin.append(name)
        if name == "update_weights_from_disk":
            self.version = (await request.json())["weight_version"]
        ok = not (name == "pause_generation" and self.url.endswith(getattr(self, "fail_suffix", "-")))
        return web.json_response({"success": ok, "message": "ok" if ok else "refused"}, status=200 if ok else 400)


def sglang_reply(tokens, finish, version):
    return {"text": None, "output_ids": tokens, "meta_info": {
        "id": "x", "finish_reason": finish, "weight_version": version,
        "output_token_logprobs": [[-0.5, t, None] for t in tokens]}}


def run(coro):
    return asyncio.run(coro)


def test_abort_is_resubmitted_and_versions_follow_segments():
    def script(fake, body):
        mx = body["sampling_params"]["max_new_tokens"]
        if len(fake.calls) == 1:
            return 200, sglang_reply([10, 11, 12], {"type": "abort", "message": "paused"}, "4")
        return 200, sglang_reply([20] * mx, {"type": "length", "length": mx}, "5")

    async def main():
        fake = await Fake(script).start()
        async with RolloutClient([fake.url]) as c:
            r = await c.agenerate(ModelRequest([1, 2], SamplingParams(max_new_tokens=8, seed=3)))
        await fake.runner.cleanup()
        return fake, r

    fake, r = run(main())
    assert r.output_tokens == [10, 11, 12] + [20] * 5 and r.output_logprobs == [-0.5] * 8
    assert r.output_versions == [4, 4, 4] + [5] * 5 and r.num_segments == 2 and r.stop_reason == "length"
    second = fake.calls[1]
    assert second["input_ids"] == [1, 2, 10, 11, 12] and second["sampling_params"]["max_new_tokens"] == 5
    assert second["sampling_params"]["sampling_seed"] == 3 and second["return_logprob"] is True


def test_5xx_retries_elsewhere_dead_server_readmitted_only_when_current():
    def flaky(fake, body):
        return 503, {"message": "overloaded"}

    def good(fake, body):
        return 200, sglang_reply([7], {"type": "stop", "matched": 7}, fake.version)

    async def main():
        bad, ok = await Fake(flaky).start(), await Fake(good).start()
        pushed = {"version": 0}  # the trainer's policy version (RolloutCluster.version)
        async with RolloutClient([bad.url, ok.url], dead_after=2, health_interval=0.05,
                                 backoff_base=0.001, version_fn=lambda: pushed["version"]) as c:
            rs = await asyncio.gather(*(c.agenerate(ModelRequest([1])) for _ in range(6)))
            assert all(r.output_tokens == [7] and r.stop_matched == 7 for r in rs)
            assert not c.servers[0].alive and c.stats["retries"] >= 2
            async with AdminClient([ok.url]) as admin:  # the push reaches the live one only
                await admin.update_weights_from_disk(DiskWeightsUpdate("/x", weight_version="3"))
            pushed["version"] = 3
            await asyncio.sleep(0.3)
            assert not c.servers[0].alive  # healthy but still on version 0
            bad.version = "3"
            await asyncio.sleep(0.3)
            assert c.servers[0].alive
        for f in (bad, ok):
            await f.runner.cleanup()

    run(main())


def test_4xx_is_not_retried():
    async def main():
        fake = await Fake(lambda f, b: (400, {"message": "input_ids: bad"})).start()
        async with RolloutClient([fake.url]) as c:
            with pytest.raises(ServerRequestError, match="input_ids: bad"):
                await c.agenerate(ModelRequest([1]))
        await fake.runner.cleanup()
        return fake

    assert len(run(main()).calls) == 1


def test_admin_failure_names_the_server_and_pause_gates_new_segments():
    def good(fake, body):
        return 200, sglang_reply([7], {"type": "stop", "matched": 7}, "0")

    async def main():
        a, b = await Fake(good).start(), await Fake(good).start()
        b.fail_suffix = b.url[-6:]
        async with RolloutClient([a.url, b.url]) as c, AdminClient([a.url, b.url]) as admin:
            c.hold()
            with pytest.raises(AdminError, match=b.url) as e:
                await admin.pause("abort")
            assert list(e.value.failures) == [b.url]
            task = asyncio.create_task(c.agenerate(ModelRequest([1])))
            await asyncio.sleep(0.1)
            assert not task.done() and not a.calls and not b.calls  # gated while paused
            await admin.continue_generation()
            c.release()
            assert (await task).output_tokens == [7]
        for f in (a, b):
            await f.runner.cleanup()

    run(main())
