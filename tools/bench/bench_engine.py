"""Benchmark: the Megatron engine at TP=1 (compute_logp, train_batch) vs plain PyTorch on the same
model and tokens: HF transformers' LlamaForCausalLM (eager attention, fp32) with torch AdamW.

    python tools/bench/bench_engine.py [--hidden 512 --layers 8 --vocab 8192]
        [--batch 16 --seq 256] [--iters 5] [--out docs/benchmarks.md]

Both sides run in this one process, on the same CPU threads, alternately; tokens/s counts every
token of the batch. Target (DESIGN): engine >= 0.8x plain PyTorch.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from in_process import one_rank_world, timed  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"))
    args = ap.parse_args()

    one_rank_world()
    import transformers

    from megarl.common import compat
    from megarl.trainer import parallel
    from megarl.config import load_config
    from megarl.models.random_hf import tiny_config, write_random_hf
    from megarl.trainer.batch import TensorBatch
    from megarl.trainer.engine import Engine, EngineSpec
    from megarl.trainer.sft import sft_loss

    compat.quiet_megatron_warnings()
    hf = write_random_hf(tempfile.mkdtemp(prefix="bench_engine_"), tiny_config(
        hidden_size=args.hidden, num_hidden_layers=args.layers, vocab_size=args.vocab,
        intermediate_size=args.hidden * 11 // 4, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=args.seq))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    tokens = args.batch * args.seq
    batch = TensorBatch(ids, torch.full((args.batch,), args.seq),
                        {"loss_mask": torch.ones(args.batch, args.seq)})

    parallel.init_distributed()
    cfg = load_config(None, [f"model.hf_path={hf}", "data.train_path=x", "optim.lr=1e-5",
                             f"train.micro_batch_tokens={tokens}", f"train.max_seq_len={args.seq}"])
    ps = parallel.init_model_parallel(1, 1)
    engine = Engine.build(EngineSpec.from_config(cfg), ps)
    m_logp = timed(lambda: engine.compute_logp(batch), args.iters)
    m_train = timed(lambda: engine.train_batch(batch, sft_loss), args.iters)

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager",
                                                              dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)

    def hf_logp():
        with torch.no_grad():
            logits = model(ids).logits.float()
            torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])

    def hf_train():
        model.train()
        opt.zero_grad()
        logits = model(ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, args.vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    p_logp = timed(hf_logp, args.iters)
    p_train = timed(hf_train, args.iters)
    n = sum(p.numel() for p in model.parameters())
    rows = [
        f"| engine compute_logp TP=1, {n / 1e6:.1f}M params, {args.batch}x{args.seq} tokens, "
        f"{torch.get_num_threads()} threads | {tokens / m_logp:,.0f} tok/s | plain PyTorch "
        f"{tokens / p_logp:,.0f} tok/s | **{p_logp / m_logp:.2f}x** | |",
        f"| engine train_batch TP=1 (fwd+bwd+Adam), same model and tokens | {tokens / m_train:,.0f} tok/s "
        f"| plain PyTorch {tokens / p_train:,.0f} tok/s | **{p_train / m_train:.2f}x** | |",
    ]
    print("\n".join(rows))
    with open(args.out, "a") as f:
        f.write("\n".join(rows) + "\n")
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
