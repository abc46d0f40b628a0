"""torchrun worker: HF checkpoint -> Megatron (given TP/PP) -> HF for each tiny architecture.
Rank 0 writes {arch: {"equal": bool, "files": [...], "mismatch": [...]}} as JSON."""
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megarl import compat, parallel
from megarl.models import builder, hf_io
from megarl.models.random_hf import tiny_config, write_random_hf
from megarl.models.registry import read_model_args


def load_all(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def main():
    work, out, tp, pp, shard_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    compat.quiet_megatron_warnings()
    torch.set_num_threads(1)
    parallel.init_distributed()
    ps = parallel.init_model_parallel(tp, pp)
    results = {}
    for i, arch in enumerate(["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]):
        src, dst = os.path.join(work, arch, "hf"), os.path.join(work, arch, "export")
        if dist.get_rank() == 0:
            write_random_hf(src, tiny_config(arch), seed=i)
        dist.barrier()
        args = read_model_args(src)
        chunks = builder.build_model_chunks(args, builder.transformer_config(args, tp=tp, pp=pp), False)
        hf_io.load_hf_weights(chunks, args, src, ps.tp, ps.tp_rank)
        hf_io.export_hf(chunks, args, ps, dst, src_hf_dir=src, max_shard_bytes=shard_bytes)
        if dist.get_rank() == 0:
            a, b = load_all(src), load_all(dst)
            bad = sorted(k for k in a if k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))
            results[arch] = {"equal": not bad and set(a) == set(b), "mismatch": bad,
                             "extra": sorted(set(b) - set(a)), "files": sorted(os.listdir(dst)),
                             "config_equal": json.load(open(os.path.join(src, "config.json")))
                             == json.load(open(os.path.join(dst, "config.json")))}
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
