"""Where an RL step's time goes, and what each step-time change buys: the demo recipe for a few
steps per variant, median per-phase times from metrics.jsonl (time/wait, time/update, time/push,
time/eval; step_time), variants run interleaved (A B C A B C ...) so machine load hits all alike.

    python tools/bench/bench_step_budget.py [--steps 60] [--repeats 2] [--variants base,bypass,pin]

    base     algo.prox_logp_mode=recompute (a forward pass for pi_prox every step), no pinning
    bypass   prox_logp_mode=loglinear: with one mini-batch and one epoch pi_prox = pi_theta at the
             only optimizer step, so the recompute is skipped and the loss is unchanged; no pinning
    pin      bypass + rollout.server_cpus=[1] (server on CPU 1, trainer on CPU 0)
Everything else is configs/tiny_grpo.yaml (train.torch_threads=1, batch 256, staleness 1).
    threads  bypass with torch's default threads for the trainer (no OMP_NUM_THREADS; 2 on 2 cores)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_runs import REPO, markdown_table, read_rows, run_train  # noqa: E402

VARIANTS = {
    "base": (["algo.prox_logp_mode=recompute", "rollout.server_cpus=[]"], {}),
    "bypass": (["algo.prox_logp_mode=loglinear", "rollout.server_cpus=[]"], {}),
    "pin": (["algo.prox_logp_mode=loglinear", "rollout.server_cpus=[1]", "train.torch_threads=1"], {}),
    "threads": (["algo.prox_logp_mode=loglinear", "rollout.server_cpus=[]", "train.torch_threads=0"],
                {"OMP_NUM_THREADS": None}),
}
PHASES = ["step_time", "time/wait", "time/update", "time/push", "time/eval"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench_step_budget"))
    ap.add_argument("--variants", default="base,bypass,pin")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--override", action="append", default=[], metavar="A.B=C")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    per: dict[str, dict[str, list[float]]] = {n: {p: [] for p in PHASES + ["samples_per_s"]} for n in names}
    for rep in range(args.repeats):
        for name in names:
            overrides, env = VARIANTS[name]
            run_dir = os.path.join(args.out, f"{name}_{rep}")
            r = run_train(run_dir, [f"train.steps={args.steps}", "rollout.eval_interval=0", "data.eval_path=",
                                    *overrides, *args.override], name, env=env)
            rows = [x for x in read_rows(os.path.join(run_dir, "metrics.jsonl")) if x["step"] > 2]
            for p in PHASES:
                per[name][p] += [x.get(p, 0.0) for x in rows]
            per[name]["samples_per_s"].append(r.samples_per_s)
            print(f"[step_budget] {name} #{rep}: {r.samples_per_s:.1f} samples/s, median step "
                  f"{statistics.median(x['step_time'] for x in rows) * 1e3:.0f} ms", flush=True)
    table = []
    base = statistics.median(per[names[0]]["step_time"])
    for n in names:
        med = {p: statistics.median(per[n][p]) * 1e3 for p in PHASES}
        table.append([n, " ".join(VARIANTS[n][0]), *(f"{med[p]:.0f}" for p in PHASES),
                      f"{statistics.fmean(per[n]['samples_per_s']):.0f}", f"{base * 1e3 / med['step_time']:.2f}x"])
    md = markdown_table(["variant", "overrides", "step ms", "wait ms", "update ms", "push ms", "eval ms",
                         "samples/s", f"speed vs {names[0]}"], table)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(per, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
