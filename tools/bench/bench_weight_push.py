"""Benchmark: weight push (resharder + distributed transport + the server's load) vs the physical
limit, a raw gloo broadcast of the same bytes between two plain processes (no server).

    python tools/bench/bench_weight_push.py [--tp 1] [--hidden 1024 --layers 8 --vocab 16384]
        [--bucket-mb 128] [--repeats 3] [--out docs/benchmarks.md]
    python tools/bench/bench_weight_push.py --manager --hidden 128 --layers 4 --vocab 16 --repeats 30

Default mode: rank 0 also starts a plain receiver process (``--raw-peer``: torch only, no megarl
server) joined to it by a 2-rank gloo group; each repeat runs one push, then one raw broadcast of
every bucket's bytes (buffers allocated once, so the raw side pays no page faults), interleaved so
load on a shared machine hits both alike. The row reports push/raw of the medians, the median of
the per-repeat ratios, the push's fixed cost (pause round trip, agreement, the tail: everything but
streaming the bytes) apart from the bytes, the streaming part's own ratio, the trainer's split
(gather, convert on its thread; send busy time on the sender thread, which overlaps them), and the
peak extra RSS of the trainer and of the server during the push, sampled every 2 ms.

``--manager``: the product's path - a rollout manager process holds the admin connection (as in
megarl-train) and the push's tail is not awaited. Reports, per push (medians), the trainer's time
split into gather, convert, send (the broadcast, which also waits for the server to enter its
receive) and the fixed cost (everything else: the pause round trip through the manager, the
announce), apart from the bytes. ``--verify`` (with ``--manager``): every push is also checked by
checksum (``weights.verify_interval=1``, megarl-train's default) and the row adds its two costs:
the trainer's sha256 of the sent buckets (``push/digest_s``) and ``WeightPusher.verify`` (one
``/weights_checksum`` call through the manager, after the push's tail; the servers hash what
they hold). Without it,
verification is off so that the push alone is timed.

Starts its own ranks (torchrun on loopback) and server. Appends a table row to --out (rank 0).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--bucket-mb", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"))
    p.add_argument("--work", default="")
    p.add_argument("--manager", action="store_true", help="push through a rollout manager (megarl-train's path)")
    p.add_argument("--gap-s", type=float, default=0.25, help="--manager: seconds between pushes (an update)")
    p.add_argument("--verify", action="store_true", help="with --manager: time checksum verification too")
    p.add_argument("--raw-peer", nargs=3, metavar=("PORT", "ROUNDS", "SIZES"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


class PeakRSS:
    """Samples a process's RSS (default this one) every 2 ms; ``peak - base`` is the extra memory
    used."""

    def __init__(self, pid: int | None = None):
        self.proc, self.base, self.peak, self._stop = psutil.Process(pid), 0, 0, threading.Event()

    def __enter__(self):
        self.base = self.peak = self.proc.memory_info().rss
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    @property
    def extra(self) -> int:
        return self.peak - self.base


RAW_GROUP = "bench-raw"


def raw_peer(port: int, rounds: int, sizes: str) -> int:
    """The raw baseline's receiver: a plain process, buffers allocated (and touched) once."""
    from megarl.common.net import new_process_group

    pg = new_process_group("127.0.0.1", port, 1, 2, RAW_GROUP, "gloo", 300)
    bufs = [torch.zeros(int(n), dtype=torch.uint8) for n in sizes.split(",")]
    for _ in range(rounds):
        for buf in bufs:
            dist.broadcast(buf, group=pg, group_src=0)
    return 0


class RawBaseline:
    """Rank 0's side of the physical limit: the same bucket bytes, one gloo broadcast per bucket,
    to a plain process (`raw_peer`)."""

    def __init__(self, sizes: list[int], rounds: int):
        from megarl.common.net import free_port, new_process_group

        port = free_port("127.0.0.1")
        self.peer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--raw-peer", str(port),
                                      str(rounds), ",".join(map(str, sizes))], env=dict(os.environ, RANK=""))
        self.pg = new_process_group("127.0.0.1", port, 0, 2, RAW_GROUP, "gloo", 300)
        self.bufs = [torch.ones(n, dtype=torch.uint8) for n in sizes]

    def run(self) -> float:
        t0 = time.perf_counter()
        for buf in self.bufs:
            dist.broadcast(buf, group=self.pg, group_src=0)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.peer.wait(timeout=60)


def worker(args):
    from megarl.common import compat
    from megarl.trainer import parallel
    from megarl.launch.preflight import check_wire
    from megarl.config import load_config
    from megarl.trainer.engine import Engine, EngineSpec
    from megarl.rollout.cluster import RolloutCluster
    from megarl.weights.push import PushSpec, WeightPusher

    compat.quiet_megatron_warnings()
    parallel.init_distributed()
    hf, server = os.environ["BENCH_HF"], os.environ["BENCH_SERVER"]
    cfg = load_config(None, [f"model.hf_path={hf}", f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl",
                             f"data.tokenizer_path={REPO}/examples/tiny/model", f"parallel.tp={args.tp}",
                             f"weights.bucket_mb={args.bucket_mb}", f"rollout.servers=[{server}]",
                             "weights.timeout_s=300", f"train.run_dir={os.environ['BENCH_WORK']}/run",
                             f"weights.verify_interval={int(args.verify)}"])
    check_wire(cfg)  # the wire the server advertises, as megarl-train's preflight chooses it
    ps = parallel.init_model_parallel(args.tp, 1)
    engine = Engine.build(EngineSpec.from_config(cfg), ps, trainable=False)
    if args.manager:
        return manager_pushes(args, cfg, ps, engine)
    cluster = RolloutCluster.from_config(cfg, [server], driver=ps.rank == 0)
    pusher = WeightPusher(PushSpec.from_config(cfg), engine, cluster)
    pusher.push()  # warm-up: groups, first allocation
    sizes = [sum(s.nbytes(pusher.resharder.serving_dtype) for s in b) for b in pusher.resharder.stage_plan(0)]
    raw = RawBaseline(sizes, args.repeats + 1) if ps.rank == 0 else None
    if raw:
        raw.run()  # warm-up
    push_s, raw_s, extra, server_extra, rows = [], [], [], [], []
    for _ in range(args.repeats):
        dist.barrier()
        with PeakRSS() as mem, PeakRSS(int(os.environ["BENCH_SERVER_PID"])) as smem:
            t0 = time.perf_counter()
            rows.append(pusher.push())
            push_s.append(time.perf_counter() - t0)
        extra.append(mem.extra)
        server_extra.append(smem.extra)
        dist.barrier()
        if raw:
            raw_s.append(raw.run())
    if ps.rank == 0:
        raw.close()
        total = sum(sizes)
        med = statistics.median
        p, r = med(push_s), med(raw_s)
        stream = med(m.stream_s for m in rows)
        bucket = args.bucket_mb * 2**20
        row = (f"| weight push, TP={args.tp}, {total / 2**20:.0f} MiB fp32, {len(sizes)} buckets of "
               f"<= {args.bucket_mb} MiB, {args.repeats} interleaved repeats | {total / p / 2**30:.2f} GiB/s | "
               f"raw gloo, 2 plain processes {total / r / 2**30:.2f} GiB/s | **{r / p:.2f}x** (per-repeat "
               f"median {med(a / b for a, b in zip(raw_s, push_s)):.2f}x) | fixed "
               f"{1e3 * med(m.fixed_s for m in rows):.0f} ms; streaming alone {r / stream:.2f}x | trainer gather "
               f"{1e3 * med(m.gather_s for m in rows):.0f} + convert {1e3 * med(m.convert_s for m in rows):.0f} ms, "
               f"send busy "
               f"{1e3 * med(m.send_s for m in rows):.0f} ms | peak extra RSS trainer {max(extra) / 2**20:.0f} MiB "
               f"(= {max(extra) / bucket:.2f} buckets), server {max(server_extra) / 2**20:.0f} MiB |")
        print(row)
        print("push_s", [round(x, 3) for x in push_s], "raw_s", [round(x, 3) for x in raw_s])
        with open(args.out, "a") as f:
            f.write(row + "\n")
    pusher.close()
    dist.barrier()
    os._exit(0)


def manager_pushes(args, cfg, ps, engine):
    """The push as megarl-train runs it: through a rollout manager process."""
    from megarl.config import save_config
    from megarl.trainer.rollout_link import RolloutSide
    from megarl.weights.push import PushSpec, WeightPusher

    if ps.rank == 0:
        save_config(cfg, cfg.train.run_dir)
    dist.barrier()
    side = RolloutSide(cfg, ps)
    side.start()
    pusher = WeightPusher(PushSpec.from_config(cfg), engine, side.connect(0, None))
    pusher.push()  # warm-up: groups, first allocation
    rows, verify_s = [], []
    for _ in range(args.repeats):
        dist.barrier()
        rows.append(pusher.push())
        time.sleep(args.gap_s)  # the update between two pushes, while the manager finishes the tail
        if args.verify:
            if ps.rank == 0:
                pusher.cluster.settle()  # the push's tail first: time the check alone
            dist.barrier()
            t0 = time.perf_counter()
            assert pusher.verify() == []
            verify_s.append(time.perf_counter() - t0)
    pusher.cluster.settle() if ps.rank == 0 else None  # the last tail finished too
    if ps.rank == 0:
        med = lambda f: statistics.median(f(m) for m in rows)  # noqa: E731
        total = med(lambda m: m.total_s)
        row = (f"| push through the rollout manager, TP={args.tp}, {rows[0].bytes / 2**20:.1f} MiB, "
               f"{rows[0].buckets} bucket(s), {args.repeats} pushes {args.gap_s} s apart | {1e3 * total:.1f} ms | "
               f"{1e3 * med(lambda m: m.gather_s):.1f} + {1e3 * med(lambda m: m.convert_s):.1f} ms | "
               f"{1e3 * med(lambda m: m.send_s):.1f} ms | **{1e3 * med(lambda m: m.fixed_s):.1f} ms** "
               f"(pause {1e3 * med(lambda m: m.pause_s):.1f} ms) |")
        if args.verify:
            row += (f" checksums: trainer {1e3 * med(lambda m: m.digest_s):.1f} ms, verify call "
                    f"{1e3 * statistics.median(verify_s):.1f} ms |")
        print(row)
        with open(args.out, "a") as f:
            f.write(row + "\n")
    pusher.close()
    side.close()
    dist.barrier()
    os._exit(0)


def main():
    args = parse()
    if args.raw_peer:
        return raw_peer(int(args.raw_peer[0]), int(args.raw_peer[1]), args.raw_peer[2])
    if os.environ.get("RANK"):
        return worker(args)
    from megarl.models.random_hf import tiny_config, write_random_hf

    work = args.work or tempfile.mkdtemp(prefix="bench_push_")
    hf = os.path.join(work, "hf")
    write_random_hf(hf, tiny_config(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                    vocab_size=args.vocab, intermediate_size=args.hidden * 11 // 4,
                                    num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256)))
    from rl_runs import torchrun_with_server

    return torchrun_with_server(__file__, hf, work, args.tp)


if __name__ == "__main__":
    sys.exit(main())
