"""Build the CPU demo model: addition corpus -> char tokenizer -> tiny Llama config -> SFT -> eval.

    python tools/make_tiny_model.py --out DIR [--digits 2] [--target-accuracy 0.3] [--hidden 128 --layers 4]
        [--experts 4 --topk 2 --moe-intermediate 128]    (a Qwen3-MoE instead of a Llama)

Writes
    DIR/data/{sft,rl_prompts,eval_prompts}.jsonl   the task (eval pairs never appear in the others)
    DIR/hf/{config.json,tokenizer.model}           an HF Llama config without weights
    DIR/sft_run/                                   the SFT run (metrics.jsonl, checkpoints, exports/)
    DIR/model/                                     the chosen SFT checkpoint as an HF dir (RL start)
    DIR/sft_eval.json                              its greedy held-out accuracy (+ every candidate's)
    DIR/eval_server/server0.log                    the CPU rollout server of the accuracy runs
SFT is megarl itself (`python -m megarl.train configs/tiny_sft.yaml ...`, random init). The RL demo
needs a start point that is neither hopeless nor solved: this model jumps from ~0.15 to ~0.9
greedy held-out accuracy within ~200 SFT steps (steps ~500-700 of a 1500-step cosine schedule), so
the run exports an HF checkpoint every `--export-every` steps (`hf_export_dir=.../step_{step}`),
measures greedy accuracy through the CPU rollout server (every 4th export until one reaches the
target, then every export around it), and keeps the one closest to `--target-accuracy`. `--target-accuracy 0` keeps the last step instead.
`--skip-sft` stops after the config; `--skip-eval` skips the accuracy runs (keeps the last step).

    python tools/make_tiny_model.py --out DIR --task count --max-pos 1088 [--count-end 999 ...]
writes the counting task instead ("a+b=" -> "a+(a+1)+...+b", answers of 1,003-1,063 tokens;
megarl.data.tasks.CountingTask; docs/long_context.md says what it measured).

    python tools/make_tiny_model.py --out DIR --reward-model [--rm-steps 2000]
writes DIR/reward_model/ instead: a tiny LlamaForSequenceClassification trained to score correct
sums above wrong ones (tools/tiny_reward_model.py; held-out accuracy and AUC in its rm_eval.json),
with DIR/hf's tokenizer (made first when missing). configs/tiny_grpo_rm.yaml trains from it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, REPO)

from megarl.data.datasets import PromptDataset, read_jsonl  # noqa: E402
from megarl.data.tasks import CountingTask, write_addition_corpus, write_counting_corpus  # noqa: E402
from megarl.common.tokenizer import SentencePieceTokenizer, load_tokenizer, train_sentencepiece  # noqa: E402
from megarl.rollout.client import RolloutClient  # noqa: E402
from megarl.rollout.evaluation import EvalResult, evaluate_samples  # noqa: E402
from megarl.rollout.local import LocalServers  # noqa: E402
from megarl.rewards import arith_exact_match  # noqa: E402
from megarl.protocol.types import SamplingParams  # noqa: E402

TASK_CHARS = "0123456789+="


def make_tokenizer(sft_path: str, hf_dir: str) -> SentencePieceTokenizer:
    """Char-level vocab: <unk>=0, <s>=1, </s>=2, then digits, '+', '=' (and any other corpus char)."""
    texts = [row["prompt"] + row["response"] for _, row in read_jsonl(sft_path, ("prompt", "response"))]
    return train_sentencepiece(texts, hf_dir, vocab_size=64, model_type="char", required_chars=TASK_CHARS)


def llama_config(args: argparse.Namespace, tok: SentencePieceTokenizer) -> dict:
    """HF LlamaForCausalLM config (Qwen3MoeForCausalLM with `--experts` > 0); vocab rounded up to
    `--vocab-multiple` so TP can split it."""
    m = args.vocab_multiple
    vocab = -(-tok.vocab_size // m) * m
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise SystemExit("--hidden must divide by --heads and --heads by --kv-heads")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
    } if not args.experts else moe_config(args, tok, vocab)


def moe_config(args: argparse.Namespace, tok: SentencePieceTokenizer, vocab: int) -> dict:
    """HF Qwen3MoeForCausalLM config: every layer an MoE MLP of `--experts` experts of width
    `--moe-intermediate`, `--topk` per token, renormalised top-k weights (the released models'
    norm_topk_prob), per-head q/k RMSNorm as Qwen3 has."""
    if not 0 < args.topk <= args.experts:
        raise SystemExit("--topk must be in 1..--experts")
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "moe_intermediate_size": args.moe_intermediate,
        "num_experts": args.experts,
        "num_experts_per_tok": args.topk,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.0,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def run_sft(args: argparse.Namespace, out: str) -> dict[int, str]:
    """The SFT run; returns {step: HF export dir} (one every --export-every steps and the last)."""
    exports = os.path.join(out, "sft_run", "exports")
    if args.reuse_sft and os.path.isdir(os.path.join(exports, f"step_{args.sft_steps}")):
        print(f"[make_tiny_model] reusing the SFT exports in {exports}", flush=True)
        return {int(d.rsplit("_", 1)[1]): os.path.join(exports, d) for d in os.listdir(exports)}
    shutil.rmtree(exports, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_sft.yaml"),
        f"model.hf_path={out}/hf", "model.init=random", f"data.train_path={out}/data/sft.jsonl",
        f"train.steps={args.sft_steps}", f"optim.lr_decay_steps={args.sft_decay_steps}",
        f"train.run_dir={out}/sft_run", "checkpoint.hf_export_dir=" + os.path.join(exports, "step_{step}"),
        f"checkpoint.hf_export_interval={args.export_every}", "checkpoint.resume=false", *args.override,
    ]
    print("[make_tiny_model] SFT:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    return {int(d.rsplit("_", 1)[1]): os.path.join(exports, d) for d in os.listdir(exports)}


def evaluate_model(model_dir: str, prompts_path: str, n: int, max_new_tokens: int, log_dir: str
                   ) -> EvalResult:
    """Greedy exact-answer accuracy on the first n prompts, through a local CPU rollout server."""
    tok = load_tokenizer(model_dir)
    samples = PromptDataset(prompts_path, tok).samples[:n]
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=[tok.eos_id])

    async def run(urls: list[str]) -> EvalResult:
        async with RolloutClient(urls) as client:
            return await evaluate_samples(client, samples, arith_exact_match, sampling, tok)

    for attempt in range(3):  # a free port can be taken by another process before the server binds it
        try:
            with LocalServers(model_dir, 1, log_dir) as urls:
                return asyncio.run(run(urls))
        except RuntimeError as e:
            if attempt == 2 or "exited early" not in str(e):
                raise
            print(f"[make_tiny_model] eval server failed to start, retrying: {str(e)[:200]}", flush=True)


def choose_checkpoint(args: argparse.Namespace, exports: dict[int, str], eval_path: str,
                      log_dir: str) -> tuple[int, dict[int, float]]:
    """The export whose greedy accuracy is closest to --target-accuracy (ties: the earlier), and
    {step: accuracy} of every export evaluated. Coarse to fine: every 4th export until one reaches
    the target, then every export between the coarse point before it and the one after it."""
    accs: dict[int, float] = {}

    def acc(step: int) -> float:
        if step not in accs:
            accs[step] = evaluate_model(exports[step], eval_path, args.n_eval, answer_tokens(args), log_dir).accuracy
            print(f"[make_tiny_model] SFT step {step}: greedy held-out accuracy {accs[step]:.3f}", flush=True)
        return accs[step]

    steps = sorted(exports)
    coarse = steps[3::4] if len(steps) > 4 else steps
    hit = next((i for i, st in enumerate(coarse) if acc(st) >= args.target_accuracy), len(coarse) - 1)
    lo = coarse[hit - 1] if hit > 0 else steps[0]
    hi = coarse[hit + 1] if hit + 1 < len(coarse) else steps[-1]
    for st in steps:
        if lo <= st <= hi:
            acc(st)
    best = min(sorted(accs), key=lambda st: abs(accs[st] - args.target_accuracy))
    return best, accs


def answer_tokens(args: argparse.Namespace) -> int:
    """The longest answer plus EOS (the eval's max_new_tokens)."""
    if args.task == "count":
        return 4 * args.count_max + 1  # the longest count, EOS and one to spare
    return args.digits + 3  # the sum (at most digits + 1), EOS and one to spare


def make_reward_model(args: argparse.Namespace, out: str, hf_dir: str) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # imported, not run as a script
        sys.path.insert(0, here)
    from tiny_reward_model import train_reward_model  # tools/, beside this script

    m = train_reward_model(os.path.join(out, "reward_model"), hf_dir, args.digits, args.seed,
                           n_eval=args.n_eval, steps=args.rm_steps)
    print(f"[make_tiny_model] reward model in {out}/reward_model: held-out accuracy {m['accuracy']:.3f}, "
          f"AUC {m['auc']:.4f} ({m['train_s']:.0f}s)")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--task", choices=("add", "count"), default="add",
                    help="add: a+b= -> the sum; count: a+b= -> a+(a+1)+...+b (1,000+ token answers)")
    ap.add_argument("--digits", type=int, default=2, help="digits per operand (--task add)")
    ap.add_argument("--count-min", type=int, default=CountingTask.min_count, help="--task count: fewest numbers")
    ap.add_argument("--count-max", type=int, default=CountingTask.max_count, help="--task count: most numbers")
    ap.add_argument("--count-end", type=int, default=0,
                    help="--task count: every count ends at this number (0: the prompt's second number, any)")
    ap.add_argument("--count-alt-sep", default="",
                    help="--task count: SFT on each answer twice, with '+' and with this separator (RL rewards '+')")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-sft", type=int, default=5000, help="SFT examples")
    ap.add_argument("--n-rl", type=int, default=5000, help="RL prompts")
    ap.add_argument("--n-eval", type=int, default=500, help="held-out eval prompts")
    ap.add_argument("--sft-steps", type=int, default=640, help="SFT steps run")
    ap.add_argument("--sft-decay-steps", type=int, default=1500,
                    help="length of the cosine LR schedule (longer than --sft-steps: an early stop)")
    ap.add_argument("--export-every", type=int, default=10, help="SFT steps between candidate exports")
    ap.add_argument("--target-accuracy", type=float, default=0.3,
                    help="keep the SFT checkpoint closest to this greedy accuracy (0: the last one)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--experts", type=int, default=0,
                    help="> 0: a Qwen3-MoE with this many routed experts per layer (0: dense Llama)")
    ap.add_argument("--topk", type=int, default=2, help="MoE: experts per token")
    ap.add_argument("--moe-intermediate", type=int, default=128, help="MoE: intermediate size of one expert")
    ap.add_argument("--max-pos", type=int, default=64, help="max_position_embeddings")
    ap.add_argument("--vocab-multiple", type=int, default=16, help="round vocab_size up to this")
    ap.add_argument("--override", action="append", default=[], metavar="A.B=C",
                    help="extra megarl.train override for the SFT run (repeatable)")
    ap.add_argument("--skip-sft", action="store_true", help="stop after data, tokenizer and config")
    ap.add_argument("--reuse-sft", action="store_true",
                    help="keep the SFT exports of a finished earlier run in DIR/sft_run and only choose")
    ap.add_argument("--skip-eval", action="store_true", help="do not measure held-out accuracy")
    ap.add_argument("--reward-model", action="store_true",
                    help="train DIR/reward_model (a tiny reward model for the task) and stop")
    ap.add_argument("--rm-steps", type=int, default=2000, help="--reward-model: training steps")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    hf_dir = os.path.join(out, "hf")
    t0 = time.monotonic()

    prompt_len = 1 + 3 * 2 + 2 if args.task == "count" else 1 + args.digits * 2 + 2  # bos a + b =
    longest = prompt_len + answer_tokens(args)
    if longest > args.max_pos:
        raise SystemExit(f"--max-pos {args.max_pos} < longest sample ({longest} tokens)")
    if args.reward_model and args.task != "add":
        raise SystemExit("--reward-model is for --task add")
    if args.reward_model and os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        return make_reward_model(args, out, hf_dir)
    if args.task == "count":
        paths = write_counting_corpus(os.path.join(out, "data"), args.n_sft, args.n_rl, args.n_eval, args.seed,
                                      args.count_min, args.count_max, args.count_end, args.count_alt_sep)
    else:
        paths = write_addition_corpus(os.path.join(out, "data"), args.digits, args.n_sft, args.n_rl,
                                      args.n_eval, args.seed)
    tok = make_tokenizer(paths["sft"], hf_dir)
    config = llama_config(args, tok)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"[make_tiny_model] data in {out}/data, tokenizer vocab {tok.vocab_size} "
          f"(config vocab {config['vocab_size']}), config in {hf_dir} ({time.monotonic() - t0:.1f}s)")
    if args.reward_model:
        return make_reward_model(args, out, hf_dir)
    if args.skip_sft:
        return 0

    exports = run_sft(args, out)
    print(f"[make_tiny_model] SFT done ({time.monotonic() - t0:.1f}s)")
    model_dir = os.path.join(out, "model")
    step, accs = max(exports), {}
    if not args.skip_eval:
        if args.target_accuracy > 0:
            step, accs = choose_checkpoint(args, exports, paths["eval_prompts"],
                                           os.path.join(out, "eval_server"))
        else:
            accs = {step: evaluate_model(exports[step], paths["eval_prompts"], args.n_eval,
                                         answer_tokens(args), os.path.join(out, "eval_server")).accuracy}
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.copytree(exports[step], model_dir)
    print(f"[make_tiny_model] model in {model_dir}: SFT step {step}, greedy held-out accuracy "
          f"{accs.get(step, float('nan')):.3f} on {args.n_eval} prompts ({time.monotonic() - t0:.1f}s)")
    if accs:
        with open(os.path.join(out, "sft_eval.json"), "w") as f:
            json.dump({"greedy_accuracy": accs[step], "n": args.n_eval, "sft_step": step,
                       "sft_decay_steps": args.sft_decay_steps, "target_accuracy": args.target_accuracy,
                       "candidates": {str(k): v for k, v in sorted(accs.items())}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
