"""Checks of a model's files against what megarl will build from them: the HF ``config.json`` vs
a loaded config (TP, PP, EP), HF safetensors headers and dist-checkpoint metadata vs config.json,
and (`check_finite_hf`, `check_finite`) the weights' values.

Pure file reads (headers and metadata only, except the finiteness checks, which read tensor data
one tensor at a time) and megarl's own model code; no Megatron, no ranks. Library code:
`megarl.launch.preflight` and the command-line tools (megarl-convert, megarl-logprobs) call these;
config loading does not (`Config.validate` checks the config alone). The checks against
config.json alone (`check_against_model` of a dense model, `check_layout`) import no torch, so
megarl-train and megarl-launch reject a bad layout before paying for it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from megarl.common.errors import ConfigError, ToolError
from megarl.protocol.hf_model import ModelArgs

if TYPE_CHECKING:
    import torch

_SAFETENSORS_DTYPES = ("F32", "BF16", "F16")  # the float types a checkpoint may store
_IGNORED_HF = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- a config vs config.json

def check_against_model(cfg) -> None:
    """Checks of a loaded `Config` that need the HF config.json of ``model.hf_path``: TP vs heads,
    query groups and the dense MLP, the pipeline split of the layers (uneven first/last stages
    included), EP vs the experts. Run by `megarl.launch.preflight.check_inputs` (megarl-train) and
    megarl-launch; every error is one `ConfigError` line naming the field."""
    from megarl.models import stages
    from megarl.protocol.hf_model import read_model_args

    try:
        args = read_model_args(cfg.model.hf_path)
    except FileNotFoundError:
        raise ConfigError(f"model.hf_path: no config.json in {cfg.model.hf_path!r}") from None
    except (OSError, ValueError) as e:  # unreadable, bad JSON or UTF-8, missing or mistyped keys
        raise ConfigError(f"model.hf_path: {e}") from None
    tp, pp, vpp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp
    if cfg.weights.refit == "shard" and args.num_experts:  # parallel.pp > 1: Config.validate
        raise ConfigError("weights.refit: shard supports dense models on one pipeline stage "
                          f"({args.architecture} is MoE); use weights.refit=gather")
    if cfg.optim.freeze:  # patterns are HF names: checked here, not after the ranks built the model
        from megarl.models.freeze import frozen_rows
        frozen_rows(cfg.optim.freeze, args)
    if args.num_heads % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide num_attention_heads={args.num_heads}")
    if args.num_kv_heads % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide num_key_value_heads={args.num_kv_heads}")
    if not args.num_experts and args.ffn_hidden_size % tp:  # experts are whole on every rank
        raise ConfigError(f"parallel.tp: {tp} does not divide intermediate_size={args.ffn_hidden_size}")
    try:
        stages.resolve(args.num_layers, pp, vpp, cfg.parallel.first_stage_layers,
                       cfg.parallel.last_stage_layers)
        if args.num_experts:
            from megarl.models.builder import moe_kwargs, resolve_spec  # torch: MoE models only

            # the spec the run asks for (a GPU recipe validates on CPU: TE's presence is checked
            # when the model is built, builder.resolve_spec)
            use_te = cfg.model.spec == "te" or (cfg.model.spec == "auto" and resolve_spec("auto"))
            moe_kwargs(args, tp, cfg.parallel.ep, cfg.moe, use_te=use_te,
                       sequence_parallel=cfg.parallel.sequence_parallel)
        elif cfg.parallel.ep > 1:
            raise ValueError(f"parallel.ep: {cfg.parallel.ep} > 1 needs an MoE model "
                             f"({args.architecture} is dense)")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.moe.routing_replay != "none" and not args.num_experts:
        raise ConfigError(f"moe.routing_replay: {cfg.moe.routing_replay} needs an MoE model "
                          f"({args.architecture} is dense)")


# ----------------------------------------------------------------------------- files vs config.json

def _listing(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


# ----------------------------------------------------------------------------- validation

def model_args(config_dir: str) -> ModelArgs:
    """config.json -> ModelArgs; a bad config is a one-line ToolError."""
    from megarl.protocol.hf_model import read_model_args

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
    import torch
    from safetensors import SafetensorError, safe_open

    from megarl.models.hf_io import HFCheckpoint
    from megarl.models.layouts import hf_shapes

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
    stored = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    return stored[sorted(kinds)[0]] if len(kinds) == 1 else torch.float32


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
    from megarl.models.layouts import mcore_shapes

    check_safe(ckpt_dir)
    args = stored_args(ckpt_dir, args)
    meta = {k: v for k, v in tensor_metadata(ckpt_dir).items() if not k.startswith("optimizer.")}
    # LoRA adapters (megarl.models.lora) sit beside the base weights; megarl-convert merges them
    found = {k: shape for k, (shape, _) in meta.items() if not k.endswith((".lora_A", ".lora_B"))}
    _compare(found, mcore_shapes(args), {k: ckpt_dir for k in found},
             "embedding.word_embeddings.weight", args, ckpt_dir)
    return meta["embedding.word_embeddings.weight"][1]


def check_finite(t: torch.Tensor, name: str, where: str) -> None:
    """ToolError ``where: tensor name is all NaN`` (or: has N NaN/inf values) unless every value of
    ``t`` is finite. In pieces of 16M values, so the check allocates little beside ``t``."""
    import torch

    flat = t.detach().reshape(-1)
    pieces = flat.split(1 << 24)
    if all(bool(torch.isfinite(p).all()) for p in pieces):
        return
    bad = sum(int((~torch.isfinite(p)).sum()) for p in pieces)
    what = "is all NaN" if all(bool(torch.isnan(p).all()) for p in pieces) else \
        f"has {bad} NaN/inf values of {flat.numel()}"
    raise ToolError(f"{where}: tensor {name} {what} (non-finite weights give NaN outputs)")


def check_finite_hf(hf_dir: str, args: ModelArgs) -> None:
    """Every weight of an HF checkpoint that `check_hf` accepted holds finite values. It reads
    all tensor data (one tensor at a time): an all-NaN model (a diverged run's export, a broken
    download) passes every header check and would convert and score without a word."""
    from safetensors import safe_open

    from megarl.models.hf_io import HFCheckpoint
    from megarl.models.layouts import hf_shapes

    wanted = set(hf_shapes(args))
    by_file: dict[str, list[str]] = {}
    for name, fname in HFCheckpoint(hf_dir).weight_map.items():
        if name in wanted:
            by_file.setdefault(fname, []).append(name)
    for fname in sorted(by_file):
        path = os.path.join(hf_dir, fname)
        with safe_open(path, framework="pt") as f:
            for name in by_file[fname]:
                check_finite(f.get_tensor(name), name, path)
