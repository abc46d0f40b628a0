"""Benchmark: the step hand-off on the trainer, from the manager's received frame to this DP
rank's `TensorBatch` with advantages (ready for `train_batch`), plus the step's rollout metrics.

    python tools/bench/bench_handoff.py [--ref /tmp/handoff-base] [--samples 256] [--repeats 30]
        [--estimators grpo,reinforce_pp]

A synthetic step: ``--samples`` trajectories in groups of 8, long-tailed lengths 20-400 tokens
(prompt 10-30 tokens), packed by the tree's own `pack_batch` and encoded by its channel. Each
repeat: rank 0 reads the frame with the tree's `Channel.recv` from an in-memory socket (what
`Link.request` returns: a `Batch`), then every
rank runs the tree's hand-off (broadcast to the other ranks, this rank's share, advantages). Time
= the slowest rank's, median of the repeats. DP=1 is one process; DP=2 two processes over gloo on
loopback (real collectives).

``--ref DIR`` runs the same measurement on another checkout (e.g. a `git worktree` of the base
commit) in the same invocation, each (tree, DP) in its own subprocess with PYTHONPATH=that tree,
alternating, so both see the same machine load; the table gives ref / this ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def synthetic_trajs(n: int, seed: int = 0):
    import numpy as np
    from megarl.protocol.types import Trajectory

    rng = np.random.default_rng(seed)
    # long tail: most responses short, a few near the cap (as RL rollouts are)
    total = np.clip(20 + rng.lognormal(4.0, 0.9, n), 20, 400).astype(int)
    trajs = []
    for i in range(n):
        p = int(min(rng.integers(10, 31), total[i] - 1))
        g = int(total[i]) - p
        ids = rng.integers(0, 32000, int(total[i])).tolist()
        logp = [0.0] * p + (-rng.random(g)).tolist()
        versions = [-1] * p + [int(v) for v in rng.integers(3, 5, g)]
        trajs.append(Trajectory(ids, [0] * p + [1] * g, logp, versions, float(rng.random() < 0.4),
                                i // 8, {"prompt_index": i // 8, "completion": "x" * 8}))
    return trajs


def frame(trajs, dp: int) -> bytes:
    """The `Batch` frame as the manager sends it (the tree's own packing and encoding)."""
    from megarl.protocol import channel
    from megarl.protocol.packing import pack_batch

    return b"".join(bytes(b) for b in channel.encode(pack_batch(trajs, dp, {"rollout/tokens": 1}, [])))


class FrameSocket:
    """Stands in for the link's socket: hands out one frame in 256 KiB reads, so the tree's own
    `Channel.recv` (its copies included) runs without the kernel's share of the cost."""

    def __init__(self, data: bytes):
        self.data, self.at = memoryview(data), 0

    def setsockopt(self, *a):
        pass

    def settimeout(self, t):
        pass

    def recv_into(self, view, n):
        k = min(n, len(self.data) - self.at, 1 << 18)
        view[:k] = self.data[self.at:self.at + k]
        self.at += k
        return k

    def received(self):
        """The tree's receive of the frame: what `Link.request` returns."""
        from megarl.protocol.channel import Channel

        self.at = 0
        return Channel(self, "bench").recv()


def handoff_fn(ps, estimator: str):
    """The tree's hand-off: Batch (rank 0; None elsewhere) -> (TensorBatch, metrics)."""
    from megarl.config import load_config
    from megarl.trainer.actor import Actor

    cfg = load_config(None, ["model.hf_path=x", "data.train_path=x", f"algo.advantage={estimator}"])
    actor = Actor(cfg, ps, engine=None)
    import importlib.util

    if importlib.util.find_spec("megarl.trainer.handoff"):  # one form: flat arrays -> this rank's TensorBatch
        from megarl.trainer.handoff import receive_step
        from megarl.trainer.rollout_stats import batch_metrics

        def run(batch):
            step = receive_step(batch, ps)
            tb = actor.step_fields(step.share(ps.dp_rank), version=4, update=False)[0]
            return tb, batch_metrics(step, 4)
        return run
    from megarl.trainer import rollout_link
    from megarl.trainer.rl import local_share  # base commit b340815: Trajectory objects per rank
    from megarl.trainer.rollout_stats import batch_metrics

    def run_old(batch):
        trajs, _, _ = rollout_link.unpack_step(batch, ps)
        tb = actor.with_advantages(local_share(trajs, ps))
        return tb, batch_metrics(trajs, 4)
    return run_old


def count_calls(run, sock) -> dict:
    """Python calls into megarl during one hand-off on this rank: distinct functions, and all
    calls (per-sample objects show up as calls per sample)."""
    seen, total = set(), 0

    def prof(frame, event, arg):
        nonlocal total
        if event == "call" and "/megarl/" in frame.f_code.co_filename:
            total += 1
            seen.add((frame.f_code.co_filename, frame.f_code.co_name))
    batch = sock.received() if sock is not None else None
    sys.setprofile(prof)
    try:
        run(batch)
    finally:
        sys.setprofile(None)
    return {"functions": len(seen), "calls": total}


def worker(rank: int, dp: int, port: int, args, out_q) -> None:
    import torch
    import torch.distributed as dist
    from types import SimpleNamespace

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=dp)
    ps = SimpleNamespace(rank=rank, world_size=dp, dp=dp, dp_rank=rank, tp=1, pp=1, tp_rank=0, pp_rank=0,
                         dp_group=dist.group.WORLD, device=torch.device("cpu"))
    sock = FrameSocket(frame(synthetic_trajs(args.samples), dp)) if rank == 0 else None
    result = {}
    for est in args.estimators.split(","):
        run = handoff_fn(ps, est)
        times, rows = [], 0
        for i in range(args.repeats + 2):  # two warm-ups
            dist.barrier()
            t0 = time.perf_counter()
            tb, metrics = run(sock.received() if rank == 0 else None)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i >= 2:
                times.append(float(dt))
            rows = len(tb)
            assert "advantages" in tb.fields and metrics["trained_samples"] == args.samples
        result[est] = {"median_ms": 1e3 * statistics.median(times), "rows": rows, **count_calls(run, sock)}
    if rank == 0:
        out_q.put(result)
    dist.destroy_process_group()


def run_worker(args) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.dp, port, args, q)) for r in range(args.dp)]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join(60)
    print("RESULT " + json.dumps(result))


def measure(tree: str, dp: int, args) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--dp", str(dp), "--samples", str(args.samples),
           "--repeats", str(args.repeats), "--estimators", args.estimators]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tree)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not line:
        raise SystemExit(f"bench worker ({tree}, dp={dp}) failed:\n{out.stderr[-3000:]}")
    return json.loads(line[-1][7:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="", help="another checkout to measure in the same run (the 'before')")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--estimators", default="grpo,reinforce_pp")
    ap.add_argument("--dps", default="1,2")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_worker(args)
        return 0
    trees = [("ref", os.path.abspath(args.ref))] if args.ref else []
    trees.append(("this", REPO))
    res = {}
    for dp in [int(x) for x in args.dps.split(",")]:
        for name, tree in trees:  # back to back: the same machine load for both
            res[(name, dp)] = measure(tree, dp, args)
    ests = args.estimators.split(",")
    print(f"step: {args.samples} samples in groups of 8, lengths 20-400 (long tail); median of {args.repeats}")
    head = "| DP | advantage | rows/rank |" + "".join(f" {n} ms |" for n, _ in trees)
    head += "".join(f" {n}: megarl functions / calls (rank 0) |" for n, _ in trees)
    head += " ref / this |" if args.ref else ""
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for dp in [int(x) for x in args.dps.split(",")]:
        for est in ests:
            row = f"| {dp} | {est} | {res[('this', dp)][est]['rows']} |"
            row += "".join(f" {res[(n, dp)][est]['median_ms']:.2f} |" for n, _ in trees)
            row += "".join(f" {res[(n, dp)][est]['functions']} / {res[(n, dp)][est]['calls']} |" for n, _ in trees)
            if args.ref:
                row += f" **{res[('ref', dp)][est]['median_ms'] / res[('this', dp)][est]['median_ms']:.1f}x** |"
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
