"""CPU utilisation of a whole job: runs a command and samples the CPU time of its process tree
(the trainer, the rollout manager, the servers, reward workers) from /proc.

    python tools/bench/cpu_util.py [--run-dir RUN_DIR] -- megarl-train configs/tiny_grpo.yaml

Prints the wall time, and the share of all cores used (1.0 = every core busy) over the whole
command and, with --run-dir, over its training window (first step's start to last step's end, from
RUN_DIR/metrics.jsonl: start-up and the final plots excluded). Writes RUN_DIR/cpu_util.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_runs import CpuSampler, read_rows  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", help="the run's directory (for the training window)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command after --")
    t0 = time.time()
    proc = subprocess.Popen(cmd)
    sampler = CpuSampler(proc.pid)
    code = proc.wait()
    t1 = time.time()
    sampler.stop()
    out = {"command": " ".join(cmd), "exit": code, "wall_s": round(t1 - t0, 1), "cores": sampler.cores,
           "cpu_util_whole": sampler.utilization(t0, t1)}
    if args.run_dir and os.path.exists(os.path.join(args.run_dir, "metrics.jsonl")):
        steps = [r for r in read_rows(os.path.join(args.run_dir, "metrics.jsonl")) if r["step"] >= 1]
        if steps:
            out["cpu_util_training"] = sampler.utilization(steps[0]["time"] - steps[0]["step_time"],
                                                           steps[-1]["time"])
        with open(os.path.join(args.run_dir, "cpu_util.json"), "w") as f:
            json.dump(out, f, indent=1)
    print(f"[cpu_util] {json.dumps(out)}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
