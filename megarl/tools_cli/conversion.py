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

Validation (``check_hf``, ``check_mcore``) reads only headers and metadata, before any rank starts.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

import torch

from megarl.models.layouts import (full_to_hf, group_by_bytes, hf_shapes, hf_to_full, mcore_key,
                                   mcore_shapes, safetensors_file_names)
from megarl.models.registry import ModelArgs, param_table
from megarl.tools_cli import ToolError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_IGNORED_HF = ("rotary_emb.inv_freq",)


def _listing(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


# ----------------------------------------------------------------------------- validation

def model_args(config_dir: str) -> ModelArgs:
    """config.json -> ModelArgs; a bad config is a one-line ToolError."""
    from megarl.models.registry import read_model_args

    try:
        return read_model_args(config_dir)
    except (FileNotFoundError, ValueError) as e:
        raise ToolError(str(e)) from None


def check_layout(args: ModelArgs, tp: int, pp: int) -> None:
    """TP must divide the heads and the MLP; any PP up to the layer count works (a PP that does not
    divide the layers gets Megatron's uneven first/last stages, :mod:`megarl.models.stages`)."""
    if tp < 1 or pp < 1:
        raise ToolError(f"--tp/--pp must be >= 1 (got tp={tp}, pp={pp})")
    for what, n in (("num_attention_heads", args.num_heads), ("num_key_value_heads", args.num_kv_heads),
                    ("intermediate_size", args.ffn_hidden_size)):
        if n % tp:
            raise ToolError(f"--tp {tp} does not divide {what}={n} (config.json)")
    if pp > args.num_layers:
        raise ToolError(f"--pp {pp} is greater than num_hidden_layers={args.num_layers} (config.json)")
    if args.num_experts and tp > 1:
        raise ToolError(f"--tp {tp}: MoE models ({args.architecture}) run with tp=1 here")


def _compare(found: dict[str, tuple], expected: dict[str, tuple], where: dict[str, str],
             embed_key: str, args: ModelArgs, source: str) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if embed_key in found and embed_key in expected and found[embed_key][0] != expected[embed_key][0]:
        raise ToolError(f"vocab size mismatch: config.json has vocab_size={args.vocab_size} but "
                        f"{embed_key} in {where[embed_key]} has {found[embed_key][0]} rows")
    if missing:
        raise ToolError(f"{source}: missing {len(missing)} tensor(s): {_listing(missing)}")
    if unexpected:
        raise ToolError(f"{source}: unexpected {len(unexpected)} tensor(s): {_listing(unexpected)}")
    bad = [k for k in expected if tuple(found[k]) != tuple(expected[k])]
    if bad:
        k = bad[0]
        more = f" ({len(bad) - 1} more mismatches)" if len(bad) > 1 else ""
        raise ToolError(f"{k}: shape {tuple(found[k])} in {where[k]}, but config.json implies "
                        f"{tuple(expected[k])}{more}")


def check_hf(hf_dir: str, args: ModelArgs) -> torch.dtype:
    """Reads every safetensors header: keys vs the architecture, shapes vs config.json, dtypes.
    Returns the (common) stored dtype."""
    from safetensors import SafetensorError, safe_open

    from megarl.models.hf_io import HFCheckpoint

    ckpt = HFCheckpoint(hf_dir)  # raises naming a missing index/file or a corrupt header
    shapes, dtypes, where = {}, {}, {}
    for fname in sorted(set(ckpt.weight_map.values())):
        path = os.path.join(hf_dir, fname)
        if not os.path.isfile(path):
            raise ToolError(f"{path}: missing (listed in model.safetensors.index.json)")
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    shapes[name], dtypes[name], where[name] = tuple(sl.get_shape()), sl.get_dtype(), fname
        except (SafetensorError, OSError) as e:
            raise ToolError(f"{path}: cannot read safetensors ({e})") from None
    listed = sorted(n for n, fname in ckpt.weight_map.items() if where.get(n) != fname)
    if listed:
        raise ToolError(f"{hf_dir}: index lists {listed[0]} in {ckpt.weight_map[listed[0]]}, "
                        "which does not hold it")
    expected = hf_shapes(args)
    ignorable = {n for n in shapes if n.endswith(_IGNORED_HF)}
    if args.tie_word_embeddings and "lm_head.weight" in shapes:
        ignorable.add("lm_head.weight")  # a tied head some writers keep: the embedding is used
    found = {n: s for n, s in shapes.items() if n not in ignorable}
    _compare(found, expected, where, "model.embed_tokens.weight", args, hf_dir)
    kinds = {dtypes[n] for n in expected}
    odd = sorted(n for n in expected if dtypes[n] not in _SAFETENSORS_DTYPES)
    if odd:
        raise ToolError(f"{odd[0]}: dtype {dtypes[odd[0]]} in {where[odd[0]]} is not a float type")
    return _SAFETENSORS_DTYPES[sorted(kinds)[0]] if len(kinds) == 1 else torch.float32


def tensor_metadata(ckpt_dir: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every tensor of a dist checkpoint, from its metadata alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megarl.checkpoint import read_dcp_metadata

    md = read_dcp_metadata(ckpt_dir)
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def stored_args(ckpt_dir: str, args: ModelArgs) -> ModelArgs:
    """``args`` as a dist checkpoint stores the model: the original vocabulary from megarl.json
    (written by every megarl save; config.json's for older checkpoints) and the padded one from
    the stored embedding rows (whatever TP and padding the checkpoint was saved with)."""
    from megarl.checkpoint import read_meta

    meta = read_meta(ckpt_dir) or {}
    vocab = int(meta.get("vocab_size") or args.vocab_size)
    stored = tensor_metadata(ckpt_dir).get("embedding.word_embeddings.weight")
    rows = stored[0][0] if stored else vocab
    if rows < vocab:
        raise ToolError(f"vocab size mismatch: config.json has vocab_size={vocab} but "
                        f"embedding.word_embeddings.weight in {ckpt_dir} has {rows} rows")
    return dataclasses.replace(args, vocab_size=vocab, padded_vocab_size=rows)


def check_mcore(ckpt_dir: str, args: ModelArgs) -> torch.dtype:
    """Refuses unsafe content, then checks the model tensors of a dist checkpoint against
    config.json (metadata only). Returns the stored dtype."""
    from megarl.checkpoint import check_safe

    check_safe(ckpt_dir)
    args = stored_args(ckpt_dir, args)
    meta = {k: v for k, v in tensor_metadata(ckpt_dir).items() if not k.startswith("optimizer.")}
    found = {k: shape for k, (shape, _) in meta.items()}
    _compare(found, mcore_shapes(args), {k: ckpt_dir for k in found},
             "embedding.word_embeddings.weight", args, ckpt_dir)
    return meta["embedding.word_embeddings.weight"][1]


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


def write_hf(ckpt_dir: str, out_dir: str, args: ModelArgs, dtype: torch.dtype, max_bytes: int) -> None:
    """Writes the model tensors of a dist checkpoint as HF safetensors (one file in memory at a
    time). Needs torch.distributed (a single rank is enough). ``args``: :func:`stored_args`
    (the vocabulary padding is read and dropped)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from safetensors.torch import save_file

    stored = tensor_metadata(ckpt_dir)
    groups = plan_files(args, dtype, max_bytes)
    names = safetensors_file_names(len(groups))
    progress = Progress("mcore-to-hf", len(hf_shapes(args)), enabled=True)
    weight_map, total = {}, 0
    for fname, rows in zip(names, groups):
        request = {}
        for i, (layer, pmap) in enumerate(rows):
            key = mcore_key(pmap)
            shape, sdtype = stored[key]
            # one layer (and expert) of a stacked key: a [1, (1,) ...] piece at offset `layer` of
            # axis 0 (and `expert` of axis 1) - not prepend_axis_num, whose legacy path needs
            # every layer local in a 1-rank world
            offsets = [] if layer is None else [(0, layer, shape[0])]
            if pmap.expert is not None:
                offsets.append((1, pmap.expert, shape[1]))
            piece = (1,) * len(offsets) + tuple(shape[len(offsets):])
            request[i] = ShardedTensor.from_rank_offsets(key, torch.empty(piece, dtype=sdtype), *offsets)
        loaded = dist_checkpointing.load(request, ckpt_dir, validate_access_integrity=False)
        tensors = {}
        for i, (layer, pmap) in enumerate(rows):
            full = loaded[i].reshape(loaded[i].shape[(layer is not None) + (pmap.expert is not None):])
            for name, t in zip(pmap.names(layer)[1], full_to_hf(pmap, full, args)):
                tensors[name] = t.to(dtype).contiguous()
                weight_map[name] = fname
                progress.update(tensors[name].numel() * tensors[name].element_size())
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        del tensors, loaded, request
    if len(names) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    progress.close()
