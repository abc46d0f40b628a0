"""megarl vs TRL's GRPOTrainer on heavy-tailed answer lengths: trained response tokens per second
and wall time to held-out accuracy, same task, model, tokenizer, hyperparameters and machine.

    pip install -e ".[bench]"        # trl + transformers + datasets (optional benchmark deps)
    python tools/bench/bench_tail_vs_trl.py [--budget-s 180] [--out runs/bench_tail]

The task (written by this script under OUT/assets, seeded): count down. A prompt ``N:K=`` (N a
3-digit number) asks for the K numbers from N down, comma-separated: ``537:3=`` -> ``537,536,535``.
K follows a heavy tail, P(K >= k) = 2 / (k + 1) on [1, 32], so answers are 4 to 128 tokens with EOS
(a third of them 4 tokens, one in 17 the longest); the reward is exact match
(megarl.rewards:arith_exact_match: the completion's first word is the answer).

The model: a char-level Llama (vocabulary 16: digits, ':' ',' '=' and BOS/EOS/UNK; hidden 256, 4
layers, 4 heads, MLP 704; 3.22M parameters), random, then warm-started by supervised training on
the task (transformers, this process) until greedy held-out accuracy reaches --warm-target (0.46)
and saved (HF safetensors + tokenizer.json). Both sides start from those weights:

    TRL     GRPOTrainer in a child process (--trl-threads torch threads), synchronous on-policy,
            generation with transformers `generate`.
    megarl  `megarl-train` with a recipe this script writes (OUT/tail_grpo.yaml), asynchronous
            (rollout.max_staleness 1), its defaults otherwise (packed sequences: auto).

GRPO on both: 8 prompts x 8 samples per step, lr 1e-4 (constant), no KL, clip 0.2 / 0.28, token-mean
loss, group-normalised advantages, temperature 1, 132 new tokens at most. Every --eval-every steps
each side measures greedy accuracy on the 200 held-out prompts; evaluation time is excluded from
both clocks. Each side trains --budget-s seconds. Reported: median step, trained response tokens/s
(the sampled completions' tokens, EOS included, over training seconds), accuracy curve, seconds to
each threshold both reach, megarl / TRL ratios. Results: OUT/result.json and OUT/curves.png.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_vs_trl import greedy_accuracy, plot, time_to, write_char_tokenizer  # noqa: E402
from megarl.rewards import arith_exact_match  # noqa: E402
from rl_runs import run_train  # noqa: E402

CHARS = "0123456789:,="  # ids 3.. after <unk> <s> </s>
MAX_K = 32
MAX_NEW = 4 * MAX_K + 4  # the longest answer (127 chars + EOS) and a little room
THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7)


# ----------------------------------------------------------------------------- the task
def countdown(n: int, k: int) -> str:
    return ",".join(str(n - i) for i in range(k))


def sample_rows(count: int, seed: int) -> list[dict]:
    """``count`` prompts ``N:K=`` with K heavy-tailed (P(K >= k) = 2 / (k + 1), k <= 32)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        u = rng.random()
        k = min(MAX_K, max(1, int(2.0 / max(u, 1e-9)) - 1))  # P(K >= k) = P(u <= 2/(k+1))
        n = rng.randint(99 + k, 999)  # N - K + 1 >= 100: every number of the answer has 3 digits
        rows.append({"prompt": f"{n}:{k}=", "answer": countdown(n, k)})
    return rows


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def make_tokenizer(model_dir: str) -> None:
    """The task's char-level tokenizer: <unk> <s> </s>, then the digits and ':' ',' '='."""
    write_char_tokenizer(model_dir, {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(CHARS)}}, 192)


def check_tokenizers(model_dir: str, rows: list[dict]) -> None:
    """megarl's tokenizer.json loader and transformers' fast tokenizer give the same ids."""
    from transformers import AutoTokenizer

    from megarl.common.tokenizer import load_tokenizer

    mine, hf = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    for r in rows[:200]:
        a, b = mine.encode(r["prompt"], add_bos=True), hf(r["prompt"])["input_ids"]
        if a != b or len(a) != len(r["prompt"]) + 1:
            raise SystemExit(f"tokenizers disagree on {r['prompt']!r}: {a} {b}")
    assert hf.eos_token_id == mine.eos_id == 2


# ----------------------------------------------------------------------------- warm start
def forced_accuracy(model, batch) -> float:
    """Greedy exact match without decoding: a greedy completion is the answer (then EOS) exactly
    when the argmax at every answer position, fed the answer so far, is the answer's next token."""
    import torch

    x, labels = batch
    was_training = model.training
    model.eval()
    with torch.no_grad():
        pred = model(input_ids=x).logits.argmax(-1)
    model.train(was_training)
    target = labels[:, 1:]
    ok = (pred[:, :-1] == target) | (target == -100)
    return ok.all(dim=1).float().mean().item()


def sft_batch(tok, rows: list[dict]):
    """(ids, labels) of prompt + answer + EOS rows, padded with EOS; labels only on the answer
    and its EOS (-100 elsewhere)."""
    import torch

    ids = [tok(r["prompt"])["input_ids"] + tok(r["answer"], add_special_tokens=False)["input_ids"] + [2]
           for r in rows]
    width = max(map(len, ids))
    x = torch.full((len(ids), width), 2, dtype=torch.long)
    labels = torch.full_like(x, -100)
    for i, (seq, r) in enumerate(zip(ids, rows)):
        p = len(r["prompt"]) + 1
        x[i, :len(seq)] = torch.tensor(seq)
        labels[i, p:len(seq)] = torch.tensor(seq[p:])
    return x, labels


def warm_start(out: str, target: float, seed: int) -> dict:
    """OUT/assets/model: the random Llama trained on the task's answers (loss on answer tokens
    and EOS) until greedy held-out accuracy >= ``target``; returns what it reached."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir = os.path.join(out, "assets", "model")
    data = os.path.join(out, "assets", "data")
    os.makedirs(model_dir, exist_ok=True)
    os.makedirs(data, exist_ok=True)
    train_rows, eval_rows, sft_rows = sample_rows(20000, seed), sample_rows(200, seed + 1), sample_rows(50000, seed + 2)
    write_jsonl(os.path.join(data, "rl_prompts.jsonl"), train_rows)
    write_jsonl(os.path.join(data, "eval_prompts.jsonl"), eval_rows)
    make_tokenizer(model_dir)
    check_tokenizers(model_dir, train_rows)
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=16, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=192,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    t0, acc, step, batch = time.perf_counter(), 0.0, 0, 64
    held_out = sft_batch(tok, eval_rows)
    # batches of similar lengths (a padded batch of the heavy tail is mostly padding), in random order
    by_length = sorted(sft_rows, key=lambda r: len(r["answer"]))
    batches = [by_length[i:i + batch] for i in range(0, len(by_length), batch)]
    random.Random(seed).shuffle(batches)
    model.train()
    while acc < target:
        x, labels = sft_batch(tok, batches[step % len(batches)])
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 10 == 0:
            acc = forced_accuracy(model, held_out)
            if step % 100 == 0 or acc >= target:
                print(f"[warm] step {step} loss {loss.item():.3f} held-out {acc:.3f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if step > 20000:
            raise SystemExit(f"warm start: held-out accuracy {acc:.3f} < {target} after {step} steps")
    greedy = greedy_accuracy(model, tok, eval_rows, MAX_NEW)  # the same, decoded: what both sides evaluate
    print(f"[warm] greedy held-out accuracy {greedy:.3f} (teacher-forced {acc:.3f})", flush=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"params": params, "steps": step, "accuracy": greedy, "seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- the two sides
RECIPE = """# written by tools/bench/bench_tail_vs_trl.py: GRPO on the heavy-tailed countdown
model:
  hf_path: {model}
  init: hf
train:
  algorithm: rl
  steps: {steps}
  global_batch_size: 64
  micro_batch_tokens: 4096
  max_seq_len: 160
  seed: {seed}
data:
  train_path: {data}/rl_prompts.jsonl
  eval_path: {data}/eval_prompts.jsonl
optim:
  lr: 1.0e-4
  clip_grad: 1.0
algo:
  policy_loss: decoupled_ppo
  prox_logp_mode: loglinear
  advantage: grpo
  eps_clip_low: 0.2
  eps_clip_high: 0.28
rollout:
  local_servers: 1
  group_size: 8
  max_new_tokens: {max_new}
  max_staleness: 1
  max_concurrent: 64
  eval_interval: {eval_every}
  eval_size: 200
  eval_at_start: true
checkpoint:
  save_interval: 0
"""


def run_megarl(args, model_dir: str, data: str) -> dict:
    recipe = os.path.join(args.out, "tail_grpo.yaml")
    with open(recipe, "w") as f:
        f.write(RECIPE.format(model=model_dir, data=data, steps=args.max_steps, seed=args.seed,
                              max_new=MAX_NEW, eval_every=args.eval_every))
    r = run_train(os.path.join(args.out, "megarl"), [f"data.train_path={data}/rl_prompts.jsonl",
                                                    f"data.eval_path={data}/eval_prompts.jsonl",
                                                    *args.megarl_override],
                  "megarl", None, recipe, budget_s=args.budget_s)
    rows = [json.loads(line) for line in open(os.path.join(args.out, "megarl", "metrics.jsonl")) if line.strip()]
    steps = [x for x in rows if x["step"] >= 1]
    tokens = sum(x["response_len"] * 64 for x in steps)
    return {"name": "megarl", "evals": r.evals, "train_s": r.train_s, "steps": len(steps),
            "step_s": statistics.median(x["step_time"] for x in steps),
            "update_s": statistics.median(x["time/update"] for x in steps),
            "push_s": statistics.median(x.get("time/push", 0.0) for x in steps),
            "wait_s": statistics.median(x.get("time/wait", 0.0) for x in steps),
            "pad_share": statistics.median(x.get("pad_share", 0.0) for x in steps),
            "trainer_idle": statistics.median(x.get("trainer_idle_ratio", 0.0) for x in steps),
            "rollout_idle": statistics.median(x.get("rollout_idle_ratio", 0.0) for x in steps),
            "tokens": tokens, "tokens_per_s": tokens / max(r.train_s, 1e-9),
            "cpu_util": r.extra.get("cpu_util")}


def run_trl(args, model_dir: str, data: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.trl_threads)
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    read = lambda name: [json.loads(line) for line in open(os.path.join(data, name))]  # noqa: E731
    train, held_out = Dataset.from_list(read("rl_prompts.jsonl")), read("eval_prompts.jsonl")

    def reward(prompts, completions, answer, **_):
        return [arith_exact_match(p, c, {"answer": a}) for p, c, a in zip(prompts, completions, answer)]

    log = {"evals": [], "steps": [], "tokens": 0.0}

    class Clock(TrainerCallback):
        """Training seconds (evaluations excluded), step times, completion tokens, held-out
        accuracy every --eval-every steps."""

        def on_train_begin(self, a, state, control, **kw):
            self.eval_s = 0.0
            self.evaluate(0)
            self.t0 = self.last = time.perf_counter()

        def evaluate(self, step: int) -> None:
            t = time.perf_counter()
            acc = greedy_accuracy(model, tok, held_out, MAX_NEW)
            self.eval_s += time.perf_counter() - t
            train_s = (time.perf_counter() - self.t0 - self.eval_s) if step else 0.0
            log["evals"].append({"step": step, "accuracy": acc, "train_s": train_s})
            print(f"[trl] step {step} accuracy {acc:.3f} train {train_s:.1f}s", flush=True)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:  # logging_steps=1: this step's samples
                log["tokens"] += logs["completions/mean_length"] * 64

        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            log["steps"].append(now - self.last)
            step = state.global_step
            if step % args.eval_every == 0:
                self.evaluate(step)
            self.last = time.perf_counter()  # the evaluation is not the next step's
            if now - self.t0 - self.eval_s > args.budget_s:
                control.should_training_stop = True

    cfg = GRPOConfig(
        output_dir=os.path.join(args.out, "trl"), per_device_train_batch_size=64, num_generations=8,
        max_completion_length=MAX_NEW, learning_rate=1e-4, lr_scheduler_type="constant",
        max_grad_norm=1.0, weight_decay=0.0, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        scale_rewards="group", temperature=1.0, max_steps=args.max_steps, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=args.seed, bf16=False,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=train,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    train_s = log["evals"][-1]["train_s"] if len(log["evals"]) > 1 else sum(log["steps"])
    train_s = max(train_s, sum(log["steps"]))
    return {"name": "trl", "evals": log["evals"], "train_s": train_s, "steps": len(log["steps"]),
            "step_s": statistics.median(log["steps"]), "tokens": log["tokens"],
            "tokens_per_s": log["tokens"] / max(sum(log["steps"]), 1e-9)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench_tail"))
    ap.add_argument("--budget-s", type=float, default=180.0, help="training seconds per side")
    ap.add_argument("--eval-every", type=int, default=25, help="steps between evaluations (both sides)")
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--warm-target", type=float, default=0.46)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process")
    ap.add_argument("--megarl-override", action="append", default=[], metavar="A.B=C")
    ap.add_argument("--only", choices=("both", "trl", "megarl"), default="both")
    ap.add_argument("--reuse-assets", action="store_true", help="keep OUT/assets from an earlier run")
    ap.add_argument("--worker", choices=("trl",), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    model_dir, data = os.path.join(args.out, "assets", "model"), os.path.join(args.out, "assets", "data")
    if args.worker == "trl":
        with open(os.path.join(args.out, "trl.json"), "w") as f:
            json.dump(run_trl(args, model_dir, data), f)
        return 0
    os.makedirs(args.out, exist_ok=True)
    warm_path = os.path.join(args.out, "assets", "warm.json")
    if not (args.reuse_assets and os.path.exists(warm_path)):
        warm = warm_start(args.out, args.warm_target, args.seed)
        with open(warm_path, "w") as f:
            json.dump(warm, f)
    warm = json.load(open(warm_path))
    print(f"[bench_tail] model {warm['params'] / 1e6:.2f}M parameters, warm start {warm['accuracy']:.3f} "
          f"after {warm['steps']} steps", flush=True)
    results = {"warm": warm}
    if args.only in ("both", "megarl"):
        results["megarl"] = run_megarl(args, model_dir, data)
    if args.only in ("both", "trl"):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "trl",
               *(argv if argv is not None else sys.argv[1:])]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.trl_threads)))
        results["trl"] = json.load(open(os.path.join(args.out, "trl.json")))
    for name in ("megarl", "trl"):
        if name in results:
            r = results[name]
            extra = "".join(f", {k} {r[k]:.3f}" for k in ("update_s", "push_s", "wait_s", "pad_share",
                                                          "trainer_idle", "rollout_idle") if k in r)
            print(f"{name:>7}: {r['steps']} steps in {r['train_s']:.0f} s, median step {r['step_s']:.3f} s{extra}; "
                  f"{r['tokens_per_s']:.0f} trained response tokens/s; held-out "
                  f"{r['evals'][0]['accuracy']:.3f} -> {r['evals'][-1]['accuracy']:.3f}", flush=True)
    if "megarl" in results and "trl" in results:
        results["tokens_ratio"] = results["megarl"]["tokens_per_s"] / results["trl"]["tokens_per_s"]
        print(f"megarl / TRL trained response tokens/s: {results['tokens_ratio']:.2f}x")
        results["time_to"] = {}
        for t in THRESHOLDS:
            row = {n: time_to(results[n]["evals"], t) for n in ("megarl", "trl")}
            if all(row.values()):
                row["ratio"] = row["megarl"][0] / row["trl"][0]
                print(f"to {t}: megarl {row['megarl'][0]:.0f} s, TRL {row['trl'][0]:.0f} s -> "
                      f"{row['ratio']:.2f}x of TRL's wall time")
            results["time_to"][str(t)] = row
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, "curves.png"),
         f"heavy-tailed countdown (answers 4-128 tokens), {warm['params'] / 1e6:.2f}M-parameter Llama, 8 x 8 GRPO")
    return 0


if __name__ == "__main__":
    sys.exit(main())
