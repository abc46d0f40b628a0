"""What the weight push costs the trainer, overlapped (``weights.overlap``) and synchronous: the
README demo recipe (staleness 1, checksums every 10th push) run whole with each setting, the two
interleaved (A B A B ...) so machine load hits both alike.

    python tools/bench/bench_push_overlap.py [--steps 500] [--repeats 1] [--out docs/benchmarks.md]

Per setting, medians over steps 3.. of every repeat: the step, the trainer's blocking push time
(``push/blocking_s``: synchronous = the whole push; overlapped = staging the copy plus any wait for
the previous flight), the checksum phase the trainer waits for (``time/verify``, synchronous only:
an overlapped push checks inside its flight), the push's wall time (``push/total_s``, where the
flight landed) and its share of the step that the trainer waited for ((blocking + verify) /
step). The accuracy column is the run's last held-out evaluation; the wall column the whole
command. Appends the table, with this command, to ``--out`` (a file ending in .md), else prints
it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_runs import REPO, markdown_table, read_rows, run_train  # noqa: E402

SETTINGS = {"synchronous": ["weights.overlap=false"], "overlapped": ["weights.overlap=true"]}


def summarize(rows: list[dict]) -> dict:
    steps = [r for r in rows if r.get("step", 0) > 2]
    blocking = [r["push/blocking_s"] for r in steps if "push/blocking_s" in r]
    # the checksum the trainer waits for, per step (every 10th push synchronous; never overlapped)
    verify = [r.get("time/verify", 0.0) for r in steps]
    step = [r["step_time"] for r in steps]
    wall = [r["push/total_s"] for r in steps if "push/total_s" in r]
    share = [(r.get("push/blocking_s", 0.0) + r.get("time/verify", 0.0)) / r["step_time"] for r in steps]
    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    return {"step": step, "blocking": blocking, "verify": verify, "wall": wall, "share": share,
            "accuracy": evals[-1] if evals else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--work", default=os.path.join(REPO, "runs", "bench_push_overlap"))
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    per = {name: {"step": [], "blocking": [], "verify": [], "wall": [], "share": [], "accuracy": [], "wall_s": []}
           for name in SETTINGS}
    for rep in range(args.repeats):
        for name, overrides in SETTINGS.items():
            run_dir = os.path.join(args.work, f"{name}_{rep}")
            r = run_train(run_dir, [f"train.steps={args.steps}", *overrides], name)
            got = summarize(read_rows(os.path.join(run_dir, "metrics.jsonl")))
            for key in ("step", "blocking", "verify", "wall", "share"):
                per[name][key] += got[key]
            per[name]["accuracy"].append(got["accuracy"])
            per[name]["wall_s"].append(r.process_s)
            print(f"[push_overlap] {name} #{rep}: blocking {statistics.median(got['blocking']) * 1e3:.2f} ms, "
                  f"step {statistics.median(got['step']) * 1e3:.0f} ms, accuracy {got['accuracy']}", flush=True)
    rows = []
    for name, v in per.items():
        rows.append([name, f"{statistics.median(v['step']) * 1e3:.0f}", f"{statistics.median(v['blocking']) * 1e3:.2f}",
                     f"{statistics.fmean(v['verify']) * 1e3:.2f}", f"{statistics.median(v['wall']) * 1e3:.1f}",
                     f"{statistics.fmean(v['share']) * 100:.1f}%",
                     ", ".join(f"{a:.3f}" for a in v["accuracy"] if a is not None),
                     ", ".join(f"{w:.0f}" for w in v["wall_s"])])
    md = markdown_table(["push", "median step ms", "trainer's blocking push ms (median)",
                         "trainer's checksum wait ms per step (mean)", "push wall ms (median)",
                         "push + verify share of the step (mean)", "final held-out accuracy", "command wall s"], rows)
    cmd = f"python tools/bench/bench_push_overlap.py --steps {args.steps} --repeats {args.repeats}"
    text = f"`{cmd}`\n\n{md}\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
