"""torchrun worker for the weight push. Mode "layouts": for each (tp, pp) layout and transport,
reset a real megarl CPU server to weights A, push the trainer's weights B, and record (rank 0)
the max |server logprob - trainer logprob| and whether every server tensor equals the HF export.
Mode "stall": push to a server that is SIGSTOPped (hangs) or killed (dead); record how long it
took to fail and the error on every rank."""
import json
import os
import signal
import sys
import time
import urllib.request

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megarl import compat, parallel
from megarl.config import load_config
from megarl.trainer.batch import TensorBatch
from megarl.trainer.engine import Engine, EngineSpec
from megarl.rollout.cluster import RolloutCluster
from megarl.weights.push import PushSpec, WeightPusher


def post(url, body, timeout=60):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def build(hf_b, server, tp, pp, transport, work, timeout_s=60, trainable=False):
    cfg = load_config(None, [f"model.hf_path={hf_b}", "data.train_path=x", f"parallel.tp={tp}",
                             f"parallel.pp={pp}", f"weights.transport={transport}",
                             f"weights.timeout_s={timeout_s}", "weights.bucket_mb=1",
                             f"weights.disk_dir={work}/push_{transport}_{tp}{pp}",
                             f"rollout.servers=[{server}]", f"train.run_dir={work}/run"])
    ps = parallel.init_model_parallel(tp, pp)
    engine = Engine.build(EngineSpec.from_config(cfg), ps, trainable=trainable)
    cluster = RolloutCluster.from_config(cfg, [server], driver=dist.get_rank() == 0)
    return engine, WeightPusher(PushSpec.from_config(cfg), engine, cluster)


def server_vs_trainer(engine, server):
    """Greedy continuation on the server; trainer logprobs of the same tokens."""
    seq = [None]
    if dist.get_rank() == 0:
        out = post(f"{server}/generate", {"input_ids": [1, 5, 9, 17, 33], "return_logprob": True,
                                           "sampling_params": {"temperature": 0, "max_new_tokens": 12,
                                                               "ignore_eos": True}})
        lps = out["meta_info"]["output_token_logprobs"]
        seq = [([1, 5, 9, 17, 33] + [t for _, t, _ in lps], [lp for lp, _, _ in lps],
                out["meta_info"].get("weight_version"))]
    dist.broadcast_object_list(seq, src=0)
    ids, server_lp, version = seq[0]
    mine = engine.compute_logp(TensorBatch.from_lists([ids])).logp[0, 5:]
    return float((mine - torch.tensor(server_lp)).abs().max()), version


def server_weights_equal(server, reference_dir):
    ref = load_file(os.path.join(reference_dir, "model.safetensors"))
    bad = []
    for name, t in ref.items():
        got = torch.tensor(post(f"{server}/get_weights_by_name", {"name": name, "truncate_size": 100000}))
        if not torch.equal(got, t.float()):
            bad.append(name)
    return bad


def layouts(hf_a, hf_b, server, work, specs):
    results = {}
    for spec in specs:
        tp, pp, transport = spec.split(",")
        if dist.get_rank() == 0:  # reset the server to weights A
            assert post(f"{server}/update_weights_from_disk", {"model_path": hf_a})["success"]
        dist.barrier()
        engine, pusher = build(hf_b, server, int(tp), int(pp), transport, work)
        before, _ = server_vs_trainer(engine, server)
        m = pusher.push()
        after, version = server_vs_trainer(engine, server)
        bad = server_weights_equal(server, hf_b) if dist.get_rank() == 0 else None
        results[spec] = {"before": before, "after": after, "version": version, "bad": bad,
                         "bytes": m.bytes, "buckets": m.buckets}
        pusher.close()
        pusher.cluster.close()
        parallel.destroy_model_parallel_only()
    return results


def stall(hf_b, server, work, pid, how):
    engine, pusher = build(hf_b, server, 2, 1, "distributed", work, timeout_s=4)
    pusher.push()  # healthy first push: groups exist
    dist.barrier()
    if dist.get_rank() == 0:
        os.kill(pid, signal.SIGSTOP if how == "hang" else signal.SIGKILL)
    dist.barrier()
    t0 = time.perf_counter()
    try:
        pusher.push()
        err = None
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    elapsed = time.perf_counter() - t0
    if dist.get_rank() == 0 and how == "hang":
        os.kill(pid, signal.SIGCONT)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, {"error": err, "elapsed": elapsed})
    return out


def join(hf_a, hf_b, server, server2, work):
    """Push v1 to server 1; server 2 (weights A) joins late and must get v1; verify() agrees,
    and catches a server whose weights were changed behind the trainer's back."""
    engine, pusher = build(hf_b, server, 2, 2, "distributed", work)
    pusher.push()
    late_before, _ = server_vs_trainer(engine, server2)
    pusher.add_server(server2)
    late_after, late_version = server_vs_trainer(engine, server2)
    first_after, first_version = server_vs_trainer(engine, server)
    ok = pusher.verify()
    if dist.get_rank() == 0:  # tamper: server 2 back to weights A
        assert post(f"{server2}/update_weights_from_disk", {"model_path": hf_a})["success"]
    dist.barrier()
    tampered = pusher.verify()
    pusher.close()
    return {"late_before": late_before, "late_after": late_after, "late_version": late_version,
            "first_after": first_after, "first_version": first_version, "verify_ok": ok,
            "verify_tampered": sorted(tampered), "pusher_version": pusher.version}


def delta(hf_a, hf_b, server, work):
    """TP=2, trainable engine: the embedding and layer 0 frozen (requires_grad False), push v1
    (everything), change every trainable parameter, push v2: only the changed rows travel, and
    afterwards every server tensor equals the trainer's bitwise (sha256 of all of them)."""
    from megarl.models.hf_io import local_params

    if dist.get_rank() == 0:
        assert post(f"{server}/update_weights_from_disk", {"model_path": hf_a})["success"]
    dist.barrier()
    engine, pusher = build(hf_b, server, 2, 1, "distributed", work, trainable=True)
    for lp in local_params(engine.chunks, engine.args, engine.use_te):
        if lp.pmap.mcore.startswith("embedding.") or lp.layer == 0:
            lp.param.requires_grad_(False)
    first = pusher.push()
    torch.manual_seed(dist.get_rank() // 2)  # the same change on both TP ranks of a replicated norm
    with torch.no_grad():  # an update: the optimizer's writes, to trainable parameters only
        for c in engine.chunks:
            for p in c.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn_like(p))
    second = pusher.push()
    after, version = server_vs_trainer(engine, server)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, pusher._gather_digests())  # every tensor, not only those sent
    everything = {n: d for part in parts for n, d in part.items()}
    differ = pusher._compare(everything) if dist.get_rank() == 0 else None
    checked = pusher.verify()
    pusher.close()
    return {"first_bytes": first.bytes, "second_bytes": second.bytes, "after": after, "version": version,
            "compared": len(everything), "differ": differ, "verify": checked}


def main():
    mode, hf_a, hf_b, server, work, out, *rest = sys.argv[1:]
    compat.quiet_megatron_warnings()
    torch.set_num_threads(1)
    parallel.init_distributed()
    if mode == "layouts":
        results = layouts(hf_a, hf_b, server, work, rest)
    elif mode == "join":
        results = join(hf_a, hf_b, server, rest[0], work)
    elif mode == "delta":
        results = delta(hf_a, hf_b, server, work)
    else:
        results = stall(hf_b, server, work, int(rest[0]), rest[1])
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    os._exit(0)  # a stalled server's group may still hold sockets; don't wait on them


if __name__ == "__main__":
    main()
