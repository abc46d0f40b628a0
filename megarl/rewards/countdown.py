"""Countdown reward: combine the given numbers with + - * / to reach the target.

    countdown_reward(prompt, completion, meta) -> 1.0 | 0.0,  meta = {"numbers": [...], "target": t}

The equation is taken from the last ``<answer>...</answer>`` of the completion, else its last
``\\boxed{...}``, else its last line; an ``= ...`` tail is ignored. It scores 1.0 when it is
built only from + - * / and parentheses over integer literals, every literal is one of the given
numbers (each used at most once, as often as it appears in `numbers`), and its exact rational
value equals the target. No unary minus (not a Countdown move), no floats, no other operators;
evaluation is the whitelisted AST walker of `megarl.common.safe_math` (exact fractions).
"""
from __future__ import annotations

import collections
import re
from fractions import Fraction
from typing import Any, Optional

from megarl.rewards.math_answer import extract_boxed
from megarl.common.safe_math import FRACTIONS, UnsafeExpression, evaluate

__all__ = ["extract_equation", "check_countdown", "countdown_reward"]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def extract_equation(completion: str) -> Optional[str]:
    tagged = _ANSWER.findall(completion)
    if tagged:
        text = tagged[-1]
    else:
        text = extract_boxed(completion)
        if text is None:
            lines = [ln for ln in completion.strip().splitlines() if ln.strip()]
            text = lines[-1] if lines else ""
    text = text.split("=", 1)[0].replace("×", "*").replace("÷", "/").replace("\\times", "*")
    text = text.replace("\\div", "/").replace("\\cdot", "*").strip()
    return text or None


def check_countdown(equation: str, numbers: list[int], target) -> bool:
    """Whether `equation` reaches `target` using each of `numbers` at most once."""
    used: list = []
    try:
        value = evaluate(equation, FRACTIONS, max_chars=256, max_nodes=128, on_number=used.append)
    except (UnsafeExpression, ArithmeticError):
        return False
    available = collections.Counter(int(n) for n in numbers)
    if any(isinstance(u, float) for u in used) or collections.Counter(used) - available:
        return False
    return value == Fraction(str(target))


def countdown_reward(prompt: str, completion: str, meta: dict[str, Any]) -> float:
    equation = extract_equation(completion)
    if equation is None:
        return 0.0
    return 1.0 if check_countdown(equation, list(meta["numbers"]), meta["target"]) else 0.0
