"""torchrun worker (1 rank) for test_moe_losses.py: one training step of a tiny Qwen3-MoE per
setting "aux,z" (moe.aux_loss_coeff, moe.z_loss_coeff), each from the same weights and batch,
several token-budget micro-batches. Saves to OUT (torch.save) per setting: the step metrics, every
router's input hidden states and padding mask per micro-batch (forward hooks), the router weights
before the step and the last layer's router gradient (DDP main_grad, no clipping)."""
import sys

import torch

from megarl.common import compat
from megarl.trainer import parallel
from megarl.config import load_config
from megarl.trainer.engine import Engine, EngineSpec
from megarl.trainer.sft import sft_loss

from layouts_worker import make_batch


def run(hf_dir: str, aux: float, z: float, batch) -> dict:
    cfg = load_config(None, [f"model.hf_path={hf_dir}", "data.train_path=x", "train.micro_batch_tokens=64",
                             "optim.lr=0.01", "optim.clip_grad=0", f"moe.aux_loss_coeff={aux}",
                             f"moe.z_loss_coeff={z}"])
    ps = parallel.init_model_parallel(1, 1, seed=1234)
    engine = Engine.build(EngineSpec.from_config(cfg), ps)
    layers = engine.chunks[0].module.decoder.layers
    captured = {i: [] for i in range(len(layers))}

    def hook(i):
        def save(module, args, kwargs, out):
            x = args[0]
            pad = args[1] if len(args) > 1 else kwargs.get("padding_mask")
            captured[i].append((x.detach().clone(), None if pad is None else pad.detach().clone()))
        return save

    handles = [layer.mlp.router.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    weights = [layer.mlp.router.weight.detach().clone() for layer in layers]
    metrics = engine.train_batch(batch, sft_loss)
    for h in handles:
        h.remove()
    grad = layers[-1].mlp.router.weight.main_grad.detach().clone()
    parallel.destroy_model_parallel_only()
    return {"metrics": metrics, "inputs": captured, "weights": weights, "last_router_grad": grad,
            "loss_mask": batch["loss_mask"].clone(), "lengths": batch.lengths.clone()}


def main():
    hf_dir, out, *settings = sys.argv[1:]
    compat.quiet_megatron_warnings()
    torch.set_num_threads(1)
    parallel.init_distributed()
    batch = make_batch(n=8, vocab=128, seed=3)
    results = {}
    for spec in settings:
        aux, z = (float(v) for v in spec.split(","))
        results[spec] = run(hf_dir, aux, z, batch)
    torch.save(results, out)
    parallel.destroy()


if __name__ == "__main__":
    main()
