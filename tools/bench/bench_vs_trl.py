"""megarl vs TRL's GRPOTrainer: wall time to held-out accuracies, same task, model, tokenizer,
hyperparameters and machine.

    pip install -e ".[bench]"        # trl + transformers + datasets (optional benchmark deps)
    python tools/bench/bench_vs_trl.py [--target 0.8] [--budget-s 480] [--out runs/bench_vs_trl]

Both sides start from the same weights (examples/tiny/model, an HF Llama safetensors), use the same
char-level tokenizer (a `tokenizer.json` this script writes once with `tokenizers` from the demo's
sentencepiece vocabulary, same ids; megarl loads it too because the asset dir has no
tokenizer.model), the same 2-digit addition prompts and exact-match reward, the same held-out set
(greedy accuracy on the 500 eval prompts), and the same GRPO hyperparameters, read from the megarl
recipe (configs/tiny_grpo.yaml): samples per step and per prompt, max new tokens, temperature, lr
and warmup, clip range (TRL epsilon / epsilon_high), grad-norm clip, token-mean loss ("dapo"),
group-normalised advantages, no KL. They run one after the other on this machine:

    TRL     GRPOTrainer in a child process (--trl-threads torch threads, default 1: TRL's best on
            the loaded 2-core machine), synchronous on-policy, generation with transformers
            `generate` (no vLLM on CPU).
    megarl  `megarl-train configs/tiny_grpo.yaml` on the same assets (async, local CPU server).

Every --eval-every steps each side measures held-out accuracy; evaluation time is excluded from the
training wall time of both (megarl: time/eval of its rows; TRL: timed around the callback). A side
stops at the first evaluation >= --target or after --budget-s seconds of training. Reported per
side: start accuracy, training seconds to each of 0.5/0.6/0.7/0.8 (those reached), s/step,
trained completions/s, CPU milliseconds per trained sample (megarl: per program - trainer ranks,
rollout manager, servers, reward workers - over its training window, which includes the
evaluation it runs beside training; TRL: its process, evaluation excluded), and the ratio megarl / TRL at every threshold both reached (target <= 1.0x
now, design aim 0.5x). Results go to OUT/result.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megarl.data.datasets import read_jsonl  # noqa: E402
from megarl.rewards import arith_exact_match  # noqa: E402
from rl_runs import DATA, run_train  # noqa: E402

THRESHOLDS = (0.5, 0.6, 0.7, 0.8)


# ----------------------------------------------------------------------------- shared assets
def make_assets(out: str, src_model: str) -> str:
    """OUT/assets/model: the demo weights + config, and a tokenizer.json with the sentencepiece ids."""
    import sentencepiece as spm

    model_dir = os.path.join(out, "assets", "model")
    os.makedirs(model_dir, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(os.path.join(src_model, name), os.path.join(model_dir, name))
    sp = spm.SentencePieceProcessor(model_file=os.path.join(src_model, "tokenizer.model"))
    write_char_tokenizer(model_dir, {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}, 64)
    check_tokenizers(model_dir, sp)
    return model_dir


def write_char_tokenizer(model_dir: str, vocab: dict[str, int], max_length: int) -> None:
    """A char-level ``tokenizer.json`` (one token per character, ``vocab``: piece -> id with
    <unk> <s> </s>) that megarl's loader and transformers' fast tokenizer both read; BOS
    prepended, EOS = </s>, padding with EOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per char
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "</s>", "unk_token": "<unk>", "model_max_length": max_length}, f, indent=1)


def check_tokenizers(model_dir: str, sp) -> None:
    """The three views of the tokenizer agree on every prompt: sentencepiece (+BOS), megarl's
    tokenizer.json loader, and transformers' fast tokenizer (what TRL uses)."""
    from transformers import AutoTokenizer

    from megarl.common.tokenizer import load_tokenizer

    mine, hf = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(mine).__name__ == "HFJsonTokenizer", type(mine)
    for path in ("eval_prompts.jsonl", "rl_prompts.jsonl"):
        for _, row in read_jsonl(os.path.join(DATA, path), ("prompt", "answer")):
            ref = [sp.bos_id()] + sp.encode(row["prompt"])
            got = (mine.encode(row["prompt"], add_bos=True), hf(row["prompt"])["input_ids"])
            if got[0] != ref or got[1] != ref:
                raise SystemExit(f"tokenizers disagree on {row['prompt']!r}: {ref} {got}")
    assert hf.eos_token_id == mine.eos_id == sp.eos_id() and hf.decode([3, 4, 2], skip_special_tokens=True) == mine.decode([3, 4, 2])


def eval_rows(n: int = 500) -> list[dict]:
    return [row for _, row in read_jsonl(os.path.join(DATA, "eval_prompts.jsonl"), ("prompt", "answer"))][:n]


# ----------------------------------------------------------------------------- TRL side
def greedy_accuracy(model, tok, rows: list[dict], max_new_tokens: int = 8) -> float:
    """Exact-match accuracy of greedy completions (the same reward as megarl's evaluation)."""
    import torch

    was_training = model.training
    model.eval()
    enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    return sum(arith_exact_match(r["prompt"], t, r) for r, t in zip(rows, texts)) / len(rows)


def megarl_recipe(args: argparse.Namespace):
    """The megarl config both sides take their hyperparameters from."""
    from megarl.config import load_config

    return load_config(os.path.join(REPO, args.megarl_config), list(args.megarl_override), validate=False)


def run_trl(args: argparse.Namespace, model_dir: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.trl_threads)
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train = Dataset.from_list([row for _, row in read_jsonl(os.path.join(DATA, "rl_prompts.jsonl"),
                                                            ("prompt", "answer"))])
    held_out = eval_rows()

    def reward(prompts, completions, answer, **_):
        return [arith_exact_match(p, c, {"answer": a}) for p, c, a in zip(prompts, completions, answer)]

    log = {"evals": []}

    class Clock(TrainerCallback):
        """Training seconds (evaluations excluded), held-out accuracy every --eval-every steps."""

        def on_train_begin(self, a, state, control, **kw):
            self.eval_s = self.eval_cpu = 0.0
            self.evaluate(0)
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

        def evaluate(self, step: int) -> float:
            t, c = time.perf_counter(), time.process_time()
            acc = greedy_accuracy(model, tok, held_out)
            self.eval_s += time.perf_counter() - t
            self.eval_cpu += time.process_time() - c
            train_s = (time.perf_counter() - self.t0 - self.eval_s) if step else 0.0
            # CPU seconds of the whole TRL process (every thread), evaluation excluded
            train_cpu = (time.process_time() - self.cpu0 - self.eval_cpu) if step else 0.0
            log["evals"].append({"step": step, "accuracy": acc, "train_s": train_s, "train_cpu_s": train_cpu})
            print(f"[trl] step {step} accuracy {acc:.3f} train {train_s:.1f}s", flush=True)
            return acc

        def on_step_end(self, a, state, control, **kw):
            step = state.global_step
            if step % args.eval_every == 0:
                acc = self.evaluate(step)
                train_s = log["evals"][-1]["train_s"]
                if acc >= args.target or train_s > args.budget_s:
                    control.should_training_stop = True

    m = megarl_recipe(args)
    cfg = GRPOConfig(
        output_dir=os.path.join(args.out, "trl"), per_device_train_batch_size=m.train.global_batch_size,
        num_generations=m.rollout.group_size, max_completion_length=m.rollout.max_new_tokens,
        learning_rate=m.optim.lr, warmup_steps=m.optim.lr_warmup_steps,
        lr_scheduler_type="constant_with_warmup", max_grad_norm=m.optim.clip_grad,
        adam_beta1=m.optim.adam_beta1, adam_beta2=m.optim.adam_beta2, adam_epsilon=m.optim.adam_eps,
        weight_decay=m.optim.weight_decay, beta=0.0, epsilon=m.algo.eps_clip_low,
        epsilon_high=m.algo.eps_clip_high, loss_type="dapo", scale_rewards="group",
        temperature=m.rollout.temperature, max_steps=args.max_steps, logging_steps=25,
        save_strategy="no", report_to=[], use_cpu=True, seed=args.seed, bf16=False,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=train,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    return summarize("trl", log["evals"], args.target, completions_per_step=m.train.global_batch_size)


# ----------------------------------------------------------------------------- megarl side
def run_megarl(args: argparse.Namespace, model_dir: str) -> dict:
    overrides = [f"model.hf_path={model_dir}", f"train.steps={args.max_steps}", f"train.seed={args.seed}",
                 f"rollout.eval_interval={args.eval_every}", "rollout.eval_size=500",
                 "rollout.eval_at_start=true", f"train.stop_at_eval_accuracy={args.target}",
                 *args.megarl_override]
    r = run_train(os.path.join(args.out, "megarl"), overrides, "megarl", args.target, args.megarl_config,
                  budget_s=args.budget_s)
    end = next((e for e in r.evals if e["step"] == r.steps_to_target), r.evals[-1])
    roles = r.extra.get("cpu_s_by_role") or {}
    per_sample = {role: cpu / max(r.trained_samples, 1) for role, cpu in roles.items()}
    return {"cpu_s_per_sample": per_sample, "cpu_s_per_sample_total": sum(per_sample.values()),
            "name": "megarl", "start_accuracy": r.start_accuracy, "reached": r.steps_to_target is not None,
            "steps": end["step"], "accuracy": end["accuracy"], "train_s": end["train_s"],
            "s_per_step": r.s_per_step, "completions_per_s": r.samples_per_s, "process_s": r.process_s,
            "evals": r.evals}


def summarize(name: str, evals: list[dict], target: float, completions_per_step: int) -> dict:
    """TRL's evaluations -> the same fields as the megarl side."""
    hit = next((e for e in evals if e["step"] and e["accuracy"] >= target), None)
    end = hit or evals[-1]
    s_per_step = end["train_s"] / end["step"] if end["step"] else float("nan")
    cpu = end.get("train_cpu_s", 0.0) / (end["step"] * completions_per_step) if end["step"] else float("nan")
    return {"cpu_s_per_sample": {"trl": cpu}, "cpu_s_per_sample_total": cpu,
            "name": name, "start_accuracy": evals[0]["accuracy"], "reached": hit is not None,
            "steps": end["step"], "accuracy": end["accuracy"], "train_s": end["train_s"],
            "s_per_step": s_per_step, "completions_per_s": completions_per_step / s_per_step,
            "evals": evals}


def time_to(evals: list[dict], threshold: float):
    """(training seconds, step) of the first evaluation >= threshold, or None."""
    hit = next((e for e in evals if e["step"] and e["accuracy"] >= threshold), None)
    return (hit["train_s"], hit["step"]) if hit else None


def plot(results: dict, out: str, title: str = "") -> None:
    """Held-out accuracy vs training seconds and vs step, both sides (OUT/curves.png)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench_vs_trl] matplotlib not installed: no PNG")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in ("megarl", "trl"):
        if name in results:
            ev = results[name]["evals"]
            for ax, x in zip(axes, ("train_s", "step")):
                ax.plot([e[x] for e in ev], [e["accuracy"] for e in ev], marker=".", label=name)
    for ax, label in zip(axes, ("training seconds (evaluation excluded)", "step")):
        ax.set_xlabel(label)
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench_vs_trl"))
    ap.add_argument("--model", default=os.path.join(REPO, "examples", "tiny", "model"))
    ap.add_argument("--target", type=float, default=0.8, help="held-out greedy accuracy to reach")
    ap.add_argument("--eval-every", type=int, default=25, help="steps between evaluations (both sides)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="training seconds per side at most")
    ap.add_argument("--max-steps", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--trl-threads", type=int, default=1,
                    help="torch threads of the TRL process (1: on the shared 2-core machine 2 threads made "
                         "TRL 7x slower per step, 4.26 vs 0.59 s)")
    ap.add_argument("--megarl-config", default="configs/tiny_grpo.yaml")
    ap.add_argument("--megarl-override", action="append", default=[], metavar="A.B=C")
    ap.add_argument("--only", choices=("both", "trl", "megarl"), default="both")
    ap.add_argument("--replot", action="store_true", help="only redraw OUT/curves.png from OUT/result.json")
    ap.add_argument("--worker", choices=("trl",), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    model_dir = os.path.join(args.out, "assets", "model")
    if args.worker == "trl":  # the child process: its own torch threads, nothing else loaded
        print(json.dumps(run_trl(args, model_dir)), file=open(os.path.join(args.out, "trl.json"), "w"))
        return 0
    if args.replot:
        plot(json.load(open(os.path.join(args.out, "result.json"))), os.path.join(args.out, "curves.png"))
        return 0
    make_assets(args.out, args.model)
    results = {}
    if args.only in ("both", "megarl"):
        results["megarl"] = run_megarl(args, model_dir)
    if args.only in ("both", "trl"):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "trl", *(argv if argv is not None else sys.argv[1:])]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.trl_threads)))
        results["trl"] = json.load(open(os.path.join(args.out, "trl.json")))
    for r in results.values():
        print(f"{r['name']:>7}: start {r['start_accuracy']:.3f} -> {r['accuracy']:.3f} at step {r['steps']}"
              f" in {r['train_s']:.1f} s of training ({'reached' if r['reached'] else 'NOT reached'}"
              f" {args.target}), {r['s_per_step']:.3f} s/step, {r['completions_per_s']:.0f} completions/s")
        cpu = r.get("cpu_s_per_sample") or {}
        print(f"{'':>7}  CPU ms per trained sample: {1e3 * r.get('cpu_s_per_sample_total', float('nan')):.2f}"
              + "".join(f", {role} {1e3 * v:.2f}" for role, v in cpu.items() if len(cpu) > 1))
    thresholds = [t for t in THRESHOLDS if t <= args.target]
    results["time_to"] = {}
    for t in thresholds:
        row = {n: time_to(r["evals"], t) for n, r in results.items() if n in ("megarl", "trl")}
        if len(row) == 2 and all(row.values()):
            row["ratio"] = row["megarl"][0] / row["trl"][0]
        results["time_to"][str(t)] = row
        print(f"to {t}: " + ", ".join(f"{n} {v[0]:.1f} s (step {v[1]})" if v else f"{n} not reached"
                                       for n, v in row.items() if n != "ratio")
              + (f" -> megarl / TRL = {row['ratio']:.2f}x" if "ratio" in row else ""))
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, "curves.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
