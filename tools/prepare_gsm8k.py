"""GSM8K -> megarl RL prompt files for the configs/qwen2.5-*-gsm8k.yaml recipes.

    python tools/prepare_gsm8k.py --out data/gsm8k                   # from the HF hub (datasets)
    python tools/prepare_gsm8k.py --out data/gsm8k --input DIR       # DIR/{train,test}.jsonl

Input rows are GSM8K's {"question", "answer": "<solution> #### <number>"} (the `openai/gsm8k`
"main" config, or the train.jsonl / test.jsonl of github.com/openai/grade-school-math). Output:
``OUT/train.jsonl`` and ``OUT/test.jsonl``, one {"prompt", "answer", "question"} per line, where
``prompt`` is the question in Qwen's chat format ending with the assistant turn (megarl feeds the
text to the tokenizer as is) and ``answer`` is the final number that
``megarl.rewards:math_reward`` compares against.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, REPO)

from megarl.rewards import extract_answer  # noqa: E402

INSTRUCTION = "Solve the problem step by step. Write the final answer as a number after \"####\"."
CHAT = "<|im_start|>user\n{question}\n{instruction}<|im_end|>\n<|im_start|>assistant\n"


def to_record(row: dict) -> dict:
    """One GSM8K row -> a megarl prompt record (error names the missing field)."""
    for key in ("question", "answer"):
        if key not in row:
            raise ValueError(f"GSM8K row without {key!r}: {str(row)[:80]}")
    answer = extract_answer(str(row["answer"]))
    if answer is None:
        raise ValueError(f"GSM8K answer without a final number: {str(row['answer'])[-80:]}")
    question = str(row["question"]).strip()
    return {"prompt": CHAT.format(question=question, instruction=INSTRUCTION), "answer": answer,
            "question": question}


def read_split(input_dir: str | None, split: str) -> list[dict]:
    if input_dir:
        with open(os.path.join(input_dir, f"{split}.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    try:
        from datasets import load_dataset
    except ImportError:
        raise SystemExit("prepare_gsm8k: pass --input DIR, or `pip install datasets` to download") from None
    return list(load_dataset("openai/gsm8k", "main", split=split))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--input", default=None, help="directory with GSM8K train.jsonl / test.jsonl")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    for split in ("train", "test"):
        records = [to_record(r) for r in read_split(a.input, split)]
        tmp = os.path.join(a.out, f".{split}.jsonl.tmp")
        with open(tmp, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, os.path.join(a.out, f"{split}.jsonl"))
        print(f"[prepare_gsm8k] {split}: {len(records)} prompts -> {a.out}/{split}.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
