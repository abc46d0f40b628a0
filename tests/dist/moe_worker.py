"""torchrun worker (4 ranks) for test_moe.py, on a tiny Qwen3-MoE HF checkpoint WORK/<name>/hf:

    moe_worker.py WORK ranks4 NAME...   per model: megarl-convert hf-to-mcore --pp 2; megarl-logprobs
                                        --ep 2 (DP=4) and --pp 2 --ep 2 (uneven [2, 1] stages);
                                        the Resharder's buckets, export_hf and a model dist checkpoint
                                        at EP=2 and PP=2 x EP=2, as WORK/<name>/{reshard,export,saved}_*
    python moe_worker.py WORK single NAME...   logprobs at EP=1, mcore-to-hf (converted and saved)
    moe_worker.py WORK ranks4 NAME... + HF OUT LAYOUT...   then, in the same launch, layouts_worker's
                                        training layouts of HF (its ranks' imports paid once)
Exit status: the first non-zero tool status.
"""
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file


def reshard_and_export(work: str, name: str, pp: int, ep: int) -> None:
    """Every HF tensor as the resharder yields it (source ranks of each stage) and as export_hf
    writes it, from an Engine whose experts are split over ``ep`` ranks."""
    from megarl.trainer import parallel
    from megarl.config import load_config
    from megarl.trainer.engine import Engine, EngineSpec
    from megarl.weights.resharder import Resharder

    hf = f"{work}/{name}/hf"
    cfg = load_config(None, [f"model.hf_path={hf}", "data.train_path=x", f"parallel.pp={pp}",
                             f"parallel.ep={ep}"])
    ps = parallel.init_model_parallel(1, pp, ep=ep)
    engine = Engine.build(EngineSpec.from_config(cfg), ps, trainable=False)
    tensors = {}
    for bucket in Resharder(engine, bucket_bytes=40_000).iter_buckets():
        tensors.update({n: t.clone() for n, t in zip(bucket.names, bucket.tensors)})
    out = f"{work}/{name}/reshard_pp{pp}ep{ep}"
    os.makedirs(out, exist_ok=True)
    if tensors:
        save_file(tensors, f"{out}/stage{ps.pp_rank}.safetensors")
    engine.export_hf(f"{work}/{name}/export_pp{pp}ep{ep}")
    save_model(engine, hf, f"{work}/{name}/saved_pp{pp}ep{ep}")
    dist.barrier()
    parallel.destroy_model_parallel_only()


def save_model(engine, hf: str, out: str) -> None:
    """A model-only dist checkpoint written by this EP layout (each rank its own experts)."""
    import json
    import shutil

    from megarl.checkpoint import META, model_sharded_state_dict
    from megarl.mcore.checkpoint import save_sharded

    if dist.get_rank() == 0:
        os.makedirs(out)
    dist.barrier()
    save_sharded(model_sharded_state_dict(engine.chunks), out)
    if dist.get_rank() == 0:
        shutil.copy(f"{hf}/config.json", out)
        with open(os.path.join(out, META), "w") as f:
            json.dump({"format": "megarl-checkpoint", "kind": "converted", "complete": True,
                       "vocab_size": engine.args.vocab_size}, f)


def main():
    from megarl.common import compat
    from megarl.trainer import parallel
    from megarl.commands import convert, logprobs

    work, mode, *names = sys.argv[1:]
    training = names[names.index("+") + 1:] if "+" in names else []
    names = names[:names.index("+")] if "+" in names else names
    torch.set_num_threads(1)
    calls = []
    for name in names:
        d, inp = f"{work}/{name}", f"{work}/input.jsonl"
        if mode == "ranks4":
            calls += [(convert.main, ["hf-to-mcore", "--hf", f"{d}/hf", "--out", f"{d}/mcore", "--pp", "2"]),
                      (logprobs.main, ["--ckpt", f"{d}/mcore", "--input", inp, "--output", f"{d}/ep2.jsonl",
                                       "--ep", "2"]),
                      (logprobs.main, ["--ckpt", f"{d}/mcore", "--input", inp, "--output",
                                       f"{d}/pp2ep2.jsonl", "--pp", "2", "--ep", "2"])]
        else:
            calls += [(logprobs.main, ["--ckpt", f"{d}/mcore", "--input", inp, "--output", f"{d}/ep1.jsonl"]),
                      (convert.main, ["mcore-to-hf", "--ckpt", f"{d}/mcore", "--out", f"{d}/hf_back"]),
                      (convert.main, ["mcore-to-hf", "--ckpt", f"{d}/saved_pp2ep2", "--out",
                                      f"{d}/saved_back"])]
    if mode == "ranks4":
        compat.quiet_megatron_warnings()
        parallel.init_distributed()
    for fn, argv in calls:
        rc = fn(argv)
        if rc:
            print(f"FAILED ({rc}): {argv}", file=sys.stderr)
            return rc
    if mode == "ranks4":
        for name in names:
            for pp, ep in ((1, 2), (2, 2)):
                reshard_and_export(work, name, pp, ep)
        if training:
            from layouts_worker import run_group

            run_group(training[0], training[1], training[2:])
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
