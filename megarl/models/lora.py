"""LoRA on Megatron's tensor-parallel linear layers (``lora.*``), for any TP/PP layout.

A targeted linear layer y = W x keeps W frozen and adds a low-rank path, s = alpha / r:

    y = W x + s * B A dropout(x)          A [r, in] (random), B [out, r] (zeros: step 0 = the base)

Column-parallel layers (linear_qkv, linear_fc1; W split by output rows): A is replicated and B is
split like W, so each rank computes its own output rows; the input of B goes through
``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), which makes the
gradients of A and x the sum over the output shards. Row-parallel layers (linear_proj, linear_fc2;
W split by input columns): A is split like W, the partial products A_r x_r are all-reduced
(``reduce_from_tensor_model_parallel_region``) and B is replicated. Both give exactly the dense
W x + s B A x of TP=1 (tests/dist/test_lora_dist.py).

The layer keeps its class and parameters (so weight tables, loading and export are unchanged); it
is re-classed in place to a subclass that adds ``lora_A`` / ``lora_B`` parameters, the adapter in
``forward`` and their checkpoint sharding (A or B along its TP dimension; fc1's B in Megatron's
[gate_r; up_r] split, like the base weight). TE's column layers that fuse the preceding norm
(``TELayerNormColumnParallelLinear``) get the norm applied to the adapter's input too.

A is drawn from one generator per (layer, module), seeded by ``model.seed``, as the full [r, in]
tensor and then sharded: the initial adapters do not depend on the TP layout.

HF / PEFT form of the adapters (:func:`adapter_hf_tensors`): a fused column layer's B splits along
its rows exactly like the base weight (q/k/v by query group; gate/up) while A is shared, so the HF
modules q_proj, k_proj, v_proj (gate_proj, up_proj) each get that same A:
``model.layers.L.self_attn.q_proj.lora_A.weight`` [r, hidden], ``...q_proj.lora_B.weight`` [q, r].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megarl.config.lora import hf_target_modules
from megarl.protocol.hf_model import GATE_UP, ModelArgs, ParamMap, param_table
from megarl.protocol.lora_names import A_SUFFIX, SCALING, adapter_names, base_name, module_of

from megarl.mcore.lora import TARGETS, LoRAMixin, unwrap

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
SCALING_NAME = SCALING  # pushed with the adapters: the servers' alpha / r (megarl.protocol.lora_names)


def is_adapter_param(local_name: str) -> bool:
    return local_name.endswith(ADAPTER_SUFFIXES)


# ----------------------------------------------------------------------------- HF / PEFT form

@dataclass(frozen=True)
class AdapterRow:
    """One adapted Megatron layer: its table row (HF names of the base weights) and target."""

    layer: int
    target: str
    pmap: ParamMap

    @property
    def column(self) -> bool:
        return TARGETS[self.target][1]

    def hf_modules(self) -> tuple[str, ...]:
        """HF module names (the base weights' names without ``.weight``)."""
        return tuple(h[: -len(".weight")] for h in self.pmap.names(self.layer)[1])


def adapter_rows(args: ModelArgs, targets) -> list[AdapterRow]:
    """Every adapted row of the model, in table order (pure)."""
    out = []
    for layer, pmap in param_table(args):
        if layer is None or pmap.expert is not None:
            continue
        for t in targets:
            if pmap.mcore == f"decoder.layers.{{L}}.{TARGETS[t][0]}.weight":
                out.append(AdapterRow(layer, t, pmap))
    return out


def hf_adapter_shapes(args: ModelArgs, targets, rank: int) -> dict[str, tuple[int, int]]:
    """{HF adapter name: shape} of the whole model (PEFT names without the ``base_model.model.``
    prefix), from the config alone."""
    from megarl.models.layouts import hf_shapes

    base = hf_shapes(args)
    out = {}
    for row in adapter_rows(args, targets):
        for mod in row.hf_modules():
            rows, cols = base[mod + ".weight"]
            a, b = adapter_names(mod)
            out[a], out[b] = (rank, cols), (rows, rank)
    return out


def merged_weight_names(args: ModelArgs, lora) -> frozenset:
    """HF names of the base weights the adapters change (servers hold them merged, W0 + s B A)."""
    return frozenset(base_name(n) for n in hf_adapter_shapes(args, lora.target_modules, lora.rank)
                     if n.endswith(A_SUFFIX))


def adapter_bytes(args: ModelArgs, targets, rank: int, layers, dtype: torch.dtype) -> int:
    """Bytes of the HF-form adapters of the given layers in ``dtype`` plus the 4-byte fp32 scale
    that travels with them (what one adapter push sends for those layers)."""
    el = torch.empty(0, dtype=dtype).element_size()
    layers = set(layers)
    shapes = hf_adapter_shapes(args, targets, rank)
    total = sum(r * c * el for n, (r, c) in shapes.items() if int(n.split(".")[2]) in layers)
    return total + 4


def _local_adapters(chunks) -> dict[str, torch.nn.Module]:
    """{"decoder.layers.{global}.{path}": the wrapped module} of this rank."""
    from megarl.mcore.model import global_layer_index

    out = {}
    for chunk in chunks:
        model = unwrap(chunk)
        for local_layer, layer in enumerate(model.decoder.layers):
            g = global_layer_index(model, local_layer)
            for target, (path, _) in TARGETS.items():
                try:
                    module = layer.get_submodule(path)
                except AttributeError:
                    continue
                if isinstance(module, LoRAMixin):
                    out[f"decoder.layers.{g}.{path}"] = module
    return out


def stage_layers(chunks) -> list[int]:
    """Global indices of the adapted layers these chunks hold (this pipeline stage's)."""
    return sorted({int(k.split(".")[2]) for k in _local_adapters(chunks)})


def adapter_hf_tensors(chunks, args: ModelArgs, targets, tp: int, tp_group, layers,
                       dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF adapter name, full tensor) of the given global layers held by these chunks, in
    table order. Collective over the TP group (the sharded factor is all-gathered)."""
    from megarl.models.layouts import shards_to_hf

    local = _local_adapters(chunks)
    layers = set(layers)
    for row in adapter_rows(args, targets):
        if row.layer not in layers:
            continue
        m = local[f"decoder.layers.{row.layer}.{TARGETS[row.target][0]}"]
        A, B = m.lora_A.detach(), m.lora_B.detach()
        if row.column:
            shards = [B] if tp == 1 else _all_gather(B, tp, tp_group)
            if row.pmap.kind == GATE_UP and len(shards) == 1:
                Bs = [t.contiguous() for t in shards[0].chunk(2, dim=0)]
            else:
                Bs = shards_to_hf(row.pmap, shards, args)
            As = [A] + [A.clone() for _ in Bs[1:]]  # one tensor per HF module (safetensors-safe)
        else:
            As = [A if tp == 1 else torch.cat(_all_gather(A, tp, tp_group), dim=1)]
            Bs = [B]
        for mod, a, b in zip(row.hf_modules(), As, Bs):
            for name, t in zip(adapter_names(mod), (a, b)):
                yield name, (t.to(dtype) if dtype is not None else t).contiguous()


def _all_gather(t: torch.Tensor, tp: int, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def merge_hf(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scaling: float
             ) -> dict[str, torch.Tensor]:
    """HF base weights + HF-form adapters -> merged weights W0 + s B A (only the adapted ones are
    returned; computed in float32, cast back to the base's dtype)."""
    out = {}
    for name, a in adapters.items():
        if not name.endswith(A_SUFFIX):
            continue
        mod = module_of(name)
        b = adapters[adapter_names(mod)[1]]
        w0 = base[f"{mod}.weight"]
        out[f"{mod}.weight"] = (w0.float() + scaling * (b.float() @ a.float())).to(w0.dtype)
    return out


# ----------------------------------------------------------------------------- export

class merged_into_base:
    """Context manager: every adapted weight holds W + s B A (this rank's shard: column
    W_r + s B_r A, row W_r + s B A_r) inside the block and its exact old value after it, so an HF
    export made inside writes the merged model."""

    def __init__(self, chunks):
        self.modules = list(_local_adapters(chunks).values())
        self.saved: list[torch.Tensor] = []

    def __enter__(self):
        with torch.no_grad():
            for m in self.modules:
                self.saved.append(m.weight.detach().clone())
                m.weight.add_((m.lora_scaling * (m.lora_B.float() @ m.lora_A.float())).to(m.weight.dtype))
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for m, w in zip(self.modules, self.saved):
                m.weight.copy_(w)
        self.saved.clear()
        return False


HF_MODULE = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def peft_config(lora, base_model: str) -> dict:
    """adapter_config.json of a PEFT LoRA adapter for ``lora`` (the `LoRAConfig`)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": hf_target_modules(lora.target_modules),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
            "init_lora_weights": True, "modules_to_save": None}


def export_peft(chunks, args: ModelArgs, ps, lora, out_dir: str, base_model: str = "",
                dtype: Optional[torch.dtype] = None) -> int:
    """Writes the adapters alone in PEFT's layout: ``adapter_config.json`` and
    ``adapter_model.safetensors`` (names ``base_model.model.<HF module>.lora_A.weight``). Collective
    over all ranks; each stage's TP group gathers its layers, global rank 0 writes (atomically) and
    gets the adapters' bytes back (other ranks 0)."""
    import json
    import os
    import shutil

    from safetensors.torch import save_file

    tensors = {}
    if ps.first_replica:
        for name, t in adapter_hf_tensors(chunks, args, lora.target_modules, ps.tp, ps.tp_group,
                                          stage_layers(chunks), dtype):
            if ps.tp_rank == 0:
                tensors[f"base_model.model.{name}"] = t.detach().cpu().clone()
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, tensors)
    written = 0
    if dist.get_rank() == 0:
        written = sum(t.numel() * t.element_size() for p in parts for t in p.values())
        tmp = out_dir.rstrip("/") + ".tmp-adapter"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_file({k: v for p in parts for k, v in p.items()}, os.path.join(tmp, "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(peft_config(lora, base_model), f, indent=2)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    dist.barrier()
    return written
