"""On-policy distillation against the reward alone: how many steps the demo's start model
(examples/tiny/model, greedy held-out accuracy ~0.3) needs to reach 0.9x a stronger teacher's
held-out accuracy, learning from the task reward alone, from the teacher alone, or from both.

    python tools/bench/bench_distill.py [--teacher examples/tiny/teacher] [--steps 500]
        [--coef 0.5] [--eval-interval 10] [--out runs/bench_distill] [--png docs/distill.png]

    reward_only   configs/tiny_grpo.yaml as shipped (exact-match reward, GRPO)
    distill       + teacher.path, algo.distill_coef=COEF (the reward's advantage kept, weight 1)
    distill_only  + algo.distill_reward_coef=0 (the teacher's per-token signal alone)

The teacher's accuracy is measured first with megarl-eval (greedy, the same 500 held-out
prompts); each run evaluates every EVAL_INTERVAL steps and stops at STEPS. Steps to the target
are the first evaluation at or above 0.9x the teacher's accuracy. Results in OUT/result.json,
OUT/table.md and OUT/distill.png (copied to --png).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_runs import DATA, REPO, fmt, markdown_table, run_train, write_results  # noqa: E402

TEACHER = os.path.join(REPO, "examples", "tiny", "teacher")


def teacher_accuracy(teacher: str, out: str) -> float:
    """megarl-eval of the teacher: greedy accuracy on the held-out prompts."""
    cmd = [sys.executable, "-m", "megarl.eval", os.path.join(REPO, "configs", "tiny_grpo.yaml"),
           f"model.hf_path={teacher}", f"data.eval_path={DATA}/eval_prompts.jsonl",
           f"train.run_dir={out}/teacher_eval_run", f"eval.out_dir={out}/teacher_eval"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(f"megarl-eval of {teacher} failed: {proc.stderr.strip().splitlines()[-1:]}")
    with open(os.path.join(out, "teacher_eval", "results.json")) as f:
        return float(json.load(f)["greedy_accuracy"])


def plot(results: dict, target: float, teacher_acc: float, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot([e["step"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], marker="o", label=name)
    ax.axhline(teacher_acc, color="gray", linestyle="--", label=f"teacher {teacher_acc:.3f}")
    ax.axhline(target, color="gray", linestyle=":", label=f"0.9 x teacher {target:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default=TEACHER)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--coef", type=float, default=0.5)
    ap.add_argument("--eval-interval", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench_distill"))
    ap.add_argument("--png", default="")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    teacher_acc = teacher_accuracy(a.teacher, a.out)
    target = 0.9 * teacher_acc
    print(f"[bench] teacher {a.teacher}: greedy accuracy {teacher_acc:.3f}; target {target:.3f}", flush=True)
    common = [f"train.steps={a.steps}", f"rollout.eval_interval={a.eval_interval}", "checkpoint.save_interval=0"]
    teacher = [f"teacher.path={a.teacher}", f"algo.distill_coef={a.coef}"]
    runs = {"reward_only": common, "distill": common + teacher,
            "distill_only": common + teacher + ["algo.distill_reward_coef=0"]}
    results = {}
    for name, overrides in runs.items():
        s = run_train(os.path.join(a.out, name), overrides, name=name, target=target)
        results[name] = s.as_dict()
    rows = [[name, fmt(r["start_accuracy"]), fmt(r["final_accuracy"]), r["steps_to_target"] or "not reached",
             fmt(r["time_to_target_s"], ".0f"), fmt(r["s_per_step"], ".2f")] for name, r in results.items()]
    md = (f"teacher {os.path.relpath(a.teacher, REPO)}: greedy accuracy {teacher_acc:.3f}, target 0.9x = "
          f"{target:.3f}; {a.steps} steps, evaluation every {a.eval_interval}\n\n" + markdown_table(
              ["run", "start acc", f"acc at step {a.steps}", "steps to target", "train s to target", "s/step"], rows))
    write_results(a.out, {"teacher_accuracy": teacher_acc, "target": target, "runs": results}, md)
    png = os.path.join(a.out, "distill.png")
    plot(results, target, teacher_acc, png)
    if a.png:
        shutil.copyfile(png, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
