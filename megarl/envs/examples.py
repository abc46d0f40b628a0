"""Environments megarl ships (serve one with ``megarl-env megarl.envs.examples:ToolEnv``).

    ToolEnv      tools the model calls, then an answer scored at the end: each turn's tool calls
                 run (`megarl.tools`: ``calculator``, or ``python`` - model-written code in the
                 bubblewrap sandbox, `megarl.tools.sandbox`) and answer as tool messages; a turn
                 without calls is the final answer, scored by ``reward_fn(prompt, answer, meta)``.
    GuessNumber  several turns acting on the answers: guess meta["answer"] in [low, high], told
                 "higher" or "lower" after each wrong guess; reward 1 for finding it (``delay_s``:
                 each step takes that long - a slow environment, for benchmarks and tests).
"""
from __future__ import annotations

import asyncio
import re
import time
from typing import Optional

from megarl.envs.base import Environment
from megarl.envs.types import Action, ProtocolError, StepResult, Task

__all__ = ["ToolEnv", "GuessNumber"]


class ToolEnv(Environment):
    def __init__(self, tools=("calculator",), reward_fn: str = "megarl.rewards:math_reward",
                 tool_timeout_s: float = 10.0, max_tool_calls: int = 4, max_result_chars: int = 2000):
        from megarl.rewards import load_reward_fn
        from megarl.tools import build_tools, tool_schema

        self._tools = build_tools(list(tools))
        self.tools = [tool_schema(t) for t in self._tools.values()]
        self.reward_fn = load_reward_fn(reward_fn)
        self.tool_timeout_s, self.max_tool_calls = tool_timeout_s, max_tool_calls
        self.max_result_chars = max_result_chars
        self.task: Optional[Task] = None

    def reset(self, task: Task, seed: Optional[int]) -> None:
        self.task = task

    async def _call(self, index: int, call) -> tuple[str, bool]:
        from megarl.tools import run_tool_call

        if index >= self.max_tool_calls:
            return f"error: more than {self.max_tool_calls} tool calls in one turn", False
        try:
            args = call.parsed_arguments()
        except ProtocolError as e:
            return f"error: {e}", False
        return await run_tool_call(self._tools, call.name, args, self.tool_timeout_s, self.max_result_chars)

    async def step(self, action: Action) -> StepResult:
        if not action.tool_calls:
            reward = await asyncio.to_thread(self.reward_fn, self.task.prompt, action.content, self.task.meta)
            return StepResult(reward=float(reward), done=True, info={"answered": True})
        results = await asyncio.gather(*(self._call(i, c) for i, c in enumerate(action.tool_calls)))
        observation = [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": text}
                       for c, (text, _) in zip(action.tool_calls, results)]
        return StepResult(observation, 0.0, False, {"tool_errors": sum(not ok for _, ok in results)})


_INT = re.compile(r"-?\d+")


class GuessNumber(Environment):
    def __init__(self, low: int = 0, high: int = 99, delay_s: float = 0.0):
        if low > high or delay_s < 0:
            raise ValueError(f"GuessNumber: need low <= high and delay_s >= 0, got {low}, {high}, {delay_s}")
        self.low, self.high = low, high
        self.delay_s = delay_s  # each step takes this long (time.sleep): a slow environment, for benchmarks
        self.secret: Optional[int] = None

    def reset(self, task: Task, seed: Optional[int]) -> None:
        self.secret = int(task.meta["answer"])

    def step(self, action: Action) -> StepResult:
        if self.delay_s:
            time.sleep(self.delay_s)  # a plain method: the server runs it in a worker thread
        found = _INT.findall(action.content)
        if not found:
            return StepResult([{"role": "user", "content": f"Guess a whole number from {self.low} to {self.high}."}])
        guess = int(found[-1])
        if guess == self.secret:
            return StepResult(reward=1.0, done=True, info={"guess": guess})
        hint = "higher" if guess < self.secret else "lower"
        return StepResult([{"role": "user", "content": hint}], info={"guess": guess})
