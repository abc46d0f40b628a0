"""RolloutClient (generation) and AdminClient against in-process fake SGLang servers
(SGLang-shaped JSON, no per-token versions): resubmission after abort, version stamping, retries,
dead servers, admin errors, the gate."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from aiohttp import web

from megarl.rollout.admin import AdminClient
from megarl.rollout.client import AdminError, RolloutClient, RolloutError, ServerRequestError
from megarl.protocol.types import DiskWeightsUpdate, ModelRequest, RoutedExperts, SamplingParams


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


def _routes(rows: int, base: int, layers: int = 2, top_k: int = 2) -> np.ndarray:
    """int32 [rows, layers, top_k] whose entry is base + row (so the source of each row shows)."""
    return np.broadcast_to((base + np.arange(rows, dtype=np.int32))[:, None, None], (rows, layers, top_k)).copy()


def _with_routes(reply: dict, ids: np.ndarray, weights=None) -> dict:
    reply["meta_info"]["routed_experts"] = base64.b64encode(ids.astype("<i4").tobytes()).decode()
    if weights is not None:
        reply["meta_info"]["routed_expert_weights"] = base64.b64encode(weights.astype("<f4").tobytes()).decode()
    return reply


def test_routed_experts_are_requested_decoded_and_stitched_across_segments():
    """Segment 1 (prompt 2 + 3 tokens, aborted) covers rows 0..3; the resubmitted segment 2 covers
    rows 0..8 of the longer prompt: rows 0..3 stay segment 1's, rows 4..8 come from segment 2. The
    second server sends ids only (as SGLang does), so the sample has no weights."""
    def script(fake, body):
        assert body["return_routed_experts"] is True
        n_in = len(body["input_ids"])
        if len(fake.calls) == 1:
            ids = _routes(n_in + 3 - 1, 100)
            return 200, _with_routes(sglang_reply([10, 11, 12], {"type": "abort"}, "4"), ids, ids * 0.5)
        return 200, _with_routes(sglang_reply([20] * 5, {"type": "length", "length": 5}, "5"), _routes(n_in + 4, 200))

    async def main():
        fake = await Fake(script).start()
        async with RolloutClient([fake.url], routed_experts=(2, 2)) as c:
            r = await c.agenerate(ModelRequest([1, 2], SamplingParams(max_new_tokens=8)))
        await fake.runner.cleanup()
        return r

    r = run(main())
    routes = r.routed_experts
    assert routes.rows == r.input_len + r.output_len - 1 == 9 and routes.ids.dtype == np.int32
    # the resubmitted segment's rows everywhere: what the server held when it made the last tokens
    assert routes.ids[:, 0, 0].tolist() == list(range(200, 209))
    assert routes.ids.shape == (9, 2, 2) and routes.weights is None


def test_routed_experts_decode_checks_and_errors():
    ids, w = _routes(3, 7, layers=4, top_k=2), np.full((3, 4, 2), 0.25, np.float32)
    meta = _with_routes({"meta_info": {}}, ids, w)["meta_info"]
    got = RoutedExperts.from_meta(meta, 4, 2)
    assert np.array_equal(got.ids, ids) and np.array_equal(got.weights, w) and got.rows == 3
    with pytest.raises(ValueError, match="whole number"):
        RoutedExperts.from_meta(meta, 5, 2)  # 24 values are no whole number of [5, 2] rows
    with pytest.raises(ValueError, match="no routed_experts"):
        RoutedExperts.from_meta({}, 4, 2)
    first = RoutedExperts(ids[:2], w[:2])
    both = first.extend(RoutedExperts(_routes(5, 50, 4, 2), np.zeros((5, 4, 2), np.float32)))
    assert both.ids[:, 0, 0].tolist() == [50, 51, 52, 53, 54] and not both.weights.any()  # the later segment's
    longer = RoutedExperts(_routes(6, 9, 4, 2), w[[0, 0, 0, 0, 0, 0]]).extend(RoutedExperts(ids[:2], w[:2]))
    assert longer.ids[:, 0, 0].tolist() == [7, 8, 11, 12, 13, 14]  # rows past a shorter segment kept

    def script(fake, body):  # a server that ignores return_routed_experts
        return 200, sglang_reply([3], {"type": "length", "length": 1}, "0")

    async def main():
        fake = await Fake(script).start()
        try:
            async with RolloutClient([fake.url], routed_experts=(4, 2)) as c:
                await c.agenerate(ModelRequest([1], SamplingParams(max_new_tokens=1)))
        finally:
            await fake.runner.cleanup()

    with pytest.raises(RolloutError, match="enable-return-routed-experts"):
        run(main())


def test_a_group_goes_out_as_one_batched_request_and_interrupted_samples_continue_alone():
    """agenerate_n sends the group's first segments as one /generate (lists of input_ids,
    sampling_params with per-sample seeds, and rids); a sample the push aborted is resubmitted on
    its own with its tokens so far, and its versions follow its segments."""
    def script(fake, body):
        if isinstance(body["input_ids"][0], list):  # the group's batch: sample 1 is interrupted
            return 200, [sglang_reply([10, 11], {"type": "abort", "message": "paused"}, "3") if i == 1
                         else sglang_reply([7] * sp["max_new_tokens"], {"type": "length"}, "3")
                         for i, sp in enumerate(body["sampling_params"])]
        mx = body["sampling_params"]["max_new_tokens"]
        return 200, sglang_reply([20] * mx, {"type": "length"}, "4")

    async def main():
        fake = await Fake(script).start()
        async with RolloutClient([fake.url]) as c:
            out = await c.agenerate_n(ModelRequest([1, 2], SamplingParams(max_new_tokens=5, seed=9)), 3)
        await fake.runner.cleanup()
        return fake, out

    fake, out = run(main())
    batch, resubmit = fake.calls
    assert batch["input_ids"] == [[1, 2]] * 3 and len(batch["rid"]) == 3 == len(set(batch["rid"]))
    assert [sp["sampling_seed"] for sp in batch["sampling_params"]] == \
        [9 * 1_000_003 + i for i in range(3)]
    assert resubmit["input_ids"] == [1, 2, 10, 11] and resubmit["sampling_params"]["max_new_tokens"] == 3
    assert [r.output_tokens for r in out] == [[7] * 5, [10, 11, 20, 20, 20], [7] * 5]
    assert out[1].output_versions == [3, 3, 4, 4, 4] and out[1].num_segments == 2
    assert [r.num_segments for r in (out[0], out[2])] == [1, 1]
    assert all(r.stop_reason == "length" for r in out)


def test_a_batched_reply_of_the_wrong_length_is_an_error_naming_the_server():
    async def main():
        fake = await Fake(lambda f, b: (200, [sglang_reply([1], {"type": "length"}, "0")])).start()
        try:
            async with RolloutClient([fake.url]) as c:
                with pytest.raises(RolloutError, match=f"batched /generate from {fake.url}: expected a list of 2"):
                    await c.agenerate_n(ModelRequest([1], SamplingParams(max_new_tokens=1)), 2)
        finally:
            await fake.runner.cleanup()

    run(main())
