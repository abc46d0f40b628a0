"""torchrun worker for the weight push: ``push_worker.py PLAN.json OUT.json`` runs the plan's jobs in
turn in one launch (the ranks' ~10 s of imports paid once) and rank 0 writes {job name: result}.
Each job names its mode, its models (weights A, B) and its own server(s):

- "layouts": for each (tp, pp[, refit[, ep]]) layout and transport, reset a real megarl CPU server
  to weights A, push the trainer's weights B, and record (rank 0) the max |server logprob -
  trainer logprob| and whether every server tensor equals the HF export.
- "join", "delta", "disk_delta": a late server, delta pushes over the weight-update group / disk.
- "stall": push to a server that is SIGSTOPped (hangs) or killed (dead); record how long it took
  to fail and the error on every rank. A stalled push leaves its groups behind, so the test plan
  runs stall jobs last.

Model-parallel state is torn down between jobs (and between layouts)."""
import json
import os
import signal
import sys
import time
import urllib.request

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megarl.common import compat
from megarl.trainer import parallel
from megarl.config import load_config
from megarl.launch.preflight import check_wire
from megarl.trainer.batch import TensorBatch
from megarl.trainer.engine import Engine, EngineSpec
from megarl.rollout.cluster import RolloutCluster
from megarl.weights.checksums import compare
from megarl.weights.push import PushSpec, WeightPusher
from megarl.weights.transports import PushError


def post(url, body, timeout=60):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def build(hf_b, server, tp, pp, transport, work, timeout_s=60, trainable=False, refit="gather", ep=1,
          extra=()):
    cfg = load_config(None, [f"model.hf_path={hf_b}", "data.train_path=x", f"parallel.tp={tp}",
                             f"parallel.pp={pp}", f"parallel.ep={ep}", f"weights.transport={transport}",
                             f"weights.timeout_s={timeout_s}", "weights.bucket_mb=1", f"weights.refit={refit}",
                             f"weights.disk_dir={work}/push_{transport}_{tp}{pp}",
                             f"rollout.servers=[{server}]", f"train.run_dir={work}/run",
                             "weights.verify_interval=1", *extra])  # every push checked (auto: every 10th)
    check_wire(cfg)  # the wire the server advertises, as megarl-train's preflight chooses it
    ps = parallel.init_model_parallel(tp, pp, ep=ep)
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
        tp, pp, transport, *rest = spec.split(",")  # "tp,pp,transport[,refit[,ep]]"
        if dist.get_rank() == 0:  # reset the server to weights A
            assert post(f"{server}/update_weights_from_disk", {"model_path": hf_a})["success"]
        dist.barrier()
        engine, pusher = build(hf_b, server, int(tp), int(pp), transport, work,
                               refit=rest[0] if rest else "gather", ep=int(rest[1]) if len(rest) > 1 else 1)
        before, _ = server_vs_trainer(engine, server)
        m = pusher.push()
        after, version = server_vs_trainer(engine, server)
        bad = server_weights_equal(server, hf_b) if dist.get_rank() == 0 else None
        checked = pusher.verify()  # checksums of what the trainer holds vs what the server holds
        results[spec] = {"before": before, "after": after, "version": version, "bad": bad,
                         "bytes": m.bytes, "buckets": m.buckets, "verify": checked}
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
    pusher.cluster.close()
    return {"late_before": late_before, "late_after": late_after, "late_version": late_version,
            "first_after": first_after, "first_version": first_version, "verify_ok": ok,
            "verify_tampered": sorted(tampered), "pusher_version": pusher.version}


def delta(hf_a, hf_b, server, work):
    """TP=2, trainable engine with optim.freeze = the embedding and layer 0: push v1 (everything),
    two real optimizer steps (SFT loss), push v2, two more, push v3: v2 and v3 carry only the
    trainable rows; the frozen ones stay bitwise unchanged in the trainer, and afterwards every
    server tensor equals the trainer's bitwise (sha256 of all of them)."""
    from megarl.models.hf_io import local_params
    from megarl.trainer.sft import sft_loss

    if dist.get_rank() == 0:
        assert post(f"{server}/update_weights_from_disk", {"model_path": hf_a})["success"]
    dist.barrier()
    engine, pusher = build(hf_b, server, 2, 1, "distributed", work, trainable=True,
                           extra=('optim.freeze=["model.embed_tokens.weight","model.layers.0.*"]',
                                  "optim.lr=0.01"))
    lps = local_params(engine.chunks, engine.args, engine.use_te)
    frozen = {lp.local_name: lp.param.detach().clone() for lp in lps if not lp.param.requires_grad}
    trainable = {lp.local_name: lp.param.detach().clone() for lp in lps if lp.param.requires_grad}
    ids = [[1, 5, 9, 17, 33, 2, 8, 40, 3, 7, 11, 60]] * 2
    batch = TensorBatch.from_lists(ids, {"loss_mask": [[0.0] * 4 + [1.0] * 8] * 2})
    sent = [pusher.push().bytes]
    for _ in range(2):
        for _ in range(2):
            engine.train_batch(batch, sft_loss)
        sent.append(pusher.push().bytes)
    now = {lp.local_name: lp.param.detach() for lp in lps}
    after, version = server_vs_trainer(engine, server)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, pusher.checksums.gather(pusher.resharder, pusher.ps))  # every tensor, not only those sent
    everything = {n: d for part in parts for n, d in part.items()}
    differ = compare(pusher.admin, everything, pusher.timeout_s) if dist.get_rank() == 0 else None
    checked = pusher.verify()
    pusher.close()
    pusher.cluster.close()
    return {"sent": sent, "after": after, "version": version, "frozen_params": len(frozen),
            "frozen_changed": sorted(n for n, t in frozen.items() if not torch.equal(t, now[n])),
            "trainable_unchanged": sorted(n for n, t in trainable.items() if torch.equal(t, now[n])),
            "compared": len(everything), "differ": differ, "verify": checked}


def disk_delta(hf_a, hf_b, server, work):
    """TP=2, weights.transport=disk with weights.disk_delta=raw, optim.freeze = embedding + layer 0: push
    v1 (raw records), two real optimizer steps, v2 (frozen: same records, the rest raw), two more,
    v3 as with weights.disk_delta=xor (XOR+zlib records against v2); the server rebuilds every tensor
    (CRC-32 checked) and equals the trainer bitwise."""
    from megarl.trainer.sft import sft_loss

    if dist.get_rank() == 0:
        assert post(f"{server}/update_weights_from_disk", {"model_path": hf_a})["success"]
    dist.barrier()
    engine, pusher = build(hf_b, server, 2, 1, "disk", work, trainable=True,
                           extra=('optim.freeze=["model.embed_tokens.weight","model.layers.0.*"]',
                                  "optim.lr=0.01", "weights.disk_delta=raw"))
    ids = [[1, 5, 9, 17, 33, 2, 8, 40, 3, 7, 11, 60]] * 2
    batch = TensorBatch.from_lists(ids, {"loss_mask": [[0.0] * 4 + [1.0] * 8] * 2})
    sent = [pusher.push().bytes]
    for xor in (False, True):  # v2: weights.disk_delta=raw, v3: as with =xor
        for _ in range(2):
            engine.train_batch(batch, sft_loss)
        pusher.transport.xor = xor
        sent.append(pusher.push().bytes)
    codecs = {}
    if dist.get_rank() == 0:
        with open(os.path.join(pusher.transport.dir, "v3", "megarl_delta.json")) as f:
            man = json.load(f)
        codecs = {"base": man["base"], "codecs": sorted(e[3] for e in man["tensors"].values()),
                  "frozen_record_bytes": sum(e[2] for n, e in man["tensors"].items()
                                             if n == "model.embed_tokens.weight" or n.startswith("model.layers.0."))}
    # the server moves to another version behind the trainer's back: the next delta (against v3)
    # is refused, and the push after it writes every tensor raw
    if dist.get_rank() == 0:
        assert post(f"{server}/update_weight_version", {"new_version": "elsewhere"})["success"]
    dist.barrier()
    engine.train_batch(batch, sft_loss)
    try:
        pusher.push()
        refused = ""
    except PushError as e:
        refused = str(e)
    sent.append(pusher.push().bytes)
    if dist.get_rank() == 0:
        with open(os.path.join(pusher.transport.dir, "v4", "megarl_delta.json")) as f:
            man = json.load(f)
        codecs["retry_base"] = man["base"]
        codecs["retry_codecs"] = sorted(set(e[3] for e in man["tensors"].values()))
    after, version = server_vs_trainer(engine, server)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, pusher.checksums.gather(pusher.resharder, pusher.ps))
    everything = {n: d for part in parts for n, d in part.items()}
    differ = compare(pusher.admin, everything, pusher.timeout_s) if dist.get_rank() == 0 else None
    pusher.close()
    pusher.cluster.close()
    return {"sent": sent, "after": after, "version": version, "compared": len(everything),
            "differ": differ, "refused": refused, **codecs}


def run_job(job: dict):
    mode, a, b, servers, work = job["mode"], job["hf_a"], job["hf_b"], job["servers"], job["work"]
    if mode == "layouts":
        return layouts(a, b, servers[0], work, job["specs"])
    if mode == "join":
        return join(a, b, servers[0], servers[1], work)
    if mode == "delta":
        return delta(a, b, servers[0], work)
    if mode == "disk_delta":
        return disk_delta(a, b, servers[0], work)
    return stall(b, servers[0], work, job["pids"][0], job["how"])


def main():
    plan, out = sys.argv[1:]
    compat.quiet_megatron_warnings()
    torch.set_num_threads(1)
    parallel.init_distributed()
    results = {}
    for job in json.load(open(plan)):
        results[job["name"]] = run_job(job)
        parallel.destroy_model_parallel_only()
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    os._exit(0)  # a stalled server's group may still hold sockets; don't wait on them


if __name__ == "__main__":
    main()
