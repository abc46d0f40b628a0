"""Staleness ablation: max staleness x {standard PPO against behaviour logprobs, decoupled PPO}, a
few seeds; trained samples/s and final held-out accuracy, as a table and a PNG.

    python tools/bench/bench_staleness.py [--staleness 0,1,2,4,8] [--seeds 1,2] [--steps 60]

    ppo        algo.policy_loss=ppo algo.old_logp=behave: ratio pi_theta / pi_behave, clipped
    decoupled  algo.policy_loss=decoupled_ppo: ratio pi_theta / pi_prox clipped, times the
               (capped) behaviour weight pi_prox / pi_behave (AReaL)

Everything else is the demo recipe (configs/tiny_grpo.yaml). On this task the trainer is the
bottleneck, so the rollout side fills its whole staleness window and the mean staleness of a batch
is close to max_staleness. AReaL's published direction: decoupled PPO keeps its accuracy as the
staleness grows while standard PPO against the behaviour policy loses it. Results in
OUT/result.json, OUT/table.md and OUT/staleness.png (copy to docs/ with --png).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_runs import REPO, markdown_table, read_rows, run_train, write_results  # noqa: E402

LOSSES = {"ppo": ["algo.policy_loss=ppo", "algo.old_logp=behave", "algo.prox_logp_mode=recompute"],
          "decoupled": ["algo.policy_loss=decoupled_ppo"]}


def plot(results: dict, staleness: list[int], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for loss in LOSSES:
        for ax, key in zip(axes, ("final_accuracy", "samples_per_s")):
            means, errs = [], []
            for s in staleness:
                vals = [r[key] for r in results.get(f"{loss}_s{s}", [])]
                means.append(statistics.fmean(vals) if vals else float("nan"))
                errs.append((max(vals) - min(vals)) / 2 if len(vals) > 1 else 0.0)
            ax.errorbar(staleness, means, yerr=errs, marker="o", capsize=3, label=loss)
    start = [r["start_accuracy"] for rs in results.values() for r in rs if r["start_accuracy"] is not None]
    if start:
        axes[0].axhline(statistics.fmean(start), color="gray", linestyle=":", label="start")
    axes[0].set_title("final held-out accuracy")
    axes[1].set_title("trained samples/s")
    for ax in axes:
        ax.set_xlabel("max staleness")
        ax.set_xticks(staleness)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench_staleness"))
    ap.add_argument("--staleness", default="0,1,2,4,8")
    ap.add_argument("--losses", default="ppo,decoupled")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--png", default="", help="also copy the PNG here (e.g. docs/staleness_ablation.png)")
    ap.add_argument("--override", action="append", default=[], metavar="A.B=C")
    args = ap.parse_args(argv)
    staleness = [int(s) for s in args.staleness.split(",")]
    results: dict[str, list[dict]] = {}
    for seed in args.seeds.split(","):
        for s in staleness:
            for loss in args.losses.split(","):
                name = f"{loss}_s{s}"
                run_dir = os.path.join(args.out, f"{name}_seed{seed}")
                r = run_train(run_dir, [*LOSSES[loss], f"rollout.max_staleness={s}", f"train.seed={seed}",
                                        f"model.seed={seed}", f"train.steps={args.steps}",
                                        f"rollout.eval_interval={args.steps}", "rollout.eval_size=500",
                                        "rollout.eval_at_start=true", *args.override], name)
                rows = [x for x in read_rows(os.path.join(run_dir, "metrics.jsonl")) if x["step"] >= 1]
                d = r.as_dict()
                d["staleness_mean"] = statistics.fmean(x["staleness_mean"] for x in rows)
                results.setdefault(name, []).append(d)
                print(f"[staleness] {name} seed {seed}: {r.samples_per_s:.1f} samples/s, accuracy "
                      f"{r.start_accuracy:.3f} -> {r.final_accuracy:.3f}, staleness mean {d['staleness_mean']:.2f}",
                      flush=True)
    table = []
    for s in staleness:
        for loss in args.losses.split(","):
            rs = results.get(f"{loss}_s{s}", [])
            if rs:
                acc = [r["final_accuracy"] for r in rs]
                table.append([s, loss, f"{statistics.fmean(r['staleness_mean'] for r in rs):.2f}",
                              f"{statistics.fmean(r['samples_per_s'] for r in rs):.1f}",
                              " / ".join(f"{a:.3f}" for a in acc), f"{statistics.fmean(acc):.3f}",
                              f"{statistics.fmean(r['start_accuracy'] for r in rs):.3f}"])
    md = markdown_table(["max staleness", "loss", "staleness mean", "trained samples/s",
                         "final accuracy per seed", "mean", "start"], table)
    write_results(args.out, results, md)
    try:
        png = os.path.join(args.out, "staleness.png")
        plot(results, staleness, png)
        if args.png:
            import shutil
            shutil.copyfile(png, args.png)
    except ImportError:
        print("[staleness] matplotlib not installed: no PNG")
    return 0


if __name__ == "__main__":
    sys.exit(main())
