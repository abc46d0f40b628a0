"""Parity driver for test_parity_convert.py: runs the megarl-convert / megarl-logprobs entry points
(their ``main``) for several models in one process, to pay the import cost once.

    torchrun -nproc 2 ckpt_parity_worker.py WORK ranks2   hf-to-mcore (--tp 2, or --pp 2 for Qwen3)
                                                           for the archs not converted by the real
                                                           CLI, then logprobs --tp 2 for every arch
    python ckpt_parity_worker.py WORK single               logprobs --tp 1, mcore-to-hf for every
                                                           arch (Qwen2 into 60 kB files + index)
Exit status: the first non-zero tool status (the test then shows the tool's stderr).
"""
import os
import sys

import torch

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def main():
    from megarl import parallel
    from megarl.tools_cli import convert, logprobs

    work, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    calls = []
    if mode == "ranks2":
        parallel.init_distributed()  # the tools join this process group and leave it up
        for arch in ARCHS:
            if not os.path.exists(f"{work}/{arch}/mcore"):
                layout = ["--pp", "2"] if arch == "Qwen3ForCausalLM" else ["--tp", "2"]
                calls.append((convert.main, ["hf-to-mcore", "--hf", f"{work}/{arch}/hf",
                                             "--out", f"{work}/{arch}/mcore", *layout]))
        for arch in ARCHS:
            calls.append((logprobs.main, ["--ckpt", f"{work}/{arch}/mcore", "--input", f"{work}/input.jsonl",
                                          "--output", f"{work}/{arch}/tp2.jsonl", "--tp", "2"]))
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
    if mode == "ranks2":
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
