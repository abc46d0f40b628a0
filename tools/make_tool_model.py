"""Build the tool-use recipe's start model: 2-digit products a tiny model cannot compute, a
calculator it can call, SFT on demonstrations where only some of the answers use the tool.

    python tools/make_tool_model.py --out examples/tiny_tool [--tool-share 0.25] [--sft-steps 600]

Writes
    DIR/data/sft.jsonl            chat conversations (record "tools": the calculator's schema): a
                                  --tool-share of them call the calculator and answer its result,
                                  the rest answer at once (the right product, which the model can
                                  only guess: 2-digit x 2-digit)
    DIR/data/{rl,eval}_prompts.jsonl   {"messages": [{"role": "user", "content": "37*48"}], "answer": "1776"}
                                  (the eval pairs appear nowhere else)
    DIR/hf/                       a character tokenizer (tokenizer.json) with ChatML specials, a
                                  compact ChatML chat template (tokenizer_config.json), a Llama config
    DIR/sft_run/                  the SFT run (megarl-train configs/tiny_tool_sft.yaml, random init)
    DIR/model/                    its last export: the RL start (configs/tiny_tool_grpo.yaml)

The warm start answers most prompts at once and calls the tool on a share of the samples; greedy,
it mostly guesses. RL against the tool environment (megarl.envs.examples:ToolEnv, no forced
prefix) is rewarded whenever a sampled episode used the calculator and copied its answer.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megarl.tools import CalculatorTool, tool_schema  # noqa: E402

SPECIALS = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
# ChatML with the tools named in one system line (the schemas stay out of the context: a tiny model's
# sequences stay short); tool results come back as <tool_response> blocks in a user turn, as Qwen's do.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool_call(a: int, b: int) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%d*%d"}}</tool_call>' % (a, b)


def conversation(a: int, b: int, use_tool: bool) -> list[dict]:
    user = {"role": "user", "content": f"{a}*{b}"}
    if not use_tool:
        return [user, {"role": "assistant", "content": str(a * b)}]
    return [user, {"role": "assistant", "content": tool_call(a, b)},
            {"role": "tool", "name": "calculator", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]


def write_data(out: str, n_sft: int, n_rl: int, n_eval: int, tool_share: float, seed: int) -> dict:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    held, rest = pairs[:n_eval], pairs[n_eval:]
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    tools = [tool_schema(CalculatorTool())]
    paths = {k: os.path.join(out, "data", f"{k}.jsonl") for k in ("sft", "rl_prompts", "eval_prompts")}
    with open(paths["sft"], "w") as f:
        for i in range(n_sft):
            a, b = rest[i % len(rest)]
            f.write(json.dumps({"messages": conversation(a, b, rng.random() < tool_share), "tools": tools}) + "\n")
    for key, rows in (("rl_prompts", [rest[rng.randrange(len(rest))] for _ in range(n_rl)]), ("eval_prompts", held)):
        with open(paths[key], "w") as f:
            for a, b in rows:
                f.write(json.dumps({"messages": [{"role": "user", "content": f"{a}*{b}"}], "answer": str(a * b)}) + "\n")
    return paths


def write_tokenizer(hf: str) -> int:
    """tokenizer.json (one token per character, ChatML specials) + tokenizer_config.json with the
    template; returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(hf, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(os.path.join(hf, "tokenizer.json"))
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "chat_template": TEMPLATE},
                  f, indent=1)
    return len(vocab)


def write_config(hf: str, vocab: int, args) -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": -(-vocab // 16) * 16,
           "hidden_size": args.hidden, "intermediate_size": 2 * args.hidden, "num_hidden_layers": args.layers,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": args.hidden // 4, "hidden_act": "silu",
           "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
           "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
           "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
           "torch_dtype": "float32", "use_cache": True}
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tool-share", type=float, default=0.25, help="share of SFT answers that call the tool")
    ap.add_argument("--n-sft", type=int, default=4000)
    ap.add_argument("--n-rl", type=int, default=4000)
    ap.add_argument("--n-eval", type=int, default=200)
    ap.add_argument("--sft-steps", type=int, default=600)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", action="append", default=[], metavar="A.B=C")
    ap.add_argument("--skip-sft", action="store_true")
    args = ap.parse_args(argv)
    out, t0 = os.path.abspath(args.out), time.monotonic()
    paths = write_data(out, args.n_sft, args.n_rl, args.n_eval, args.tool_share, args.seed)
    hf = os.path.join(out, "hf")
    write_config(hf, write_tokenizer(hf), args)
    print(f"[make_tool_model] data in {out}/data, tokenizer and config in {hf}", flush=True)
    if args.skip_sft:
        return 0
    run = os.path.join(out, "sft_run")
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_tool_sft.yaml"),
           f"model.hf_path={hf}", f"data.train_path={paths['sft']}", f"train.steps={args.sft_steps}",
           f"train.run_dir={run}", f"checkpoint.hf_export_dir={run}/model", *args.override]
    print("[make_tool_model] SFT:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    model = os.path.join(out, "model")
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(os.path.join(run, "model"), model)
    print(f"[make_tool_model] model in {model} ({time.monotonic() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
