"""Which pipeline stage holds which decoder layer: even splits, uneven first/last stages, and
interleaved (virtual) stages, computed the way megatron-core 0.16.1 places them.

Megatron's rule (``TransformerConfig.num_layers_in_first_pipeline_stage`` /
``num_layers_in_last_pipeline_stage``): the first and last stages hold the given counts and the
remaining layers are spread evenly over the middle stages, which must divide them. megarl always
resolves the split to explicit per-stage counts here and hands Megatron both end counts when the
split is uneven, so the builder, the planner, the exporter and checkpoints agree by construction.

When PP does not divide the layer count and neither end is given, :func:`resolve` picks a split
whose largest stage holds ``ceil(L / pp)`` layers (the best possible), with the middle stages at
that maximum and the first stage taking the larger half of the rest: e.g. 3 layers over 2 stages
-> [2, 1], 7 over 4 -> [2, 2, 2, 1], 10 over 4 -> [2, 3, 3, 2].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PipelineSplit:
    """Resolved layer placement: ``counts[r]`` layers on pipeline rank r (in layer order)."""

    counts: tuple[int, ...]
    vpp: Optional[int] = None  # virtual stages per rank (even splits only)

    @property
    def pp(self) -> int:
        return len(self.counts)

    @property
    def num_layers(self) -> int:
        return sum(self.counts)

    @property
    def uneven(self) -> bool:
        return len(set(self.counts)) > 1

    def offset(self, stage: int) -> int:
        """Global index of the first layer of pipeline rank ``stage`` (no interleaving)."""
        return sum(self.counts[:stage])

    def stage_of(self, layer: int) -> tuple[int, Optional[int]]:
        """Global layer index -> (pipeline rank, virtual stage or None)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.num_layers})")
        if self.vpp:
            # interleaved: chunk v of rank r holds the (v*pp + r)-th block of L/(pp*vpp) layers
            block = layer // (self.num_layers // (self.pp * self.vpp))
            return block % self.pp, block // self.pp
        for stage in range(self.pp):
            if layer < self.offset(stage + 1):
                return stage, None
        raise AssertionError("unreachable")

    def row_stage(self, layer: Optional[int], is_embedding: bool) -> tuple[int, Optional[int]]:
        """(rank, virtual stage) serving a weight-table row: its layer's, the first stage for the
        embedding, the last for the final norm and output layer."""
        if layer is not None:
            return self.stage_of(layer)
        if is_embedding:
            return 0, (0 if self.vpp else None)
        return self.pp - 1, ((self.vpp - 1) if self.vpp else None)

    def megatron_kwargs(self) -> dict:
        """TransformerConfig fields for this split (empty for an even split)."""
        if not self.uneven:
            return {}
        return {"num_layers_in_first_pipeline_stage": self.counts[0],
                "num_layers_in_last_pipeline_stage": self.counts[-1]}


def _auto_ends(num_layers: int, pp: int) -> tuple[int, int]:
    """First/last counts for a PP that does not divide the layers (module docstring)."""
    per_stage = -(-num_layers // pp)
    while per_stage > 1 and num_layers - per_stage * (pp - 2) < 2:
        per_stage -= 1  # the ends need at least one layer each
    rest = num_layers - per_stage * (pp - 2)
    return rest - rest // 2, rest // 2


def resolve(num_layers: int, pp: int, vpp: Optional[int] = None, first: Optional[int] = None,
            last: Optional[int] = None) -> PipelineSplit:
    """The split of ``num_layers`` over ``pp`` ranks. Errors (ValueError) start with the config
    field to change: ``parallel.pp``, ``parallel.first_stage_layers``, ``parallel.last_stage_layers``."""
    if pp < 1:
        raise ValueError(f"parallel.pp: must be >= 1, got {pp}")
    if pp > num_layers:
        raise ValueError(f"parallel.pp: {pp} is greater than num_hidden_layers={num_layers}")
    for name, n in (("first_stage_layers", first), ("last_stage_layers", last)):
        if n is not None and pp == 1:
            raise ValueError(f"parallel.{name}: only with parallel.pp > 1")
        if n is not None and not 1 <= n <= num_layers - (pp - 1):
            raise ValueError(f"parallel.{name}: {n} must be in [1, {num_layers - (pp - 1)}] "
                             f"(num_hidden_layers={num_layers}, pp={pp}: every stage needs a layer)")
    if vpp:
        if first is not None or last is not None or num_layers % (pp * vpp):
            raise ValueError(f"parallel.vpp: needs pp*vpp={pp * vpp} to divide "
                             f"num_hidden_layers={num_layers} and no first/last stage layers")
        return PipelineSplit((num_layers // pp,) * pp, vpp)
    if first is None and last is None:
        if num_layers % pp == 0:
            return PipelineSplit((num_layers // pp,) * pp)
        first, last = _auto_ends(num_layers, pp)
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_stages == 0:
        if middle_layers:
            raise ValueError(f"parallel.first_stage_layers: first + last = {first + last} must equal "
                             f"num_hidden_layers={num_layers} when pp=2")
        return PipelineSplit((first, last))
    if middle_layers < middle_stages or middle_layers % middle_stages:
        field = "first_stage_layers" if first is not None else "last_stage_layers"
        raise ValueError(f"parallel.{field}: the remaining {middle_layers} layers do not split evenly "
                         f"over the other {middle_stages} stage(s) (num_hidden_layers={num_layers}, "
                         f"pp={pp})")
    each = middle_layers // middle_stages
    counts = [each] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return PipelineSplit(tuple(counts))


def of_config(config) -> PipelineSplit:
    """The split a built Megatron ``TransformerConfig`` describes (the source of truth at run time)."""
    return resolve(config.num_layers, config.pipeline_model_parallel_size,
                   config.virtual_pipeline_model_parallel_size,
                   config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage)
