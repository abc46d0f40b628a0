"""Learning curves of RL runs: held-out accuracy and reward vs step and vs wall time, as one PNG.

    write_learning_curve(run_dir)       # -> run_dir/learning_curve.png (end of every RL run)
    plot_learning_curves({label: rows}, out)

Wall time is measured from the start of the first step (the first row's ``time - step_time``),
so a run's plot reads "accuracy after N seconds of training". Evaluations at step 0
(``rollout.eval_at_start``) are the start point. matplotlib is optional (the [test]/[plot]
extras): without it the curve is skipped with a one-line note and the run is unaffected.
"""
from __future__ import annotations

import json
import os
from typing import Optional

CURVE_KEYS = (("eval_accuracy", "held-out greedy accuracy"), ("reward", "train reward (mean)"))


def read_rows(path: str) -> list[dict]:
    """metrics.jsonl -> list of dicts (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def elapsed(rows: list[dict]) -> list[Optional[float]]:
    """Seconds since the first step started, per row (None for rows without a timestamp)."""
    timed = [r for r in rows if isinstance(r.get("time"), (int, float))]
    if not timed:
        return [None] * len(rows)
    first = min(timed, key=lambda r: r["time"])
    t0 = first["time"] - float(first.get("step_time", 0.0) or 0.0)
    return [r["time"] - t0 if isinstance(r.get("time"), (int, float)) else None for r in rows]


def eval_set_names(rows: list[dict]) -> list[str]:
    """The held-out sets a run reported (eval/<name>/accuracy keys), in their first appearance's order."""
    names: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2:
                names[k.split("/")[1]] = None
    return list(names)


def plot_learning_curves(runs: dict[str, list[dict]], out: str, title: str = "") -> None:
    """2x2 grid: (accuracy, reward) x (vs step, vs wall seconds); one line per run (and per
    held-out set of a run with data.eval_sets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), squeeze=False)
    for row, (key, name) in enumerate(CURVE_KEYS):
        for col, xlabel in enumerate(("step", "wall time (s)")):
            ax = axes[row][col]
            lines = 0
            for label, rows in runs.items():
                xs = [r["step"] for r in rows] if col == 0 else elapsed(rows)
                # several held-out sets (data.eval_sets): one line per set, eval/<name>/accuracy
                sets = eval_set_names(rows) if key == "eval_accuracy" else []
                for line_key, line_label in ([(f"eval/{n}/accuracy", f"{label}: {n}" if len(runs) > 1 else n)
                                              for n in sets] or [(key, label)]):
                    # vs step: an evaluation is drawn at the step it measured (eval/<name>/step), not
                    # the later step whose row reported it (evaluations run beside training)
                    at = line_key.rsplit("/", 1)[0] + "/step" if line_key != "eval_accuracy" else "eval/step"
                    pts = [(r.get(at, x) if col == 0 and key == "eval_accuracy" else x, r[line_key])
                           for x, r in zip(xs, rows) if x is not None and isinstance(r.get(line_key), (int, float))]
                    if pts:
                        lines += 1
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=line_label,
                                marker="o" if key == "eval_accuracy" else None,
                                linewidth=1.5 if key == "eval_accuracy" else 0.8)
            ax.set_title(f"{name} vs {'step' if col == 0 else 'wall time'}")
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            if key == "eval_accuracy":
                ax.set_ylim(0.0, 1.0)
            if lines > 1:
                ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def write_learning_curve(run_dir: str, name: str = "learning_curve.png") -> Optional[str]:
    """Writes run_dir/learning_curve.png from run_dir/metrics.jsonl; returns its path, or None
    (with a one-line note) when matplotlib is missing or there is nothing to plot."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = read_rows(path) if os.path.isfile(path) else []
    if not any(k in r for r in rows for k, _ in CURVE_KEYS):
        return None
    try:
        import matplotlib  # noqa: F401  (probe only)
    except ImportError:
        print("[plot] matplotlib not installed: skipping the learning-curve PNG "
              "(pip install matplotlib)")
        return None
    out = os.path.join(run_dir, name)
    accs = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    title = os.path.basename(os.path.abspath(run_dir))
    if len(accs) >= 2:
        title += f": accuracy {accs[0][1]:.3f} (step {accs[0][0]}) -> {accs[-1][1]:.3f} (step {accs[-1][0]})"
    plot_learning_curves({os.path.basename(os.path.abspath(run_dir)): rows}, out, title)
    return out
