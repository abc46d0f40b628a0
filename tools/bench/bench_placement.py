"""Colocated vs disaggregated placement on the same cores and the same recipe (issue #31 item 4):
step time, phase times, the job's peak resident memory, CPU use, final accuracy.

    python tools/bench/bench_placement.py [--steps 100] [--out runs/bench_placement]

The demo recipe (configs/tiny_grpo.yaml, 32 prompts x 8 samples per step) on the machine's two
cores, one run per mode, one after the other:

    disagg_onpolicy  max_staleness 0; the local server on CPU 1 (one thread), the trainer one thread:
                     a node split between a rollout device and a trainer device
    colocated        rollout.placement colocated: the server sleeps (kv_cache and weights released)
                     while the trainer trains, weights handed over through /dev/shm; nothing pinned,
                     the trainer and the server two threads each - every core in each phase
    async_s1         max_staleness 1 (the demo's default), disaggregated as disagg_onpolicy

Reported per mode: seconds per step (evaluation excluded) and its phases (wait for the batch,
sleep, update, wake, push), the peak RSS of the job's whole process tree (trainer, rollout
manager, server; sampled every 0.5 s), CPU utilisation over the training window, held-out
accuracy at the start and the end (500 prompts). OUT/result.json, OUT/table.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_runs import REPO, fmt, markdown_table, read_rows, run_train, write_results  # noqa: E402

PINNED = ["rollout.server_cpus=[1]", "rollout.server_threads=1", "train.torch_threads=1"]
MODES = {
    "disagg_onpolicy": ["rollout.max_staleness=0", *PINNED],
    "colocated": ["rollout.placement=colocated", "rollout.max_staleness=0", "weights.transport=shm",
                  "rollout.server_cpus=[]", "rollout.server_threads=2", "train.torch_threads=2"],
    "async_s1": ["rollout.max_staleness=1", *PINNED],
}
PHASES = ("wait", "sleep", "update", "wake", "push")


def phases(rows: list[dict]) -> dict:
    steps = [r for r in rows if r["step"] >= 2]  # step 1 pays the warm-up
    return {p: statistics.fmean(r.get(f"time/{p}", 0.0) for r in steps) for p in PHASES}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench_placement"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    results, rows = {}, []
    for mode in args.modes.split(","):
        run_dir = os.path.join(args.out, mode)
        r = run_train(run_dir, [*MODES[mode], f"train.steps={args.steps}", f"rollout.eval_interval={args.steps}",
                                "rollout.eval_size=500", "rollout.eval_at_start=true", "checkpoint.save_interval=0"],
                      mode)
        r.extra.update(phases(read_rows(os.path.join(run_dir, "metrics.jsonl"))))
        results[mode] = r.as_dict()
        e = r.extra
        print(f"[bench_placement] {mode}: {r.s_per_step:.3f} s/step, peak RSS {e['peak_rss_mb']:.0f} MB, "
              f"accuracy {fmt(r.start_accuracy)} -> {fmt(r.final_accuracy)}", flush=True)
        rows.append([mode, f"{r.s_per_step:.3f}", " + ".join(f"{e[p]:.3f}" for p in PHASES),
                     f"{e['peak_rss_mb']:.0f}", fmt(e.get("cpu_util"), ".2f"),
                     f"{fmt(r.start_accuracy)} -> {fmt(r.final_accuracy)}"])
    table = markdown_table(["mode", "s/step", " + ".join(PHASES) + " (s)", "peak RSS of the job (MB)",
                            "CPU utilisation", "held-out accuracy"], rows)
    write_results(args.out, results, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
