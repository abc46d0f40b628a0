"""HF safetensors <-> Megatron dist checkpoints, one tensor (or one output file) in memory at a time.

Megatron's checkpoint holds each parameter as one *global* tensor whatever the layout: per-layer
parameters are stacked on a leading layer axis, ``linear_qkv`` is the fused QKV of the whole model
(rows grouped per query group), ``linear_fc1`` is ``[gate; up]``, and the norms use the TE-style
keys (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) for either spec. So:

* hf -> mcore: each rank builds its TP/PP share of the model on the *meta* device (shapes only,
  Megatron's own key/shard layout) and saves it through a lazy writer: every chunk is computed
  from the HF tensors when it is written, i.e. (key, layer) -> full Megatron tensor -> slice.
* mcore -> hf: a single process reads, per output file, the layer slices it needs straight from
  the checkpoint (any saving layout) and splits them into HF tensors.

Validation (``check_hf``, ``check_mcore``, in `megarl.models.checks`) reads only headers and
metadata, before any rank starts; ``check_finite_hf`` then reads the HF weights once (NaN/inf),
and mcore -> hf checks each tensor as it reads it.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

import torch

from megarl.models.checks import check_finite, tensor_metadata
from megarl.models.layouts import (full_to_hf, group_by_bytes, hf_shapes, hf_to_full, mcore_key,
                                   safetensors_file_names)
from megarl.protocol.hf_model import ModelArgs, param_table

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- progress

class Progress:
    """Counts tensors and bytes; prints a line at most every 2 s and a summary at the end."""

    def __init__(self, desc: str, total: Optional[int], enabled: bool):
        self.desc, self.total, self.enabled = desc, total, enabled
        self.n = self.bytes = 0
        self.start = self.last = time.monotonic()

    def update(self, nbytes: int) -> None:
        self.n += 1
        self.bytes += nbytes
        now = time.monotonic()
        if self.enabled and now - self.last >= 2.0:
            self.last = now
            print(f"[megarl-convert] {self.line()}", flush=True)

    def line(self) -> str:
        total = f"/{self.total}" if self.total else ""
        return (f"{self.desc}: {self.n}{total} tensors, {self.bytes / 2**20:.1f} MiB, "
                f"{time.monotonic() - self.start:.1f}s")

    def close(self) -> None:
        if self.enabled:
            print(f"[megarl-convert] {self.line()}", flush=True)


# ----------------------------------------------------------------------------- hf -> mcore

def _meta_chunks(args: ModelArgs, ps, dtype: torch.dtype) -> list:
    """This rank's GPTModel chunk(s) on the meta device: Megatron's keys and shards, no memory.
    ``args`` carries the padded vocabulary; the pipeline split is the automatic one."""
    from megarl.models import builder

    config = builder.transformer_config(args, tp=ps.tp, pp=ps.pp)
    config.perform_initialization = False
    config.use_cpu_initialization = True  # else Megatron allocates on an explicit CUDA device
    config.params_dtype = dtype
    with torch.device("meta"):
        return [builder.gpt_model(args, config, use_te=False)]


def write_mcore(hf_dir: str, out_dir: str, args: ModelArgs, ps, dtype: torch.dtype) -> None:
    """Writes the HF checkpoint as a Megatron dist checkpoint into ``out_dir``. Collective: every
    rank writes its TP/PP share; memory holds one full tensor at a time."""
    from megatron.core import dist_checkpointing

    from megarl.checkpoint import model_sharded_state_dict, sync_save_strategy
    from megarl.models.hf_io import HFCheckpoint, local_params

    chunks = _meta_chunks(args, ps, dtype)
    sharded = model_sharded_state_dict(chunks)
    rows = {lp.local_name: lp for lp in local_params(chunks, args)}
    by_key = {v.key: rows[k] for k, v in sharded["model"].items() if k in rows}
    experts = {(mcore_key(pmap), pmap.expert): pmap for _, pmap in param_table(args)
               if pmap.expert is not None}
    ckpt = HFCheckpoint(hf_dir)
    progress = Progress("hf-to-mcore", None, enabled=ps.rank == 0)
    last: dict = {}

    def resolve(key, offsets, sizes):
        lp = by_key[key]
        # leading stacked axes: the layer, then (MoE) the expert
        lead = (lp.layer is not None) + (lp.pmap.expert is not None)
        layer = offsets[0] if lead else None
        pmap = experts[key, offsets[1]] if lead == 2 else lp.pmap
        if last.get("id") != (key, offsets[:lead]):  # fc1's gate and up halves arrive back to back
            full = hf_to_full(pmap, [ckpt.get(n) for n in pmap.names(layer)[1]], args)
            last.update(id=(key, offsets[:lead]), full=full)
        inner = zip(offsets[lead:], sizes[lead:])
        piece = last["full"][tuple(slice(o, o + s) for o, s in inner)].to(dtype).clone()
        progress.update(piece.numel() * piece.element_size())
        return piece.reshape((1,) * lead + tuple(piece.shape))

    dist_checkpointing.save(sharded, out_dir, sharded_strategy=sync_save_strategy(resolve))
    progress.close()


# ----------------------------------------------------------------------------- mcore -> hf

def plan_files(args: ModelArgs, dtype: torch.dtype, max_bytes: int) -> list[list[tuple]]:
    """Table rows grouped into output files of at most ``max_bytes`` (a row never splits)."""
    shapes, el = hf_shapes(args), torch.tensor([], dtype=dtype).element_size()

    def nbytes(row: tuple) -> int:
        layer, pmap = row
        return sum(el * int(torch.Size(shapes[n]).numel()) for n in pmap.names(layer)[1])

    return group_by_bytes(param_table(args), nbytes, max_bytes)


def write_hf(ckpt_dir: str, out_dir: str, args: ModelArgs, dtype: torch.dtype, max_bytes: int,
             lora: Optional[dict] = None) -> None:
    """Writes the model tensors of a dist checkpoint as HF safetensors (one file in memory at a
    time). Needs torch.distributed (a single rank is enough). ``args``: `megarl.models.checks.stored_args`
    (the vocabulary padding is read and dropped). ``lora`` (megarl.json's ``lora`` of a LoRA
    training checkpoint: rank, alpha, target_modules): every adapted weight is written merged,
    W + (alpha / rank) B A, and the adapters alone go to ``<out_dir>/adapter`` in PEFT's layout."""
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    from megarl.mcore.checkpoint import stacked_piece

    stored = tensor_metadata(ckpt_dir)
    groups = plan_files(args, dtype, max_bytes)
    names = safetensors_file_names(len(groups))
    progress = Progress("mcore-to-hf", len(hf_shapes(args)), enabled=True)
    weight_map, total = {}, 0
    adapters: dict[str, torch.Tensor] = {}  # LoRA: PEFT name -> tensor
    for fname, rows in zip(names, groups):
        request = {}
        for i, (layer, pmap) in enumerate(rows):
            key = mcore_key(pmap)
            shape, sdtype = stored[key]
            request[i] = stacked_piece(key, shape, sdtype, layer, pmap.expert)
        loaded = dist_checkpointing.load(request, ckpt_dir, validate_access_integrity=False)
        tensors = {}
        for i, (layer, pmap) in enumerate(rows):
            full = loaded[i].reshape(loaded[i].shape[(layer is not None) + (pmap.expert is not None):])
            if lora is not None and _adapter_key(pmap, lora) is not None:
                full = _merge_adapter(ckpt_dir, stored, pmap, layer, full, args, lora, adapters)
            for name, t in zip(pmap.names(layer)[1], full_to_hf(pmap, full, args)):
                check_finite(t, name, f"{ckpt_dir} ({mcore_key(pmap)})")  # failing: the temp dir goes
                tensors[name] = t.to(dtype).contiguous()
                weight_map[name] = fname
                progress.update(tensors[name].numel() * tensors[name].element_size())
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        del tensors, loaded, request
    if len(names) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if lora is not None:
        _write_peft(out_dir, adapters, lora, dtype)
    progress.close()


def _adapter_key(pmap, lora: dict) -> Optional[str]:
    """The stacked checkpoint key prefix of the adapters of a table row (None: not adapted)."""
    from megarl.models.lora import TARGETS

    for target in lora["target_modules"]:
        if pmap.expert is None and pmap.mcore == f"decoder.layers.{{L}}.{TARGETS[target][0]}.weight":
            return f"decoder.layers.{TARGETS[target][0]}"
    return None


def _merge_adapter(ckpt_dir, stored, pmap, layer, full, args, lora, adapters) -> torch.Tensor:
    """``full`` (the Megatron full tensor of one layer: fused QKV rows, fc1 = [gate; up]) +
    (alpha / rank) B A with the layer's stacked A and B, whose rows are in the same full layout;
    records the row's PEFT tensors (B split like the weight, A shared) in ``adapters``."""
    from megatron.core import dist_checkpointing

    from megarl.mcore.checkpoint import stacked_piece

    prefix = _adapter_key(pmap, lora)
    request = {k: stacked_piece(f"{prefix}.{k}", *stored[f"{prefix}.{k}"], layer, None) for k in ("lora_A", "lora_B")}
    ab = dist_checkpointing.load(request, ckpt_dir, validate_access_integrity=False)
    A, B = ab["lora_A"][0], ab["lora_B"][0]
    for name, t in (("lora_A", A), ("lora_B", B)):
        check_finite(t, name, f"{ckpt_dir} ({prefix}.{name})")
    scaling = float(lora["alpha"]) / int(lora["rank"])
    merged = (full.float() + scaling * (B.float() @ A.float())).to(full.dtype)
    hf = [h[: -len(".weight")] for h in pmap.names(layer)[1]]
    Bs = full_to_hf(pmap, B, args) if len(hf) > 1 else [B]
    for mod, b in zip(hf, Bs):
        adapters[f"base_model.model.{mod}.lora_A.weight"] = A.clone()
        adapters[f"base_model.model.{mod}.lora_B.weight"] = b.contiguous()
    return merged


def _write_peft(out_dir: str, adapters: dict, lora: dict, dtype: torch.dtype) -> None:
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from megarl.models.lora import peft_config

    adapter_dir = os.path.join(out_dir, "adapter")
    os.makedirs(adapter_dir, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in adapters.items()},
              os.path.join(adapter_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(peft_config(SimpleNamespace(**lora), ""), f, indent=2)
