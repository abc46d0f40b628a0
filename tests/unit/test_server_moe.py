"""The CPU server's mixture-of-experts forward against transformers fp32 (tiny random models built
WITH transformers): Qwen3-MoE (top-k renormalised or not, a dense layer via mlp_only_layers) and
Qwen2-MoE (shared expert behind a sigmoid gate). Teacher-forced per-token logprobs through a
batched prefill + batched decode steps match within 1e-5; the recorded routing equals the ids and
weights of transformers' routers; over HTTP, /generate returns SGLang's ``routed_experts`` (and
megarl's ``routed_expert_weights``) for prompt + output - 1 tokens; every tensor name of the
trainer's Qwen3-MoE table is a server parameter, and /update_weights_from_tensor with those names
replaces the experts (the served logprobs become the new model's)."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web
from hf_models import save_random

from megarl.server import build_state
from megarl.server.app import build_app
from megarl.server.model import CausalLM, DecoderConfig, KVCache
from megarl.server.weights import read_hf_dir
from megarl.protocol.wire import RoutedExperts

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS, TOP_K = 128, 3, 2


def build(path, arch: str, seed: int, **overrides):
    """A transformers model of `arch` with perturbed weights, saved to `path`; returned in eval mode."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_experts=8, num_experts_per_tok=TOP_K, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                  rms_norm_eps=1e-6)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=16, **overrides)
    else:
        cfg = transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=48, **overrides)
    return save_random(transformers, cfg, str(path), seed)


def load(path, max_len=256) -> CausalLM:
    m = CausalLM(DecoderConfig.from_dir(str(path)), torch.float32, max_len=max_len)
    t = read_hf_dir(str(path))
    assert m.missing(t) == []
    m.load(t)
    return m


def hf_forward(model, ids):
    """transformers' fp32 logprobs of ids[1:] and its routers' (ids [T, L, k], weights [T, L, k]);
    a dense layer reports ids -1 and weights 0 like the server."""
    seen = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(lambda mod, inp, out, i=i: seen.__setitem__(i, out)))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    T = len(ids)
    rids = torch.full((T, LAYERS, TOP_K), -1, dtype=torch.int32)
    rw = torch.zeros(T, LAYERS, TOP_K)
    for i, (_, scores, idx) in seen.items():
        rids[:, i], rw[:, i] = idx.to(torch.int32), scores.float()
    return lp.tolist(), rids, rw


def teacher_forced(model: CausalLM, seqs, prompt_lens):
    """Batched prefill of the prompts, then the rest fed token by token in batched decode steps.
    Returns per sequence (logprobs of tokens after the prompt, route ids, route weights) with
    one routing row per fed position (every token but the last)."""
    cache = KVCache(model.cfg, model.dtype, 8, 256)
    T = max(prompt_lens)
    routes = model.new_routes((len(seqs), T))
    logits = model.prefill([s[:n] for s, n in zip(seqs, prompt_lens)], 0, cache, routes=routes)
    rid = [[routes.ids()[b, :n]] for b, n in enumerate(prompt_lens)]
    rw = [[routes.weights()[b, :n]] for b, n in enumerate(prompt_lens)]
    out = [[] for _ in seqs]
    lens = list(prompt_lens)
    for _ in range(max(len(s) - n for s, n in zip(seqs, prompt_lens))):
        lp = torch.log_softmax(logits, -1)
        for b, s in enumerate(seqs):
            if lens[b] < len(s):
                out[b].append(lp[b, s[lens[b]]].item())
        toks = torch.tensor([s[min(n, len(s) - 1)] for s, n in zip(seqs, lens)])
        pos = torch.tensor([min(n, len(s) - 1) for s, n in zip(seqs, lens)])
        routes = model.new_routes((len(seqs),))
        logits = model.decode(toks, pos, cache, routes=routes)
        for b, s in enumerate(seqs):
            if lens[b] < len(s) - 1:
                rid[b].append(routes.ids()[b:b + 1])
                rw[b].append(routes.weights()[b:b + 1])
        lens = [n + 1 for n in lens]
    return [(o, torch.cat(i), torch.cat(w)) for o, i, w in zip(out, rid, rw)]


CASES = {
    "qwen3_moe_norm": ("qwen3_moe", dict(norm_topk_prob=True)),
    "qwen3_moe_nonorm_dense_layer": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen2_moe_shared_expert": ("qwen2_moe", dict(norm_topk_prob=False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_and_routing_match_transformers(tmp_path, case):
    arch, overrides = CASES[case]
    hf = build(tmp_path, arch, seed=3, **overrides)
    model = load(tmp_path)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (26, 9, 17)]
    prompts = [7, 3, 12]
    for s, n, (lps, ids, weights) in zip(seqs, prompts, teacher_forced(model, seqs, prompts)):
        want_lp, want_ids, want_w = hf_forward(hf, s)
        assert len(lps) == len(s) - n and ids.shape == (len(s) - 1, LAYERS, TOP_K)
        assert max(abs(a - b) for a, b in zip(lps, want_lp[n - 1:])) <= 1e-5
        assert torch.equal(ids, want_ids[:-1])
        assert (weights - want_w[:-1]).abs().max().item() <= 1e-6
    if "dense" in case:
        assert (ids[:, 1] == -1).all() and (ids[:, 0] >= 0).all()
    # the routing is not trivial: several experts are used, and the weights are not all equal
    assert len(torch.unique(ids[ids >= 0])) >= 4 and weights[ids >= 0].std() > 0.01


def test_trainer_names_are_the_server_parameters(tmp_path):
    """The resharder names experts by the Qwen3-MoE table (megarl.protocol.hf_model): every name and
    shape it can send is a server parameter, and every server parameter is one of them."""
    from megarl.models.layouts import hf_shapes
    from megarl.protocol.hf_model import read_model_args

    build(tmp_path, "qwen3_moe", seed=0, norm_topk_prob=True)
    model = load(tmp_path)
    shapes = hf_shapes(read_model_args(str(tmp_path)))
    assert any(".mlp.experts.7.down_proj.weight" in n for n in shapes)
    assert set(shapes) == set(model.params)
    assert all(tuple(model.params[n].shape) == tuple(s) for n, s in shapes.items())


async def _serve(state, fn):
    runner = web.AppRunner(build_app(state))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with aiohttp.ClientSession() as http:
            return await fn(http, url)
    finally:
        await runner.cleanup()


def test_http_routes_and_expert_weight_update(tmp_path):
    from megarl.protocol.tensor_wire import tensor_update

    hf_a = build(tmp_path / "a", "qwen3_moe", seed=5, norm_topk_prob=True)
    hf_b = build(tmp_path / "b", "qwen3_moe", seed=6, norm_topk_prob=True)
    prompts = [[5, 17, 33, 2, 90, 64, 11], [40], [8, 9, 100, 3]]  # one batch: rows of 3 lengths
    req = {"input_ids": prompts, "return_logprob": True, "return_routed_experts": True,
           "sampling_params": {"max_new_tokens": 9, "temperature": 0.0, "ignore_eos": True}}

    async def scenario(http, url):
        async with http.post(url + "/generate", json=req) as r:
            first = await r.json()
        upd = tensor_update(read_hf_dir(str(tmp_path / "b")), "megarl", weight_version="1")
        async with http.post(url + "/update_weights_from_tensor", json=upd.to_json()) as r:
            assert r.status == 200, await r.text()
        async with http.post(url + "/generate", json=req) as r:
            second = await r.json()
        return first, second

    state = build_state(str(tmp_path / "a"), enable_return_routed_experts=True)
    first, second = asyncio.run(_serve(state, scenario))
    pairs = [(p, res, hf_a) for p, res in zip(prompts, first)] + [(p, res, hf_b) for p, res in zip(prompts, second)]
    for prompt, res, hf in pairs:
        meta = res["meta_info"]
        ids = prompt + res["output_ids"]
        want_lp, want_ids, want_w = hf_forward(hf, ids)
        got_lp = [e[0] for e in meta["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp[len(prompt) - 1:])) <= 1e-5
        routes = RoutedExperts.from_meta(meta, LAYERS, TOP_K)
        assert routes.rows == meta["prompt_tokens"] + meta["completion_tokens"] - 1 == len(ids) - 1
        assert np.array_equal(routes.ids, want_ids[:-1].numpy())
        assert np.abs(routes.weights - want_w[:-1].numpy()).max() <= 1e-6
    assert first[0]["meta_info"]["routed_experts"] != second[0]["meta_info"]["routed_experts"]


def test_routes_need_the_server_flag_and_an_moe_model(tmp_path):
    build(tmp_path, "qwen3_moe", seed=1)
    state = build_state(str(tmp_path))  # started without --enable-return-routed-experts

    async def scenario(http, url):
        body = {"input_ids": [1, 2, 3], "return_routed_experts": True, "sampling_params": {"max_new_tokens": 2}}
        async with http.post(url + "/generate", json=body) as r:
            return r.status, await r.json()

    status, body = asyncio.run(_serve(state, scenario))
    assert status == 400 and "--enable-return-routed-experts" in body["message"]
    from test_server_reference import make_tiny_model

    make_tiny_model(tmp_path / "dense")
    with pytest.raises(ValueError, match="no experts"):
        build_state(str(tmp_path / "dense"), enable_return_routed_experts=True)


def test_sequence_keeps_the_first_routing_of_each_position():
    """A retracted request's re-prefill adds only the rows it lacks; the response has
    prompt + output - 1 rows (the last sampled token was never fed)."""
    from megarl.server.engine import Sequence
    from megarl.server.sampling import SamplingConfig

    def rows(n, base):
        ids = (base + torch.arange(n, dtype=torch.int32))[:, None, None].expand(n, 2, 2).contiguous()
        return ids, ids.float() / 1000

    s = Sequence("r", [1, 2, 3], SamplingConfig(), lambda seq: None, want_routes=True)
    s.add_routes(*rows(3, 100), 0)  # prefill of the prompt
    s.out_ids = [7]
    s.add_routes(*rows(1, 203), 3)  # decode of token 7 (position 3)
    s.out_ids = [7, 8]
    s.add_routes(*rows(5, 300), 0)  # retract + re-prefill of positions 0..4
    s.out_ids = [7, 8, 9]
    ids, weights = s.routes()
    assert ids[:, 0, 0].tolist() == [100, 101, 102, 203, 304] and ids.dtype == torch.int32
    assert weights[:, 1, 1].tolist() == pytest.approx([0.1, 0.101, 0.102, 0.203, 0.304])
    with pytest.raises(RuntimeError, match="never computed"):
        s.add_routes(*rows(1, 0), 9)
