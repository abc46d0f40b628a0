"""torchrun worker: HF checkpoint -> Megatron (given TP/PP) -> HF for each tiny architecture, in
two shapes: the default tiny config and an "odd" one (vocab 333, padded to 512 rows at TP=2;
3 layers, so PP=2 splits them unevenly). Rank 0 writes {"<arch>/<shape>": {"equal": bool,
"files": [...], "mismatch": [...], "rows": Megatron embedding rows, "layers": [...]}} as JSON."""
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megarl.common import compat
from megarl.trainer import parallel
from megarl.models import builder, hf_io
from megarl.models.layouts import pad_vocab
from megarl.models.random_hf import tiny_config, write_random_hf
from megarl.protocol.hf_model import read_model_args


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
    shapes = {"base": {}, "odd": {"vocab_size": 333, "num_hidden_layers": 3}}
    for i, arch in enumerate(["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]):
        for shape, overrides in shapes.items():
            results[f"{arch}/{shape}"] = roundtrip(work, arch, shape, tiny_config(arch, **overrides), i,
                                                   ps, shard_bytes)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def roundtrip(work, arch, shape, config, seed, ps, shard_bytes):
    src, dst = os.path.join(work, arch, shape, "hf"), os.path.join(work, arch, shape, "export")
    if dist.get_rank() == 0:
        write_random_hf(src, config, seed=seed)
    dist.barrier()
    args = pad_vocab(read_model_args(src), 128, ps.tp)
    chunks = builder.build_model_chunks(args, builder.transformer_config(args, tp=ps.tp, pp=ps.pp), False)
    hf_io.load_hf_weights(chunks, args, src, ps.tp, ps.tp_rank)
    hf_io.export_hf(chunks, args, ps, dst, src_hf_dir=src, max_shard_bytes=shard_bytes)
    layers = [None] * dist.get_world_size()
    dist.all_gather_object(layers, [l.layer_number - 1 for l in chunks[0].decoder.layers])
    result = None
    if dist.get_rank() == 0:
        a, b = load_all(src), load_all(dst)
        bad = sorted(k for k in a if k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))
        result = {"equal": not bad and set(a) == set(b), "mismatch": bad,
                  "extra": sorted(set(b) - set(a)), "files": sorted(os.listdir(dst)),
                  "config_equal": json.load(open(os.path.join(src, "config.json")))
                  == json.load(open(os.path.join(dst, "config.json"))),
                  "rows": ps.tp * chunks[0].embedding.word_embeddings.weight.shape[0], "layers": layers}
    dist.barrier()
    return result


if __name__ == "__main__":
    main()
