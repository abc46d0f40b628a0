"""Gantt chart of an RL run's timeline: where rollout and training overlap and where each waits.

    python tools/plot_timeline.py runs/tiny_grpo [--out timeline.png] [--last 20]

Reads <run>/timeline/*.jsonl (spans recorded by megarl-train: wait / update / push / eval on the
trainer, one `generate` span per /generate segment on each rollout server) and draws one row per
lane: the trainer's phases in colour, each server's busy time (merged overlapping segments).
Prints the idle ratios over the plotted window and one line of advice.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.common.timeline import read_timeline  # noqa: E402

COLORS = {"wait": "#d62728", "update": "#1f77b4", "push": "#ff7f0e", "eval": "#9467bd",
          "generate": "#2ca02c"}


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals (a server is busy while any of its segments runs)."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def window(spans: list[dict], last_steps: int) -> list[dict]:
    """The spans of the last ``last_steps`` trainer steps (a step ends with its update)."""
    updates = [s for s in spans if s["name"] == "update"]
    if last_steps <= 0 or len(updates) <= last_steps:
        return spans
    t0 = updates[-last_steps - 1]["end"]
    return [s for s in spans if s["end"] >= t0]


def ratios(spans: list[dict]) -> tuple[float, float, float]:
    """(wall seconds, trainer idle ratio, rollout idle ratio) over the spans' extent."""
    t0, t1 = min(s["start"] for s in spans), max(s["end"] for s in spans)
    wall = max(t1 - t0, 1e-9)
    wait = sum(s["end"] - s["start"] for s in spans if s["name"] == "wait")
    busy = sum(b - a for a, b in merge([(s["start"], s["end"]) for s in spans if s["name"] == "generate"]))
    return wall, wait / wall, 1.0 - busy / wall


def advice(trainer_idle: float, rollout_idle: float) -> str:
    if trainer_idle > 0.3 and trainer_idle > rollout_idle:
        return ("the trainer waits for rollouts: give rollout more (servers, or a larger "
                "max_staleness so generation runs further ahead)")
    if rollout_idle > 0.3 and rollout_idle > trainer_idle:
        return ("the servers wait for the trainer: give training more (ranks, a smaller update), "
                "or raise max_staleness so generation is not held back")
    return "balanced: neither side waits for long"


def plot(spans: list[dict], out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(s["start"] for s in spans)
    lanes = sorted({s["lane"] for s in spans}, key=lambda x: (x != "trainer", x))
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * len(lanes)))
    for row, lane in enumerate(lanes):
        mine = [s for s in spans if s["lane"] == lane]
        if lane == "trainer":
            for name in ("wait", "update", "push", "eval"):
                bars = [(s["start"] - t0, s["end"] - s["start"]) for s in mine if s["name"] == name]
                ax.broken_barh(bars, (row - 0.35, 0.7), color=COLORS[name], label=name)
        else:
            bars = [(a - t0, b - a) for a, b in merge([(s["start"], s["end"]) for s in mine])]
            ax.broken_barh(bars, (row - 0.35, 0.7), color=COLORS["generate"],
                           label="generate" if row == len(lanes) - 1 else None)
    ax.set_yticks(range(len(lanes)), [lane.replace("http://", "server ") for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--out", default="", help="PNG path (default <run_dir>/timeline.png)")
    ap.add_argument("--last", type=int, default=20, help="plot the last N steps (0 = all)")
    args = ap.parse_args(argv)
    directory = os.path.join(args.run_dir, "timeline")
    if not os.path.isdir(directory):
        print(f"plot_timeline: no timeline in {args.run_dir} (logging.timeline off?)", file=sys.stderr)
        return 2
    spans = window(read_timeline(directory), args.last)
    if not spans:
        print(f"plot_timeline: {directory} holds no spans", file=sys.stderr)
        return 2
    wall, t_idle, r_idle = ratios(spans)
    out = args.out or os.path.join(args.run_dir, "timeline.png")
    plot(spans, out, f"{os.path.basename(os.path.abspath(args.run_dir))}: trainer idle {t_idle:.0%}, "
                     f"rollout idle {r_idle:.0%} over {wall:.1f} s")
    print(f"{out}: {wall:.1f} s, trainer idle {t_idle:.1%}, rollout idle {r_idle:.1%}")
    print("advice:", advice(t_idle, r_idle))
    return 0


if __name__ == "__main__":
    sys.exit(main())
