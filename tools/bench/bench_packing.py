"""Benchmark: the trainer's update padded vs packed (train.pack_sequences) on long-tailed RL lengths.

    python tools/bench/bench_packing.py [--model demo|medium] [--samples 256] [--cap 256]
        [--micro-batch-tokens 4096] [--iters 5] [--out docs/benchmarks.md]

The step: --samples sequences of a prompt (8-13 tokens, the demo's) and a response whose length
follows the long tail of tools/bench/bench_async.py (P(len > x) = 4 / x on [4, --cap]: most answers
short, a few at the cap). One engine per mode (real megatron-core, TP=1, same weights), in this
process, alternating: compute_logp (the proximal-logprob recompute) and train_batch (forward +
backward + Adam), median of --iters. Reported per mode: the padded-token share of the
micro-batches (positions the model computes that are padding), micro-batch count, and the times;
then packed / padded.

Models: demo = examples/tiny/model (4 layers, hidden 128, vocab 16); medium = a random Llama with
hidden 512, 8 layers, vocab 8192 (tools/bench/bench_engine.py's), where the matmuls dominate.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from in_process import one_rank_world, timed  # noqa: E402


def long_tailed_lengths(n: int, cap: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompts 8-13 tokens, responses P(len > x) = 4 / x on [4, cap]."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g)
    responses = torch.clamp((4.0 / u).floor(), 4, cap).long().tolist()
    prompts = torch.randint(8, 14, (n,), generator=g).tolist()
    return list(zip(prompts, responses))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("demo", "medium"), default="demo")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--cap", type=int, default=256)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"))
    args = ap.parse_args()

    one_rank_world()
    from megarl.common import compat
    from megarl.config import load_config
    from megarl.models.random_hf import tiny_config, write_random_hf
    from megarl.protocol.hf_model import read_model_args
    from megarl.trainer import parallel
    from megarl.trainer.batch import TensorBatch
    from megarl.trainer.engine import Engine, EngineSpec
    from megarl.trainer.sft import sft_loss

    compat.quiet_megatron_warnings()
    if args.model == "demo":
        hf = os.path.join(REPO, "examples", "tiny", "model")
    else:
        hf = write_random_hf(tempfile.mkdtemp(prefix="bench_packing_"), tiny_config(
            hidden_size=512, num_hidden_layers=8, vocab_size=8192, intermediate_size=512 * 11 // 4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=args.cap + 16))
    vocab = read_model_args(hf).vocab_size
    lengths = long_tailed_lengths(args.samples, args.cap)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, vocab, (p + r,), generator=g).tolist() for p, r in lengths]
    masks = [[0.0] * p + [1.0] * r for p, r in lengths]
    batch = TensorBatch.from_lists(ids, {"loss_mask": masks})
    real = int(batch.lengths.sum())

    parallel.init_distributed()
    ps = parallel.init_model_parallel(1, 1)
    results = {}
    for packed in (False, True):
        cfg = load_config(None, [f"model.hf_path={hf}", "data.train_path=x", "optim.lr=1e-6",
                                 f"train.micro_batch_tokens={args.micro_batch_tokens}",
                                 f"train.max_seq_len={args.cap + 16}", f"train.pack_sequences={str(packed).lower()}"])
        engine = Engine.build(EngineSpec.from_config(cfg), ps)
        mbs = engine._microbatches(batch)
        computed = real if packed else sum(m.tokens.numel() for m in mbs)
        results[packed] = {"mbs": len(mbs), "computed": computed,
                           "logp": timed(lambda: engine.compute_logp(batch), args.iters),
                           "train": timed(lambda: engine.train_batch(batch, sft_loss), args.iters)}
        print(f"packed={packed}: {results[packed]}", flush=True)
    pad, pk = results[False], results[True]
    resp = [r for _, r in lengths]
    desc = (f"{args.model} model, {args.samples} samples, {real:,} real tokens (responses mean "
            f"{statistics.mean(resp):.0f}, p50 {statistics.median(resp):.0f}, max {max(resp)}), "
            f"micro_batch_tokens {args.micro_batch_tokens}, {torch.get_num_threads()} threads")
    rows = [f"| {desc} | padded | {pad['mbs']} | {1 - real / pad['computed']:.0%} | {pad['logp']:.3f} s "
            f"| {pad['train']:.3f} s |",
            f"| | packed | {pk['mbs']} | 0% | {pk['logp']:.3f} s ({pad['logp'] / pk['logp']:.2f}x faster) "
            f"| {pk['train']:.3f} s ({pad['train'] / pk['train']:.2f}x faster) |"]
    print("\n".join(rows))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(rows) + "\n")
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
