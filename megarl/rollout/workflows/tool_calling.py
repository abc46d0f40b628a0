"""Tool-calling rollouts: the policy writes Hermes/Qwen-style tool calls, tools answer as turns.

    assistant: ... <tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>
    tool:      84                                          (a <tool_response> turn, loss_mask 0)
    assistant: ... final answer                            (scored by the reward function)

Each assistant turn is parsed for ``<tool_call>`` JSON blocks (``arguments`` may be an object or
a JSON string). With calls, they run concurrently, each under `tool_timeout_s`, and their results
(or ``error: ...`` text: malformed JSON, unknown tool, bad arguments, a timeout) go back as
``{"role": "tool"}`` messages in call order; the turn's reward is 0. A turn without calls - or
the last allowed turn - ends the episode and is scored by ``ctx.reward`` on that turn's text.
The tools' schemas reach the model through the chat template's ``tools`` (the dataset renders
prompts with `tool_schemas`). Built on `MultiTurnWorkflow`: token accounting, per-token versions,
`turn_discount` and `forced_prefix` work the same.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Optional, Union

from megarl.data.prompts import PromptSample
from megarl.tools import build_tools, run_tool_call, tool_schema
from megarl.protocol.types import ModelResponse
from megarl.rollout.workflows.base import WorkflowContext
from megarl.rollout.workflows.multi_turn import EnvStep, MultiTurnWorkflow

__all__ = ["ToolCall", "parse_tool_calls", "ToolCallingWorkflow"]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    error: Optional[str] = None  # set when the block could not be parsed into name + arguments


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every complete ``<tool_call>{json}</tool_call>`` block of `text`, in order."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"invalid JSON in <tool_call>: {e.msg}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, 'a tool call needs {"name": str, "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, "tool call arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


class ToolCallingWorkflow(MultiTurnWorkflow):
    """Options (``rollout.workflow_args``): tools (built-in names "calculator", "python", dicts
    {name, **options} or "module:Class"), max_turns (default 4), tool_timeout_s, max_tool_calls
    (per turn; extra calls get an error), max_result_chars, stop_at_tool_call (add
    "</tool_call>" as a stop string), plus MultiTurnWorkflow's turn_discount, forced_prefix,
    plain_formats and group_size."""

    def __init__(self, ctx: WorkflowContext, tools: tuple[Union[str, dict], ...] = ("calculator",),
                 max_turns: int = 4, tool_timeout_s: float = 10.0, max_tool_calls: int = 4,
                 max_result_chars: int = 2000, stop_at_tool_call: bool = False, **kwargs):
        self.tools = build_tools(list(tools))
        self.tool_schemas = [tool_schema(t) for t in self.tools.values()]
        self.tool_timeout_s, self.max_tool_calls = tool_timeout_s, max_tool_calls
        self.max_result_chars = max_result_chars
        self.extra_stop = ("</tool_call>",) if stop_at_tool_call else ()
        super().__init__(ctx, max_turns=max_turns, **kwargs)

    async def _answer(self, call: ToolCall, index: int) -> tuple[str, bool]:
        if call.error is not None:
            return f"error: {call.error}", False
        if index >= self.max_tool_calls:
            return f"error: more than {self.max_tool_calls} tool calls in one turn", False
        return await run_tool_call(self.tools, call.name, call.arguments, self.tool_timeout_s,
                                   self.max_result_chars)

    async def step(self, sample: PromptSample, turn: int, text: str, response: ModelResponse,
                   state: dict) -> EnvStep:
        calls = parse_tool_calls(text)
        if not calls or turn == self.max_turns - 1 or response.stop_reason == "abort":
            reward = await self.ctx.reward(sample.prompt, text, sample.meta)
            return EnvStep(reward, True, info={"tool_calls": 0})
        results = await asyncio.gather(*(self._answer(c, i) for i, c in enumerate(calls)))
        messages = [{"role": "tool", "name": c.name, "content": content} for c, (content, _) in zip(calls, results)]
        return EnvStep(0.0, False, messages, info={
            "tool_calls": len(calls), "tool_errors": sum(not ok for _, ok in results),
            "tool_results": [content for content, _ in results]})
