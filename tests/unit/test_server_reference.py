"""An independent full-sequence reference forward (HF conventions) + tiny random HF checkpoints.

Shared by the rollout unit tests and the server e2e tests: `make_tiny_model` writes config.json and
model.safetensors with random weights; `reference_logprobs` recomputes per-token logprobs of a
token sequence with no KV cache, no fused weights and explicit GQA expansion, so it shares no code
with `megarl.server.model`. When `transformers` is installed it is checked against it too.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

DT = torch.float64  # exact reference: the server (fp32) must be within fp32 noise of it

ARCH_CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096),
}


def make_tiny_model(path, arch="llama", vocab=128, hidden=64, layers=2, heads=4, kv_heads=2,
                    inter=128, tie=False, seed=0, shards=1, eos=2, max_pos=512) -> dict:
    """Write a random HF checkpoint dir; returns the state dict."""
    os.makedirs(path, exist_ok=True)
    cfg = dict(ARCH_CONFIGS[arch], vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tie, hidden_act="silu",
               max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=eos,
               torch_dtype="float32")
    d = cfg.get("head_dim", hidden // heads)
    g = torch.Generator().manual_seed(seed)
    # Scales keep logits within ~+-5: fp32 noise then stays well under 1e-5 in logprobs.
    r = lambda *s, scale=0.15: torch.randn(*s, generator=g) * scale  # noqa: E731
    sd = {"model.embed_tokens.weight": r(vocab, hidden, scale=0.15 if tie else 0.5),
          "model.norm.weight": 1 + r(hidden, scale=0.08)}
    if not tie:
        sd["lm_head.weight"] = r(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = r(heads * d, hidden)
        sd[p + "self_attn.k_proj.weight"] = r(kv_heads * d, hidden)
        sd[p + "self_attn.v_proj.weight"] = r(kv_heads * d, hidden)
        sd[p + "self_attn.o_proj.weight"] = r(hidden, heads * d)
        if arch == "qwen2":
            for n, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
                sd[p + f"self_attn.{n}_proj.bias"] = r(rows)
        if arch == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = 1 + r(d, scale=0.08)
            sd[p + "self_attn.k_norm.weight"] = 1 + r(d, scale=0.08)
        sd[p + "mlp.gate_proj.weight"] = r(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = r(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = r(hidden, inter)
        sd[p + "input_layernorm.weight"] = 1 + r(hidden, scale=0.08)
        sd[p + "post_attention_layernorm.weight"] = 1 + r(hidden, scale=0.08)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    names = sorted(sd)
    if shards == 1:
        save_file(sd, os.path.join(path, "model.safetensors"))
    else:
        weight_map = {}
        for k in range(shards):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: sd[n] for n in names[k::shards]}
            save_file(part, os.path.join(path, fname))
            weight_map.update({n: fname for n in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return sd


def _norm(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def reference_logits(model_dir: str, sd: dict, ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, V] of one sequence, computed from scratch."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", H // nh)
    T = len(ids)
    x = sd["model.embed_tokens.weight"][torch.tensor(ids)].to(DT)
    pos = torch.arange(T, dtype=DT)
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=DT) / d)
    ang = pos[:, None] * inv[None, :]  # [T, d/2]
    cos, sin = torch.cos(ang), torch.sin(ang)

    def rope(t):  # t [heads, T, d]: rotate pairs (i, i + d/2)
        a, b = t[..., : d // 2], t[..., d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def lin(name, h):
        w = sd[name + ".weight"].to(DT)
        out = h @ w.T
        return out + sd[name + ".bias"].to(DT) if name + ".bias" in sd else out

    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _norm(x, sd[p + "input_layernorm.weight"].to(DT))
        q = lin(p + "self_attn.q_proj", h).view(T, nh, d).transpose(0, 1)
        k = lin(p + "self_attn.k_proj", h).view(T, nkv, d).transpose(0, 1)
        v = lin(p + "self_attn.v_proj", h).view(T, nkv, d).transpose(0, 1)
        if p + "self_attn.q_norm.weight" in sd:
            q = _norm(q, sd[p + "self_attn.q_norm.weight"].to(DT))
            k = _norm(k, sd[p + "self_attn.k_norm.weight"].to(DT))
        q, k = rope(q), rope(k)
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        s = (q @ k.transpose(1, 2)) / math.sqrt(d)
        s = s.masked_fill(~causal, float("-inf"))
        a = torch.softmax(s, -1) @ v  # [nh, T, d]
        x = x + lin(p + "self_attn.o_proj", a.transpose(0, 1).reshape(T, nh * d))
        h = _norm(x, sd[p + "post_attention_layernorm.weight"].to(DT))
        g = lin(p + "mlp.gate_proj", h)
        x = x + lin(p + "mlp.down_proj", g * torch.sigmoid(g) * lin(p + "mlp.up_proj", h))
    x = _norm(x, sd["model.norm.weight"].to(DT))
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).to(DT)
    return x @ head.T


def reference_logprobs(model_dir: str, sd: dict, ids: list[int], temperature: float = 1.0) -> list[float]:
    """Entry i = log p(ids[i] | ids[:i]) with p = softmax(logits / temperature); entry 0 = 0.0 (the
    megarl-logprobs convention)."""
    lp = torch.log_softmax(reference_logits(model_dir, sd, ids).to(DT) / temperature, -1)
    return [0.0] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_reference_matches_transformers(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    sd = make_tiny_model(tmp_path, arch=arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = [1, 5, 9, 33, 7, 100, 3, 64]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = reference_logits(str(tmp_path), sd, ids).float()
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
