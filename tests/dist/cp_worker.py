"""torchrun worker for tests/dist/test_context_parallel.py: one tiny model under several layouts
(TP, PP, CP, the interleaved pipeline, padded or packed micro-batches) on real megatron-core over gloo; rank 0 writes, per
layout, every sample's per-token logprobs and entropies, the step's loss and grad norm, the
logprobs after one optimizer step and the full HF tensors after it (the export and the push read
them), as JSON.

    cp_worker.py HF_DIR OUT.json TP,PP,CP,PACKED[,MICRO_BATCH_TOKENS[,VPP]] ...

Each DP rank takes samples i with i % dp == dp_rank, so every layout trains the same step."""
import json
import random
import sys

import torch
import torch.distributed as dist

from megarl.common import compat
from megarl.config import load_config
from megarl.trainer import parallel
from megarl.trainer.batch import TensorBatch, per_sample
from megarl.trainer.engine import Engine, EngineSpec
from megarl.trainer.sft import sft_loss


def make_batch(n=8, vocab=128, seed=0):
    """Rows of 5-70 tokens: lengths not multiples of 2 x cp, one row longer than the rest."""
    rng = random.Random(seed)
    ids, mask = [], []
    for i in range(n):
        length = 70 if i == 3 else rng.randint(5, 30)
        prompt = rng.randint(2, length - 2)
        ids.append([rng.randrange(vocab) for _ in range(length)])
        mask.append([0.0] * prompt + [1.0] * (length - prompt))
    return TensorBatch.from_lists(ids, {"loss_mask": mask})


def run_layout(hf_dir, tp, pp, cp, packed, mbt, batch, vpp=0):
    cfg = load_config(None, [f"model.hf_path={hf_dir}", "data.train_path=x", f"parallel.tp={tp}",
                             f"parallel.pp={pp}", f"parallel.cp={cp}", *([f"parallel.vpp={vpp}"] if vpp else []),
                             f"train.micro_batch_tokens={mbt}",
                             f"train.pack_sequences={str(packed).lower()}", "optim.lr=0.01",
                             # a first Adam step maps g to ~lr * sign(g): near g = 0 it turns float
                             # rounding of the gradient into 1e-5 parameter differences (DP=2 vs DP=1
                             # show them too); eps 1e-3 keeps the map smooth, so parameters compare
                             "optim.adam_eps=1e-3"])
    ps = parallel.init_model_parallel(tp, pp, vpp or None, seed=1234, cp=cp)
    engine = Engine.build(EngineSpec.from_config(cfg), ps)
    mine = [i for i in range(len(batch)) if i % ps.dp == ps.dp_rank]
    local = batch.select(mine)
    first = engine.compute_logp(local, with_entropy=True)
    metrics = engine.train_batch(local, sft_loss)
    after = per_sample(engine.compute_logp(local).logp, local.lengths)
    tensors = {name: t.tolist() for name, t in engine.named_hf_tensors()}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {
        "samples": {i: (lp.tolist(), en.tolist(), af.tolist()) for i, lp, en, af in zip(
            mine, per_sample(first.logp, local.lengths), per_sample(first.entropy, local.lengths), after)},
        "tensors": tensors})
    merged, weights = {}, {}
    for r in rows:
        merged.update(r["samples"])
        weights.update(r["tensors"])
    parallel.destroy_model_parallel_only()
    return {"logp": [merged[i][0] for i in range(len(batch))],
            "entropy": [merged[i][1] for i in range(len(batch))],
            "logp_after": [merged[i][2] for i in range(len(batch))],
            "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "tokens": metrics["tokens"],
            "weights": weights}


def main():
    compat.quiet_megatron_warnings()
    torch.set_num_threads(1)
    parallel.init_distributed()
    hf_dir, out, *layouts = sys.argv[1:]
    with open(f"{hf_dir}/config.json") as f:
        batch = make_batch(vocab=json.load(f)["vocab_size"])
    results = {}
    for spec in layouts:
        tp, pp, cp, packed, *rest = (int(x) for x in spec.split(","))
        results[spec] = run_layout(hf_dir, tp, pp, cp, bool(packed), rest[0] if rest else 4096, batch, rest[1] if len(rest) > 1 else 0)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
