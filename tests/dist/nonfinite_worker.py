"""torchrun worker: a NaN loss must skip the optimizer step on every rank (weights bitwise
unchanged, LR schedule not advanced), and the next finite step must update as usual."""
import json
import sys

import torch
import torch.distributed as dist

from megarl.common import compat
from megarl.trainer import parallel
from megarl.config import load_config
from megarl.trainer.engine import Engine, EngineSpec
from megarl.trainer.sft import sft_loss
from layouts_worker import make_batch


def nan_loss(logp, entropy, mb):
    loss, stats = sft_loss(logp, entropy, mb)
    return loss * float("nan"), stats


def snapshot(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for c in engine.chunks for p in c.parameters()]


def main():
    hf_dir, tp, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    compat.quiet_megatron_warnings()
    parallel.init_distributed()
    cfg = load_config(None, [f"model.hf_path={hf_dir}", "data.train_path=x", f"parallel.tp={tp}",
                             "optim.lr=0.01"])
    ps = parallel.init_model_parallel(tp, 1, seed=1234)
    engine = Engine.build(EngineSpec.from_config(cfg), ps)
    batch = make_batch()
    before = snapshot(engine)
    bad = engine.train_batch(batch, nan_loss)
    same = all(torch.equal(a, b) for a, b in zip(before, snapshot(engine)))
    step_after_bad, sched_after_bad = engine.step, engine.scheduler.num_steps
    good = engine.train_batch(batch, sft_loss)
    changed = any(not torch.equal(a, b) for a, b in zip(before, snapshot(engine)))
    finite = all(torch.isfinite(p).all() for p in snapshot(engine))
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"bad_ok": bad["update_ok"], "bad_norm": bad["grad_norm"],
                                  "unchanged": same, "step_after_bad": step_after_bad,
                                  "sched_after_bad": sched_after_bad, "good_ok": good["update_ok"],
                                  "changed": changed, "finite": finite, "step": engine.step})
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    parallel.destroy()


if __name__ == "__main__":
    main()
