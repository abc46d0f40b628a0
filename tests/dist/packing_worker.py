"""torchrun worker for tests/dist/test_packed_sequences.py: one engine (real megatron-core over
gloo) at the layout given runs the same batch padded and packed (train.pack_sequences): per-token
logprobs, entropies and one optimizer step from the same weights, compared in one process."""
import json
import sys

import torch
import torch.distributed as dist

from megarl.common import compat
from megarl.config import load_config
from megarl.trainer import parallel
from megarl.trainer.batch import TensorBatch
from megarl.trainer.engine import Engine, EngineSpec
from megarl.trainer.sft import sft_loss


def long_tailed_batch(n=12, vocab=128, seed=0):
    """Mostly short rows and a few long ones: padding is most of a padded micro-batch."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = [], []
    for i in range(n):
        length = 40 if i % 5 == 0 else int(torch.randint(3, 12, (1,), generator=g))
        ids.append(torch.randint(0, vocab, (length,), generator=g).tolist())
        prompt = max(1, length // 3)
        mask.append([0.0] * prompt + [1.0] * (length - prompt))
    return TensorBatch.from_lists(ids, {"loss_mask": mask})


def main():
    hf_dir, tp, pp, sp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
    compat.quiet_megatron_warnings()
    parallel.init_distributed()
    over = [f"model.hf_path={hf_dir}", "data.train_path=x", f"parallel.tp={tp}", f"parallel.pp={pp}",
            f"parallel.sequence_parallel={str(sp).lower()}", "train.micro_batch_tokens=96", "optim.lr=0.01"]
    ps = parallel.init_model_parallel(tp, pp, seed=1234)
    engines = {}
    for packed in (False, True):
        cfg = load_config(None, over + [f"train.pack_sequences={str(packed).lower()}"])
        engines[packed] = Engine.build(EngineSpec.from_config(cfg), ps)
    batch = long_tailed_batch()
    res = {}
    for packed, engine in engines.items():
        first = engine.compute_logp(batch, with_entropy=True)
        metrics = engine.train_batch(batch, sft_loss)
        after = engine.compute_logp(batch).logp
        mbs = engine._microbatches(batch)
        res[packed] = {"logp": first.logp, "entropy": first.entropy, "after": after,
                       "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "microbatches": len(mbs)}
    valid = torch.arange(batch.seq_len)[None] < batch.lengths[:, None]
    pad, pk = res[False], res[True]
    row = {"logp_diff": (pad["logp"] - pk["logp"]).abs().max().item(),
           "entropy_diff": (pad["entropy"] - pk["entropy"]).abs().max().item(),
           "after_diff": (pad["after"] - pk["after"]).abs().max().item(),
           "moved": (pad["after"] - pad["logp"]).abs().max().item(),
           "loss": [pad["loss"], pk["loss"]], "grad_norm": [pad["grad_norm"], pk["grad_norm"]],
           "microbatches": [pad["microbatches"], pk["microbatches"]],
           "zeros_outside": bool((pk["logp"][~valid] == 0).all() and (pk["logp"][:, 0] == 0).all()),
           "real_tokens": int(batch.lengths.sum()), "padded_tokens": int(len(batch) * batch.seq_len)}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
