"""Benchmark: memory and time of one long sequence at CP=1 and CP=2 (parallel.cp), same model,
same tokens.

    python tools/bench/bench_cp_memory.py [--lengths 8192,16384] [--out docs/benchmarks.md]

Each (length, cp) is its own torchrun launch of cp ranks on this machine's cores (OMP threads
split between the ranks). A rank builds the engine (real megatron-core, a random Llama: hidden
256, 4 layers, 8 heads / 4 KV groups, vocab 4096), runs one warm-up step on a 64-token batch (the
gradient buffers and Adam state exist from then on), reads its resident memory, then trains one
step on a single sequence of --length tokens (loss on every token after the first 16) and reads
its peak resident memory (ru_maxrss). Reported per rank (the largest): the peak, the part above
the pre-step level (activations, logits, attention buffers and their gradients: "step memory")
and the step time; then CP=2 / CP=1.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=688, vocab_size=4096, max_position_embeddings=32768)


def worker(hf: str, length: int, out: str) -> None:
    import resource
    import time

    import torch
    import torch.distributed as dist

    from megarl.common import compat
    from megarl.config import load_config
    from megarl.trainer import parallel
    from megarl.trainer.batch import TensorBatch
    from megarl.trainer.engine import Engine, EngineSpec
    from megarl.trainer.sft import sft_loss

    compat.quiet_megatron_warnings()
    parallel.init_distributed()
    cp = dist.get_world_size()
    cfg = load_config(None, [f"model.hf_path={hf}", "data.train_path=x", f"parallel.cp={cp}",
                             f"train.micro_batch_tokens={length}", "optim.lr=1e-4"])
    engine = Engine.build(EngineSpec.from_config(cfg), parallel.init_model_parallel(1, 1, cp=cp))
    g = torch.Generator().manual_seed(0)

    def batch(n):
        ids = torch.randint(3, MODEL["vocab_size"], (n,), generator=g).tolist()
        return TensorBatch.from_lists([ids], {"loss_mask": [[0.0] * 16 + [1.0] * (n - 16)]})

    engine.train_batch(batch(64), sft_loss)
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    step = batch(length)
    dist.barrier()
    t0 = time.perf_counter()
    metrics = engine.train_batch(step, sft_loss)
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = [None] * cp
    dist.all_gather_object(rows, {"before": before, "peak": peak, "time": elapsed, "loss": metrics["loss"]})
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(hf: str, length: int, cp: int, tmp: str) -> dict:
    from megarl.common.net import free_port

    out = os.path.join(tmp, f"cp{cp}_{length}.json")
    threads = max(1, (os.cpu_count() or 2) // cp)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cp), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), os.path.abspath(__file__), "--worker", hf,
           str(length), out]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"bench_cp_memory: cp={cp} length={length} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        rows = json.load(f)
    worst = max(rows, key=lambda r: r["peak"])
    return {"peak": worst["peak"], "step": worst["peak"] - worst["before"], "time": max(r["time"] for r in rows),
            "loss": rows[0]["loss"]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--out", default="", help="append the table to this markdown file")
    a = ap.parse_args()
    from megarl.models.random_hf import tiny_config, write_random_hf

    mib = 1 << 20
    lines = ["| tokens | CP | peak / rank (MiB) | step memory / rank (MiB) | share of peak | step time (s) | "
             "loss |", "|---|---|---|---|---|---|---|"]
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_random_hf(os.path.join(tmp, "hf"), tiny_config("LlamaForCausalLM", **MODEL), seed=0, std=0.02)
        for length in (int(x) for x in a.lengths.split(",")):
            got = {}
            for cp in (1, 2):
                r = got[cp] = measure(hf, length, cp, tmp)
                lines.append(f"| {length} | {cp} | {r['peak'] / mib:.0f} | {r['step'] / mib:.0f} | "
                             f"{r['step'] / r['peak']:.2f} | {r['time']:.2f} | {r['loss']:.4f} |")
                print(lines[-1], flush=True)
            ratios.append(f"{length} tokens: CP=2 / CP=1 peak {got[2]['peak'] / got[1]['peak']:.2f}x, step memory "
                          f"{got[2]['step'] / got[1]['step']:.2f}x, step time {got[2]['time'] / got[1]['time']:.2f}x")
            print(ratios[-1], flush=True)
    text = "\n".join(lines + [""] + [f"- {r}" for r in ratios])
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
