"""Build the CPU demo model: addition corpus -> char tokenizer -> tiny Llama config -> SFT -> eval.

    python tools/make_tiny_model.py --out DIR [--digits 2] [--sft-steps N] [--hidden 128 --layers 4]

Writes
    DIR/data/{sft,rl_prompts,eval_prompts}.jsonl   the task (eval pairs never appear in the others)
    DIR/hf/{config.json,tokenizer.model}           an HF Llama config without weights
    DIR/sft_run/                                   the SFT run (metrics.jsonl, checkpoints)
    DIR/model/                                     the SFT'd model as an HF dir (the RL start point)
    DIR/eval_server/server0.log                    the CPU rollout server of the accuracy run
SFT is megarl itself (`python -m megarl.train configs/tiny_sft.yaml ...`, random init); greedy
accuracy on the held-out prompts is then measured through the CPU rollout server.
`--skip-sft` stops after the config; `--skip-eval` skips the accuracy run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, REPO)

from megarl.data.datasets import PromptDataset, read_jsonl  # noqa: E402
from megarl.data.tasks import write_addition_corpus  # noqa: E402
from megarl.data.tokenizer import SentencePieceTokenizer, load_tokenizer, train_sentencepiece  # noqa: E402
from megarl.rollout.client import RolloutClient  # noqa: E402
from megarl.rollout.evaluation import EvalResult, evaluate_samples  # noqa: E402
from megarl.rollout.local import LocalCluster  # noqa: E402
from megarl.rollout.rewards import arith_exact_match  # noqa: E402
from megarl.rollout.types import SamplingParams  # noqa: E402

TASK_CHARS = "0123456789+="


def make_tokenizer(sft_path: str, hf_dir: str) -> SentencePieceTokenizer:
    """Char-level vocab: <unk>=0, <s>=1, </s>=2, then digits, '+', '=' (and any other corpus char)."""
    texts = [row["prompt"] + row["response"] for _, row in read_jsonl(sft_path, ("prompt", "response"))]
    return train_sentencepiece(texts, hf_dir, vocab_size=64, model_type="char", required_chars=TASK_CHARS)


def llama_config(args: argparse.Namespace, tok: SentencePieceTokenizer) -> dict:
    """HF LlamaForCausalLM config; vocab rounded up to `--vocab-multiple` so TP can split it."""
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
    }


def run_sft(args: argparse.Namespace, out: str) -> None:
    cmd = [
        sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_sft.yaml"),
        f"model.hf_path={out}/hf", "model.init=random", f"data.train_path={out}/data/sft.jsonl",
        f"train.steps={args.sft_steps}", f"train.run_dir={out}/sft_run",
        f"checkpoint.hf_export_dir={out}/model", *args.override,
    ]
    print("[make_tiny_model] SFT:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def evaluate_model(model_dir: str, prompts_path: str, n: int, max_new_tokens: int, log_dir: str
                   ) -> EvalResult:
    """Greedy exact-answer accuracy on the first n prompts, through a local CPU rollout server."""
    tok = load_tokenizer(model_dir)
    samples = PromptDataset(prompts_path, tok).samples[:n]
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=[tok.eos_id])

    async def run(urls: list[str]) -> EvalResult:
        async with RolloutClient(urls) as client:
            return await evaluate_samples(client, samples, arith_exact_match, sampling, tok)

    with LocalCluster(model_dir, 1, log_dir) as urls:
        return asyncio.run(run(urls))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--digits", type=int, default=2, help="digits per operand")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-sft", type=int, default=5000, help="SFT examples")
    ap.add_argument("--n-rl", type=int, default=5000, help="RL prompts")
    ap.add_argument("--n-eval", type=int, default=500, help="held-out eval prompts")
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--max-pos", type=int, default=64, help="max_position_embeddings")
    ap.add_argument("--vocab-multiple", type=int, default=16, help="round vocab_size up to this")
    ap.add_argument("--override", action="append", default=[], metavar="A.B=C",
                    help="extra megarl.train override for the SFT run (repeatable)")
    ap.add_argument("--skip-sft", action="store_true", help="stop after data, tokenizer and config")
    ap.add_argument("--skip-eval", action="store_true", help="do not measure held-out accuracy")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    hf_dir = os.path.join(out, "hf")
    t0 = time.monotonic()

    longest = 1 + args.digits * 2 + 2 + (args.digits + 1) + 1  # bos a + b = sum eos
    if longest > args.max_pos:
        raise SystemExit(f"--max-pos {args.max_pos} < longest sample ({longest} tokens)")
    paths = write_addition_corpus(os.path.join(out, "data"), args.digits, args.n_sft, args.n_rl,
                                  args.n_eval, args.seed)
    tok = make_tokenizer(paths["sft"], hf_dir)
    config = llama_config(args, tok)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"[make_tiny_model] data in {out}/data, tokenizer vocab {tok.vocab_size} "
          f"(config vocab {config['vocab_size']}), config in {hf_dir} ({time.monotonic() - t0:.1f}s)")
    if args.skip_sft:
        return 0

    run_sft(args, out)
    print(f"[make_tiny_model] SFT done, model in {out}/model ({time.monotonic() - t0:.1f}s)")
    if not args.skip_eval:
        acc = evaluate_model(os.path.join(out, "model"), paths["eval_prompts"], args.n_eval,
                             args.digits + 3, os.path.join(out, "eval_server")).accuracy
        print(f"[make_tiny_model] greedy held-out accuracy {acc:.3f} on {args.n_eval} prompts "
              f"({time.monotonic() - t0:.1f}s)")
        with open(os.path.join(out, "sft_eval.json"), "w") as f:
            json.dump({"greedy_accuracy": acc, "n": args.n_eval}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
