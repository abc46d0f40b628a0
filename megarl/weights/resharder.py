"""Gather + convert + bucket: Megatron shards -> byte-capped buckets of HF/SGLang tensors.

For each pipeline stage, the TP group of DP rank 0 walks the stage's part of the plan; per
Megatron parameter it all-gathers the TP shards (an MoE expert comes from the expert-parallel rank
that owns it: the other ranks of DP rank 0's expert-parallel group walk the plan too and broadcast
their experts), splits fused QKV / gate-up into HF tensors, drops the vocabulary padding of the
embedding / output layer (servers get the original vocab), casts to the serving dtype and appends
them to the current bucket. Only the stage's source rank
(DP=0, TP=0) keeps the tensors and yields buckets; its TP peers take part in the gathers and
drop the results. A bucket is yielded as soon as it is full; the pusher builds bucket k+1 while
its sender thread sends bucket k, and never more (at most 2 buckets of extra memory). With one
shard per row (TP=1) most HF tensors are views of the parameters themselves: no extra memory.
"""
from __future__ import annotations

import dataclasses

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megarl.models.hf_io import gather_row, local_params, serves_weights
from megarl.models import stages
from megarl.models.layouts import shards_to_hf
from megarl.protocol.hf_model import GATE_UP, param_table
from megarl.weights.planner import TensorMeta, bucketize, plan


@dataclass
class Bucket:
    names: list[str]
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def dtypes(self) -> list[str]:
        return [str(t.dtype).replace("torch.", "") for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.tensors]


@dataclass
class ReshardTimes:
    gather_s: float = 0.0
    convert_s: float = 0.0
    buckets: int = 0
    bytes: int = 0


@dataclass
class Resharder:
    """Bound to one engine (model chunks + parallel state); reusable across pushes."""

    engine: object
    bucket_bytes: int = 256 * 2**20
    dtype: Optional[torch.dtype] = None  # serving dtype; None = the training dtype
    times: ReshardTimes = field(default_factory=ReshardTimes)
    adapters: bool = True  # LoRA: stream the adapters after the base rows (off: SGLang loads a PEFT dir)
    _plans: dict = field(default_factory=dict, repr=False)
    _locals: Optional[list] = field(default=None, repr=False)

    def stage_plan(self, stage: int, skip: frozenset = frozenset()) -> list[list[TensorMeta]]:
        """Buckets of this stage, identical on every rank; rows whose Megatron name is in ``skip``
        (a delta push's unchanged rows) are left out before bucketing. Kept per (stage, skip): the
        model's shapes do not change between pushes."""
        key = (stage, skip)
        if key not in self._plans:
            e = self.engine
            specs = [s for s in plan(e.args, stages.of_config(e.tconfig)) if s.stage == stage
                     and s.mcore_name not in skip]
            self._plans[key] = bucketize(specs, self.bucket_bytes, self.serving_dtype)
        return self._plans[key]

    def _local_params(self) -> list:
        """This rank's parameters with their HF rows, found once (a push walks the modules ~4,000
        times for the demo model otherwise; the parameters are the same objects for the engine's
        life: loads and optimizer steps write into them)."""
        if self._locals is None:
            e = self.engine
            self._locals = list(local_params(e.chunks, e.args, e.use_te))
        return self._locals

    def frozen_rows(self) -> dict[str, bool]:
        """{Megatron row name: no local shard of it can change} for this rank's dense rows: every
        shard has ``requires_grad`` False, so no optimizer step writes it. Experts are left out
        (a row's owner may be another expert-parallel rank): they are always sent."""
        out: dict[str, bool] = {}
        for lp in self._local_params():
            if lp.pmap.expert is None:
                name = lp.pmap.names(lp.layer)[0]
                out[name] = out.get(name, True) and not lp.param.requires_grad
        return out

    def agreed_frozen(self) -> frozenset:
        """Rows frozen on every rank that holds a shard of them (one all-gather of small dicts per
        push), so every rank skips the same gathers even if freezing was not symmetric."""
        if dist.get_world_size() == 1:
            return frozenset(n for n, f in self.frozen_rows().items() if f)
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, self.frozen_rows())
        verdict: dict[str, bool] = {}
        for part in parts:
            for name, frozen in part.items():
                verdict[name] = verdict.get(name, True) and frozen
        return frozenset(n for n, f in verdict.items() if f)

    @property
    def serving_dtype(self) -> torch.dtype:
        return self.dtype or next(p for c in self.engine.chunks for p in c.parameters()).dtype

    def total_bytes(self) -> int:
        """Bytes of the whole model in the serving dtype (all stages)."""
        return sum(s.nbytes(self.serving_dtype) for stage in range(self.engine.ps.pp)
                   for bucket in self.stage_plan(stage) for s in bucket)

    @property
    def local_only(self) -> bool:
        """Whether a push gathers nothing from other ranks (one TP shard, no expert parallelism):
        its buckets can then be built from a `snapshot` on any thread."""
        ps = self.engine.ps
        return ps.tp == 1 and ps.ep == 1

    def snapshot(self, frozen: frozenset = frozenset()) -> list:
        """This rank's parameters as they are now, for `iter_buckets` to build a push from while
        the optimizer goes on writing the originals: copies, but for the rows in ``frozen``
        (no optimizer step writes them: the parameters themselves)."""
        return [lp if lp.pmap.names(lp.layer)[0] in frozen else dataclasses.replace(lp, param=lp.param.detach().clone())
                for lp in self._local_params()]

    def iter_buckets(self, skip: frozenset = frozenset(), params: Optional[list] = None) -> Iterator[Bucket]:
        """This rank's stage, as buckets, without the rows in ``skip`` (the same set on every
        rank); yields only on the stage's source rank. Collective over the TP group of DP rank 0
        and, for MoE experts, its expert-parallel group (other ranks return at once).
        ``params``: a `snapshot` to read instead of the live parameters."""
        e = self.engine
        ps = e.ps
        self.times = ReshardTimes()
        if not serves_weights(ps):
            return
        # the last stage's copy of a tied embedding is not a tensor of its own in HF: skip it, so
        # the embedding row maps to the first stage's parameter
        local = {lp.pmap.names(lp.layer)[0]: lp for lp in (self._local_params() if params is None else params)
                 if not (e.args.tie_word_embeddings and lp.local_name == "output_layer.weight")}
        rows = {pmap.names(layer)[0]: (layer, pmap) for layer, pmap in param_table(e.args)}
        # a row's HF tensors (q, k, v; gate, up) may straddle two buckets: the ones not yet
        # placed wait here, so each row is gathered exactly once
        converted: dict[str, torch.Tensor] = {}
        for bucket_specs in self.stage_plan(ps.pp_rank, skip):
            names, tensors = [], []
            for spec in bucket_specs:
                if not ps.first_replica and rows[spec.mcore_name][1].expert is None:
                    continue  # an expert-parallel helper: only expert rows need it
                if spec.hf_name not in converted:  # the plan lists a row's tensors together
                    converted = self._convert(local.get(spec.mcore_name), *rows[spec.mcore_name])
                t = converted.pop(spec.hf_name)
                if tuple(t.shape) != spec.shape:
                    raise RuntimeError(f"resharder: {spec.hf_name} has shape {tuple(t.shape)}, "
                                       f"plan says {spec.shape}")
                if ps.is_pp_source:  # TP peers gathered with us; only the source keeps tensors
                    names.append(spec.hf_name)
                    tensors.append(t)
            if ps.is_pp_source:  # yielded at once: the pusher sends it while we build the next
                bucket = Bucket(names, tensors)
                self.times.buckets += 1
                self.times.bytes += bucket.nbytes
                yield bucket
        if self.adapters and getattr(e.spec, "lora", None) is not None and ps.first_replica:
            yield from self._adapter_buckets()

    def _adapter_buckets(self) -> Iterator[Bucket]:
        """LoRA (`megarl.models.lora`): this stage's adapters in HF/PEFT form (q/k/v and gate/up
        split, A shared), after its base rows (which a delta push leaves out: they are frozen),
        the first bucket led by the scale ``lora.scaling`` the servers merge with."""
        from megarl.models.lora import SCALING_NAME, adapter_hf_tensors, stage_layers

        e, ps = self.engine, self.engine.ps
        lora = e.spec.lora
        names = [SCALING_NAME]
        tensors = [torch.tensor([lora.scaling], dtype=torch.float32, device=ps.device)]
        t0 = time.perf_counter()
        for name, t in adapter_hf_tensors(e.chunks, e.args, lora.target_modules, ps.tp, ps.tp_group,
                                          stage_layers(e.chunks), self.dtype):
            if not ps.is_pp_source:
                continue
            if names and sum(x.numel() * x.element_size() for x in tensors) + t.numel() * t.element_size() \
                    > self.bucket_bytes:
                self.times.gather_s += time.perf_counter() - t0
                yield self._count(Bucket(names, tensors))
                names, tensors, t0 = [], [], time.perf_counter()
            names.append(name)
            tensors.append(t)
        self.times.gather_s += time.perf_counter() - t0
        if ps.is_pp_source and names:
            yield self._count(Bucket(names, tensors))

    def _count(self, bucket: Bucket) -> Bucket:
        self.times.buckets += 1
        self.times.bytes += bucket.nbytes
        return bucket

    def _convert(self, lp, layer, pmap) -> dict[str, torch.Tensor]:
        """One Megatron row -> its HF tensors. With one shard (TP=1, an expert) a tensor that needs
        no reordering or cast is a view of the parameter (gate/up rows, embedding rows without
        the padding, plain weights): the transport reads the parameter itself, nothing is copied.
        Only query-group interleaved QKV and dtype casts make new tensors."""
        e = self.engine
        t0 = time.perf_counter()
        shards = gather_row(lp, pmap, e.args, e.ps, self._param_dtype)
        t1 = time.perf_counter()
        if pmap.kind == GATE_UP and len(shards) == 1:
            out = list(shards[0].chunk(2, dim=0))  # [gate; up] rows: two contiguous views
        else:
            out = shards_to_hf(pmap, shards, e.args)
        names = pmap.names(layer)[1]
        # to() and contiguous() return the tensor itself when it already is both
        result = {n: (t.to(self.dtype) if self.dtype else t).contiguous() for n, t in zip(names, out)}
        self.times.gather_s += t1 - t0
        self.times.convert_s += time.perf_counter() - t1
        return result

    @property
    def _param_dtype(self) -> torch.dtype:
        return next(p for c in self.engine.chunks for p in c.parameters()).dtype
