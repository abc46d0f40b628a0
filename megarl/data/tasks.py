"""Synthetic tasks with programmatic verifiers: multi-digit addition ("12+34=" -> "46").

The CPU demo and the RL benchmarks train on it: `write_addition_corpus` emits SFT pairs, RL prompts
and a held-out eval set that never shares a pair with the other two, all fixed by (digits, seed).
Its verifier is `megarl.rewards.arith_exact_match`; held-out accuracy is measured by
`megarl.rollout.evaluation` (this module stays data only: nothing under megarl.data imports rollout).
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Iterable, Iterator

__all__ = [
    "AdditionTask",
    "write_jsonl",
    "write_addition_corpus",
]

_EVAL_STREAM, _SFT_STREAM, _RL_STREAM = 0, 1, 2


@dataclass(frozen=True)
class AdditionTask:
    """a + b with both operands of exactly `digits` digits (0-9 for digits=1)."""

    digits: int = 2
    seed: int = 0

    def __post_init__(self):
        if self.digits < 1:
            raise ValueError(f"digits must be >= 1, got {self.digits}")

    @property
    def low(self) -> int:
        return 0 if self.digits == 1 else 10 ** (self.digits - 1)

    @property
    def num_pairs(self) -> int:
        return (10 ** self.digits - self.low) ** 2

    def pair(self, k: int) -> tuple[int, int]:
        """The k-th (a, b) in row-major order over the operand range."""
        a, b = divmod(k, 10 ** self.digits - self.low)
        return a + self.low, b + self.low

    @staticmethod
    def prompt(a: int, b: int) -> str:
        return f"{a}+{b}="

    @staticmethod
    def answer(a: int, b: int) -> str:
        return str(a + b)

    def _rng(self, stream: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + stream)

    def held_out(self, n: int) -> list[tuple[int, int]]:
        """n distinct pairs, the same for a given (digits, seed) whatever else is generated."""
        if n > self.num_pairs:
            raise ValueError(f"{n} held-out pairs requested; only {self.num_pairs} exist")
        return [self.pair(k) for k in self._rng(_EVAL_STREAM).sample(range(self.num_pairs), n)]

    def training_pairs(self, n: int, n_held_out: int, stream: int = _SFT_STREAM) -> list[tuple[int, int]]:
        """n pairs drawn with replacement from those NOT in `held_out(n_held_out)`."""
        excluded = set(self.held_out(n_held_out))
        if len(excluded) >= self.num_pairs and n > 0:
            raise ValueError("the held-out set covers every pair; nothing is left to train on")
        rng, out = self._rng(stream), []
        while len(out) < n:
            p = self.pair(rng.randrange(self.num_pairs))
            if p not in excluded:
                out.append(p)
        return out

    def sft_rows(self, pairs: Iterable[tuple[int, int]]) -> Iterator[dict]:
        return ({"prompt": self.prompt(a, b), "response": self.answer(a, b)} for a, b in pairs)

    def rl_rows(self, pairs: Iterable[tuple[int, int]]) -> Iterator[dict]:
        return ({"prompt": self.prompt(a, b), "answer": self.answer(a, b)} for a, b in pairs)


def write_jsonl(path: str, rows: Iterable[dict]) -> int:
    """Write one JSON object per line; returns the number written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            n += 1
    return n


def write_addition_corpus(
    out_dir: str, digits: int = 2, n_sft: int = 5000, n_rl: int = 5000, n_eval: int = 500, seed: int = 0
) -> dict[str, str]:
    """sft.jsonl {"prompt","response"}, rl_prompts.jsonl and eval_prompts.jsonl {"prompt","answer"}."""
    task = AdditionTask(digits, seed)
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in ("sft", "rl_prompts", "eval_prompts")}
    write_jsonl(paths["sft"], task.sft_rows(task.training_pairs(n_sft, n_eval, _SFT_STREAM)))
    write_jsonl(paths["rl_prompts"], task.rl_rows(task.training_pairs(n_rl, n_eval, _RL_STREAM)))
    write_jsonl(paths["eval_prompts"], task.rl_rows(task.held_out(n_eval)))
    return paths
