"""HF safetensors <-> Megatron model chunks, for any TP/PP(/VPP) layout.

Loading: every rank reads only the HF tensors of its own stage (lazily, one at a time) and cuts
its TP shard (MoE: loads its own experts). Exporting: per table row, the TP group of DP rank 0
all-gathers the shards (an MoE expert is broadcast by the expert-parallel rank owning it) and the
TP-rank-0 rank of each pipeline stage writes its stage's tensors (vocabulary padding dropped,
:mod:`megarl.models.layouts`); the file layout (one file for a
small model, ``model-0000k-of-0000n.safetensors`` + index otherwise) is computed identically on
every rank from parameter metadata. The directory appears atomically (temp dir + rename).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megarl.mcore.model import global_layer_index, local_expert_indices
from megarl.models import stages
from megarl.models.layouts import (expert_shape, group_by_bytes, hf_shapes, hf_to_shard,
                                   safetensors_file_names, shards_to_hf)
from megarl.protocol.hf_model import ModelArgs, ParamMap, param_table, te_name

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")  # TEGroupedMLP (grouped GEMM)


def expert_row_name(rest: str, local_expert_indices) -> str:
    """A layer-relative parameter name with a *local* expert index (SequentialMLP's
    ``mlp.experts.local_experts.{e}.linear_fc1.weight`` or TEGroupedMLP's
    ``mlp.experts.linear_fc1.weight{e}``) -> the table's name with the *global* expert index;
    other names unchanged."""
    e = _EXPERT.match(rest)
    if e:
        return f"mlp.experts.local_experts.{local_expert_indices[int(e.group(1))]}.{e.group(2)}"
    g = _GROUPED.match(rest)
    if g:
        return f"mlp.experts.local_experts.{local_expert_indices[int(g.group(2))]}.{g.group(1)}.weight"
    return rest


class HFCheckpoint:
    """Lazy reader of an HF safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            self.weight_map = {k: "model.safetensors" for k in self._keys(single)}
        else:
            raise FileNotFoundError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")

    @staticmethod
    def _keys(path: str) -> list[str]:
        try:
            with safe_open(path, framework="pt") as f:
                return list(f.keys())
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: cannot read safetensors ({e})") from None

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        path = os.path.join(self.dir, self.weight_map[name])
        try:
            with safe_open(path, framework="pt") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: cannot read tensor {name!r} ({e})") from None


@dataclass(frozen=True)
class LocalParam:
    """A Megatron parameter of this rank with its global identity."""

    chunk: int
    local_name: str  # name inside the GPTModel chunk
    layer: Optional[int]  # global layer index
    pmap: ParamMap
    param: torch.nn.Parameter


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    while hasattr(m, "module"):
        m = m.module
    return m


def local_params(chunks: list[torch.nn.Module], args: ModelArgs, use_te: bool = False) -> list[LocalParam]:
    """Maps every parameter of this rank's chunks to its table row (error on an unknown name)."""
    table: dict[str, tuple[Optional[int], ParamMap]] = {}
    for layer, pmap in param_table(args):
        name = pmap.names(layer)[0]
        table[te_name(name, bool(args.num_experts)) if use_te else name] = (layer, pmap)
    if args.tie_word_embeddings:  # the last stage's copy of the tied embedding (PP > 1)
        emb = next(p for layer, p in param_table(args) if p.mcore.startswith("embedding."))
        table["output_layer.weight"] = (None, emb)
    out = []
    for ci, chunk in enumerate(chunks):
        model = _unwrap(chunk)
        for local_name, param in model.named_parameters():
            if local_name.endswith((".lora_A", ".lora_B")):  # LoRA adapters: megarl.models.lora
                continue
            name = local_name
            m = _LAYER.match(local_name)
            if m:
                local_layer, rest = int(m.group(1)), m.group(2)
                if rest.startswith("mlp.experts."):  # local expert index -> global (this EP rank's share)
                    rest = expert_row_name(rest, local_expert_indices(model, local_layer))
                name = f"decoder.layers.{global_layer_index(model, local_layer)}.{rest}"
            if name not in table:
                raise KeyError(f"Megatron parameter {local_name!r} has no entry in the "
                               f"{args.architecture} weight table")
            layer, pmap = table[name]
            out.append(LocalParam(ci, local_name, layer, pmap, param))
    return out


@torch.no_grad()
def load_hf_weights(chunks, args: ModelArgs, hf_dir: str, tp: int, tp_rank: int, use_te: bool = False) -> None:
    """Copies the HF checkpoint into this rank's parameters; shape mismatches name the tensor."""
    ckpt = HFCheckpoint(hf_dir)
    for lp in local_params(chunks, args, use_te):
        hf_names = lp.pmap.names(lp.layer)[1]
        tensors = [ckpt.get(n) for n in hf_names]
        shard = hf_to_shard(lp.pmap, tensors, args, tp, tp_rank)
        if tuple(shard.shape) != tuple(lp.param.shape):
            raise ValueError(f"{hf_dir}: {hf_names[0]} gives shape {tuple(shard.shape)} for "
                             f"{lp.local_name}, which expects {tuple(lp.param.shape)}")
        lp.param.copy_(shard.to(lp.param.dtype))


def gather_tp(param: torch.Tensor, tp_dim: Optional[int], tp: int, tp_group) -> list[torch.Tensor]:
    """All TP shards of ``param`` on every TP rank (replicated params: the local one)."""
    if tp == 1 or tp_dim is None:
        return [param.detach()]
    shards = [torch.empty_like(param) for _ in range(tp)]
    dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
    return shards


def serves_weights(ps) -> bool:
    """Ranks that take part in gathering full tensors: the TP group of DP rank 0, plus (MoE) the
    other ranks of its expert-parallel group, which own the remaining experts."""
    return ps.first_replica or (ps.ep > 1 and ps.expert_dp_rank == 0)


def gather_expert(lp: Optional[LocalParam], pmap: ParamMap, args: ModelArgs, ps,
                  dtype: torch.dtype) -> torch.Tensor:
    """The full tensor of an MoE expert row on every rank of the expert-parallel group: its owner
    (expert // (E / EP)) broadcasts. Experts are never TP-split (expert_tensor_parallel_size=1)."""
    if ps.ep == 1:
        return lp.param.detach()
    owner = pmap.expert // (args.num_experts // ps.ep)
    if owner == ps.ep_rank:
        buf = lp.param.detach().contiguous()
    else:
        buf = torch.empty(expert_shape(pmap, args), dtype=dtype, device=ps.device)
    dist.broadcast(buf, src=ps.ep_global_ranks[owner], group=ps.ep_group)
    return buf


def gather_row(lp: Optional[LocalParam], pmap: ParamMap, args: ModelArgs, ps,
               dtype: torch.dtype) -> list[torch.Tensor]:
    """All Megatron shards of one table row (TP shards, or one whole expert); ``lp`` is this
    rank's parameter of the row (None: an expert another rank owns)."""
    if pmap.expert is not None:
        return [gather_expert(lp, pmap, args, ps, dtype)]
    return gather_tp(lp.param, pmap.tp_dim, ps.tp, ps.tp_group)


def stage_rows(args: ModelArgs, split, stage: int) -> list[tuple[Optional[int], ParamMap]]:
    """The weight-table rows pipeline rank ``stage`` serves, in table order."""
    return [(layer, pmap) for layer, pmap in param_table(args)
            if split.row_stage(layer, pmap.mcore.startswith("embedding."))[0] == stage]


def iter_hf_tensors(chunks, args: ModelArgs, ps, use_te: bool = False,
                    dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields this stage's (HF name, full tensor) pairs in table order (vocabulary padding
    dropped, the tied output-layer copy skipped). Collective: every rank for which
    :func:`serves_weights` holds must iterate; ranks other than DP rank 0 only help with experts
    and yield nothing."""
    local = {lp.pmap.names(lp.layer)[0]: lp for lp in local_params(chunks, args, use_te)
             if not (args.tie_word_embeddings and lp.local_name == "output_layer.weight")}
    ref_dtype = next(iter(local.values())).param.dtype
    split = stages.of_config(_unwrap(chunks[0]).config)
    for layer, pmap in stage_rows(args, split, ps.pp_rank):
        if not ps.first_replica and pmap.expert is None:
            continue
        shards = gather_row(local.get(pmap.names(layer)[0]), pmap, args, ps, ref_dtype)
        if not ps.first_replica:
            continue
        for name, tensor in zip(pmap.names(layer)[1], shards_to_hf(pmap, shards, args)):
            yield name, tensor.to(dtype) if dtype is not None else tensor


def hf_config_dict(args: ModelArgs, base: Optional[dict] = None, dtype: str = "float32") -> dict:
    cfg = dict(base or {})
    cfg.update({
        "architectures": [args.architecture], "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size, "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads, "num_key_value_heads": args.num_kv_heads,
        "intermediate_size": args.ffn_hidden_size, "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta, "max_position_embeddings": args.max_position_embeddings,
        "tie_word_embeddings": args.tie_word_embeddings, "torch_dtype": dtype,
    })
    if args.qk_norm or "head_dim" in cfg:
        cfg["head_dim"] = args.head_dim
    return cfg


def export_hf(chunks, args: ModelArgs, ps, out_dir: str, *, src_hf_dir: str = "",
              use_te: bool = False, dtype: Optional[torch.dtype] = None,
              max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes the model as an HF checkpoint. Collective over all ranks.

    Files: ``model.safetensors`` when one file holds it all, else ``model-0000k-of-0000n`` plus
    ``model.safetensors.index.json``. config.json starts from ``src_hf_dir``'s (unknown fields
    kept) and the tokenizer files are copied from there.
    """
    rank = dist.get_rank()
    tmp = out_dir.rstrip("/") + ".tmp-export"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    writer = ps.first_replica and ps.tp_rank == 0
    # Every rank computes the same file layout from (stage, name, nbytes) metadata.
    meta = []
    if writer:  # from the table: HF sizes (no vocabulary padding), experts of every EP rank
        param = next(p for c in chunks for p in c.parameters())
        el = torch.tensor([], dtype=dtype or param.dtype).element_size()
        shapes = hf_shapes(args)
        for layer, pmap in stage_rows(args, stages.of_config(_unwrap(chunks[0]).config), ps.pp_rank):
            meta += [((name,), torch.Size(shapes[name]).numel() * el) for name in pmap.names(layer)[1]]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ps.pp_rank, meta) if writer else None)
    files = _plan_files([g for g in gathered if g is not None], max_shard_bytes)
    if serves_weights(ps):
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in iter_hf_tensors(chunks, args, ps, use_te, dtype):
            if not writer:
                continue
            fname = files[name]
            pending.setdefault(fname, {})[name] = tensor.contiguous().cpu()
            if len(pending[fname]) == sum(1 for v in files.values() if v == fname):
                save_file(pending.pop(fname), os.path.join(tmp, fname), metadata={"format": "pt"})
    dist.barrier()
    if rank == 0:
        _write_metadata(tmp, files, args, src_hf_dir, dtype)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    dist.barrier()


def _plan_files(stages: list, max_bytes: int) -> dict[str, str]:
    """(pp_rank, [(hf_names, nbytes)]) lists -> HF name -> file name. Files never span pipeline
    stages (each stage's writer owns its files) and hold at most ``max_bytes`` where possible."""
    named = [(pp_rank, n, nbytes) for pp_rank, meta in sorted(stages, key=lambda s: s[0])
             for names, nbytes in meta for n in names]
    groups = group_by_bytes(named, lambda x: x[2], max_bytes, boundary=lambda x: x[0])
    files = safetensors_file_names(len(groups))
    return {n: fname for fname, group in zip(files, groups) for _, n, _ in group}


def _write_metadata(out: str, files: dict, args: ModelArgs, src_hf_dir: str, dtype) -> None:
    base = {}
    if src_hf_dir and os.path.isfile(os.path.join(src_hf_dir, "config.json")):
        with open(os.path.join(src_hf_dir, "config.json")) as f:
            base = json.load(f)
    dtype_name = str(dtype).replace("torch.", "") if dtype else base.get("torch_dtype", "float32")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config_dict(args, base, dtype_name), f, indent=2)
    if len(set(files.values())) > 1:
        total = sum(os.path.getsize(os.path.join(out, fn)) for fn in set(files.values()))
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": files}, f, indent=2)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):
        src = os.path.join(src_hf_dir, name) if src_hf_dir else ""
        if src and os.path.isfile(src):
            shutil.copy(src, os.path.join(out, name))
