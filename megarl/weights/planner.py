"""Pure resharding plan: which pipeline stage serves which HF tensor, with what shape, in which
bucket. Works on parameter metadata only (no distributed init, no tensors), so it is unit-tested
directly and every rank computes the same plan.

Layer placement follows Megatron: without interleaving, stage r holds layers
[r*L/pp, (r+1)*L/pp); with ``vpp`` virtual stages, model chunk v of stage r holds the
``(v*pp + r)``-th block of ``L/(pp*vpp)`` layers. Embedding lives on the first stage; final norm and
(untied) output layer on the last. A tied output layer is not sent: HF has no ``lm_head.weight``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megarl.models.layouts import group_by_bytes, hf_shapes
from megarl.models.registry import ModelArgs, param_table


@dataclass(frozen=True)
class TensorSpec:
    hf_name: str
    shape: tuple[int, ...]
    stage: int  # pipeline rank that serves it
    vp_stage: Optional[int]  # model chunk on that rank (interleaved schedules), else None
    layer: Optional[int]  # global layer index
    mcore_name: str
    kind: str  # plain | qkv | gate_up (how TP shards are merged)
    tp_dim: Optional[int]

    def nbytes(self, dtype: torch.dtype) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.tensor([], dtype=dtype).element_size()


def stage_of_layer(layer: int, num_layers: int, pp: int, vpp: Optional[int] = None) -> tuple[int, Optional[int]]:
    """Global layer index -> (pipeline rank, virtual stage or None)."""
    if vpp:
        per_chunk = num_layers // (pp * vpp)
        block = layer // per_chunk
        return block % pp, block // pp
    return layer // (num_layers // pp), None


def plan(args: ModelArgs, pp: int = 1, vpp: Optional[int] = None) -> list[TensorSpec]:
    """Every HF tensor of the model with its serving stage, in the order stages send them."""
    shapes = hf_shapes(args)
    specs = []
    for layer, pmap in param_table(args):
        if layer is not None:
            stage, vstage = stage_of_layer(layer, args.num_layers, pp, vpp)
        elif pmap.mcore.startswith("embedding."):
            stage, vstage = 0, (0 if vpp else None)
        else:  # final norm, output layer
            stage, vstage = pp - 1, ((vpp - 1) if vpp else None)
        mcore, names = pmap.names(layer)
        for name in names:
            specs.append(TensorSpec(name, shapes[name], stage, vstage, layer, mcore, pmap.kind, pmap.tp_dim))
    return sorted(specs, key=lambda s: (s.stage, s.vp_stage or 0))


def bucketize(specs: list[TensorSpec], bucket_bytes: int, dtype: torch.dtype) -> list[list[TensorSpec]]:
    """Consecutive specs grouped so each bucket holds at most ``bucket_bytes`` (a larger tensor
    gets a bucket of its own); buckets never span stages."""
    return group_by_bytes(specs, lambda s: s.nbytes(dtype), bucket_bytes, boundary=lambda s: s.stage)
