"""megarl-logprobs: per-token logprobs of given token sequences under a checkpoint.

    megarl-logprobs --ckpt DIR --input IN.jsonl --output OUT.jsonl [--tp N --pp M --ep E]

DIR is an HF model directory, a megarl dist checkpoint (converted or training) or a save
directory (its latest complete checkpoint). Each input line is a JSON object with "input_ids";
each output line is that object plus "logprobs", where entry i = log p(token i | tokens < i) and
entry 0 = 0.0. Runs Megatron's forward (Engine.compute_logp) under any TP/PP layout; extra ranks
beyond TP*PP split the samples (data parallel); ``--ep`` splits an MoE model's experts over E of
them (started with E*TP*PP ranks when not under a launcher). OUT appears atomically.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

from megarl.common.cli import ArgumentParser, add_debug_flag
from megarl.commands import (ToolError, check_output_file, finish_ranks, init_ranks, needs_launch,
                              run_tool)

PROG = "megarl-logprobs"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "mcore"
    path: str  # HF dir or the resolved checkpoint dir; both hold config.json


def resolve_source(path: str) -> ModelSource:
    from megarl.checkpoint import is_complete, resolve_checkpoint, verify_checkpoint

    has_weights = any(os.path.isfile(os.path.join(path, n))
                      for n in ("model.safetensors", "model.safetensors.index.json"))
    if has_weights and not is_complete(path):
        return ModelSource("hf", path)
    ckpt = resolve_checkpoint(path)
    verify_checkpoint(ckpt)  # a missing or truncated file: one line naming it, before any read
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        raise ToolError(f"{ckpt}: no config.json next to the checkpoint")
    return ModelSource("mcore", ckpt)


def read_input(path: str, vocab_size: int, max_positions: int | None = None) -> list[dict]:
    """Input rows; errors name the line."""
    if not os.path.isfile(path):
        raise ToolError(f"--input {path}: no such file")
    from megarl.data.datasets import read_jsonl

    try:
        records = read_jsonl(path)
    except (ValueError, KeyError) as e:
        raise ToolError(str(e).strip("'")) from None
    rows = []
    for lineno, row in records:
        ids = row.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ToolError(f"{path}:{lineno}: needs \"input_ids\": a non-empty list of integers")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ToolError(f"{path}:{lineno}: token id {bad[0]} is outside the vocabulary "
                            f"[0, {vocab_size})")
        if max_positions is not None and len(ids) > max_positions:
            raise ToolError(f"{path}:{lineno}: {len(ids)} tokens is longer than the model's context "
                            f"(max_position_embeddings={max_positions})")
        rows.append(row)
    if not rows:
        raise ToolError(f"--input {path}: no input lines")
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="HF dir, megarl checkpoint or save dir")
    ap.add_argument("--input", required=True, help='JSONL, one {"input_ids": [...]} per line')
    ap.add_argument("--output", required=True, help="JSONL: each input object plus \"logprobs\"")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (need not divide the layers)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    ap.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                    help="Megatron vocabulary padding multiple (times --tp); the padding is masked")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096, help="padded tokens per forward")
    ap.add_argument("--batch-size", type=int, default=256, help="sequences per gathered chunk")
    add_debug_flag(ap)
    return ap.parse_args(argv)


def run(a: argparse.Namespace, argv: list[str]) -> int:
    from megarl.models.checks import check_finite_hf, check_hf, check_layout, check_mcore, model_args

    for flag, v in (("--batch-size", a.batch_size), ("--micro-batch-tokens", a.micro_batch_tokens)):
        if v < 1:
            raise ToolError(f"{flag} must be >= 1, got {v}")
    if not os.path.isdir(a.ckpt):
        raise ToolError(f"--ckpt {a.ckpt}: no such directory")
    source = resolve_source(a.ckpt)
    args = model_args(source.path)
    check_layout(args, a.tp, a.pp)
    if a.make_vocab_size_divisible_by < 1:
        raise ToolError(f"--make-vocab-size-divisible-by must be >= 1, got {a.make_vocab_size_divisible_by}")
    (check_hf if source.kind == "hf" else check_mcore)(source.path, args)
    rows = read_input(a.input, args.vocab_size, args.max_position_embeddings)
    check_output_file("--output", a.output, {"--input": a.input})
    if a.ep < 1 or (a.ep > 1 and not args.num_experts):
        raise ToolError(f"--ep {a.ep}: must be 1 for a dense model ({args.architecture})" if a.ep > 1
                        else f"--ep must be >= 1, got {a.ep}")
    if args.num_experts and args.num_experts % a.ep:
        raise ToolError(f"--ep {a.ep} does not divide num_experts={args.num_experts} (config.json)")
    if source.kind == "hf":  # a dist checkpoint's weights are checked as each rank loads them
        check_finite_hf(source.path, args)
    if needs_launch(a.tp * a.pp * a.ep):
        from megarl.trainer import parallel

        return parallel.relaunch(a.tp * a.pp * a.ep, "megarl.commands.logprobs", argv)
    ps, created = init_ranks(a.tp, a.pp, a.ep)
    try:
        _compute_and_write(a, source, rows, ps)
    finally:
        finish_ranks(created)
    return 0


def _compute_and_write(a, source: ModelSource, rows: list[dict], ps) -> None:
    import torch.distributed as dist

    from megarl.checkpoint import load_model_weights
    from megarl.config import load_config
    from megarl.models.checks import check_finite
    from megarl.trainer.batch import TensorBatch, per_sample
    from megarl.trainer.engine import Engine, EngineSpec

    cfg = load_config(None, [f"model.hf_path={source.path}",
                             f"model.init={'hf' if source.kind == 'hf' else 'random'}",
                             f"data.train_path={a.input}", f"parallel.tp={a.tp}", f"parallel.pp={a.pp}",
                             f"train.micro_batch_tokens={a.micro_batch_tokens}",
                             f"model.make_vocab_size_divisible_by={a.make_vocab_size_divisible_by}",
                             f"parallel.ep={a.ep}"])
    engine = Engine.build(EngineSpec.from_config(cfg), ps, trainable=False)
    if source.kind == "mcore":
        from megarl.checkpoint.layout import read_meta

        lora = (read_meta(source.path) or {}).get("lora")
        if lora:  # a LoRA training checkpoint: its adapters on top of its base (megarl.models.lora)
            from megarl.config import LoRAConfig
            from megarl.mcore.lora import apply_lora

            apply_lora(engine.chunks, LoRAConfig(**lora), engine.args, cfg.model.seed)
        load_model_weights(engine.chunks, source.path)
        for chunk in engine.chunks:  # this rank's shards (HF weights were checked before any rank)
            for name, p in chunk.named_parameters():
                check_finite(p, name, source.path)
    tmp = a.output + ".tmp"
    out = open(tmp, "w") if ps.rank == 0 else None
    try:
        for lo in range(0, len(rows), a.batch_size):
            chunk = list(range(lo, min(lo + a.batch_size, len(rows))))
            ours = [i for i in chunk if i % ps.dp == ps.dp_rank]
            # a 1-token sequence has nothing to predict: entry 0 is 0.0 by definition, no forward
            mine = [i for i in ours if len(rows[i]["input_ids"]) > 1]
            batch = TensorBatch.from_lists([rows[i]["input_ids"] for i in mine])
            logp = per_sample(engine.compute_logp(batch).logp, batch.lengths) if mine else []
            share = ({i: lp.tolist() for i, lp in zip(mine, logp)} | {i: [0.0] for i in ours if i not in mine}
                     if ours and ps.tp_rank == 0 and ps.pp_rank == 0 else {})
            gathered = [None] * ps.world_size if ps.rank == 0 else None
            dist.gather_object(share, gathered, dst=0)
            if out is not None:
                merged = {k: v for g in gathered for k, v in g.items()}
                for i in chunk:
                    out.write(json.dumps({**rows[i], "logprobs": merged[i]}) + "\n")
        if out is not None:
            out.close()
            os.replace(tmp, a.output)
            print(f"[{PROG}] wrote {len(rows)} sequences to {a.output}", flush=True)
    finally:
        if out is not None:  # failed before or at the rename: no half-written output stays
            out.close()
            if os.path.exists(tmp):
                os.remove(tmp)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    return run_tool(PROG, lambda: run(a, argv), a.debug)


if __name__ == "__main__":
    sys.exit(main())
