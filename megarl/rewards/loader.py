"""Reward functions by import path: "package.module:function", or ":Class" built with
``reward.args``. Used by the reward runtime (`base`) and by reward worker processes (`pool`), which
import this module alone (no event loop, no torch)."""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Optional

# configs written before the reward package left megarl.rollout still name it there
_MOVED = {"megarl.rollout.rewards": "megarl.rewards"}


def is_async_callable(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _resolve(path: str) -> Any:
    module_name, sep, attr = path.partition(":")
    module_name = _MOVED.get(module_name, module_name)
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
    return obj


def load_reward_fn(path: str, args: Optional[dict] = None):
    """Resolve "module.sub:function" (or ":Class", built with `args`) to a reward callable.

    Raises ValueError (malformed path), ImportError (module or attribute missing) or TypeError
    (not callable, incompatible signature, args for a function); every message names `path`.
    """
    obj = _resolve(path)
    if inspect.isclass(obj):
        try:
            obj = obj(**(args or {}))
        except TypeError as e:
            raise TypeError(f"reward class {path!r} cannot be built from reward.args {args or {}}: {e}") from e
    elif args:
        raise TypeError(f"reward.args {sorted(args)} given but {path!r} is not a class")
    if not callable(obj):
        raise TypeError(f"reward function {path!r} is a {type(obj).__name__}, not a callable")
    try:
        inspect.signature(obj).bind("prompt", "completion", {})
    except TypeError as e:
        raise TypeError(
            f"reward function {path!r} cannot be called as fn(prompt, completion, meta): {e}"
        ) from e
    except ValueError:
        pass  # builtins without an inspectable signature: trust them
    return obj


def check_reward_path(path: str, args: Optional[dict] = None) -> None:
    """What `load_reward_fn` checks, without building a class: a preflight must not open a
    plugin's connections or processes. A class's constructor must take ``args``; a function
    must take (prompt, completion, meta) and no args."""
    obj = _resolve(path)
    if not inspect.isclass(obj):
        load_reward_fn(path, args)
        return
    try:
        inspect.signature(obj).bind(**(args or {}))
    except TypeError as e:
        raise TypeError(f"reward class {path!r} cannot be built from reward.args {args or {}}: {e}") from e

