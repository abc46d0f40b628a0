"""RolloutClient against both SGLang-protocol servers: megarl-server and real SGLang (PyPI, on CPU).

Every test runs once per server (parameter ``megarl`` / ``sglang``); the real-SGLang half carries
the ``sglang`` marker (``python -m pytest -m sglang`` runs it alone, ``-m "not sglang"`` skips it).
One server of each kind serves the whole module; each test gets it back with the original weights,
``weight_version`` "0" and generation running. Real SGLang comes from its own venv, installed on
first use by tools/sglang_cpu/install.sh (1-3 min, once per machine); set MEGARL_SKIP_SGLANG=1
to skip that half instead.

Both servers run fp32; logprobs are compared with an independent float64 forward
(test_server_reference). Known differences between the servers that the client absorbs or the
tests avoid are listed in tools/sglang_cpu/README.md.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import pytest
import torch.distributed as dist
from e2e_servers import REPO, ServerProc, free_port, http
from test_server_reference import make_tiny_model, reference_logprobs

from megarl.common.net import new_process_group
from megarl.config.server_wire import AUTO_VERIFY_EVERY
from megarl.rollout.admin import AdminClient
from megarl.rollout.client import RolloutClient
from megarl.protocol.types import (DiskWeightsUpdate, DistributedWeightsMeta, ModelRequest, SamplingParams,
                                   WeightsUpdateGroup)
from megarl.protocol.tensor_wire import tensor_update

KEY = "protocol-key"
TOL = 5e-5  # fp32 server vs float64 reference over up to ~600 positions (seen: up to 2.04e-5, batch-dependent)
CONTEXT = 2048


def _load_launcher():
    spec = importlib.util.spec_from_file_location(
        "megarl_sglang_cpu_launch", os.path.join(REPO, "tools", "sglang_cpu", "launch.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_char_tokenizer(path: str, vocab_size: int = 128) -> None:
    """An HF fast tokenizer (tokenizer.json) both servers load: one char per token, ids 0-2 =
    <unk> <s> </s>, then printable ASCII and Latin-1 letters so every model id decodes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    chars = [chr(c) for c in range(32, 127)] + [chr(c) for c in range(0xC0, 0x180)]
    vocab = {t: i for i, t in enumerate(specials + chars[: vocab_size - len(specials)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "model_max_length": CONTEXT}, f)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"old": (dir, state_dict), "new": (dir, state_dict)}: two tiny Llamas, one tokenizer."""
    out = {}
    for name, seed in (("old", 0), ("new", 1)):
        path = str(tmp_path_factory.mktemp(f"proto-{name}"))
        out[name] = path, make_tiny_model(path, seed=seed, max_pos=CONTEXT)
        write_char_tokenizer(path)
    return out


@dataclass
class Server:
    kind: str
    url: str
    progress: Callable[[], float]  # grows while the server generates


def _megarl_progress(url: str) -> Callable[[], float]:
    return lambda: http("GET", url + "/get_server_info", key=KEY)[1].get("tokens", 0)


def _sglang_progress(url: str) -> Callable[[], float]:
    """KV tokens in use (prometheus gauge, refreshed every few decode steps)."""
    def read() -> float:
        code, text = http("GET", url + "/metrics", key=KEY)
        for line in str(text).splitlines():
            if line.startswith("sglang:num_used_tokens"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0
    return read


def _start_sglang(request, model_dir: str, log_dir: str) -> tuple:
    if os.environ.get("MEGARL_SKIP_SGLANG") == "1":
        pytest.skip("MEGARL_SKIP_SGLANG=1")
    launch = _load_launcher()
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        if launch.installed_python() is None:
            print(f"\n[sglang] installing real SGLang {launch.VERSION} into {launch.venv_dir()} "
                  "(first use on this machine: 1-3 min, ~11 GB)", flush=True)
        t0 = time.monotonic()
        python = launch.ensure_installed()
        install_s = time.monotonic() - t0
        print(f"\n[sglang] venv ready in {install_s:.0f} s; starting the server (~40-80 s)", flush=True)
    srv = launch.SGLangServer(model_dir, python=python, api_key=KEY, log_path=os.path.join(log_dir, "sglang.log"),
                              extra=["--enable-metrics"])
    srv.start()
    try:
        srv.wait_ready(timeout=480)  # the first start compiles bytecode: ~3 min
    except Exception:
        srv.stop()
        raise
    with capman.global_and_fixture_disabled():
        print(f"[sglang] server ready in {srv.ready_s:.0f} s", flush=True)
    return srv, Server("sglang", srv.url, _sglang_progress(srv.url))


@pytest.fixture(scope="module", params=["megarl", pytest.param("sglang", marks=pytest.mark.sglang)])
def server(request, models, tmp_path_factory):
    model_dir = models["old"][0]
    if request.param == "megarl":
        proc = ServerProc(model_dir, "--max-running-requests", "64", api_key=KEY).wait_ready()
        yield Server("megarl", proc.url, _megarl_progress(proc.url))
        proc.stop()
    else:
        proc, srv = _start_sglang(request, model_dir, str(tmp_path_factory.mktemp("sglang-log")))
        yield srv
        proc.stop()


@pytest.fixture
def srv(server, models):
    """The module's server, running, with the original weights as version "0"."""
    for path, body in (("/continue_generation", {}),
                       ("/update_weights_from_disk", {"model_path": models["old"][0], "weight_version": "0"})):
        code, out = http("POST", server.url + path, body, key=KEY)
        assert code == 200, (path, out)
    return server


class Clients:
    """``async with Clients(server) as (c, a)``: generation client and admin client."""

    def __init__(self, server: Server):
        self.c = RolloutClient([server.url], api_key=KEY)
        self.a = AdminClient([server.url], api_key=KEY)

    async def __aenter__(self):
        return self.c, self.a

    async def __aexit__(self, *exc):
        await self.c.close()
        await self.a.close()


def client(server: Server) -> Clients:
    return Clients(server)


def assert_logprobs(model, prompt, tokens, logprobs) -> None:
    path, sd = model
    assert len(logprobs) == len(tokens) > 0
    want = reference_logprobs(path, sd, prompt + tokens)[len(prompt):]
    err = max(abs(a - b) for a, b in zip(logprobs, want))
    assert err <= TOL, f"max |logprob - reference| = {err:.2e}"


async def wait_generating(server: Server, tokens: int = 40, timeout: float = 60.0) -> None:
    """Until the server's progress counter moved by ``tokens`` (the request is mid-generation)."""
    base = await asyncio.to_thread(server.progress)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(server.progress) - base >= tokens:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{server.kind}: no generation progress in {timeout:.0f} s")


async def check_generation(c: RolloutClient, model, version: int) -> None:
    """Greedy 16 tokens: every token stamped ``version``, logprobs those of ``model``."""
    req = ModelRequest([1, 9, 8, 7], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    r = await c.agenerate(req)
    assert r.output_versions == [version] * 16 and r.stop_reason == "length"
    assert_logprobs(model, r.input_tokens, r.output_tokens, r.output_logprobs)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=3)],
                         ids=["greedy", "sampled"])
def test_generate_logprobs_match_reference(srv, models, sampling):
    async def main():
        async with client(srv) as (c, a):
            reqs = [ModelRequest(p, SamplingParams(max_new_tokens=24, ignore_eos=True, **sampling))
                    for p in ([1, 5, 9, 14], [1, 30, 31, 32, 33, 34, 35, 36, 37], [1, 7])]
            return await asyncio.gather(*(c.agenerate(r) for r in reqs))

    for r in asyncio.run(main()):
        assert r.stop_reason == "length" and r.output_len == 24 and r.num_segments == 1
        assert r.output_versions == [0] * 24
        assert_logprobs(models["old"], r.input_tokens, r.output_tokens, r.output_logprobs)


def test_n_samples(srv, models):
    body = {"input_ids": [1, 5, 6], "sampling_params": {"n": 4, "max_new_tokens": 16, "ignore_eos": True}}
    code, outs = http("POST", srv.url + "/generate", body, key=KEY)
    assert code == 200 and isinstance(outs, list) and len(outs) == 4, outs
    assert all(len(o["output_ids"]) == 16 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1

    async def main():
        async with client(srv) as (c, a):
            req = ModelRequest([1, 5, 6], SamplingParams(max_new_tokens=16, ignore_eos=True, seed=7))
            return await c.agenerate_n(req, 4)

    resps = asyncio.run(main())
    assert len(resps) == 4 and len({tuple(r.output_tokens) for r in resps}) > 1
    for r in resps:
        assert_logprobs(models["old"], r.input_tokens, r.output_tokens, r.output_logprobs)


def test_stop_strings_and_stop_tokens(srv):
    prompt = [1, 10, 11, 12]

    async def main():
        async with client(srv) as (c, a):
            gen = lambda **kw: c.agenerate(ModelRequest(prompt, SamplingParams(  # noqa: E731
                max_new_tokens=40, temperature=0.0, **kw)))
            full = await gen(ignore_eos=True)
            text = full.text
            assert isinstance(text, str) and len(text) >= 8
            stop = text[len(text) // 2: len(text) // 2 + 2]
            by_str = await gen(ignore_eos=True, stop=[stop])
            # SGLang's ignore_eos also ignores stop_token_ids, so this case keeps EOS on
            plain = await gen()
            tok = plain.output_tokens[min(5, plain.output_len - 1)]
            by_tok = await gen(stop_token_ids=[tok])
            return full, stop, by_str, plain, tok, by_tok

    full, stop, by_str, plain, tok, by_tok = asyncio.run(main())
    assert by_str.stop_reason == "stop" and by_str.stop_matched == stop
    assert by_str.text == full.text[: full.text.index(stop)]
    assert full.output_tokens[: by_str.output_len] == by_str.output_tokens
    assert len(by_str.output_logprobs) == by_str.output_len
    first = plain.output_tokens.index(tok)
    assert by_tok.stop_reason == "stop" and by_tok.stop_matched == tok
    assert by_tok.output_tokens == plain.output_tokens[: first + 1]


def test_abort_mid_generation_returns_partial_tokens(srv, models):
    async def main():
        async with client(srv) as (c, a):
            req = ModelRequest([1, 3, 4], SamplingParams(max_new_tokens=1500, ignore_eos=True), rid="to-abort")
            task = asyncio.create_task(c.agenerate(req))
            await wait_generating(srv)
            await c.abort("to-abort")
            return await task

    r = asyncio.run(main())
    assert r.stop_reason == "abort" and 0 < r.output_len < 1500 and r.num_segments == 1
    assert len(r.output_logprobs) == len(r.output_versions) == r.output_len
    assert_logprobs(models["old"], r.input_tokens, r.output_tokens, r.output_logprobs)


def test_pause_update_continue_is_a_partial_rollout(srv, models):
    """pause(abort) + disk update + continue: the client resubmits prompt + tokens so far, the
    output is segment 1 (old weights, version 0) followed by segment 2 (new weights, version 1)."""
    async def main():
        async with client(srv) as (c, a):
            req = ModelRequest([1, 5, 6], SamplingParams(max_new_tokens=600, seed=5, ignore_eos=True))
            task = asyncio.create_task(c.agenerate(req))
            await wait_generating(srv)
            c.hold()  # as RolloutCluster does: the gate closes before the servers pause
            await a.pause("abort")
            await a.flush_cache()
            await a.update_weights_from_disk(DiskWeightsUpdate(models["new"][0], weight_version="1"))
            await a.continue_generation()
            c.release()
            return await task

    r = asyncio.run(main())
    n, k = r.output_len, r.output_versions.count(0)
    assert n == 600 and r.stop_reason == "length" and r.num_segments == 2
    assert 0 < k < n and r.output_versions == [0] * k + [1] * (n - k)
    seg1, seg2 = r.output_tokens[:k], r.output_tokens[k:]
    assert_logprobs(models["old"], r.input_tokens, seg1, r.output_logprobs[:k])
    assert_logprobs(models["new"], r.input_tokens + seg1, seg2, r.output_logprobs[k:])


def test_update_from_distributed_gloo(srv, models):
    path, sd = models["new"]

    async def main():
        async with client(srv) as (c, a):
            port, name = free_port(), f"wug-{srv.kind}"
            spec = WeightsUpdateGroup("127.0.0.1", port, world_size=2, group_name=name, backend="gloo")
            pg, _ = await asyncio.gather(
                asyncio.to_thread(new_process_group, "127.0.0.1", port, 0, 2, name, "gloo", 60),
                a.init_weights_update_group(spec))
            names = sorted(sd)
            meta = DistributedWeightsMeta(names, ["float32"] * len(names), [list(sd[n].shape) for n in names],
                                          group_name=name, weight_version="7")

            def broadcast():
                for n in names:
                    dist.broadcast(sd[n].contiguous(), group=pg, group_src=0)

            try:
                await a.pause("abort")
                await a.begin_weight_update()
                await asyncio.gather(a.update_weights_from_distributed(meta), asyncio.to_thread(broadcast))
                await a.end_weight_update()
                await a.continue_generation()
                info = await a.get_model_info()
                assert {i["weight_version"] for i in info.values()} == {"7"}
                await check_generation(c, models["new"], 7)
            finally:
                await a.destroy_weights_update_group(name)
                dist.destroy_process_group(pg)

    asyncio.run(main())


def test_update_from_disk_and_tensor(srv, models):
    wire = "sglang" if srv.kind == "sglang" else "megarl"

    async def main():
        async with client(srv) as (c, a):
            await check_generation(c, models["old"], 0)
            await a.update_weights_from_disk(DiskWeightsUpdate(models["new"][0], weight_version="1"))
            await check_generation(c, models["new"], 1)
            payload = tensor_update(models["old"][1], wire)
            for version in ("2", "3"):  # the same payload twice: it must be re-sendable
                payload.weight_version = version
                await a.begin_weight_update()
                await a.update_weights_from_tensor(payload)
                await a.end_weight_update()
                await check_generation(c, models["old"], int(version))

    asyncio.run(main())


def test_weight_pusher_all_transports(srv, models, tmp_path):
    """The trainer side: WeightPusher (TP=1, under torchrun) pushes B to the server holding A over
    distributed (gloo), tensor (the server's wire format) and disk; the server then serves B."""
    wire = "sglang" if srv.kind == "sglang" else "megarl"
    out = tmp_path / "push.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(os.path.dirname(__file__), "pusher_worker.py"),
           srv.url, KEY, models["old"][0], models["new"][0], str(tmp_path), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert sorted(results) == ["disk", "distributed", "tensor"]
    path, sd = models["new"]
    for transport, r in results.items():
        assert r["version"] == "1" and r["pushed"] == 1, transport
        assert r["wire"] == wire, transport  # chosen from what the server advertises
        assert r["verify"] == ([] if wire == "megarl" else None), transport  # checksums agree
        want = reference_logprobs(path, sd, r["ids"])[len(r["ids"]) - len(r["logprobs"]):]
        assert max(abs(a - b) for a, b in zip(r["logprobs"], want)) <= TOL, transport


def test_wire_is_chosen_by_the_server_and_forced_settings_stop_at_preflight(srv, tmp_path):
    """megarl-train's preflight asks the server what it is (/model_info): against real SGLang a
    megarl-only setting stops there - one line naming the field and the server, exit 2, no run
    directory - while megarl-server takes it; with nothing forced each gets its own wire."""
    from megarl.config import load_config
    from megarl.launch.preflight import check_wire

    run = tmp_path / "run"
    args = [os.path.join(REPO, "configs", "tiny_grpo.yaml"), f"rollout.servers=[{srv.url}]",
            f"rollout.api_key={KEY}", f"train.run_dir={run}"]
    auto = load_config(args[0], args[1:])
    check_wire(auto)
    want = ("sglang", 0) if srv.kind == "sglang" else ("megarl", AUTO_VERIFY_EVERY)
    assert (auto.weights.tensor_format, auto.weights.verify_interval) == want
    forced = ["weights.tensor_format=megarl", "weights.verify_interval=1"]
    if srv.kind == "megarl":
        cfg = load_config(args[0], args[1:] + forced)
        check_wire(cfg)
        assert (cfg.weights.tensor_format, cfg.weights.verify_interval) == ("megarl", 1)
        return
    for setting, field, ext in ((forced[0], "weights.tensor_format", "direct_bucket"),
                                (forced[1], "weights.verify_interval", "weights_checksum")):
        proc = subprocess.run([sys.executable, "-m", "megarl.train", *args, setting], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"megarl-train: {field}: "), proc.stderr
        assert f"needs the megarl-server extension {ext}, which server {srv.url} does not advertise" in lines[0]
        assert not run.exists()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_kept_requests_span_the_push(srv, models, mode):
    """weights.pause_mode in_place and retract (auto's choice for SGLang) as RolloutCluster runs a
    push (pause; a cache flush for retract only - SGLang refuses one while in_place requests hold
    KV cache; tensor update, publish, continue): the push goes through on both servers and the
    request's tokens are stamped 0 before the update and 1 after."""
    from megarl.rollout.cluster import RolloutCluster

    cluster = RolloutCluster([srv.url], driver=True, api_key=KEY, pause_mode=mode)
    wire = "sglang" if srv.kind == "sglang" else "megarl"

    async def main():
        async with client(srv) as (c, a):
            req = ModelRequest([1, 5, 6], SamplingParams(max_new_tokens=600, seed=5, ignore_eos=True))
            task = asyncio.create_task(c.agenerate(req))
            await wait_generating(srv)
            await asyncio.to_thread(cluster.pause_for_update)
            # tensor (as distributed): no cache flush; SGLang's disk load flushes, and refuses
            # while paused requests run (server_wire refuses in_place + disk against SGLang)
            await a.update_weights_from_tensor(tensor_update(models["new"][1], wire, flush_cache=False))
            await asyncio.to_thread(cluster.end_push, 1)
            return await task

    try:
        r = asyncio.run(main())
    finally:
        cluster.close()
    n, k = r.output_len, r.output_versions.count(0)
    # both servers keep the request through the push: one segment, no resubmission (SGLang used to
    # end it at the version flip: /update_weight_version's default abort_all_requests is true, and
    # megarl now sends false - megarl.rollout.admin)
    assert n == 600 and r.stop_reason == "length" and r.num_segments == 1
    assert 0 < k < n and r.output_versions == [0] * k + [1] * (n - k)
    assert cluster.version == 1
