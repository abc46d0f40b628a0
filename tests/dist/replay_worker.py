"""torchrun worker for test_routing_replay.py: a tiny Qwen3-MoE under each given layout ("pp,ep"),
one after the other in one launch, with moe.routing_replay=rollout. The rollout side is the megarl-server model (`CausalLM`, in process):
its per-token logprobs and routes (ids + weights) of random rows. Records on rank 0, over all DP
shares: the trainer's logprobs replaying those routes, after the trainer's routers alone were
moved (replayed with ids + weights, with ids only, not replayed), the replayed-token count and
how far one replayed training step moved the routers; OUT is {layout: record}.

    replay_worker.py HF_DIR OUT.json LAYOUT..."""
import json
import random
import sys

import torch
import torch.distributed as dist

from megarl.common import compat
from megarl.trainer import parallel
from megarl.config import load_config
from megarl.server.model import CausalLM, DecoderConfig, KVCache
from megarl.server.weights import read_hf_dir
from megarl.trainer.batch import Routes, TensorBatch
from megarl.trainer.engine import Engine, EngineSpec
from megarl.trainer.sft import sft_loss


def server_rows(hf_dir: str, rows: list[list[int]]):
    """The server model's logprobs [n] (0.0 first) and routes (ids, weights) [n, L, k] of each row;
    the last position has no route (-1 / NaN), as a /generate response gives n - 1 rows."""
    model = CausalLM(DecoderConfig.from_dir(hf_dir), torch.float32, max_len=128)
    model.load(read_hf_dir(hf_dir))
    out = []
    for ids in rows:
        cache = KVCache(model.cfg, model.dtype, 1, 128)
        routes = model.new_routes((1, len(ids)))
        logits = model.prefill([ids], 0, cache, all_logits=True, routes=routes)[0]
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        rid, rw = routes.ids()[0].clone(), routes.weights()[0].clone()
        rid[-1], rw[-1] = -1, float("nan")
        out.append(([0.0] + lp.tolist(), rid, rw))
    return out


def batch_of(rows, served, with_weights=True) -> TensorBatch:
    b = TensorBatch.from_lists(rows, {"loss_mask": [[0.0] + [1.0] * (len(r) - 1) for r in rows]})
    layers, k = served[0][1].shape[1:]
    ids = torch.full((len(rows), b.seq_len, layers, k), -1, dtype=torch.int32)
    w = torch.full(ids.shape, float("nan"))
    for i, (_, rid, rw) in enumerate(served):
        ids[i, :len(rid)] = rid
        if with_weights:
            w[i, :len(rid)] = rw
    b.routes = Routes(ids, w)
    return b


def gather_rows(ps, mine, logp, lengths):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {i: logp[j, :lengths[j]].tolist() for j, i in enumerate(mine)})
    merged = {}
    for p in parts:
        merged.update(p)
    return [merged[i] for i in sorted(merged)]


def routers(engine):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for c in engine.chunks for m in c.modules() if isinstance(m, TopKRouter)]


def main():
    import faulthandler
    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where, instead of the test timeout
    hf_dir, out, *layouts = sys.argv[1:]
    compat.quiet_megatron_warnings()
    torch.set_num_threads(1)
    parallel.init_distributed()
    vocab = json.load(open(f"{hf_dir}/config.json"))["vocab_size"]
    rng = random.Random(0)
    rows = [[rng.randrange(vocab) for _ in range(n)] for n in (9, 14, 6, 20)]
    served = server_rows(hf_dir, rows)
    results = {layout: run_layout(hf_dir, layout, rows, served) for layout in layouts}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def run_layout(hf_dir: str, layout: str, rows: list, served: list) -> dict:
    pp, ep = map(int, layout.split(","))
    cfg = load_config(None, [f"model.hf_path={hf_dir}", "data.train_path=x", f"parallel.pp={pp}",
                             f"parallel.ep={ep}", "train.micro_batch_tokens=32", "optim.lr=0.05",
                             "moe.routing_replay=rollout"])
    ps = parallel.init_model_parallel(1, pp, seed=1234, ep=ep)
    engine = Engine.build(EngineSpec.from_config(cfg), ps)
    mine = [i for i in range(len(rows)) if i % ps.dp == ps.dp_rank]
    local = batch_of([rows[i] for i in mine], [served[i] for i in mine])
    ids_only = batch_of([rows[i] for i in mine], [served[i] for i in mine], with_weights=False)
    plain = TensorBatch(local.tokens, local.lengths, dict(local.fields))
    res = {"server": [s[0] for s in served], "layers_per_rank": len(engine.replay.routers)}
    logp = lambda b: gather_rows(ps, mine, engine.compute_logp(b).logp, b.lengths.tolist())  # noqa: E731
    res["replay"] = logp(local)
    res["plain"] = logp(plain)
    # move the trainer's routers only (same draw on every rank): its own top-k changes
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for r in sorted(routers(engine), key=lambda r: r.layer_number):
            r.weight.add_(torch.randn(r.weight.shape, generator=gen) * 0.5)
    engine.replay.replayed = 0
    res["moved_replay"] = logp(local)
    res["replayed_tokens"] = int(engine.replay.replayed)
    res["moved_ids_only"] = logp(ids_only)
    res["moved_plain"] = logp(plain)
    before = [r.weight.detach().clone() for r in routers(engine)]
    metrics = engine.train_batch(local, sft_loss)
    res["router_step"] = max(float((r.weight.detach() - b).abs().max()) for r, b in zip(routers(engine), before))
    res["grad_norm"] = metrics["grad_norm"]
    dist.barrier()
    parallel.destroy_model_parallel_only()
    return res


if __name__ == "__main__":
    main()
