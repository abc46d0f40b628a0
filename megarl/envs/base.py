"""The class an environment is written as. One instance per episode (gym's model: its state is
the instance's), built by the environment server as ``cls(**env.args)`` at each /reset:

    class GuessNumber(Environment):
        def reset(self, task, seed):               # bind the episode to its task
            self.secret = int(task.meta["answer"])
        def step(self, action):                    # one assistant turn -> observation, reward, done
            guess = int(action.content.strip())
            if guess == self.secret:
                return StepResult(reward=1.0, done=True)
            return StepResult([{"role": "user", "content": "higher" if guess < self.secret else "lower"}])

``reset``, ``step`` and ``close`` may be plain or ``async`` methods: the server awaits coroutines
on its loop and runs plain methods in a worker thread, so a slow environment holds only its own
episodes. ``tools`` (OpenAI function schemas) reach the model through the chat template; the
server's /info lists them. Served with ``megarl-env pkg.module:Class --args '{"k": v}'``.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import Any, Optional

from megarl.envs.types import Action, ResetResult, StepResult, Task

__all__ = ["Environment", "load_environment", "call_maybe_async"]


class Environment:
    """One episode of an environment (see the module docstring); subclass it and override
    `reset`, `step` and, when it holds resources, `close`."""

    tools: list[dict] = []

    def __init__(self, **args: Any):
        if args:
            raise TypeError(f"{type(self).__name__} takes no arguments, got {sorted(args)}")

    def reset(self, task: Task, seed: Optional[int]) -> Optional[ResetResult]:
        return None

    def step(self, action: Action) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        return None


def load_environment(path: str) -> type:
    """``pkg.module:Class`` -> the class; ValueError in one line naming the path."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"environment {path!r}: expected 'package.module:Class'")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"environment {path!r}: cannot load it: {e}") from None
    if not (inspect.isclass(cls) and callable(getattr(cls, "step", None))):
        raise ValueError(f"environment {path!r}: not a class with a step method")
    return cls


async def call_maybe_async(fn, *args):
    """``fn(*args)``: awaited on the loop when it is a coroutine function, else in a worker thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await asyncio.to_thread(fn, *args)
    if inspect.isawaitable(result):
        result = await result
    return result
