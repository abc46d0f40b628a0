"""torchrun worker: runs one tiny model under several TP/PP(/DP) layouts and records logprobs,
loss, grad norm and post-step logprobs on rank 0 (JSON). Used by test_parallel_equivalence.py.

    layouts_worker.py HF_DIR OUT.json LAYOUT... [+ HF_DIR OUT.json LAYOUT...]...

Groups separated by ``+`` run one after the other in the same launch (the ranks' imports paid once)."""
import json
import random
import sys

import torch
import torch.distributed as dist

from megarl.common import compat
from megarl.trainer import parallel
from megarl.config import load_config
from megarl.trainer.batch import TensorBatch, per_sample
from megarl.trainer.engine import Engine, EngineSpec
from megarl.trainer.sft import sft_loss


def make_batch(n=8, vocab=128, seed=0):
    rng = random.Random(seed)
    ids, mask = [], []
    for _ in range(n):
        length = rng.randint(6, 20)
        prompt = rng.randint(2, length - 2)
        ids.append([rng.randrange(vocab) for _ in range(length)])
        mask.append([0.0] * prompt + [1.0] * (length - prompt))
    return TensorBatch.from_lists(ids, {"loss_mask": mask})


def run_layout(hf_dir, tp, pp, mbt, dist_opt, batch, ep=1, aux=0.0):
    cfg = load_config(None, [f"model.hf_path={hf_dir}", "data.train_path=x", f"parallel.tp={tp}",
                             f"parallel.pp={pp}", f"train.micro_batch_tokens={mbt}", "optim.lr=0.01",
                             f"parallel.distributed_optimizer={str(dist_opt).lower()}", f"parallel.ep={ep}",
                             f"moe.aux_loss_coeff={aux}"])
    ps = parallel.init_model_parallel(tp, pp, seed=1234, ep=ep)
    engine = Engine.build(EngineSpec.from_config(cfg), ps)
    mine = [i for i in range(len(batch)) if i % ps.dp == ps.dp_rank]
    local = batch.select(mine)
    before = per_sample(engine.compute_logp(local).logp, local.lengths)
    metrics = engine.train_batch(local, sft_loss)
    after = per_sample(engine.compute_logp(local).logp, local.lengths)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {i: (b.tolist(), a.tolist()) for i, b, a in zip(mine, before, after)})
    merged = {}
    for r in rows:
        merged.update(r)
    parallel.destroy_model_parallel_only()
    return {"logp": [merged[i][0] for i in range(len(batch))],
            "logp_after": [merged[i][1] for i in range(len(batch))],
            "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "nll": metrics["nll"],
            "moe_aux_loss": metrics.get("moe_aux_loss")}


def main():
    compat.quiet_megatron_warnings()
    torch.set_num_threads(1)
    parallel.init_distributed()
    groups, group = [], []
    for arg in sys.argv[1:] + ["+"]:
        if arg == "+":
            groups.append(group)
            group = []
        else:
            group.append(arg)
    for hf_dir, out, *layouts in groups:
        run_group(hf_dir, out, layouts)
    dist.destroy_process_group()


def run_group(hf_dir: str, out: str, layouts: list[str]) -> None:
    with open(f"{hf_dir}/config.json") as f:
        batch = make_batch(vocab=json.load(f)["vocab_size"])
    results = {}
    for spec in layouts:  # "tp,pp,micro_batch_tokens,dist_opt[,ep[,moe.aux_loss_coeff]]"
        tp, pp, mbt, dopt, *rest = spec.split(",")
        results[spec] = run_layout(hf_dir, int(tp), int(pp), int(mbt), dopt == "1", batch,
                                   int(rest[0]) if rest else 1, float(rest[1]) if len(rest) > 1 else 0.0)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    main()
