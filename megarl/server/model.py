"""Compact decoder-only transformer for the CPU rollout server (Llama / Mistral / Qwen2 / Qwen3).

Why our own forward: the server must start in seconds without `transformers`, run a batched
decode step as a handful of torch ops, and produce logprobs that match the trainer's fp32
recomputation to <= 1e-5. So everything is plain torch, in the HF conventions:

- RMSNorm in fp32: ``w * (x * rsqrt(mean(x^2) + eps))``;
- RoPE "rotate half": ``q * cos + rotate_half(q) * sin`` with ``inv_freq = theta^(-2i/d)``;
- GQA: ``num_key_value_heads`` K/V heads, each shared by ``heads / kv_heads`` query heads;
- SwiGLU MLP ``down(silu(gate(x)) * up(x))``; logits are cast to fp32 before any softmax.

Weights are held fused (q|k|v rows in one matrix, gate|up in another) to save ops per step; every
HF tensor name maps to a *view* into the fused storage (`CausalLM.params`), so a weight update by
HF name is one ``view.copy_(new)`` with no re-fusing.

KV cache (`KVCache`): one tensor per layer of shape [slots, kv_heads, capacity, head_dim] that
grows by doubling (slots and capacity) up to the configured limits. The engine keeps running
requests in slots 0..B-1, so a decode step reads the views ``k[:B, :, :T]``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported HF architectures."""

    qkv_bias: Optional[bool]  # None: follow config["attention_bias"]
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(qkv_bias=None, qk_norm=False),
    "MistralForCausalLM": ArchSpec(qkv_bias=None, qk_norm=False),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": ArchSpec(qkv_bias=None, qk_norm=True),
}


@dataclass
class DecoderConfig:
    """The fields of an HF config.json that the forward needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: Optional[int]
    sliding_window: Optional[int] = None  # attention is exact only up to this many positions

    @classmethod
    def from_hf(cls, cfg: dict) -> "DecoderConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in config.json; supported: {sorted(ARCHITECTURES)}"
            )
        spec = ARCHITECTURES[arch]
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only 'silu')")
        heads = int(cfg["num_attention_heads"])
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if spec.qkv_bias is None else spec.qkv_bias,
            o_bias=attention_bias and arch in ("LlamaForCausalLM", "MistralForCausalLM"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=spec.qk_norm,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            sliding_window=_sliding_window(arch, cfg),
        )

    @classmethod
    def from_dir(cls, path: str) -> "DecoderConfig":
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf(json.load(f))


def _sliding_window(arch: str, cfg: dict) -> Optional[int]:
    if arch == "MistralForCausalLM" or cfg.get("use_sliding_window"):
        return cfg.get("sliding_window")
    return None


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """HF default RoPE frequencies, with the 'linear' and 'llama3' scalings."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rs["factor"])
    if kind == "llama3":
        factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_ctx = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (default, linear, llama3)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float() if x.element_size() < 4 else x  # bf16/fp16 -> fp32; fp32/fp64 as is
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class KVCache:
    """Per-layer K/V tensors [slots, kv_heads, capacity, head_dim], grown by doubling."""

    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype, max_slots: int, max_len: int,
                 device: torch.device | str = "cpu"):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.max_slots, self.max_len = max_slots, max_len
        self.slots, self.capacity = 0, 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def ensure(self, slots: int, length: int) -> None:
        """Make room for `slots` slots of `length` positions (keeps existing contents)."""
        if slots <= self.slots and length <= self.capacity:
            return
        new_s = min(self.max_slots, max(slots, 2 * self.slots, 8))
        new_t = min(self.max_len, max(length, 2 * self.capacity, 128))
        shape = (new_s, self.cfg.num_kv_heads, new_t, self.cfg.head_dim)
        old_s, old_t = self.slots, self.capacity
        for cache in (self.k, self.v):
            for i in range(self.cfg.num_layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if old_s:
                    new[:old_s, :, :old_t] = cache[i]
                if i < len(cache):
                    cache[i] = new
                else:
                    cache.append(new)
        self.slots, self.capacity = new_s, new_t

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy slots `src` into slots `dst` (first `length` positions)."""
        s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for cache in (self.k, self.v):
            for t in cache:
                t[d, :, :length] = t[s, :, :length]

    def clear(self) -> None:
        self.k, self.v, self.slots, self.capacity = [], [], 0, 0


class CausalLM:
    """Weights + batched prefill/decode over a `KVCache`. Not thread-safe: one owner thread."""

    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype = torch.float32, max_len: int = 4096,
                 device: torch.device | str = "cpu"):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        c = cfg
        q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        z = lambda *shape: torch.zeros(shape, dtype=dtype, device=self.device)  # noqa: E731
        self.embed = z(c.vocab_size, c.hidden_size)
        self.norm = z(c.hidden_size)
        self.lm_head = self.embed if c.tie_word_embeddings else z(c.vocab_size, c.hidden_size)
        self.params: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed,
            "model.norm.weight": self.norm,
        }
        if not c.tie_word_embeddings:
            self.params["lm_head.weight"] = self.lm_head
        self.layers: list[dict[str, Optional[torch.Tensor]]] = []
        for i in range(c.num_layers):
            L = {
                "in_norm": z(c.hidden_size),
                "post_norm": z(c.hidden_size),
                "qkv": z(q_rows + 2 * kv_rows, c.hidden_size),
                "qkv_b": z(q_rows + 2 * kv_rows) if c.qkv_bias else None,
                "o": z(c.hidden_size, q_rows),
                "o_b": z(c.hidden_size) if c.o_bias else None,
                "gate_up": z(2 * c.intermediate_size, c.hidden_size),
                "gate_up_b": z(2 * c.intermediate_size) if c.mlp_bias else None,
                "down": z(c.hidden_size, c.intermediate_size),
                "down_b": z(c.hidden_size) if c.mlp_bias else None,
                "q_norm": z(c.head_dim) if c.qk_norm else None,
                "k_norm": z(c.head_dim) if c.qk_norm else None,
            }
            self.layers.append(L)
            p = f"model.layers.{i}."
            splits = (q_rows, kv_rows, kv_rows)
            for proj, w in zip("qkv", L["qkv"].split(splits)):
                self.params[f"{p}self_attn.{proj}_proj.weight"] = w
            if L["qkv_b"] is not None:
                for proj, b in zip("qkv", L["qkv_b"].split(splits)):
                    self.params[f"{p}self_attn.{proj}_proj.bias"] = b
            self.params[f"{p}self_attn.o_proj.weight"] = L["o"]
            if L["o_b"] is not None:
                self.params[f"{p}self_attn.o_proj.bias"] = L["o_b"]
            gate, up = L["gate_up"].split(c.intermediate_size)
            self.params[f"{p}mlp.gate_proj.weight"] = gate
            self.params[f"{p}mlp.up_proj.weight"] = up
            if L["gate_up_b"] is not None:
                gb, ub = L["gate_up_b"].split(c.intermediate_size)
                self.params[f"{p}mlp.gate_proj.bias"] = gb
                self.params[f"{p}mlp.up_proj.bias"] = ub
            self.params[f"{p}mlp.down_proj.weight"] = L["down"]
            if L["down_b"] is not None:
                self.params[f"{p}mlp.down_proj.bias"] = L["down_b"]
            self.params[f"{p}input_layernorm.weight"] = L["in_norm"]
            self.params[f"{p}post_attention_layernorm.weight"] = L["post_norm"]
            if c.qk_norm:
                self.params[f"{p}self_attn.q_norm.weight"] = L["q_norm"]
                self.params[f"{p}self_attn.k_norm.weight"] = L["k_norm"]
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(c))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(self.device, dtype), emb.sin().to(self.device, dtype)
        self.max_len = max_len

    # ---- weights -------------------------------------------------------------------------------
    def check_update(self, name: str, shape) -> str:
        """Validate one incoming HF tensor; returns the canonical name it writes."""
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        if name not in self.params:
            raise KeyError(f"unknown parameter {name!r}")
        if tuple(self.params[name].shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(shape)} != expected {tuple(self.params[name].shape)}")
        return name

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in place (dtype converted). Validates all before writing any."""
        names = [self.check_update(n, t.shape) for n, t in tensors.items()]
        for name, t in zip(names, tensors.values()):
            self.params[name].copy_(t)

    def missing(self, names) -> list[str]:
        have = set(names)
        if self.cfg.tie_word_embeddings and "lm_head.weight" in have:
            have.add("model.embed_tokens.weight")
        return sorted(set(self.params) - have)

    # ---- forward -------------------------------------------------------------------------------
    def _qkv(self, L, h, shape_q, shape_kv):
        c = self.cfg
        qkv = F.linear(h, L["qkv"], L["qkv_b"])
        q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = qkv.split((q_rows, kv_rows, kv_rows), dim=-1)
        q, k, v = q.reshape(shape_q), k.reshape(shape_kv), v.reshape(shape_kv)
        if c.qk_norm:
            q = rms_norm(q, L["q_norm"], c.rms_norm_eps)
            k = rms_norm(k, L["k_norm"], c.rms_norm_eps)
        return q, k, v

    def _mlp(self, L, x):
        c = self.cfg
        h = rms_norm(x, L["post_norm"], c.rms_norm_eps)
        gate, up = F.linear(h, L["gate_up"], L["gate_up_b"]).split(c.intermediate_size, dim=-1)
        return x + F.linear(F.silu(gate) * up, L["down"], L["down_b"])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()

    @torch.inference_mode()
    def prefill(self, seqs: list[list[int]], first_slot: int, cache: KVCache, all_logits: bool = False):
        """Run prompts (right-padded) into slots first_slot.. ; returns fp32 logits of each last
        token [m, V] (or of every position [m, L, V] with all_logits)."""
        c, m = self.cfg, len(seqs)
        lens = [len(s) for s in seqs]
        T = max(lens)
        ids = torch.zeros(m, T, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        ids = ids.to(self.device)
        cache.ensure(first_slot + m, T)
        cos, sin = self.cos[:T], self.sin[:T]
        x = F.embedding(ids, self.embed)
        for li, L in enumerate(self.layers):
            h = rms_norm(x, L["in_norm"], c.rms_norm_eps)
            q, k, v = self._qkv(L, h, (m, T, c.num_heads, c.head_dim), (m, T, c.num_kv_heads, c.head_dim))
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            cache.k[li][first_slot : first_slot + m, :, :T] = k
            cache.v[li][first_slot : first_slot + m, :, :T] = v
            # Right padding + causal mask: a real query never sees a pad key (pads come later).
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(m, T, -1), L["o"], L["o_b"])
            x = self._mlp(L, x)
        if all_logits:
            return self._logits(x)
        last = x[torch.arange(m, device=self.device), torch.tensor(lens, device=self.device) - 1]
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token for each running slot 0..B-1 at `positions` [B]; returns fp32 logits [B, V]."""
        c, B = self.cfg, tokens.shape[0]
        T = int(positions.max()) + 1
        cache.ensure(B, T)
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        rows = torch.arange(B, device=self.device)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        # Additive mask: -inf where t > positions[b] (another row's longer history or stale slots).
        future = torch.arange(T, device=self.device).unsqueeze(0) > positions.unsqueeze(1)
        mask = torch.zeros(B, 1, 1, T, dtype=self.dtype, device=self.device).masked_fill_(future.view(B, 1, 1, T), float("-inf"))
        x = F.embedding(tokens, self.embed)
        for li, L in enumerate(self.layers):
            h = rms_norm(x, L["in_norm"], c.rms_norm_eps)
            q, k, v = self._qkv(L, h, (B, c.num_heads, c.head_dim), (B, c.num_kv_heads, c.head_dim))
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            kc, vc = cache.k[li], cache.v[li]
            kc[rows, :, positions] = k
            vc[rows, :, positions] = v
            a = F.scaled_dot_product_attention(
                q.unsqueeze(2), kc[:B, :, :T], vc[:B, :, :T], attn_mask=mask, enable_gqa=True
            )
            x = x + F.linear(a.reshape(B, -1), L["o"], L["o_b"])
            x = self._mlp(L, x)
        return self._logits(x)
