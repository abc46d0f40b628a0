"""Mixture-of-experts MLP of the CPU rollout server (Qwen3-MoE, Qwen2-MoE), in transformers' math.

One MoE layer, per token x (after the post-attention RMSNorm):

    p = softmax(x @ W_router^T)  (fp32);   w, ids = topk(p, k)  (descending);
    w = w / sum(w)  when the config's ``norm_topk_prob``;   w cast back to the model dtype
    y = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))  over e = ids_j
      + sigmoid(x @ w_shared_gate) * shared_mlp(x)       (Qwen2-MoE's shared expert only)

Expert weights are held stacked per layer ([E, 2I, H] gate|up and [E, H, I] down); every HF name
(``mlp.experts.{e}.gate_proj.weight``, ...) is a view into them, so a weight update by HF name
(disk, tensor, distributed) writes in place like the dense tensors do.

Routing capture (`Routes`): the forward can record, for every token it runs and every decoder
layer, the k expert ids (int32) and the k weights actually applied (float32). Layers without
experts (``mlp_only_layers`` / ``decoder_sparse_step``) record ids -1 and weights 0, so the
layout is always [tokens, num_hidden_layers, k] - SGLang's ``routed_experts`` layout.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MoEShape:
    """The MoE fields of the HF model description, as the server's MoE MLP uses them."""

    num_experts: int
    top_k: int
    expert_intermediate: int
    norm_topk_prob: bool
    shared_intermediate: int  # 0: no shared expert (Qwen3-MoE)
    moe_layers: tuple[bool, ...]  # per decoder layer: experts (True) or the dense MLP

    @classmethod
    def from_args(cls, args) -> "MoEShape":
        """From the HF model description (`megarl.protocol.hf_model.ModelArgs`)."""
        layers = args.moe_layers or (True,) * args.num_layers
        return cls(args.num_experts, args.moe_topk, args.moe_ffn_hidden_size, args.moe_norm_topk,
                   args.moe_shared_ffn_hidden_size, tuple(layers))


def alloc_layer(spec: MoEShape, hidden: int, dtype: torch.dtype, prefix: str, device="cpu"):
    """(tensors of one MoE layer, {HF name: view}) with ``prefix`` = ``model.layers.{i}.mlp.``."""
    E, inter = spec.num_experts, spec.expert_intermediate
    L = {
        "router": torch.zeros(E, hidden, dtype=dtype, device=device),
        "experts_gate_up": torch.zeros(E, 2 * inter, hidden, dtype=dtype, device=device),
        "experts_down": torch.zeros(E, hidden, inter, dtype=dtype, device=device),
        "shared_gate_up": None, "shared_down": None, "shared_gate": None,
    }
    names = {prefix + "gate.weight": L["router"]}
    for e in range(E):
        gate, up = L["experts_gate_up"][e].split(inter)
        names[f"{prefix}experts.{e}.gate_proj.weight"] = gate
        names[f"{prefix}experts.{e}.up_proj.weight"] = up
        names[f"{prefix}experts.{e}.down_proj.weight"] = L["experts_down"][e]
    if spec.shared_intermediate:
        s = spec.shared_intermediate
        L["shared_gate_up"] = torch.zeros(2 * s, hidden, dtype=dtype, device=device)
        L["shared_down"] = torch.zeros(hidden, s, dtype=dtype, device=device)
        L["shared_gate"] = torch.zeros(1, hidden, dtype=dtype, device=device)
        gate, up = L["shared_gate_up"].split(s)
        names[prefix + "shared_expert.gate_proj.weight"] = gate
        names[prefix + "shared_expert.up_proj.weight"] = up
        names[prefix + "shared_expert.down_proj.weight"] = L["shared_down"]
        names[prefix + "shared_expert_gate.weight"] = L["shared_gate"]
    return L, names


def route(spec: MoEShape, router: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, k] int64, weights [N, k] in h's dtype) of tokens h [N, H]."""
    probs = torch.softmax(F.linear(h, router), dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(h.dtype)


def moe_mlp(spec: MoEShape, L: dict, h: torch.Tensor, routes: Optional["Routes"] = None) -> torch.Tensor:
    """The MoE MLP of normed hidden states h [..., H] (module docstring); appends the layer's
    routing to ``routes`` when given."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    ids, w = route(spec, L["router"], x)
    if routes is not None:
        routes.add(ids, w)
    out = torch.zeros_like(x)
    inter = spec.expert_intermediate
    for e in torch.unique(ids).tolist():  # only the experts some token picked
        tok, slot = torch.where(ids == e)
        gate, up = F.linear(x[tok], L["experts_gate_up"][e]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, L["experts_down"][e]) * w[tok, slot].unsqueeze(-1)
        out.index_add_(0, tok, y)
    if L["shared_gate_up"] is not None:
        gate, up = F.linear(x, L["shared_gate_up"]).split(spec.shared_intermediate, dim=-1)
        shared = F.linear(F.silu(gate) * up, L["shared_down"])
        out = out + torch.sigmoid(F.linear(x, L["shared_gate"])) * shared
    return out.reshape(shape)


class Routes:
    """Routing of one forward, layer by layer: `add` per decoder layer in order (`add_dense` for
    a layer without experts), then `ids()` / `weights()` as [*token_shape, layers, k]."""

    def __init__(self, token_shape: tuple[int, ...], top_k: int):
        self.token_shape, self.top_k = tuple(token_shape), top_k
        self._ids: list[torch.Tensor] = []
        self._w: list[torch.Tensor] = []

    def add(self, ids: torch.Tensor, w: torch.Tensor) -> None:
        self._ids.append(ids.to(torch.int32).reshape(*self.token_shape, self.top_k))
        self._w.append(w.to(torch.float32).reshape(*self.token_shape, self.top_k))

    def add_dense(self) -> None:
        self._ids.append(torch.full((*self.token_shape, self.top_k), -1, dtype=torch.int32))
        self._w.append(torch.zeros((*self.token_shape, self.top_k), dtype=torch.float32))

    def ids(self) -> torch.Tensor:
        return torch.stack(self._ids, dim=-2)

    def weights(self) -> torch.Tensor:
        return torch.stack(self._w, dim=-2)


def b64_array(t: torch.Tensor, dtype) -> str:
    """Base64 of the array's raw little-endian bytes in C order (SGLang's ``routed_experts``)."""
    return base64.b64encode(np.ascontiguousarray(t.cpu().numpy(), dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
                            ).decode("ascii")
