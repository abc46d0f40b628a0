"""Benchmark: the RL update of the demo step in megarl's engine vs the same math in plain PyTorch.

    python tools/bench/bench_update_math.py [--samples 256] [--iters 10] [--threads 1] [--out FILE]

The step is the demo recipe's (configs/tiny_grpo.yaml): 32 prompts x 8 samples of 2-digit
addition from examples/tiny/data/rl_prompts.jsonl, answers of 1-8 tokens, one micro-batch, one
optimizer step, decoupled PPO with the loglinear proximal policy at its only optimizer step
(pi_prox = pi_theta, so the ratio to the behaviour policy is clipped at 0.2/0.28), token-mean over
the step, grad clip 1.0, AdamW lr 2e-4. The same tokens, advantages and behaviour logprobs go to:

- plain PyTorch: transformers' LlamaForCausalLM (sdpa attention, fp32) on the padded batch,
  log_softmax + gather, the clipped surrogate, backward, clip_grad_norm_, torch.optim.AdamW;
- megarl: `Engine.train_batch` (real megatron-core at TP=1, Megatron's optimizer and clipping)
  with the same loss written against its micro-batch.

Both in this process, one after the other per iteration, on --threads torch threads; median
seconds per update. Reported: both times, their ratio (plain / megarl: >= 0.9x is issue #29's
target), and CPU ms per trained sample. The RL loop's `time/update` adds the advantages and the
hand-off to this (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from in_process import one_rank_world, timed  # noqa: E402
MODEL = os.path.join(REPO, "examples", "tiny", "model")
EPS_LOW, EPS_HIGH, LR, CLIP = 0.2, 0.28, 2e-4, 1.0


def demo_step(samples: int, seed: int = 0):
    """(ids [B, S], lengths [B], loss_mask, advantages, behave_logp), the demo's shape."""
    from megarl.common.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL)
    g = torch.Generator().manual_seed(seed)
    rows = [json.loads(line) for line in open(os.path.join(REPO, "examples", "tiny", "data", "rl_prompts.jsonl"))]
    ids, masks = [], []
    for i in range(samples):
        prompt = tok.encode(rows[(i // 8) % len(rows)]["prompt"], add_bos=True)
        answer = torch.randint(3, tok.vocab_size, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        ids.append(list(prompt) + answer.tolist())
        masks.append([0.0] * len(prompt) + [1.0] * len(answer))
    s = max(map(len, ids))
    lengths = torch.tensor([len(r) for r in ids])
    tokens = torch.zeros(samples, s, dtype=torch.long)
    mask = torch.zeros(samples, s)
    for i, (r, m) in enumerate(zip(ids, masks)):
        tokens[i, :len(r)] = torch.tensor(r)
        mask[i, :len(m)] = torch.tensor(m)
    adv = (torch.randn(samples, 1, generator=g) * mask)
    behave = (-torch.rand(samples, s, generator=g) * 2) * mask
    return tokens, lengths, mask, adv.expand(samples, s) * mask, behave


def clipped_surrogate(logp, behave, adv, mask, step_tokens):
    ratio = torch.exp(logp - behave)
    clipped = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    return (per_token * mask).sum() / step_tokens




def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    one_rank_world()
    import transformers

    from megarl.common import compat
    from megarl.config import load_config
    from megarl.trainer import parallel
    from megarl.trainer.batch import TensorBatch
    from megarl.trainer.engine import Engine, EngineSpec

    compat.quiet_megatron_warnings()
    tokens, lengths, mask, adv, behave = demo_step(args.samples)
    step_tokens = float(mask.sum())

    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="sdpa",
                                                              dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    attention = (torch.arange(tokens.shape[1])[None] < lengths[:, None]).long()

    def plain():
        opt.zero_grad()
        logits = model(tokens, attention_mask=attention).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        loss = clipped_surrogate(logp, behave[:, 1:], adv[:, 1:], mask[:, 1:], step_tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()

    parallel.init_distributed()
    cfg = load_config(None, [f"model.hf_path={MODEL}", "data.train_path=x", f"optim.lr={LR}",
                             f"optim.clip_grad={CLIP}", "optim.weight_decay=0.0", "train.micro_batch_tokens=4096",
                             f"train.torch_threads={args.threads}"])
    ps = parallel.init_model_parallel(1, 1)
    engine = Engine.build(EngineSpec.from_config(cfg), ps)
    batch = TensorBatch(tokens, lengths, {"loss_mask": mask, "advantages": adv, "behave_logp": behave})

    def loss_fn(logp, entropy, mb):
        return clipped_surrogate(logp, mb["behave_logp"], mb["advantages"], mb["loss_mask"], mb.step_tokens), {}

    def megarl():
        engine.train_batch(batch, loss_fn)

    t_plain, t_megarl = [], []
    for _ in range(3):  # alternate, so drift in the machine's load hits both
        t_plain.append(timed(plain, args.iters))
        t_megarl.append(timed(megarl, args.iters))
    p, m = statistics.median(t_plain), statistics.median(t_megarl)
    row = (f"| demo step: {args.samples} samples, {int(lengths.sum()):,} tokens ({tokens.numel():,} padded), "
           f"{args.threads} thread(s) | {1e3 * p:.1f} ms ({1e3 * p / args.samples:.2f} ms/sample) "
           f"| {1e3 * m:.1f} ms ({1e3 * m / args.samples:.2f} ms/sample) | **{p / m:.2f}x** |")
    print(row)
    if args.out:
        with open(args.out, "a") as f:
            f.write(row + "\n")
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
