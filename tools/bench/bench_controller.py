"""Benchmark: controller throughput (staleness manager + executor + buffer) with a null workflow
that returns a one-token group at once, so only the controller's own overhead is measured.

    python tools/bench/bench_controller.py [--episodes 200000] [--batch 256] [--staleness 2]
        [--concurrency 512] [--out docs/benchmarks.md]

A trainer thread consumes batches of --batch episodes and bumps the version after each, as the
RL loop does. Target (DESIGN): >= 20,000 episodes/s.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megarl.data.datasets import PromptSample  # noqa: E402
from megarl.rollout.cluster import RolloutCluster
from megarl.rollout.controller import RolloutController  # noqa: E402
from megarl.protocol.types import Trajectory  # noqa: E402


class NullWorkflow:
    async def arun_episode(self, client, sample):
        return [Trajectory([1, 2], [0, 1], [0.0, -0.5], [-1, 0], 1.0, -1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"))
    args = ap.parse_args()
    data = [PromptSample(i, "p", {}, [1]) for i in range(1000)]
    cluster = RolloutCluster([], driver=False)  # the version clock only: no server behind it
    c = RolloutController(data, NullWorkflow(), ["http://127.0.0.1:9"], cluster, batch_groups=args.batch,
                          max_staleness=args.staleness, max_concurrent=args.concurrency)
    cluster.subscribe(c)
    c.start()
    steps = args.episodes // args.batch
    t0 = time.perf_counter()
    for v in range(steps):
        c.next_batch(args.batch, timeout_s=60)
        cluster.commit(v + 1)  # what a weight push ends with
    dt = time.perf_counter() - t0
    c.stop()
    rate = steps * args.batch / dt
    row = (f"| controller (null workflow), batch {args.batch}, staleness {args.staleness}, "
           f"concurrency {args.concurrency} | {rate:,.0f} episodes/s | target >= 20,000 | "
           f"**{rate / 20000:.2f}x** of target | |")
    print(row)
    with open(args.out, "a") as f:
        f.write(row + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
