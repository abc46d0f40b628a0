"""LoRA layers on Megatron's tensor-parallel linears: the part of ``lora.*`` that touches
megatron-core's layer classes and TP regions (the HF/PEFT form, pushes and exports are
`megarl.models.lora`, whose docstring gives the math).

Column-parallel layers (linear_qkv, linear_fc1): A replicated, B split like W, B's input through
``copy_to_tensor_model_parallel_region``; row-parallel layers (linear_proj, linear_fc2): A split
like W, the partial products all-reduced with ``reduce_from_tensor_model_parallel_region``, B
replicated. The internals used are pinned in `megarl.mcore.pins` (LORA_PINS).
"""
from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F

from megarl.common.errors import ConfigError
from megarl.protocol.hf_model import ModelArgs

# Megatron target -> (layer-relative module path, column-parallel?)
TARGETS = {
    "linear_qkv": ("self_attention.linear_qkv", True),
    "linear_proj": ("self_attention.linear_proj", False),
    "linear_fc1": ("mlp.linear_fc1", True),
    "linear_fc2": ("mlp.linear_fc2", False),
}
COLUMN_CLASSES = ("ColumnParallelLinear", "TEColumnParallelLinear", "TELayerNormColumnParallelLinear")
ROW_CLASSES = ("RowParallelLinear", "TERowParallelLinear")
def layer_kind(module: torch.nn.Module) -> str:
    """'column' or 'row' from the Megatron/TE linear class (its own or a base class)."""
    names = {c.__name__ for c in type(module).__mro__}
    if names & set(COLUMN_CLASSES):
        return "column"
    if names & set(ROW_CLASSES):
        return "row"
    raise ConfigError(f"lora.target_modules: {type(module).__name__} is not a Megatron column- or "
                      "row-parallel linear layer")


class LoRAMixin:
    """Added in front of a Megatron/TE linear class by :func:`wrap_linear` (see the module docstring)."""

    lora_column: bool
    lora_scaling: float
    lora_dropout: float
    lora_fc1: bool

    def forward(self, x, *args, **kwargs):
        out, bias = super().forward(x, *args, **kwargs)
        return out + self.lora_delta(x).to(out.dtype), bias

    def _lora_input(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "layer_norm_weight"):  # TE: the norm is fused into this layer
            cfg = self.config
            w = self.layer_norm_weight + 1 if getattr(cfg, "layernorm_zero_centered_gamma", False) else \
                self.layer_norm_weight
            if cfg.normalization == "RMSNorm":
                xf = x.float()
                x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon)).to(x.dtype) * w
            else:
                x = F.layer_norm(x, x.shape[-1:], w, getattr(self, "layer_norm_bias", None), cfg.layernorm_epsilon)
        if self.lora_dropout > 0 and self.training:
            x = F.dropout(x, self.lora_dropout, True)
        return x

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        h = F.linear(self._lora_input(x), self.lora_A)
        if self.lora_column:  # A x is the same on every rank; its gradient sums the output shards
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        else:  # partial products of the input shards
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, self.lora_B) * self.lora_scaling

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base layer's entries, with A and B sharded along their own TP dimension (the base
        class would call them replicated)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for k in ("lora_A", "lora_B"):
            sd.pop(f"{prefix}{k}", None)
        axis = {"lora_B": 0} if self.lora_column else {"lora_A": 1}
        extra = make_sharded_tensors_for_checkpoint(
            {"lora_A": self.lora_A, "lora_B": self.lora_B}, prefix, axis, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if self.lora_fc1:  # [gate_r; up_r] per rank, like linear_fc1.weight
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora_B"
            extra[key] = apply_swiglu_sharded_factory(extra[key], sharded_offsets)
        sd.update(extra)
        return sd


_CLASSES: dict[type, type] = {}


def _lora_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"LoRA{base.__name__}", (LoRAMixin, base), {})
    return _CLASSES[base]


def _full_A(rank: int, in_features: int, seed: int, key: str) -> torch.Tensor:
    """PEFT's default A init (kaiming-uniform, a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), drawn from a
    generator of its own so that it is the same under every TP layout."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    bound = 1.0 / in_features ** 0.5
    return (torch.rand(rank, in_features, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def wrap_linear(module: torch.nn.Module, *, rank: int, scaling: float, dropout: float, seed: int,
                key: str, fc1: bool = False) -> None:
    """Turns ``module`` (a Megatron/TE column- or row-parallel linear) into its LoRA subclass in
    place, with fresh adapters (B = 0) on the weight's device and dtype."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    column = layer_kind(module) == "column"
    if column and getattr(module, "gather_output", False):
        raise ConfigError(f"lora.target_modules: {key} gathers its output; not supported")
    w = module.weight
    tp = module.tp_group.size() if getattr(module, "tp_group", None) is not None else 1
    tp_rank = module.tp_group.rank() if tp > 1 else 0
    out_local, in_local = w.shape
    in_full = in_local if column else in_local * tp
    A = _full_A(rank, in_full, seed, key)
    if not column:
        A = A.chunk(tp, dim=1)[tp_rank]
    module.__class__ = _lora_class(type(module))
    module.lora_A = torch.nn.Parameter(A.to(device=w.device, dtype=w.dtype).contiguous())
    module.lora_B = torch.nn.Parameter(torch.zeros(out_local if column else out_local, rank,
                                                   device=w.device, dtype=w.dtype))
    if column:
        set_tensor_model_parallel_attributes(module.lora_B, True, 0, 1)
    else:
        set_tensor_model_parallel_attributes(module.lora_A, True, 1, 1)
    module.lora_column, module.lora_scaling, module.lora_dropout, module.lora_fc1 = column, scaling, dropout, fc1


def unwrap(m: torch.nn.Module) -> torch.nn.Module:
    while hasattr(m, "module"):
        m = m.module
    return m


def apply_lora(chunks, lora, args: ModelArgs, seed: int) -> int:
    """Freezes every parameter of the bare chunks (before DDP and the optimizer, which then hold
    only the adapters) and wraps the ``lora.target_modules`` of every layer. Returns how many
    layers got adapters on this rank."""
    from megarl.mcore.model import global_layer_index

    if args.num_experts and {"linear_fc1", "linear_fc2"} & set(lora.target_modules):
        raise ConfigError("lora.target_modules: MoE expert layers (linear_fc1/linear_fc2 of "
                          f"{args.architecture}) are not supported; target linear_qkv/linear_proj")
    n = 0
    for chunk in chunks:
        model = unwrap(chunk)
        model.requires_grad_(False)
        for local_layer, layer in enumerate(model.decoder.layers):
            g = global_layer_index(model, local_layer)
            for target in lora.target_modules:
                path, _ = TARGETS[target]
                module = layer.get_submodule(path)
                wrap_linear(module, rank=lora.rank, scaling=lora.scaling, dropout=lora.dropout, seed=seed,
                            key=f"decoder.layers.{g}.{path}", fc1=target == "linear_fc1")
                n += 1
    return n
