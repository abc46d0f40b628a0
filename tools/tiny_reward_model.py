"""A tiny reward model for the addition demo: an HF ``LlamaForSequenceClassification`` (one score)
trained to tell a correct sum from a wrong one, for `megarl.rewards.model:RewardModel`.

    python tools/make_tiny_model.py --out examples/tiny --reward-model      (or this file directly:)
    python tools/tiny_reward_model.py --out examples/tiny/reward_model [--tokenizer examples/tiny/hf]

The scored text is the policy's prompt and completion, as RewardModel sends it by default
(``"{prompt}{completion}"``, BOS first): ``"12+34=46"``. Positives are the true sums of training
pairs (never a pair of the held-out eval set, `AdditionTask.training_pairs`); negatives are the
mistakes a policy makes: the sum off by 1, 2, 10 or 100, one digit changed, a digit dropped or
added, the operands' concatenation, a random number, an empty or non-numeric answer. The loss is
binary cross-entropy on the score logit; positives and negatives are balanced per batch.

Held-out accuracy (score > 0 is "correct") and AUC are measured on the eval prompts with the same
kinds of negatives and written to ``OUT/rm_eval.json``. Everything is seeded and runs on one
thread, so a re-run writes the same weights (same torch build).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megarl.common.tokenizer import load_tokenizer  # noqa: E402
from megarl.data.tasks import AdditionTask  # noqa: E402

_RM_STREAM = 3  # AdditionTask's random stream for reward-model pairs (0 eval, 1 SFT, 2 RL)


# kinds of wrong answers (`wrong_answers`) and how often each is drawn: near misses (the units
# digit off, one digit changed) are the policy's usual mistakes and the hardest to see, so most
# negatives are those
KINDS = ("units", "tens", "digit", "length", "random", "operands", "junk", "suffix")
KIND_WEIGHTS = (4, 1, 4, 1, 1, 1, 1, 1)


def wrong_answers(a: int, b: int, rng: random.Random, kind: str = "") -> str:
    """One wrong completion of ``a+b=``: of ``kind``, else of a kind drawn by `KIND_WEIGHTS`."""
    s = a + b
    text = str(s)
    while True:
        k = KINDS.index(kind) if kind else rng.choices(range(len(KINDS)), KIND_WEIGHTS)[0]
        if k == 0:
            out = str(s + rng.choice([-2, -1, 1, 2]))
        elif k == 1:
            out = str(s + rng.choice([-100, -10, 10, 100]))
        elif k == 2:  # one digit changed
            i = rng.randrange(len(text))
            out = text[:i] + rng.choice([d for d in "0123456789" if d != text[i]]) + text[i + 1:]
        elif k == 3:  # a digit dropped or added
            i = rng.randrange(len(text) + 1)
            out = text[:i] + text[i + 1:] if rng.random() < 0.5 else text[:i] + rng.choice("0123456789") + text[i:]
        elif k == 4:
            out = str(rng.randrange(0, 2 * (a + b) + 10))
        elif k == 5:  # the operands, not their sum
            out = rng.choice([f"{a}{b}", str(a), str(b), str(abs(a - b))])
        elif k == 6:  # junk of the task's characters
            out = "".join(rng.choice("0123456789+=") for _ in range(rng.randrange(0, 6)))
        else:  # the right sum followed by more
            out = text + "".join(rng.choice("0123456789+=") for _ in range(rng.randrange(1, 3)))
        if out != text:
            return out


def labelled_pairs(pairs, rng: random.Random, kind: str = "") -> list[tuple[str, int]]:
    """(text, label) for each pair: the true sum (1) and one wrong answer (0)."""
    out = []
    for a, b in pairs:
        prompt = AdditionTask.prompt(a, b)
        out.append((prompt + AdditionTask.answer(a, b), 1))
        out.append((prompt + wrong_answers(a, b, rng, kind), 0))
    return out


def rm_config(vocab: int, hidden: int, layers: int, pad: int, max_pos: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=max_pos,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, num_labels=1, pad_token_id=pad,
        bos_token_id=1, eos_token_id=2, architectures=["LlamaForSequenceClassification"], torch_dtype="float32")


def batch(rows, tok, pad: int):
    import torch

    ids = [tok.encode(t, add_bos=True) for t, _ in rows]
    n = max(map(len, ids))
    x = torch.tensor([s + [pad] * (n - len(s)) for s in ids])
    return x, torch.tensor([float(y) for _, y in rows])


def scores(model, rows, tok, pad: int, chunk: int = 512) -> list[float]:
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(rows), chunk):
            x, _ = batch(rows[i:i + chunk], tok, pad)
            out += model(x).logits[:, 0].tolist()
    return out


def auc(pos: list[float], neg: list[float]) -> float:
    """P(score of a positive > score of a negative), ties counting half (Mann-Whitney)."""
    ranked = sorted([(s, 1) for s in pos] + [(s, 0) for s in neg])
    rank_sum, i = 0.0, 0
    while i < len(ranked):
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        mean_rank = (i + j + 1) / 2  # 1-based ranks i+1 .. j
        rank_sum += mean_rank * sum(y for _, y in ranked[i:j])
        i = j
    n_pos, n_neg = len(pos), len(neg)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def evaluate(model, rows, tok, pad: int) -> dict:
    s = scores(model, rows, tok, pad)
    pos = [v for v, (_, y) in zip(s, rows) if y]
    neg = [v for v, (_, y) in zip(s, rows) if not y]
    acc = sum((v > 0) == bool(y) for v, (_, y) in zip(s, rows)) / len(rows)
    return {"accuracy": acc, "auc": auc(pos, neg), "n": len(rows),
            "mean_score_correct": sum(pos) / len(pos), "mean_score_wrong": sum(neg) / len(neg)}


def train_reward_model(out: str, tokenizer_dir: str, digits: int = 2, seed: int = 0, n_pairs: int = 8000,
                       n_eval: int = 500, steps: int = 2000, batch_size: int = 128, lr: float = 1e-3,
                       hidden: int = 64, layers: int = 2) -> dict:
    """Trains and saves the model (HF dir: config.json, model.safetensors, tokenizer.model) to
    ``out``; returns its held-out metrics (also in ``out/rm_eval.json``)."""
    import torch
    import transformers

    t0 = time.monotonic()
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    tok = load_tokenizer(tokenizer_dir)
    pad = 2  # </s>: never inside a scored text (completions are decoded without it)
    task = AdditionTask(digits, seed)
    rng = random.Random(seed * 7919 + _RM_STREAM)
    train = labelled_pairs(task.training_pairs(n_pairs, n_eval, _RM_STREAM), rng)
    held = labelled_pairs(task.held_out(n_eval), random.Random(seed * 7919 + _RM_STREAM + 1))
    vocab = -(-tok.vocab_size // 16) * 16
    model = transformers.LlamaForSequenceClassification(rm_config(vocab, hidden, layers, pad, 64)).float()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    # warm-up: 5% of the steps (at least 2: a one-step phase divides by zero in OneCycleLR)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=max(0.05, 2.0 / steps))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    pos = [r for r in train if r[1]]
    neg = [r for r in train if not r[1]]
    model.train()
    for step in range(steps):
        rows = rng.sample(pos, batch_size // 2) + rng.sample(neg, batch_size // 2)
        x, y = batch(rows, tok, pad)
        loss = loss_fn(model(x).logits[:, 0], y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == steps - 1:
            print(f"[tiny_reward_model] step {step} loss {loss.item():.4f} ({time.monotonic() - t0:.0f}s)", flush=True)
    model.eval()
    metrics = {**evaluate(model, held, tok, pad), "train_accuracy": evaluate(model, train[:2000], tok, pad)["accuracy"],
               "steps": steps, "seed": seed, "train_s": round(time.monotonic() - t0, 1)}
    for i, kind in enumerate(KINDS):  # held-out accuracy against each kind of wrong answer
        rows = labelled_pairs(task.held_out(n_eval), random.Random(seed * 7919 + 100 + i), kind)
        metrics[f"auc_{kind}"] = evaluate(model, rows, tok, pad)["auc"]
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    shutil.copy(os.path.join(tokenizer_dir, "tokenizer.model"), os.path.join(out, "tokenizer.model"))
    with open(os.path.join(out, "rm_eval.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    return metrics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the reward model's HF directory (replaced)")
    ap.add_argument("--tokenizer", default=os.path.join(REPO, "examples", "tiny", "hf"),
                    help="dir with the demo's tokenizer.model")
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-eval", type=int, default=500, help="held-out pairs (the demo's eval prompts)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (one-cycle schedule)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    m = train_reward_model(args.out, args.tokenizer, args.digits, args.seed, n_eval=args.n_eval, steps=args.steps,
                           lr=args.lr, hidden=args.hidden, layers=args.layers)
    print(f"[tiny_reward_model] {args.out}: held-out accuracy {m['accuracy']:.3f}, AUC {m['auc']:.4f} "
          f"on {m['n']} texts ({m['train_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
