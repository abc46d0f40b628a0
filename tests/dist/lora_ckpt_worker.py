"""torchrun worker (2 ranks, TP=2) for test_lora_dist.py's checkpoint test: LoRA SFT saves at step 2
and trains on to step 4 (reference); a fresh engine then resumes from the step-2 checkpoint and
trains steps 3-4 again. Adapters and their Adam state come back, so both runs must agree bitwise."""
import json
import sys

import torch
import torch.distributed as dist

from megarl.checkpoint import CheckpointManager
from megarl.common import compat
from megarl.config import load_config
from megarl.trainer import parallel
from megarl.trainer.engine import Engine, EngineSpec
from megarl.trainer.sft import SFTData, sft_loss


def run(cfg, resume: bool):
    ps = parallel.init_model_parallel(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.model.seed)
    engine = Engine.build(EngineSpec.from_config(cfg), ps)
    data = SFTData(cfg, ps)
    ckpt = CheckpointManager(cfg, ps, engine)
    ckpt.register("data", data)
    start = ckpt.resume() if resume else 0
    adapters_at_start = {n: p.detach().clone() for n, p in engine.chunks[0].named_parameters()
                         if n.endswith(("lora_A", "lora_B"))}
    losses = {}
    for step in range(start + 1, 5):
        losses[step] = engine.train_batch(data.next_batch(), sft_loss)["loss"]
        if step == 2 and not resume:
            ckpt.save(2)
        if step == 2:
            saved = {n: p.detach().clone() for n, p in engine.chunks[0].named_parameters()
                     if n.endswith(("lora_A", "lora_B"))}
    final = {n: p.detach().clone() for n, p in engine.chunks[0].named_parameters()}
    parallel.destroy_model_parallel_only()
    return start, losses, final, adapters_at_start, saved if not resume else None


def main():
    work = sys.argv[1]
    compat.quiet_megatron_warnings()
    parallel.init_distributed()
    cfg = load_config(None, [
        f"model.hf_path={work}/hf", "model.init=random", f"data.train_path={work}/sft.jsonl", "parallel.tp=2",
        "train.steps=4", "train.global_batch_size=8", "train.micro_batch_tokens=64", "train.max_seq_len=32",
        f"train.run_dir={work}/run", "optim.lr=3e-3", f"checkpoint.save_dir={work}/ckpt",
        "lora.rank=4", "lora.alpha=8", "lora.dropout=0.1"])
    _, ref_losses, ref_final, _, saved = run(cfg, resume=False)
    start, losses, final, restored, _ = run(cfg, resume=True)
    row = {"rank": dist.get_rank(), "start": start,
           "ref_losses": ref_losses, "losses": losses,
           "restored_equal": all(torch.equal(restored[n], saved[n]) for n in saved),
           "restored_nonzero_B": all(bool(saved[n].abs().sum() > 0) for n in saved if n.endswith("lora_B")),
           "final_equal": all(torch.equal(final[n], ref_final[n]) for n in ref_final),
           "n_adapters": len(saved)}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(f"{work}/out.json", "w") as f:
            json.dump(rows, f)
    parallel.destroy()


if __name__ == "__main__":
    main()
