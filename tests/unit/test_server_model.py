"""The server's cached, batched forward equals an independent full-sequence forward."""

from __future__ import annotations

import pytest
import torch
from test_server_reference import make_tiny_model, reference_logprobs

from megarl.server.model import CausalLM, DecoderConfig, KVCache
from megarl.server.weights import read_hf_dir


def _load(path, dtype=torch.float32, max_len=256):
    cfg = DecoderConfig.from_dir(str(path))
    m = CausalLM(cfg, dtype, max_len=max_len)
    t = read_hf_dir(str(path))
    assert m.missing(t) == []
    m.load(t)
    return m


def _teacher_forced(model, seqs, prompt_lens):
    """Prefill prompts in one batch, then feed the rest token by token in batched decode steps;
    returns per-sequence logprobs of every token after the prompt."""
    cache = KVCache(model.cfg, model.dtype, 8, 256)
    logits = model.prefill([s[:n] for s, n in zip(seqs, prompt_lens)], 0, cache)
    out = [[] for _ in seqs]
    lens = list(prompt_lens)
    for step in range(max(len(s) - n for s, n in zip(seqs, prompt_lens))):
        lp = torch.log_softmax(logits, -1)
        for b, s in enumerate(seqs):
            if lens[b] < len(s):
                out[b].append(lp[b, s[lens[b]]].item())
        # every row decodes (rows already complete feed a dummy token; its result is ignored)
        toks = torch.tensor([s[min(n, len(s) - 1)] for s, n in zip(seqs, lens)])
        pos = torch.tensor([min(n, len(s) - 1) for s, n in zip(seqs, lens)])
        logits = model.decode(toks, pos, cache)
        lens = [n + 1 for n in lens]
    return out


@pytest.mark.parametrize("arch,tie,shards", [("llama", False, 1), ("llama", True, 2), ("qwen2", False, 1), ("qwen3", True, 1)])
def test_cached_batched_forward_matches_reference(tmp_path, arch, tie, shards):
    sd = make_tiny_model(tmp_path, arch=arch, tie=tie, shards=shards)
    model = _load(tmp_path)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (12, 7, 20)]
    prompt_lens = [5, 3, 9]
    got = _teacher_forced(model, seqs, prompt_lens)
    for s, n, lps in zip(seqs, prompt_lens, got):
        want = reference_logprobs(str(tmp_path), sd, s)[n:]
        assert len(lps) == len(want)
        assert max(abs(a - b) for a, b in zip(lps, want)) <= 1e-5


def test_prefill_all_logits_and_bf16(tmp_path):
    sd = make_tiny_model(tmp_path)
    ids = list(range(3, 40))
    want = reference_logprobs(str(tmp_path), sd, ids)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.3)):
        model = _load(tmp_path, dtype)
        logits = model.prefill([ids], 0, KVCache(model.cfg, dtype, 1, 64), all_logits=True)[0]
        lp = torch.log_softmax(logits, -1)
        got = [0.0] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert max(abs(a - b) for a, b in zip(got, want)) <= tol


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        DecoderConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_weight_update_by_hf_name_writes_fused_views(tmp_path):
    make_tiny_model(tmp_path, arch="qwen2")
    model = _load(tmp_path)
    new = torch.full_like(model.params["model.layers.1.self_attn.k_proj.bias"], 0.5)
    model.load({"model.layers.1.self_attn.k_proj.bias": new})
    q_rows = model.cfg.num_heads * model.cfg.head_dim
    kv_rows = model.cfg.num_kv_heads * model.cfg.head_dim
    assert torch.equal(model.layers[1]["qkv_b"][q_rows : q_rows + kv_rows], new)
    with pytest.raises(ValueError, match="shape"):
        model.load({"model.norm.weight": torch.zeros(3)})
    with pytest.raises(KeyError):
        model.load({"model.nope.weight": torch.zeros(3)})


def test_kv_cache_grows_and_moves(tmp_path):
    make_tiny_model(tmp_path)
    model = _load(tmp_path)
    cache = KVCache(model.cfg, torch.float32, 64, 256)
    cache.ensure(2, 10)
    cache.k[0][1, :, :10] = 7.0
    cache.ensure(20, 200)
    assert cache.slots >= 20 and cache.capacity >= 200 and float(cache.k[0][1, 0, 9, 0]) == 7.0
    cache.move([1], [0], 10)
    assert float(cache.k[0][0, 0, 9, 0]) == 7.0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_matches_transformers_fp32_logprobs(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    make_tiny_model(tmp_path, arch=arch, tie=arch == "qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (30, 18)]
    got = _teacher_forced(_load(tmp_path), seqs, [6, 4])
    for s, n, lps in zip(seqs, [6, 4], got):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([s])).logits[0].float(), -1)
        want = [lp[i - 1, s[i]].item() for i in range(n, len(s))]
        assert max(abs(a - b) for a, b in zip(lps, want)) <= 1e-5
