"""torchrun worker for tests/dist/test_lora_dist.py: a LoRA engine (real megatron-core over gloo)
against its frozen base and against a dense reference W + s B A, at the layout given."""
import json
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megarl.common import compat
from megarl.config import load_config
from megarl.models.layouts import hf_to_shard
from megarl.models.lora import TARGETS, _local_adapters, adapter_hf_tensors, adapter_rows
from megarl.trainer import parallel
from megarl.trainer.engine import Engine, EngineSpec
from megarl.trainer.sft import sft_loss
from layouts_worker import make_batch

RANK, ALPHA = 4, 8.0


def random_B(engine, args, tp, tp_rank):
    """Nonzero B of every adapter, drawn in HF form from one seed (the same under every layout)."""
    local = _local_adapters(engine.chunks)
    g = torch.Generator().manual_seed(7)
    for row in adapter_rows(args, engine.spec.lora.target_modules):
        mods = row.hf_modules()
        full = []
        for mod in mods:  # HF rows of each module's B
            rows = {"q_proj": args.num_heads * args.head_dim, "k_proj": args.num_kv_heads * args.head_dim,
                    "v_proj": args.num_kv_heads * args.head_dim, "o_proj": args.hidden_size,
                    "gate_proj": args.ffn_hidden_size, "up_proj": args.ffn_hidden_size,
                    "down_proj": args.hidden_size}[mod.split(".")[-1]]
            full.append(torch.randn(rows, RANK, generator=g) * 0.3)
        key = f"decoder.layers.{row.layer}.{TARGETS[row.target][0]}"
        if key not in local:
            continue  # another pipeline stage's layer
        m = local[key]
        B = hf_to_shard(row.pmap, full, args, tp, tp_rank) if row.column else full[0]
        with torch.no_grad():
            m.lora_B.copy_(B)


def dense_reference(ref, lora_engine):
    """The frozen base engine's weights += s B A (per local shard: column W_r += s B_r A, row
    W_r += s B A_r): the dense model the LoRA one must equal."""
    src = _local_adapters(lora_engine.chunks)
    dst = {}
    for chunk in ref.chunks:
        for name, module in chunk.named_modules():
            dst[name] = module
    from megarl.mcore.model import global_layer_index
    model = ref.chunks[0]
    by_global = {}
    for local_layer, layer in enumerate(model.decoder.layers):
        g = global_layer_index(model, local_layer)
        for target, (path, _) in TARGETS.items():
            by_global[f"decoder.layers.{g}.{path}"] = layer.get_submodule(path)
    with torch.no_grad():
        for key, m in src.items():
            by_global[key].weight.add_(m.lora_scaling * (m.lora_B @ m.lora_A))


def main():
    hf_dir, tp, pp, out, adapters_out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    compat.quiet_megatron_warnings()
    parallel.init_distributed()
    cfg = load_config(None, [f"model.hf_path={hf_dir}", "data.train_path=x", f"parallel.tp={tp}",
                             f"parallel.pp={pp}", "optim.lr=0.01", f"lora.rank={RANK}", f"lora.alpha={ALPHA}"])
    ps = parallel.init_model_parallel(tp, pp, seed=1234)
    spec = EngineSpec.from_config(cfg)
    lora = Engine.build(spec, ps)
    base = Engine.build(spec, ps, trainable=False)
    assert base.spec.lora is None  # a forward-only engine is the base, without adapters
    batch = make_batch()
    base_logp = base.compute_logp(batch).logp
    init_logp = lora.compute_logp(batch).logp
    random_B(lora, lora.args, ps.tp, ps.tp_rank)
    lora_logp = lora.compute_logp(batch).logp
    lora.export_hf(adapters_out + ".export")  # merged model + PEFT adapter (collective)
    after_export = lora.compute_logp(batch).logp  # the merge is undone after the export
    dense_reference(base, lora)
    dense_logp = base.compute_logp(batch).logp
    # the push/export form: HF names, q/k/v and gate/up split
    names = []
    if pp == 1:
        tensors = dict(adapter_hf_tensors(lora.chunks, lora.args, spec.lora.target_modules, ps.tp, ps.tp_group,
                                          range(lora.args.num_layers)))
        names = sorted(tensors)
        if dist.get_rank() == 0:
            save_file({k: v.contiguous() for k, v in tensors.items()}, adapters_out)
    trainable = [p for g in lora.optimizer.param_groups for p in g["params"]]
    n_adapters = sum(1 for c in lora.chunks for n, p in c.named_parameters() if n.endswith(("lora_A", "lora_B")))
    frozen_before = {n: p.detach().clone() for c in lora.chunks for n, p in c.named_parameters()
                     if not n.endswith(("lora_A", "lora_B"))}
    adapters_before = {n: p.detach().clone() for c in lora.chunks for n, p in c.named_parameters()
                       if n.endswith(("lora_A", "lora_B"))}
    m = lora.train_batch(batch, sft_loss)
    after = {n: p.detach() for c in lora.chunks for n, p in c.named_parameters()}
    base_same = all(torch.equal(v, after[n]) for n, v in frozen_before.items())
    adapters_moved = sum(not torch.equal(v, after[n]) for n, v in adapters_before.items())
    row = {"rank": dist.get_rank(), "tp_rank": ps.tp_rank, "pp_rank": ps.pp_rank,
           "init_diff": float((init_logp - base_logp).abs().max()),
           "lora_vs_base": float((lora_logp - base_logp).abs().max()),
           "lora_vs_dense": float((lora_logp - dense_logp).abs().max()),
           "export_undone": bool(torch.equal(after_export, lora_logp)),
           "logp": lora_logp.tolist(), "optimizer_params": len(trainable), "adapter_params": n_adapters,
           "base_unchanged": base_same, "adapters_moved": adapters_moved, "grad_norm": m["grad_norm"],
           "names": names}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    parallel.destroy()


if __name__ == "__main__":
    main()
