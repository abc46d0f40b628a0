"""megarl-convert: HF safetensors <-> Megatron dist checkpoints (megarl's training checkpoint format).

    megarl-convert hf-to-mcore --hf HF_DIR --out CKPT_DIR [--tp N --pp M] [--dtype D] [--force]
                               [--make-vocab-size-divisible-by 128]
    megarl-convert mcore-to-hf --ckpt DIR --out HF_DIR [--dtype D] [--max-shard-size 5GB] [--force]

hf-to-mcore writes a model-only dist checkpoint (the same sharded torch_dist format as training
checkpoints, loadable into any TP/PP layout) with the HF config.json and tokenizer copied in;
``--tp/--pp`` choose how many ranks write it in parallel (started with torchrun when needed; a PP
that does not divide the layers gets uneven first/last stages). The embedding and output layer are
stored padded to a multiple of ``make_vocab_size_divisible_by * tp`` rows (as training holds them;
any layout loads them), and megarl.json records the original vocab_size, which mcore-to-hf
restores exactly.
mcore-to-hf takes a converted checkpoint, a training checkpoint directory or a whole save
directory (its latest complete checkpoint) of any layout, and writes HF safetensors.

Inputs are checked before anything is written (config.json vs tensor shapes, missing/unexpected
tensors by name, vocab size, TP/PP vs the head and layer counts; a checkpoint's files present
and whole, ``checkpoint.verify_checkpoint``; every weight finite: read up front from HF
safetensors, as it is read from a dist checkpoint); output appears atomically (written to a temp
directory, renamed at the end); an --out that is, contains or lies inside the input is refused,
with --force too. Errors are one line on stderr, exit status 1
(``--debug``: the traceback).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from megarl.common.cli import ArgumentParser, add_debug_flag
from megarl.commands import (ToolError, check_output_dir, discard, finish_ranks, init_ranks,
                              needs_launch, run_tool, temp_output_dir)

PROG = "megarl-convert"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB)")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])


def parse_args(argv: list[str]) -> argparse.Namespace:
    from megarl.commands.conversion import DTYPES

    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint")
    h.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    h.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks writing the checkpoint")
    h.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks writing the checkpoint")
    h.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times --tp (default 128)")
    m = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    m.add_argument("--ckpt", required=True, help="checkpoint dir, or a save dir (its latest checkpoint)")
    m.add_argument("--max-shard-size", type=parse_size, default=5 * 2**30,
                   help="largest output safetensors file (default 5GB)")
    for p in (h, m):
        p.add_argument("--out", required=True, help="output directory (created atomically)")
        p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="output dtype (default: the input's)")
        p.add_argument("--force", action="store_true", help="replace a non-empty --out")
        add_debug_flag(p)
    return ap.parse_args(argv)


def hf_to_mcore(a: argparse.Namespace, argv: list[str]) -> int:
    from megarl.models.checks import check_finite_hf, check_hf, check_layout, model_args
    from megarl.commands.conversion import DTYPES

    if not os.path.isdir(a.hf):
        raise ToolError(f"--hf {a.hf}: no such directory")
    args = model_args(a.hf)
    check_layout(args, a.tp, a.pp)
    if a.make_vocab_size_divisible_by < 1:
        raise ToolError(f"--make-vocab-size-divisible-by must be >= 1, got {a.make_vocab_size_divisible_by}")
    stored = check_hf(a.hf, args)
    dtype = DTYPES[a.dtype] if a.dtype else stored
    check_output_dir(a.out, a.force, {"--hf": a.hf})
    check_finite_hf(a.hf, args)  # the one check that reads the weights: last, and before any rank
    tmp = temp_output_dir(a.out)
    if needs_launch(a.tp * a.pp):
        from megarl.trainer import parallel

        rc = parallel.relaunch(a.tp * a.pp, "megarl.commands.convert", argv)
        if rc:
            discard(tmp)
        return rc
    return _run_ranks(a.tp, a.pp, tmp, lambda ps: _write_mcore(a, args, ps, dtype, tmp))


def _write_mcore(a, args, ps, dtype, tmp) -> None:
    from megarl.checkpoint import FORMAT, META, commit_dir, copy_hf_side_files, file_manifest, write_synced
    from megarl.checkpoint.verify import MANIFEST
    from megarl.models.layouts import pad_vocab
    from megarl.commands.conversion import write_mcore

    t0 = time.perf_counter()
    padded = pad_vocab(args, a.make_vocab_size_divisible_by, ps.tp)
    write_mcore(a.hf, tmp, padded, ps, dtype)
    if ps.rank == 0:
        copy_hf_side_files(a.hf, tmp)
        _set_config_dtype(tmp, args, dtype)
        write_synced(os.path.join(tmp, META), json.dumps({
            "format": FORMAT, "version": 1, "kind": "converted", "complete": True,
            "source": os.path.abspath(a.hf), "dtype": str(dtype).replace("torch.", ""),
            "layout": {"tp": ps.tp, "pp": ps.pp}, "vocab_size": args.vocab_size,
            "padded_vocab_size": padded.mcore_vocab_size, MANIFEST: file_manifest(tmp)}, indent=1))
        commit_dir(tmp, os.path.abspath(a.out))
        print(f"[{PROG}] wrote {a.out} ({time.perf_counter() - t0:.1f}s)", flush=True)


def _set_config_dtype(out_dir: str, args, dtype) -> None:
    """config.json from the input's, with the output dtype (both the old and new HF key)."""
    from megarl.models.hf_io import hf_config_dict

    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        base = json.load(f)
    name = str(dtype).replace("torch.", "")
    if "dtype" in base:
        base["dtype"] = name
    with open(path, "w") as f:
        json.dump(hf_config_dict(args, base, name), f, indent=2)


def _run_ranks(tp: int, pp: int, tmp: str, body) -> int:
    """Initialises ranks, runs ``body(ps)`` with a fresh temp dir, removes it on failure."""
    import torch.distributed as dist

    ps, created = init_ranks(tp, pp)
    try:
        if ps.rank == 0:
            discard(tmp)
            os.makedirs(tmp)
        dist.barrier()
        body(ps)
        dist.barrier()
    except BaseException:
        if ps.rank == 0:
            discard(tmp)
        raise
    finally:
        finish_ranks(created)
    return 0


def mcore_to_hf(a: argparse.Namespace, argv: list[str]) -> int:
    from megarl.trainer import parallel
    from megarl.checkpoint import resolve_checkpoint, verify_checkpoint
    from megarl.models.checks import check_mcore, model_args, stored_args
    from megarl.commands.conversion import DTYPES

    if parallel.discover_ranks().world_size > 1:
        raise ToolError("mcore-to-hf runs in one process (it reads any layout); start it without torchrun")
    ckpt = resolve_checkpoint(a.ckpt)
    verify_checkpoint(ckpt)  # a missing or truncated file: one line naming it, before any read
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        raise ToolError(f"{ckpt}: no config.json (megarl writes one into every checkpoint)")
    args = model_args(ckpt)
    stored = check_mcore(ckpt, args)
    args = stored_args(ckpt, args)  # the original vocab (megarl.json) and the stored padding
    dtype = DTYPES[a.dtype] if a.dtype else stored
    check_output_dir(a.out, a.force, {"--ckpt": a.ckpt})
    tmp = temp_output_dir(a.out)
    print(f"[{PROG}] reading {ckpt}", flush=True)
    return _run_ranks(1, 1, tmp, lambda ps: _write_hf(a, ckpt, args, dtype, tmp))


def _write_hf(a, ckpt, args, dtype, tmp) -> None:
    from megarl.checkpoint import commit_dir, copy_hf_side_files
    from megarl.commands.conversion import write_hf

    t0 = time.perf_counter()
    meta_path = os.path.join(ckpt, "megarl.json")
    lora = None
    if os.path.isfile(meta_path):  # a LoRA training checkpoint: merged model + PEFT adapter
        with open(meta_path) as f:
            lora = json.load(f).get("lora")
    write_hf(ckpt, tmp, args, dtype, a.max_shard_size, lora)
    copy_hf_side_files(ckpt, tmp)
    _set_config_dtype(tmp, args, dtype)
    commit_dir(tmp, os.path.abspath(a.out))
    print(f"[{PROG}] wrote {a.out} ({time.perf_counter() - t0:.1f}s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    command = {"hf-to-mcore": hf_to_mcore, "mcore-to-hf": mcore_to_hf}[a.command]
    return run_tool(PROG, lambda: command(a, argv), a.debug)


if __name__ == "__main__":
    sys.exit(main())
