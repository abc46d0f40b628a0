"""Benchmark: a TP=2 trainer pushing into megarl-server --tp 2, gathered (weights.refit=gather:
TP rank 0 gathers every full tensor and broadcasts it; the server leader receives it and hands
each follower its slices) vs shard-to-shard (weights.refit=shard: each trainer TP rank sends its
own shard straight to its peer server rank). Interleaved: per repeat one timed push of each mode
(after an untimed warm-up push that builds the groups). Prints the medians of PushMetrics.total_s.

    python tools/bench/bench_shard_refit.py [--hidden 1024 --layers 8 --vocab 16384] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


def worker(args):
    import torch.distributed as dist

    from megarl.common import compat
    from megarl.trainer import parallel
    from megarl.config import load_config
    from megarl.rollout.cluster import RolloutCluster
    from megarl.trainer.engine import Engine, EngineSpec
    from megarl.launch.preflight import check_wire
    from megarl.weights.push import PushSpec, WeightPusher

    compat.quiet_megatron_warnings()
    parallel.init_distributed()
    hf, server, work = os.environ["BENCH_HF"], os.environ["BENCH_SERVER"], os.environ["BENCH_WORK"]

    def cfg(refit):
        c = load_config(None, [f"model.hf_path={hf}", "data.train_path=x", "parallel.tp=2",
                               "weights.bucket_mb=128", f"rollout.servers=[{server}]", "weights.timeout_s=300",
                               f"train.run_dir={work}/run", "weights.verify_interval=0",
                               f"weights.refit={refit}"])
        check_wire(c)  # the wire the server advertises, as megarl-train's preflight chooses it
        return c

    ps = parallel.init_model_parallel(2, 1)
    engine = Engine.build(EngineSpec.from_config(cfg("gather")), ps, trainable=False)
    times = {"gather": [], "shard": []}
    nbytes = {}
    for _ in range(args.repeats):
        for mode in ("gather", "shard"):
            c = cfg(mode)
            pusher = WeightPusher(PushSpec.from_config(c), engine, RolloutCluster.from_config(c, [server], driver=ps.rank == 0))
            pusher.push()  # warm-up: the group, first allocations
            dist.barrier()
            m = pusher.push()
            times[mode].append(m.total_s)
            nbytes[mode] = m.bytes
            pusher.close()
            pusher.cluster.close()
    if ps.rank == 0:
        mb = nbytes["gather"] / 2**20
        for mode in ("gather", "shard"):
            print(f"{mode}: median {statistics.median(times[mode]):.3f} s over {args.repeats} "
                  f"({', '.join(f'{t:.3f}' for t in times[mode])}); {nbytes[mode] / 2**20:.0f} MiB sent "
                  f"(model {mb:.0f} MiB)", flush=True)
    dist.barrier()
    os._exit(0)


def main():
    args = parse()
    if os.environ.get("RANK"):
        return worker(args)
    from megarl.models.random_hf import tiny_config, write_random_hf

    work = tempfile.mkdtemp(prefix="bench_refit_")
    hf = os.path.join(work, "hf")
    write_random_hf(hf, tiny_config(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                    vocab_size=args.vocab, intermediate_size=args.hidden * 11 // 4,
                                    num_attention_heads=args.hidden // 64,
                                    num_key_value_heads=max(2, args.hidden // 256)))
    from rl_runs import torchrun_with_server

    return torchrun_with_server(__file__, hf, work, 2, ["--tp", "2"], ready_timeout_s=300)


if __name__ == "__main__":
    sys.exit(main())
