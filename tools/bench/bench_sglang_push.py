"""Benchmark: the weight push into real SGLang 0.5.x (CPU, fp32) by the wire megarl chooses for it -
one `flattened_bucket` broadcast per bucket, SGLang's back-to-back layout - against SGLang's
default wire (one broadcast per tensor, load_format None: what megarl sent SGLang before), and
against megarl-server's own wire (`direct_bucket`) for the same weights.

    python tools/bench/bench_sglang_push.py [--hidden 512 --layers 8 --vocab 8192] [--repeats 10]

One trainer process (a forward-only engine holding random weights B) and, on loopback, an SGLang
server and a megarl-server holding random weights A. Each variant is one `WeightPusher` (the
product's pusher, the wire resolved by preflight's `check_wire` from what the server advertises):
a warm-up push (the weight-update group's rendezvous), then ``--repeats`` timed pushes; the
variants run flattened, per tensor, flattened, per tensor (SGLang), then megarl-server with and
without its checksum, so drift on a shared machine shows. Reported per variant: median `push/total_s` (pause, flush, buckets,
the server's load, publish, continue) and `push/stream_s` (announce + broadcast + the server's
receive and load of the buckets). SGLang's CPU path is not what SGLang is built for.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_runs import REPO, markdown_table  # noqa: E402


def per_tensor_transport(base):
    """SGLang's default wire, for the baseline only: one broadcast per tensor, no load_format."""
    from megarl.weights.transports import DistributedTransport, _finish
    from megarl.protocol.messages import UpdateFromDistributed
    from megarl.protocol.wire import DistributedWeightsMeta

    class PerTensor(DistributedTransport):
        def send(self, bucket, version):
            meta = DistributedWeightsMeta(bucket.names, bucket.dtypes, bucket.shapes, self.group_name,
                                          flush_cache=False, load_format=None)
            announced = self.admin.send(UpdateFromDistributed(meta))
            works = [dist.broadcast(t.contiguous(), group=self.group, group_src=0, async_op=True)
                     for t in bucket.tensors]
            for w in works:
                w.wait()
            _finish(announced, self.timeout_s, "update_weights_from_distributed")

    return PerTensor(base.admin, base.addr, base.timeout_s, base.backend, wire="sglang")


def pushes(cfg, engine, server: str, repeats: int, per_tensor: bool = False) -> dict:
    from megarl.launch.preflight import check_wire
    from megarl.rollout.cluster import RolloutCluster
    from megarl.weights.push import PushSpec, WeightPusher

    check_wire(cfg)  # the wire the server advertises
    cluster = RolloutCluster.from_config(cfg, [server], driver=True)
    pusher = WeightPusher(PushSpec.from_config(cfg), engine, cluster)
    if per_tensor:
        pusher.transport = per_tensor_transport(pusher.transport)
    pusher.push()  # warm-up: the group's rendezvous, first allocations
    rows = [pusher.push() for _ in range(repeats)]
    pusher.close()
    cluster.close()
    med = statistics.median
    return {"wire": "per tensor (load_format None)" if per_tensor else
            {"sglang": "flattened_bucket", "megarl": "direct_bucket"}[cfg.weights.tensor_format],
            "total_s": med(m.total_s for m in rows), "stream_s": med(m.stream_s for m in rows),
            "bytes": rows[0].bytes, "buckets": rows[0].buckets}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--bucket-mb", type=int, default=32)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()

    import importlib.util

    from megarl.common import compat
    from megarl.trainer import parallel
    from megarl.config import load_config
    from megarl.models.random_hf import tiny_config, write_random_hf
    from megarl.rollout.local import start_server
    from megarl.trainer.engine import Engine, EngineSpec

    spec = importlib.util.spec_from_file_location("launch", os.path.join(REPO, "tools", "sglang_cpu", "launch.py"))
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    spec = importlib.util.spec_from_file_location("hf_tok", os.path.join(REPO, "tools", "sglang_cpu", "hf_tokenizer.py"))
    hf_tok = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_tok)

    work = tempfile.mkdtemp(prefix="bench-sglang-push-")
    shape = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, vocab_size=args.vocab,
                 intermediate_size=args.hidden * 8 // 3 // 64 * 64, num_attention_heads=args.hidden // 64,
                 num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=512)
    paths = {}
    for name, seed in (("a", 1), ("b", 2)):
        raw = write_random_hf(os.path.join(work, f"raw_{name}"), tiny_config(**shape), seed=seed)
        shutil.copyfile(os.path.join(REPO, "examples", "tiny", "model", "tokenizer.model"),
                        os.path.join(raw, "tokenizer.model"))
        paths[name] = hf_tok.hf_model_copy(raw, os.path.join(work, name))
    sglang = launch.SGLangServer(paths["a"], log_path=os.path.join(work, "sglang.log")).start()
    url_m, proc_m = start_server(paths["a"], os.path.join(work, "megarl-server.log"))
    try:
        sglang.wait_ready()
        compat.quiet_megatron_warnings()
        parallel.init_distributed()
        ps = parallel.init_model_parallel(1, 1)

        def cfg(server, *extra):
            return load_config(None, [f"model.hf_path={paths['b']}", "data.train_path=x",
                                      f"weights.bucket_mb={args.bucket_mb}", f"rollout.servers=[{server}]",
                                      "weights.timeout_s=300", f"train.run_dir={work}/run", *extra])

        engine = Engine.build(EngineSpec.from_config(cfg(sglang.url)), ps, trainable=False)
        results = []
        for per_tensor in (False, True, False, True):
            results.append({"server": "SGLang", **pushes(cfg(sglang.url), engine, sglang.url, args.repeats, per_tensor)})
            print("[bench]", results[-1], flush=True)
        # megarl-server's default checks every push by checksum (the sender thread hashes the
        # buckets); without it, the same work as the SGLang rows
        for verify in ("auto", "0"):
            r = pushes(cfg(url_m, f"weights.verify_interval={verify}"), engine, url_m, args.repeats)
            r["wire"] += ", checksum" if verify == "auto" else ", no checksum"
            results.append({"server": "megarl-server", **r})
            print("[bench]", results[-1], flush=True)
    finally:
        sglang.stop()
        proc_m.kill()
    mib = results[0]["bytes"] / 2**20
    rows = [[r["server"], r["wire"], f"{r['bytes'] / 2**20:.0f} MiB / {r['buckets']}", f"{r['total_s']:.3f}",
             f"{r['stream_s']:.3f}", f"{r['bytes'] / r['stream_s'] / 2**30:.2f}"] for r in results]
    print(f"\n{mib:.0f} MiB fp32, buckets <= {args.bucket_mb} MiB, median of {args.repeats} pushes each\n")
    print(markdown_table(["server", "wire", "bytes / buckets", "push s", "stream s", "stream GiB/s"], rows))
    os._exit(0)


if __name__ == "__main__":
    main()
