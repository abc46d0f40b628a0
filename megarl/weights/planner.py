"""Pure resharding plan: which pipeline stage serves which HF tensor, with what shape, in which
bucket. Works on parameter metadata only (no distributed init, no tensors), so it is unit-tested
directly and every rank computes the same plan.

Layer placement follows Megatron (:mod:`megarl.models.stages`): without interleaving, stage r
holds the ``counts[r]`` layers after those of the stages before it (even, or uneven first/last
stages); with ``vpp`` virtual stages, model chunk v of stage r holds the ``(v*pp + r)``-th block of
``L/(pp*vpp)`` layers. Embedding lives on the first stage; final norm and (untied) output layer on
the last. A tied output layer is not sent: HF has no ``lm_head.weight``. Shapes are HF's: the
vocabulary rows are the original ones (the resharder drops Megatron's padding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megarl.models.layouts import group_by_bytes, hf_shapes
from megarl.protocol.hf_model import ModelArgs, param_table
from megarl.models.stages import PipelineSplit, resolve


@dataclass(frozen=True)
class TensorMeta:
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


def stage_of_layer(layer: int, num_layers: int, pp: int, vpp: Optional[int] = None,
                   first: Optional[int] = None, last: Optional[int] = None) -> tuple[int, Optional[int]]:
    """Global layer index -> (pipeline rank, virtual stage or None)."""
    return resolve(num_layers, pp, vpp, first, last).stage_of(layer)


def plan(args: ModelArgs, split: PipelineSplit | int = 1, vpp: Optional[int] = None) -> list[TensorMeta]:
    """Every HF tensor of the model with its serving stage, in the order stages send them.
    ``split`` is the pipeline split, or a PP size (with ``vpp``) for the default split."""
    if isinstance(split, int):
        split = resolve(args.num_layers, split, vpp)
    shapes = hf_shapes(args)
    specs = []
    for layer, pmap in param_table(args):
        stage, vstage = split.row_stage(layer, pmap.mcore.startswith("embedding."))
        mcore, names = pmap.names(layer)
        for name in names:
            specs.append(TensorMeta(name, shapes[name], stage, vstage, layer, mcore, pmap.kind, pmap.tp_dim))
    return sorted(specs, key=lambda s: (s.stage, s.vp_stage or 0))


def bucketize(specs: list[TensorMeta], bucket_bytes: int, dtype: torch.dtype) -> list[list[TensorMeta]]:
    """Consecutive specs grouped so each bucket holds at most ``bucket_bytes`` (a larger tensor
    gets a bucket of its own); buckets never span stages."""
    return group_by_bytes(specs, lambda s: s.nbytes(dtype), bucket_bytes, boundary=lambda s: s.stage)
