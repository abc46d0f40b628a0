"""Plot metrics from a run's metrics.jsonl: one subplot per key, value vs step, saved as PNG.

    python tools/plot_metrics.py RUN_DIR/metrics.jsonl [--keys loss,reward] --out plot.png
    python tools/plot_metrics.py RUN_DIR/metrics.jsonl [RUN2/metrics.jsonl] --curve --out curve.png

Without --keys every numeric metric is drawn. Several files may be given to overlay runs.
--curve draws the learning curve instead (held-out accuracy and reward vs step and vs wall time,
megarl/common/plotting.py; every RL run writes it to RUN_DIR/learning_curve.png at its end).
Needs matplotlib (`pip install matplotlib`, or the [plot] / [test] extra).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, REPO)

_SKIP = {"step", "time"}


def read_metrics(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}:{lineno}: invalid JSON ({e.msg})")
    return rows


def numeric_keys(rows: list[dict]) -> list[str]:
    keys: dict[str, None] = {}
    for row in rows:
        for k, v in row.items():
            if k not in _SKIP and isinstance(v, (int, float)) and not isinstance(v, bool):
                keys[k] = None
    return list(keys)


def plot(runs: dict[str, list[dict]], keys: list[str], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_metrics needs matplotlib: pip install matplotlib")
    cols = 1 if len(keys) == 1 else 2
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for label, rows in runs.items():
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, marker="." if len(pts) < 50 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", nargs="+", help="metrics.jsonl file(s)")
    ap.add_argument("--keys", default=None, help="comma-separated metric names (default: all numeric)")
    ap.add_argument("--out", default="plot.png", help="output PNG path")
    ap.add_argument("--curve", action="store_true",
                    help="learning curve: eval accuracy and reward vs step and vs wall time")
    args = ap.parse_args(argv)
    runs = {}
    for path in args.metrics:
        label = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
        runs[label if label not in runs else path] = read_metrics(path)
    if args.curve:
        from megarl.common.plotting import plot_learning_curves

        plot_learning_curves(runs, args.out)
        print(f"wrote {args.out} (learning curve of {len(runs)} run(s))")
        return 0
    all_rows = [r for rows in runs.values() for r in rows]
    keys = args.keys.split(",") if args.keys else numeric_keys(all_rows)
    missing = [k for k in keys if not any(k in r for r in all_rows)]
    if missing:
        raise SystemExit(f"metric(s) {missing} not found; available: {numeric_keys(all_rows)}")
    if not keys:
        raise SystemExit(f"no numeric metrics in {args.metrics}")
    plot(runs, keys, args.out)
    print(f"wrote {args.out} ({len(keys)} plot(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
