"""Benchmark: what a checkpoint save costs the training loop, synchronous vs in the background
(checkpoint.async_save). Target: a step that saves costs <= 1.2x a step that does not.

    python tools/bench/bench_async_ckpt.py [--steps 10] [--threads N] [--out docs/benchmarks.md]

One rank (real megatron-core, CheckpointManager, this process), a random Llama (hidden 512, 8
layers, vocab 8,192: 31M parameters, a 0.5 GB checkpoint with Adam state), SFT steps on a fixed
batch. Per mode, after two warm-up steps: --steps steps without a save (their median is the
plain step), then one step followed by a save, then steps until the save is committed (async: the
writer thread competes with training for the cores) and --steps more. Reported: the plain step
(median of the steps without a save in flight), the saving step as measured (its update plus the
save's time on the critical path: the whole write synchronously, the copy to host memory
asynchronously), the slowdown of the steps that ran while the writer wrote (their time above the
plain step), and the cost = (plain step + the save's critical-path time + that slowdown) / plain
step: what a step that saves costs, its own update's noise left out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from in_process import one_rank_world  # noqa: E402

MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1376, vocab_size=8192, max_position_embeddings=4096)


def run_mode(hf: str, tmp: str, async_save: bool, steps: int) -> dict:
    import torch

    from megarl.checkpoint import CheckpointManager
    from megarl.config import load_config
    from megarl.trainer import parallel
    from megarl.trainer.batch import TensorBatch
    from megarl.trainer.engine import Engine, EngineSpec
    from megarl.trainer.sft import sft_loss

    mode = "async" if async_save else "sync"
    cfg = load_config(None, [f"model.hf_path={hf}", "data.train_path=x", "optim.lr=1e-4",
                             f"train.run_dir={tmp}/{mode}", f"checkpoint.async_save={str(async_save).lower()}",
                             "train.micro_batch_tokens=4096"])
    ps = parallel.init_model_parallel(1, 1)
    engine = Engine.build(EngineSpec.from_config(cfg), ps)
    ckpt = CheckpointManager(cfg, ps, engine)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, MODEL["vocab_size"], (256,), generator=g).tolist() for _ in range(4)]
    batch = TensorBatch.from_lists(ids, {"loss_mask": [[0.0] * 8 + [1.0] * 248 for _ in ids]})

    def step() -> float:
        t0 = time.perf_counter()
        engine.train_batch(batch, sft_loss)
        return time.perf_counter() - t0

    for _ in range(2):
        step()
    plain = [step() for _ in range(steps)]
    t0 = time.perf_counter()
    update = step()
    ckpt.save(100)
    saving = time.perf_counter() - t0
    during = []
    while ckpt._writer is not None and ckpt._writer[0].is_alive():
        during.append(step())
    ckpt.wait()
    after = [step() for _ in range(steps)]
    parallel.destroy_model_parallel_only()
    base = statistics.median(plain + after)
    slowdown = sum(t - base for t in during)
    # the save's cost: what it adds on the critical path plus what the steps beside the writer lost,
    # over a plain step (the saving step's own update varies like any step's: its median stands in)
    cost = (base + ckpt.last_save_s + max(slowdown, 0.0)) / base
    return {"mode": mode, "plain": base, "update": update, "saving": saving, "critical": ckpt.last_save_s,
            "during": len(during), "slowdown": slowdown, "cost": cost}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads of the training (0: torch's default, every core)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    one_rank_world()
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from megarl.common import compat
    from megarl.models.random_hf import tiny_config, write_random_hf
    from megarl.trainer import parallel

    compat.quiet_megatron_warnings()
    parallel.init_distributed()
    lines = ["| save | plain step (s) | saving step (s) | of which the save on the critical path (s) | "
             "steps while writing | their slowdown (s) | cost of a saving step |",
             "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_random_hf(os.path.join(tmp, "hf"), tiny_config("LlamaForCausalLM", **MODEL), seed=0, std=0.02)
        rows = [run_mode(hf, tmp, mode, a.steps) for mode in (False, True)]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['plain']:.3f} | {r['saving']:.3f} | {r['critical']:.3f} | {r['during']} | "
                     f"{r['slowdown']:.3f} | {r['cost']:.2f}x |")
    sync, asy = rows
    text = "\n".join(lines + ["", f"- synchronous: a step that saves costs {sync['cost']:.2f}x a plain step",
                              f"- async_save: {asy['cost']:.2f}x (the copy {asy['critical']:.3f} s, then "
                              f"{asy['during']} step(s) beside the writer, {max(asy['slowdown'], 0):.3f} s slower)"])
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text + "\n")
    parallel.destroy()


if __name__ == "__main__":
    main()
