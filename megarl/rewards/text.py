"""Exact-match rewards on decoded text: the tiny addition demo's verifier and its helper."""
from __future__ import annotations

from typing import Any

__all__ = ["EOS_STRINGS", "first_word", "arith_exact_match"]

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
