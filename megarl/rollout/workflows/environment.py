"""Rollouts against environment servers (`megarl.envs`: gym's reset / step over HTTP).

    trajectory k of a prompt:
      reset(task = the prompt's text and fields, seed)  -> an episode on the least-loaded server
      turn t:  generated = client.agenerate(trace)                     mask 1, own versions
               step(action = {content: text, tool_calls: parsed})      -> observation, reward, done
               stop if done, no turns left, aborted or no room in max_seq_len
               trace += close-turn + render(observation) + next-turn header   mask 0
      close(episode)                     (always, also on errors; a cancelled one in the background)
    reward = sum_t turn_discount**t * reward_t (the environment's), info["turns"] per turn

Token-in, token-out: the trainer trains exactly the token ids the servers generated; the
environment's messages enter the trace through the chat template (`TurnRenderer`) as context
(loss_mask 0). A weight push in the middle of a turn is a partial rollout inside
``client.agenerate``: each token keeps its own version, turn after turn.

Tool calls are parsed Hermes/Qwen-style (``<tool_call>{json}</tool_call>``) and sent as OpenAI
``tool_calls``; the environment's ``tools`` (its /info) are rendered into every prompt by the chat
template. An episode that fails (`EnvError`: its server died, the environment raised or overran
env.step_timeout_s) is closed and its trajectory run again from the start, up to
env.episode_retries times (``info["env_retries"]``); then the error reaches the controller, which
retries the prompt's group (rollout.max_retries) and at last records it as failed - no prompt is
lost or trained twice.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Optional

from megarl.data.prompts import PromptSample
from megarl.envs.client import EnvError, fetch_info
from megarl.envs.types import Action, Task, ToolCallMsg
from megarl.protocol.types import ModelResponse, Trajectory
from megarl.rollout.http import backoff_delay
from megarl.rollout.workflows.base import WorkflowContext
from megarl.rollout.workflows.multi_turn import EnvStep, MultiTurnWorkflow
from megarl.rollout.workflows.tool_calling import parse_tool_calls

__all__ = ["EnvironmentWorkflow", "action_of"]

log = logging.getLogger("megarl.rollout")

RETRY_BACKOFF_S = 0.5  # before a failed episode's re-run: doubled each time, at most 5 s


def action_of(text: str, turn: int) -> tuple[Action, int]:
    """(the turn as an OpenAI assistant message, malformed tool-call blocks left out of it)."""
    calls = parse_tool_calls(text)
    good = [ToolCallMsg(f"call_{turn}_{i}", c.name, json.dumps(c.arguments)) for i, c in enumerate(calls)
            if c.error is None]
    return Action(text, good), len(calls) - len(good)


class EnvironmentWorkflow(MultiTurnWorkflow):
    """Options (``rollout.workflow_args``): max_turns (default 8), stop_at_tool_call (add
    "</tool_call>" as a stop string), plus MultiTurnWorkflow's turn_discount, plain_formats,
    forced_prefix and group_size. The servers come from env.cls / env.urls (``ctx.env``)."""

    def __init__(self, ctx: WorkflowContext, max_turns: int = 8, stop_at_tool_call: bool = False, **kwargs):
        if ctx.env is None:
            raise ValueError("rollout.workflow: EnvironmentWorkflow needs environment servers (env.cls or env.urls)")
        self.env = ctx.env
        try:
            info = fetch_info(self.env.urls[0], self.env.api_key)
        except EnvError as e:
            raise ValueError(f"env: {e}") from None
        self.tool_schemas = info.get("tools") or None
        self.extra_stop = ("</tool_call>",) if stop_at_tool_call else ()
        super().__init__(ctx, max_turns=max_turns, **kwargs)

    async def begin(self, sample: PromptSample, k: int, state: dict) -> None:
        seed = None if sample.seed is None else (sample.seed * 1_000_003 + k) % 2**62
        state["episode"] = await self.env.reset(Task(sample.prompt, dict(sample.meta or {})), seed)

    async def finish(self, state: dict) -> None:
        if "episode" in state:
            await self.env.close(state["episode"])

    def abandon(self, state: dict) -> None:
        if "episode" in state:
            self.env.abandon(state["episode"])

    async def step(self, sample: PromptSample, turn: int, text: str, response: ModelResponse,
                   state: dict) -> EnvStep:
        if response.stop_reason == "abort":  # cut off, not a turn the model ended: nothing to act on
            return EnvStep(0.0, True, info={"tool_calls": 0, "aborted": True})
        action, malformed = action_of(text, turn)
        result = await self.env.step(state["episode"], action)
        return EnvStep(result.reward, result.done, result.observation, info={
            "tool_calls": len(action.tool_calls), "tool_parse_errors": malformed, "env_info": result.info})

    async def _trajectory(self, client, sample: PromptSample, k: int) -> Trajectory:
        last: Optional[EnvError] = None
        for attempt in range(self.env.episode_retries + 1):
            try:
                t = await super()._trajectory(client, sample, k)
            except EnvError as e:
                last = e
                self.env.stats["episode_retries" if attempt < self.env.episode_retries else "episodes_failed"] += 1
                log.warning("prompt %d trajectory %d: episode failed (attempt %d of %d): %s", sample.index, k,
                            attempt + 1, self.env.episode_retries + 1, e)
                if attempt < self.env.episode_retries:
                    await asyncio.sleep(backoff_delay(attempt, RETRY_BACKOFF_S, 5.0))  # a restart takes seconds
                continue
            t.info["env_retries"] = attempt
            return t
        raise last
