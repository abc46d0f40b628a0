"""Reward functions: a plugin contract, a loader by import path, and the built-in verifiers.

Contract: a reward function is a plain (synchronous) callable

    fn(prompt: str, completion: str, meta: dict) -> float

where `prompt` and `completion` are decoded text (completion without the prompt), and `meta` is the
prompt record's `meta` (every dataset field but the prompt, e.g. `meta["answer"]`). It must be
cheap, pure and thread-safe: the rollout executor may call it from worker threads. Configs name it
by import path, "package.module:function", resolved once at startup by `load_reward_fn`.
"""
from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, Optional, Protocol

__all__ = ["RewardFn", "load_reward_fn", "arith_exact_match", "first_word", "final_number",
           "gsm8k_match"]

# Text forms of EOS that a server may leave in decoded completions.
_EOS_STRINGS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<eos>")


class RewardFn(Protocol):
    def __call__(self, prompt: str, completion: str, meta: dict[str, Any]) -> float: ...


def load_reward_fn(path: str) -> RewardFn:
    """Resolve "module.sub:function" to a callable taking (prompt, completion, meta).

    Raises ValueError (malformed path), ImportError (module or attribute missing) or TypeError
    (not callable / incompatible signature); every message names `path`.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function path {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an import-time error in user code is a config problem too
        raise ImportError(f"cannot import module {module_name!r} of reward function {path!r}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"reward function {path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward function {path!r} is a {type(obj).__name__}, not a callable")
    if inspect.iscoroutinefunction(obj):
        raise TypeError(f"reward function {path!r} is async; the contract is a plain function")
    try:
        inspect.signature(obj).bind("prompt", "completion", {})
    except TypeError as e:
        raise TypeError(
            f"reward function {path!r} cannot be called as fn(prompt, completion, meta): {e}"
        ) from e
    except ValueError:
        pass  # builtins without an inspectable signature: trust them
    return obj


def first_word(completion: str) -> str:
    """The completion up to its first EOS marker, newline or whitespace (leading spaces skipped)."""
    for eos in _EOS_STRINGS:
        completion = completion.split(eos, 1)[0]
    words = completion.split(None, 1)
    return words[0] if words else ""


def arith_exact_match(prompt: str, completion: str, meta: dict[str, Any]) -> float:
    """1.0 if the first word of the completion equals str(meta["answer"]), else 0.0."""
    return 1.0 if first_word(completion) == str(meta["answer"]).strip() else 0.0


_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> Optional[str]:
    """The answer a math completion commits to, normalised ("1,234.50" -> "1234.5"): the number
    after the last "####" (GSM8K's marker), else inside the last \\boxed{...}, else the last number
    in the text. None when there is no number."""
    for eos in _EOS_STRINGS:
        text = text.split(eos, 1)[0]
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    elif "\\boxed{" in text:
        text = text.rsplit("\\boxed{", 1)[1].split("}", 1)[0]
    found = _NUMBER.findall(text)
    if not found:
        return None
    number = found[-1].replace(",", "").replace("$", "")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return number if number not in ("", "-") else None


def gsm8k_match(prompt: str, completion: str, meta: dict[str, Any]) -> float:
    """1.0 if the completion's final number (:func:`final_number`) equals the reference's; the
    reference ``meta["answer"]`` may be GSM8K's full solution ("... #### 72") or just "72"."""
    want = final_number(str(meta["answer"]))
    return 1.0 if want is not None and final_number(completion) == want else 0.0
