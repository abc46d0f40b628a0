"""Synthetic tasks with programmatic verifiers: multi-digit addition ("12+34=" -> "46") and
counting ("100+352=" -> "100+101+...+352", answers of 1,000+ tokens for the long-response recipe).

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
    "CountingTask",
    "write_counting_corpus",
    "write_jsonl",
    "write_addition_corpus",
]

_EVAL_STREAM, _SFT_STREAM, _RL_STREAM = 0, 1, 2


class _PairTask:
    """What both tasks share: seeded draws over their pairs (k -> `pair(k)`), a held-out set that is
    the same whatever else is drawn, and the SFT / RL rows of a list of pairs."""

    seed: int
    num_pairs: int

    def pair(self, k: int) -> tuple[int, int]:
        raise NotImplementedError

    def prompt(self, a: int, b: int) -> str:
        raise NotImplementedError

    def answer(self, a: int, b: int) -> str:
        raise NotImplementedError

    def _rng(self, stream: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + stream)

    def held_out(self, n: int) -> list[tuple[int, int]]:
        """n distinct pairs, the same for a given task and seed whatever else is generated."""
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


@dataclass(frozen=True)
class AdditionTask(_PairTask):
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


@dataclass(frozen=True)
class CountingTask(_PairTask):
    """Count from a to b, both 3-digit: prompt "a+b=", answer "a+(a+1)+...+b", so an answer of n
    numbers is 4n - 1 characters. n is drawn from [min_count, max_count]; the defaults make every
    answer 1,003-1,063 characters (one token each with the char tokenizer), plus EOS. A pair is
    (a, n); held-out pairs never appear among the training ones. With ``end`` every count ends at
    that number (a = end - n + 1): the stop is read from the last number written, not compared
    with the prompt, and there are max_count - min_count + 1 pairs. With ``alt_sep`` (a character
    other than a digit, '+' or '='), the SFT rows hold every pair twice, once written with '+' and
    once with ``alt_sep`` between the numbers, while the RL answer is the '+' one: a model tuned on
    them picks a separator at random at its answer's fourth token and keeps it to the end, so
    RL has one decision to learn, ~1,000 tokens before the answer is complete and checked."""

    min_count: int = 251
    max_count: int = 266
    seed: int = 0
    end: int = 0  # 0: any b (a from 100 up); else every count ends at this 3-digit number
    alt_sep: str = ""  # "": SFT on the '+' answers only

    def __post_init__(self):
        if not 1 <= self.min_count <= self.max_count <= 900:
            raise ValueError(f"need 1 <= min_count <= max_count <= 900, got {self.min_count}, {self.max_count}")
        if self.end and not 100 + self.max_count - 1 <= self.end <= 999:
            raise ValueError(f"end must be a 3-digit number >= 99 + max_count, got {self.end}")
        if self.alt_sep and (len(self.alt_sep) != 1 or self.alt_sep in "0123456789+=" or self.alt_sep.isspace()):
            raise ValueError("alt_sep must be one character other than a digit, '+', '=' or a space, "
                             f"got {self.alt_sep!r}")

    @property
    def num_pairs(self) -> int:
        counts = self.max_count - self.min_count + 1
        return counts if self.end else (900 - self.max_count + 1) * counts

    def pair(self, k: int) -> tuple[int, int]:
        a, n = divmod(k, self.max_count - self.min_count + 1)
        n += self.min_count
        return (self.end - n + 1, n) if self.end else (100 + a, n)

    @staticmethod
    def prompt(a: int, n: int) -> str:
        return f"{a}+{a + n - 1}="

    @staticmethod
    def answer(a: int, n: int, sep: str = "+") -> str:
        return sep.join(str(x) for x in range(a, a + n))

    def sft_rows(self, pairs: Iterable[tuple[int, int]]) -> Iterator[dict]:
        seps = ("+", self.alt_sep) if self.alt_sep else ("+",)
        return ({"prompt": self.prompt(a, n), "response": self.answer(a, n, sep)} for a, n in pairs for sep in seps)


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


def write_counting_corpus(out_dir: str, n_sft: int = 4000, n_rl: int = 2000, n_eval: int = 64, seed: int = 0,
                          min_count: int = 251, max_count: int = 266, end: int = 0, alt_sep: str = ""
                          ) -> dict[str, str]:
    """The counting task's sft.jsonl, rl_prompts.jsonl and eval_prompts.jsonl (as the addition corpus;
    with ``alt_sep`` the SFT rows are 2 x n_sft, each pair in both writings)."""
    task = CountingTask(min_count, max_count, seed, end, alt_sep)
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in ("sft", "rl_prompts", "eval_prompts")}
    write_jsonl(paths["sft"], task.sft_rows(task.training_pairs(n_sft, n_eval, _SFT_STREAM)))
    write_jsonl(paths["rl_prompts"], task.rl_rows(task.training_pairs(n_rl, n_eval, _RL_STREAM)))
    write_jsonl(paths["eval_prompts"], task.rl_rows(task.held_out(n_eval)))
    return paths
