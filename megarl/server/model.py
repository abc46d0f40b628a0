"""Compact decoder-only transformer for the CPU rollout server (Llama / Mistral / Qwen2 / Qwen3 and
the Qwen3-MoE / Qwen2-MoE mixture-of-experts models, whose MLP is `megarl.server.moe`).

Why our own forward: the server must start in seconds without `transformers`, run a batched
decode step as a handful of torch ops, and produce logprobs that match the trainer's fp32
recomputation to <= 1e-5. So everything is plain torch, in the HF conventions:

- RMSNorm in fp32: ``w * (x * rsqrt(mean(x^2) + eps))``;
- RoPE "rotate half": ``q * cos + rotate_half(q) * sin`` with ``inv_freq = theta^(-2i/d)``;
- GQA: ``num_key_value_heads`` K/V heads, each shared by ``heads / kv_heads`` query heads;
- SwiGLU MLP ``down(silu(gate(x)) * up(x))``; logits are cast to fp32 before any softmax;
- sliding-window attention per layer (`layer_windows`, transformers' rules in
  `megarl.protocol.hf_model._layer_windows`):
  query i attends to keys j with ``i - W < j <= i``, in prefill and in decode (the cache keeps
  every position; a decode step reads only the last W of a windowed layer).

Weights are held fused (q|k|v rows in one matrix, gate|up in another) to save ops per step; every
HF tensor name maps to a *view* into the fused storage (`CausalLM.params`), so a weight update by
HF name is one ``view.copy_(new)`` with no re-fusing.

KV cache (`KVCache`): one tensor per layer of shape [slots, kv_heads, capacity, head_dim] that
grows by doubling (slots and capacity) up to the configured limits. The engine keeps running
requests in slots 0..B-1, so a decode step reads the views ``k[:B, :, :T]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megarl.protocol.hf_model import SERVER, ModelArgs, model_args_from_config, read_model_args
from megarl.server.moe import MoEShape, Routes, alloc_layer, moe_mlp
from megarl.server.tp import TPGroup, assemble, full_shape, local_slice, shard_config


@dataclass
class DecoderConfig:
    """What the forward needs of the HF model description (`from_args`; config.json is read by
    `megarl.protocol.hf_model.read_model_args`, the architecture's row is in
    `megarl.protocol.architectures`)."""

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
    layer_windows: tuple[Optional[int], ...] = ()  # per layer: sliding window W, or None (full)
    moe: Optional[MoEShape] = None  # experts (Qwen3-MoE, Qwen2-MoE); None for dense models
    num_labels: int = 0  # a sequence classifier's score rows; 0 for a causal LM
    pad_token_id: Optional[int] = None  # a classifier scores the last token that is not this one

    @classmethod
    def from_args(cls, args: ModelArgs) -> "DecoderConfig":
        """The forward's view of the one HF model description (`megarl.protocol.hf_model`)."""
        return cls(
            architecture=args.architecture,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            intermediate_size=args.ffn_hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            rms_norm_eps=args.rms_norm_eps,
            rope_theta=args.rope_theta,
            rope_scaling=args.rope_scaling,
            tie_word_embeddings=args.tie_word_embeddings,
            qkv_bias=args.qkv_bias,
            o_bias=args.o_bias,
            mlp_bias=args.mlp_bias,
            qk_norm=args.qk_norm,
            max_position_embeddings=args.max_position_embeddings,
            eos_token_ids=args.eos_token_ids,
            bos_token_id=args.bos_token_id,
            layer_windows=args.layer_windows,
            moe=MoEShape.from_args(args) if args.num_experts else None,
            num_labels=args.num_labels,
            pad_token_id=args.pad_token_id if args.num_labels else None,
        )

    @classmethod
    def from_hf(cls, cfg: dict, path: str = "config.json") -> "DecoderConfig":
        """From a parsed config.json (errors name ``path``)."""
        return cls.from_args(model_args_from_config(cfg, path, SERVER))

    @classmethod
    def from_dir(cls, path: str) -> "DecoderConfig":
        """From ``<path>/config.json``; errors are one line naming the file."""
        return cls.from_args(read_model_args(path, SERVER))


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
                 device: torch.device | str = "cpu", tp=None):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.tp = tp if tp is not None and tp.leader else None  # the leader mirrors moves/clears
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
        if self.tp is not None:
            self.tp.command("cache_move", src, dst, length)
        s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for cache in (self.k, self.v):
            for t in cache:
                t[d, :, :length] = t[s, :, :length]

    def clear(self) -> None:
        if self.tp is not None:
            self.tp.command("cache_clear")
        self.k, self.v, self.slots, self.capacity = [], [], 0, 0


class CausalLM:
    """Weights + batched prefill/decode over a `KVCache`. Not thread-safe: one owner thread."""

    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype = torch.float32, max_len: int = 4096,
                 device: torch.device | str = "cpu", tp_rank: int = 0, tp_size: int = 1):
        # ``cfg`` is the full model's; with server TP (`megarl.server.tp`) the storages and the
        # forward use this rank's `shard_config`, and ``params`` maps HF names to local slices
        self.full_cfg, self.tp_rank, self.tp_size = cfg, tp_rank, tp_size
        cfg = shard_config(cfg, tp_size)
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.tp: Optional[TPGroup] = None  # attached once every rank has loaded its weights
        c = cfg
        self.embed = self._zeros(c.vocab_size, c.hidden_size)
        self.norm = self._zeros(c.hidden_size)
        self.lm_head = self.embed if c.tie_word_embeddings else self._zeros(c.num_labels or c.vocab_size,
                                                                            c.hidden_size)
        self.params: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed,
            "model.norm.weight": self.norm,
        }
        if not c.tie_word_embeddings:  # a classifier's head: the "score" rows its logits come from
            self.params["score.weight" if c.num_labels else "lm_head.weight"] = self.lm_head
        self.layers: list[dict[str, Optional[torch.Tensor]]] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            L = {"in_norm": self._zeros(c.hidden_size), "post_norm": self._zeros(c.hidden_size)}
            self.params[f"{p}input_layernorm.weight"] = L["in_norm"]
            self.params[f"{p}post_attention_layernorm.weight"] = L["post_norm"]
            L.update(self._alloc_attention(p + "self_attn."))
            if c.moe is not None and c.moe.moe_layers[i]:
                moe, names = alloc_layer(c.moe, c.hidden_size, dtype, p + "mlp.", self.device)
                L.update(moe, moe_layer=True)
                self.params.update(names)
            else:
                L.update(self._alloc_mlp(p + "mlp."), moe_layer=False)
            self.layers.append(L)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(c))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(self.device, dtype), emb.sin().to(self.device, dtype)
        self.max_len = max_len

    def _zeros(self, *shape) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _alloc_attention(self, p: str) -> dict:
        """q|k|v fused (rows in that order), o, optional biases and q/k norms; HF names as views."""
        c, z = self.cfg, self._zeros
        q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        A = {
            "qkv": z(q_rows + 2 * kv_rows, c.hidden_size),
            "qkv_b": z(q_rows + 2 * kv_rows) if c.qkv_bias else None,
            "o": z(c.hidden_size, q_rows),
            "o_b": z(c.hidden_size) if c.o_bias else None,
            "q_norm": z(c.head_dim) if c.qk_norm else None,
            "k_norm": z(c.head_dim) if c.qk_norm else None,
        }
        splits = (q_rows, kv_rows, kv_rows)
        for proj, w in zip("qkv", A["qkv"].split(splits)):
            self.params[f"{p}{proj}_proj.weight"] = w
        if A["qkv_b"] is not None:
            for proj, b in zip("qkv", A["qkv_b"].split(splits)):
                self.params[f"{p}{proj}_proj.bias"] = b
        self.params[f"{p}o_proj.weight"] = A["o"]
        if A["o_b"] is not None:
            self.params[f"{p}o_proj.bias"] = A["o_b"]
        if c.qk_norm:
            self.params[f"{p}q_norm.weight"] = A["q_norm"]
            self.params[f"{p}k_norm.weight"] = A["k_norm"]
        return A

    def _alloc_mlp(self, p: str) -> dict:
        """The dense SwiGLU MLP, gate|up fused."""
        c, z = self.cfg, self._zeros
        M = {
            "gate_up": z(2 * c.intermediate_size, c.hidden_size),
            "gate_up_b": z(2 * c.intermediate_size) if c.mlp_bias else None,
            "down": z(c.hidden_size, c.intermediate_size),
            "down_b": z(c.hidden_size) if c.mlp_bias else None,
        }
        gate, up = M["gate_up"].split(c.intermediate_size)
        self.params[f"{p}gate_proj.weight"] = gate
        self.params[f"{p}up_proj.weight"] = up
        if M["gate_up_b"] is not None:
            gb, ub = M["gate_up_b"].split(c.intermediate_size)
            self.params[f"{p}gate_proj.bias"] = gb
            self.params[f"{p}up_proj.bias"] = ub
        self.params[f"{p}down_proj.weight"] = M["down"]
        if M["down_b"] is not None:
            self.params[f"{p}down_proj.bias"] = M["down_b"]
        return M

    # ---- weights -------------------------------------------------------------------------------
    def check_update(self, name: str, shape) -> str:
        """Validate one incoming HF tensor; returns the canonical name it writes."""
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        if name not in self.params:
            raise KeyError(f"unknown parameter {name!r}")
        want = self.full_shape(name)
        if tuple(want) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(shape)} != expected {tuple(want)}")
        return name

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The HF (unsharded) shape of parameter ``name``."""
        return full_shape(name, self.params[name].shape, self.full_cfg, self.tp_size)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy full HF-named tensors in place (dtype converted). Validates all before writing any.
        Under server TP the leader sends them to every rank, which keeps its slices."""
        names = [self.check_update(n, t.shape) for n, t in tensors.items()]
        canon = dict(zip(names, tensors.values()))
        if self.tp is not None and self.tp.leader:
            self.tp.send_tensors(canon)
        self.load_local(canon)

    def load_local(self, tensors: dict[str, torch.Tensor]) -> None:
        """This rank's slices of full, already validated, canonical-named tensors."""
        for name, t in tensors.items():
            self.params[name].copy_(local_slice(name, t, self.full_cfg, self.tp_rank, self.tp_size))

    def full_param(self, name: str) -> torch.Tensor:
        """Canonical parameter ``name`` as the full HF tensor (under TP: gathered from every rank)."""
        if self.tp is None:
            return self.params[name]
        self.tp.command("gather", name)
        return self.gather_full(name)

    def gather_full(self, name: str) -> torch.Tensor:
        return assemble(name, self.tp.all_gather(self.params[name]), self.full_cfg, self.tp_size)

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

    def _mlp(self, L, x, routes: Optional[Routes]):
        c = self.cfg
        h = rms_norm(x, L["post_norm"], c.rms_norm_eps)
        if L["moe_layer"]:
            return x + moe_mlp(c.moe, L, h, routes)
        if routes is not None:
            routes.add_dense()
        gate, up = F.linear(h, L["gate_up"], L["gate_up_b"]).split(c.intermediate_size, dim=-1)
        return x + self._row_parallel(F.silu(gate) * up, L["down"], L["down_b"])

    def _row_parallel(self, x, w, b):
        """``x @ w.T + b`` where ``x``/``w`` hold this rank's columns: the partial products are
        summed over the TP group, the (replicated) bias added once."""
        if self.tp is None:
            return F.linear(x, w, b)
        y = F.linear(x, w)
        self.tp.all_reduce(y)
        return y if b is None else y + b

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()

    def new_routes(self, token_shape: tuple[int, ...]) -> Optional[Routes]:
        """An empty routing record for a forward over ``token_shape`` tokens (None: dense model)."""
        return Routes(token_shape, self.cfg.moe.top_k) if self.cfg.moe is not None else None

    def _window(self, li: int) -> Optional[int]:
        w = self.cfg.layer_windows[li] if self.cfg.layer_windows else None
        return w if w is not None and w < self.max_len else None  # a window past the context is full attention

    @torch.inference_mode()
    def prefill(self, seqs: list[list[int]], first_slot: int, cache: KVCache, all_logits: bool = False,
                routes: Optional[Routes] = None):
        """Run prompts (right-padded) into slots first_slot.. ; returns fp32 logits of each last
        token [m, V] (or of every position [m, L, V] with all_logits). ``routes`` (from
        `new_routes((m, max_len))`) records the MoE routing of every position, pads included."""
        if self.tp is not None and self.tp.leader:
            self.tp.command("prefill", seqs, first_slot, all_logits)
        c, m = self.cfg, len(seqs)
        lens = [len(s) for s in seqs]
        T = max(lens)
        ids = torch.zeros(m, T, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        ids = ids.to(self.device)
        cache.ensure(first_slot + m, T)
        cos, sin = self.cos[:T], self.sin[:T]
        pos = torch.arange(T, device=self.device)
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
            W = self._window(li)
            if W is None or W >= T:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:  # query i sees keys i-W < j <= i
                d = pos.unsqueeze(1) - pos.unsqueeze(0)
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=(d >= 0) & (d < W), enable_gqa=True)
            x = x + self._row_parallel(a.transpose(1, 2).reshape(m, T, -1), L["o"], L["o_b"])
            x = self._mlp(L, x, routes)
        if all_logits:
            return self._logits(x)
        last = x[torch.arange(m, device=self.device), torch.tensor(lens, device=self.device) - 1]
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
               routes: Optional[Routes] = None) -> torch.Tensor:
        """One token for each running slot 0..B-1 at `positions` [B]; returns fp32 logits [B, V].
        ``routes`` (from `new_routes((B,))`) records the MoE routing of each row's token."""
        if self.tp is not None and self.tp.leader:
            self.tp.command("decode", tokens, positions)
        c, B = self.cfg, tokens.shape[0]
        T = int(positions.max()) + 1
        cache.ensure(B, T)
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        rows = torch.arange(B, device=self.device)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        masks = self._decode_masks(positions, T)
        x = F.embedding(tokens, self.embed)
        for li, L in enumerate(self.layers):
            h = rms_norm(x, L["in_norm"], c.rms_norm_eps)
            q, k, v = self._qkv(L, h, (B, c.num_heads, c.head_dim), (B, c.num_kv_heads, c.head_dim))
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            kc, vc = cache.k[li], cache.v[li]
            kc[rows, :, positions] = k
            vc[rows, :, positions] = v
            lo, mask = masks[self._window(li)]
            a = F.scaled_dot_product_attention(
                q.unsqueeze(2), kc[:B, :, lo:T], vc[:B, :, lo:T], attn_mask=mask, enable_gqa=True
            )
            x = x + self._row_parallel(a.reshape(B, -1), L["o"], L["o_b"])
            x = self._mlp(L, x, routes)
        return self._logits(x)

    def _decode_masks(self, positions: torch.Tensor, T: int) -> dict:
        """{window or None: (first key read, additive mask [B, 1, 1, T - first])}. Keys after a
        row's position (another row's longer history, stale slots) and, in a windowed layer, keys
        at or before ``position - W`` get -inf; keys before every row's window are not read."""
        B, out = positions.shape[0], {}
        for W in {self._window(li) for li in range(self.cfg.num_layers)}:
            lo = 0 if W is None else max(0, int(positions.min()) - W + 1)
            t = torch.arange(lo, T, device=self.device).unsqueeze(0)
            hide = t > positions.unsqueeze(1)
            if W is not None:
                hide |= t <= (positions - W).unsqueeze(1)
            mask = torch.zeros(B, 1, 1, T - lo, dtype=self.dtype, device=self.device)
            out[W] = (lo, mask.masked_fill_(hide.view(B, 1, 1, T - lo), float("-inf")))
        return out
