"""Weight updates on megarl-server through RolloutClient: partial rollouts across a push, and
distributed (gloo), disk and tensor transports taking effect exactly."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import torch.distributed as dist
from e2e_servers import API_KEY, free_port, http
from test_server_reference import make_tiny_model, reference_logprobs

from megarl.common.net import new_process_group
from megarl.rollout.admin import AdminClient
from megarl.rollout.client import AdminError, RolloutClient
from megarl.server.weights import destroy_weight_update_group
from megarl.protocol.types import (
    DiskWeightsUpdate,
    DistributedWeightsMeta,
    ModelRequest,
    SamplingParams,
    TensorWeightsUpdate,
    WeightsUpdateGroup,
)
from megarl.protocol.tensor_wire import encode_megarl


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("new"))
    return path, make_tiny_model(path, seed=1)


@pytest.fixture
def servers(cluster):
    return cluster


async def wait_tokens(url: str, n: int, timeout: float = 20.0) -> None:
    """Until the server has generated n more tokens (its cumulative counter)."""
    base = (await asyncio.to_thread(http, "GET", url + "/get_server_info", None, API_KEY))[1].get("tokens", 0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = (await asyncio.to_thread(http, "GET", url + "/get_server_info", None, API_KEY))[1]
        if info.get("tokens", 0) - base >= n:
            return
        await asyncio.sleep(0.005)
    raise TimeoutError("server made no progress")


def assert_logprobs(path, sd, prompt, tokens, logprobs):
    want = reference_logprobs(path, sd, prompt + tokens)[len(prompt):]
    assert max(abs(a - b) for a, b in zip(logprobs, want)) <= 1e-5


def run_interrupted(url, push, mode, new_tokens=300):
    """Generate, interrupt it with pause(mode) + push(admin) + continue; return the response."""

    async def main():
        async with RolloutClient([url], api_key=API_KEY) as c, AdminClient([url], api_key=API_KEY) as a:
            req = ModelRequest([1, 5, 6], SamplingParams(max_new_tokens=new_tokens, seed=5, ignore_eos=True))
            task = asyncio.create_task(c.agenerate(req))
            await wait_tokens(url, 20)
            c.hold()  # as RolloutCluster does: the gate closes before the servers pause
            await a.pause(mode)
            await push(a)
            await a.continue_generation()
            c.release()
            return await task

    return asyncio.run(main())


def test_pause_abort_push_continue_is_a_partial_rollout(tiny_model, new_weights, servers):
    (old_path, sd0), (new_path, sd1) = tiny_model, new_weights
    srv = servers[0]
    push = lambda a: a.update_weights_from_tensor(  # noqa: E731
        TensorWeightsUpdate([encode_megarl(sd1)], weight_version="1"))
    resp = run_interrupted(srv.url, push, "abort")
    n = len(resp.output_tokens)
    k = resp.output_versions.count(0)
    assert n == 300 and resp.stop_reason == "length" and resp.num_segments == 2
    assert 0 < k < n and resp.output_versions == [0] * k + [1] * (n - k)
    prompt, out = resp.input_tokens, resp.output_tokens
    # segment 1 under the old weights, segment 2 under the new ones over the whole prefix
    assert_logprobs(old_path, sd0, prompt, out[:k], resp.output_logprobs[:k])
    assert_logprobs(new_path, sd1, prompt + out[:k], out[k:], resp.output_logprobs[k:])


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_retract_and_in_place_keep_the_request(tiny_model, new_weights, servers, mode):
    (old_path, _), (new_path, sd1) = tiny_model, new_weights
    srv = servers[1]
    push = lambda a: a.update_weights_from_disk(DiskWeightsUpdate(new_path, weight_version="3"))  # noqa: E731
    resp = run_interrupted(srv.url, push, mode, new_tokens=200)
    k = resp.output_versions.count(0)
    assert resp.num_segments == 1 and len(resp.output_tokens) == 200
    assert 0 < k < 200 and resp.output_versions == [0] * k + [3] * (200 - k)
    if mode == "retract":  # KV recomputed under the new weights
        p = resp.input_tokens + resp.output_tokens[:k]
        assert_logprobs(new_path, sd1, p, resp.output_tokens[k:], resp.output_logprobs[k:])


async def _generate_and_check(c: RolloutClient, path, sd, version: int):
    req = ModelRequest([1, 9, 8, 7], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    for r in await asyncio.gather(*(c.agenerate(req) for _ in range(len(c.servers)))):
        assert r.output_versions == [version] * 16
        assert_logprobs(path, sd, r.input_tokens, r.output_tokens, r.output_logprobs)


def test_update_from_distributed_gloo_two_servers(tiny_model, new_weights, servers):
    (old_path, sd0), (new_path, sd1) = tiny_model, new_weights

    async def main():
        async with RolloutClient([s.url for s in servers], api_key=API_KEY) as c, AdminClient([s.url for s in servers], api_key=API_KEY) as a:
            port = free_port()
            group = WeightsUpdateGroup("127.0.0.1", port, world_size=3, group_name="wug")
            pg, _ = await asyncio.gather(
                asyncio.to_thread(new_process_group, "127.0.0.1", port, 0, 3, "wug", "gloo", 60),
                a.init_weights_update_group(group),
            )
            names = sorted(sd1)
            meta = DistributedWeightsMeta(names, ["float32"] * len(names), [list(sd1[n].shape) for n in names],
                                          group_name="wug", weight_version="7")

            def broadcast():
                for n in names:
                    dist.broadcast(sd1[n].contiguous(), src=0, group=pg)

            await a.pause("abort")
            await a.begin_weight_update()
            # SGLang's session contract: one session at a time, no end without one
            with pytest.raises(AdminError, match="a weight-update session is already open"):
                await a.begin_weight_update()
            await asyncio.gather(a.update_weights_from_distributed(meta), asyncio.to_thread(broadcast))
            await a.end_weight_update()
            with pytest.raises(AdminError, match="no weight-update session is open"):
                await a.end_weight_update()
            await a.continue_generation()
            got = await a.get_weights_by_name("model.layers.1.mlp.down_proj.weight", truncate_size=3)
            for rows in got.values():
                assert torch.allclose(torch.tensor(rows), sd1["model.layers.1.mlp.down_proj.weight"][:3])
            infos = await a.get_model_info()
            assert {i["weight_version"] for i in infos.values()} == {"7"}
            await _generate_and_check(c, new_path, sd1, 7)
            await a.destroy_weights_update_group("wug")
            destroy_weight_update_group(pg)

    asyncio.run(main())


def test_update_from_disk_and_tensor_and_bad_updates(tiny_model, new_weights, servers):
    (old_path, sd0), (new_path, sd1) = tiny_model, new_weights
    srv = servers[0]

    async def main():
        async with RolloutClient([srv.url], api_key=API_KEY) as c, AdminClient([srv.url], api_key=API_KEY) as a:
            await _generate_and_check(c, old_path, sd0, 0)
            await a.update_weights_from_disk(DiskWeightsUpdate(new_path, weight_version="1"))
            await _generate_and_check(c, new_path, sd1, 1)
            await a.update_weights_from_tensor(TensorWeightsUpdate([encode_megarl(sd0)], weight_version="2"))
            await _generate_and_check(c, old_path, sd0, 2)
            # partial update by tensor: one parameter only
            one = {"model.norm.weight": sd1["model.norm.weight"]}
            await a.update_weights_from_tensor(TensorWeightsUpdate([encode_megarl(one)]))
            got = await a.get_weights_by_name("model.norm.weight")
            assert torch.allclose(torch.tensor(next(iter(got.values()))), sd1["model.norm.weight"])
            await a.update_weights_from_tensor(TensorWeightsUpdate([encode_megarl(sd0)]))
            # bad updates fail loudly and change nothing
            bad = {"model.norm.weight": torch.zeros(3)}
            with pytest.raises(AdminError, match=srv.url):
                await a.update_weights_from_tensor(TensorWeightsUpdate([encode_megarl(bad)]))
            with pytest.raises(AdminError, match="unknown parameter"):
                await a.update_weights_from_tensor(TensorWeightsUpdate([encode_megarl({"x.weight": torch.zeros(2)})]))
            with pytest.raises(AdminError, match="cannot read"):
                await a.update_weights_from_disk(DiskWeightsUpdate("/nonexistent/dir"))
            with pytest.raises(AdminError, match="no weight update group"):
                await a.update_weights_from_distributed(DistributedWeightsMeta(["model.norm.weight"], ["float32"], [[64]]))
            await _generate_and_check(c, old_path, sd0, 2)

    asyncio.run(main())


def test_weights_checksum_is_of_what_the_server_holds(tiny_model, new_weights, servers):
    """/weights_checksum (megarl extension): the sha256 of every tensor as the server holds it, in
    the asked dtype; a tensor changed through the server's own update endpoint changes its
    checksum and no other; a bf16-rounded push matches in bf16 only."""
    from megarl.protocol.wire import tensor_digest

    (old_path, sd0), (new_path, sd1) = tiny_model, new_weights
    names = sorted(sd0)
    fp32 = ["float32"] * len(names)

    async def main():
        async with AdminClient([s.url for s in servers], api_key=API_KEY) as a:
            got = await a.weights_checksum(names, fp32)
            assert set(got) == {s.url for s in servers}
            for sums in got.values():
                assert sums == {n: tensor_digest(sd0[n]) for n in names}
            one = {"model.norm.weight": sd1["model.norm.weight"]}
            await a.update_weights_from_tensor(TensorWeightsUpdate([encode_megarl(one)]))
            after = await a.weights_checksum(names, fp32)
            for sums in after.values():
                assert [n for n in names if sums[n] != tensor_digest(sd0[n])] == ["model.norm.weight"]
                assert sums["model.norm.weight"] == tensor_digest(sd1["model.norm.weight"])
            bf = {n: t.to(torch.bfloat16) for n, t in sd0.items()}
            await a.update_weights_from_tensor(TensorWeightsUpdate([encode_megarl(bf)]))
            held = await a.weights_checksum(names, ["bfloat16"] * len(names))
            for sums in held.values():  # the fp32 server holds the bf16 values exactly
                assert sums == {n: tensor_digest(bf[n]) for n in names}
            await a.update_weights_from_tensor(TensorWeightsUpdate([encode_megarl(sd0)]))

    asyncio.run(main())


def _write_delta(path, tensors, base, base_version, version):
    """A weights.disk_delta directory (megarl.protocol.delta_format) of ``tensors`` against ``base``."""
    import json
    import os

    from megarl.protocol.delta_format import MANIFEST, encode

    os.makedirs(path)
    with open(os.path.join(path, "stage0.bin"), "wb") as f:
        entries, _ = encode(sorted(tensors.items()), base, f)
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump({"base": base_version, "version": version, "tensors": entries}, f)
    return entries


def test_update_from_disk_delta_rebuilds_bitwise_and_refuses_corruption(tiny_model, new_weights, servers,
                                                                        tmp_path):
    """weights.disk_delta's format: raw records, then XOR+zlib records against what the server
    holds, rebuild every tensor bitwise (sha256 of what it holds); a record with a flipped byte
    fails its CRC-32, a delta against another version is refused, and neither changes anything."""
    from megarl.protocol.delta_format import _bytes
    from megarl.protocol.wire import tensor_digest

    (old_path, sd0), (new_path, sd1) = tiny_model, new_weights
    names = sorted(sd0)
    srv = servers[0]
    b1 = {n: _bytes(t).copy() for n, t in sd1.items()}

    async def holds(a, sd):
        sums = (await a.weights_checksum(names, ["float32"] * len(names)))[srv.url]
        return sums == {n: tensor_digest(sd[n]) for n in names}

    async def main():
        async with AdminClient([srv.url], api_key=API_KEY) as a:
            _write_delta(tmp_path / "d1", sd1, None, None, "d1")  # raw records
            await a.update_weights_from_disk(DiskWeightsUpdate(str(tmp_path / "d1"), weight_version="d1"))
            assert await holds(a, sd1)
            e = _write_delta(tmp_path / "d2", sd0, b1, "d1", "d2")  # XOR against sd1
            assert {v[3] for v in e.values()} == {"xor"}
            await a.update_weights_from_disk(DiskWeightsUpdate(str(tmp_path / "d2"), weight_version="d2"))
            assert await holds(a, sd0)
            # a raw record (no base for model.norm.weight) with one byte flipped: CRC-32 mismatch
            b0 = {n: _bytes(t).copy() for n, t in sd0.items() if n != "model.norm.weight"}
            e = _write_delta(tmp_path / "bad", sd1, b0, "d2", "d3")
            _, offset, length, codec, *_ = e["model.norm.weight"]
            assert codec == "raw"
            with open(tmp_path / "bad" / "stage0.bin", "r+b") as f:
                f.seek(offset + 5)
                byte = f.read(1)
                f.seek(offset + 5)
                f.write(bytes([byte[0] ^ 0x40]))
            with pytest.raises(AdminError, match="model.norm.weight: checksum mismatch"):
                await a.update_weights_from_disk(DiskWeightsUpdate(str(tmp_path / "bad"), weight_version="d3"))
            assert await holds(a, sd0)
            _write_delta(tmp_path / "stale", sd1, b1, "d1", "d3")  # the server is at d2
            with pytest.raises(AdminError, match="delta against version d1, the server holds d2"):
                await a.update_weights_from_disk(DiskWeightsUpdate(str(tmp_path / "stale"), weight_version="d3"))
            assert await holds(a, sd0)

    asyncio.run(main())
