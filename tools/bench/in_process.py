"""Helpers of the benchmarks that run megarl's engine in their own process (bench_engine,
bench_packing, bench_update_math): a one-rank torch.distributed world on loopback, and the median
time of a call."""
from __future__ import annotations

import os
import statistics
import time


def one_rank_world() -> None:
    """The environment `megarl.trainer.parallel.init_distributed` reads for a world of this process alone."""
    from megarl.common.net import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def timed(fn, iters: int) -> float:
    """Median seconds of ``iters`` calls of ``fn`` after one warm-up call."""
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
