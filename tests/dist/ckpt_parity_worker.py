"""Parity driver for test_parity_convert.py: runs the megarl-convert / megarl-logprobs entry points
(their ``main``) for several models in one process, to pay the import cost once.

    torchrun -nproc 4 ckpt_parity_worker.py WORK ranks4   hf-to-mcore for the archs not converted
                                                           by the real CLI (LAYOUTS below), then
                                                           logprobs --tp 2 --pp 2 and --tp 2 (DP=2)
                                                           for every arch
    python ckpt_parity_worker.py WORK single               logprobs --tp 1, mcore-to-hf for every
                                                           arch (Qwen2 into 60 kB files + index)
Exit status: the first non-zero tool status (the test then shows the tool's stderr).
"""
import os
import sys

import torch

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
LAYOUTS = {"Qwen2ForCausalLM": ["--tp", "2", "--pp", "2"], "Qwen3ForCausalLM": ["--pp", "2"],
           "MistralForCausalLM": ["--tp", "2", "--pp", "2"]}


def main():
    from megarl.trainer import parallel
    from megarl.commands import convert, logprobs

    work, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    calls = []
    if mode == "ranks4":
        parallel.init_distributed()  # the tools join this process group and leave it up
        for arch in ARCHS:
            if not os.path.exists(f"{work}/{arch}/mcore"):
                calls.append((convert.main, ["hf-to-mcore", "--hf", f"{work}/{arch}/hf",
                                             "--out", f"{work}/{arch}/mcore", *LAYOUTS[arch]]))
        for arch in ARCHS:
            for name, layout in (("tp2pp2", ["--tp", "2", "--pp", "2"]), ("tp2", ["--tp", "2"])):
                calls.append((logprobs.main, ["--ckpt", f"{work}/{arch}/mcore", "--input",
                                              f"{work}/input.jsonl", "--output",
                                              f"{work}/{arch}/{name}.jsonl", *layout]))
    else:
        for arch in ARCHS:
            calls.append((logprobs.main, ["--ckpt", f"{work}/{arch}/mcore", "--input", f"{work}/input.jsonl",
                                          "--output", f"{work}/{arch}/tp1.jsonl", "--tp", "1",
                                          "--micro-batch-tokens", "40"]))
            shards = ["--max-shard-size", "60KB"] if arch == "Qwen2ForCausalLM" else []
            calls.append((convert.main, ["mcore-to-hf", "--ckpt", f"{work}/{arch}/mcore",
                                         "--out", f"{work}/{arch}/hf_back", *shards]))
    for fn, argv in calls:
        rc = fn(argv)
        if rc:
            print(f"FAILED ({rc}): {argv}", file=sys.stderr)
            return rc
    if mode == "ranks4":
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
