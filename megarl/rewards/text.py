"""Rewards on decoded text: exact match (the tiny addition demo's verifier) and prefix credit (the
long counting recipe's), and their helper."""
from __future__ import annotations

from typing import Any

__all__ = ["EOS_STRINGS", "first_word", "arith_exact_match", "prefix_match"]

# Text forms of EOS that a server may leave in decoded completions.
EOS_STRINGS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<eos>")


def first_word(completion: str) -> str:
    """The completion up to its first EOS marker, newline or whitespace (leading spaces skipped)."""
    for eos in EOS_STRINGS:
        completion = completion.split(eos, 1)[0]
    words = completion.split(None, 1)
    return words[0] if words else ""


def arith_exact_match(prompt: str, completion: str, meta: dict[str, Any]) -> float:
    """1.0 if the first word of the completion equals str(meta["answer"]), else 0.0."""
    return 1.0 if first_word(completion) == str(meta["answer"]).strip() else 0.0


def prefix_match(prompt: str, completion: str, meta: dict[str, Any]) -> float:
    """Partial credit for a long exact answer: the characters of the first word before its first
    difference from str(meta["answer"]), over the longer of the two - 1.0 exactly when they are
    equal; stopping early and running on past the answer both lose. What a 1,000-character answer
    needs to learn from (exact match alone is 0 until every character is right)."""
    got, want = first_word(completion), str(meta["answer"]).strip()
    if not want:
        return 1.0 if not got else 0.0
    n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return n / max(len(got), len(want))
