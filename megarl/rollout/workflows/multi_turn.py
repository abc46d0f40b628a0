"""Multi-turn rollouts: the policy answers, an environment replies, the reply becomes a new turn.

    trace = prompt (+ forced_prefix)                                          mask 0
    for turn in 0 .. max_turns-1:
        generated = client.agenerate(trace)   (partial rollouts inside)       mask 1, own versions
        step = await self.step(sample, turn, text, response, state)  -> EnvStep(reward, done, messages)
        stop if step.done, no turns left, aborted, or no room in max_seq_len
        trace += close-turn + render(step.messages) + next-turn header        mask 0
    reward = sum_t turn_discount**t * reward_t;  info["turns"] spans, info["turn_rewards"]

`step` is the environment; override it in a subclass (`ToolCallingWorkflow` runs tools there).
The default is answer feedback: the turn is scored by the reward function; a score below
`success_reward` is answered with `feedback` as a user turn until the answer is right or
`max_turns` are used - so with the default discount a first-try answer scores 1, a second-try
answer `turn_discount`.

`forced_prefix` (text) is appended as context at the start of the first assistant turn: never
trained (mask 0), but part of that turn's text as the environment sees it. It exists to steer
small or untuned models deterministically (e.g. force a tool call in a test).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional

from megarl.data.prompts import PromptSample
from megarl.protocol.types import ModelRequest, ModelResponse, SamplingParams, Trajectory
from megarl.rollout.workflows.base import TokenTrace, WorkflowContext, completion_text
from megarl.rollout.workflows.turns import TurnRenderer

__all__ = ["EnvStep", "MultiTurnWorkflow"]


@dataclass
class EnvStep:
    """The environment's answer to one assistant turn."""

    reward: float  # this turn's reward
    done: bool  # end the episode after this turn
    messages: list[dict] = field(default_factory=list)  # feedback turns ({"role", "content"}) if not done
    info: dict = field(default_factory=dict)  # merged into the turn's record in info["turns"]


class MultiTurnWorkflow:
    """Options (``rollout.workflow_args``): max_turns, turn_discount, success_reward, feedback,
    forced_prefix, plain_formats (role -> "...{content}..." when prompts have no chat template),
    group_size (default: the context's)."""

    # Set by subclasses before __init__ runs: tool schemas for the chat template, stop strings.
    tool_schemas: Optional[list[dict]] = None
    extra_stop: tuple[str, ...] = ()

    def __init__(self, ctx: WorkflowContext, max_turns: int = 2, turn_discount: float = 1.0,
                 success_reward: float = 1.0, feedback: str = "Your answer is not correct. Try again.",
                 forced_prefix: str = "", plain_formats: Optional[dict[str, str]] = None,
                 group_size: Optional[int] = None):
        if max_turns < 1 or not 0.0 < turn_discount <= 1.0:
            raise ValueError("workflow_args: need max_turns >= 1 and 0 < turn_discount <= 1")
        self.ctx, self.max_turns, self.turn_discount = ctx, max_turns, turn_discount
        self.success_reward, self.feedback = success_reward, feedback
        self.group_size = group_size or ctx.group_size
        self.forced_prefix = forced_prefix
        self.forced_ids = ctx.tokenizer.encode(forced_prefix) if forced_prefix else []
        self.turns = TurnRenderer(ctx.tokenizer, ctx.chat_template, plain_formats, self.tool_schemas)

    # ---- the environment ----------------------------------------------------------------------
    async def step(self, sample: PromptSample, turn: int, text: str, response: ModelResponse,
                   state: dict) -> EnvStep:
        """Answer feedback (override for other environments). `state` is per trajectory."""
        reward = await self.ctx.reward(sample.prompt, text, sample.meta)
        if reward >= self.success_reward:
            return EnvStep(reward, True)
        return EnvStep(reward, False, [{"role": "user", "content": self.feedback}])

    async def begin(self, sample: PromptSample, k: int, state: dict) -> None:
        """Before trajectory `k`'s first turn (an environment server's reset); nothing by default."""

    async def finish(self, state: dict) -> None:
        """After its last turn, also when the trajectory raised; nothing by default."""

    def abandon(self, state: dict) -> None:
        """When the trajectory was cancelled (no await allowed): release what `begin` took; nothing
        by default."""

    # ---- the rollout ----------------------------------------------------------------------------
    def completion_text(self, tokens: list[int]) -> str:
        return completion_text(self.ctx.tokenizer, tokens)

    async def arun_episode(self, client, sample: PromptSample) -> Optional[list[Trajectory]]:
        if self.ctx.budget(len(sample.prompt_ids) + len(self.forced_ids)) == 0:
            return None  # no room for a single generated token
        tasks = [asyncio.ensure_future(self._trajectory(client, sample, k)) for k in range(self.group_size)]
        try:
            return list(await asyncio.gather(*tasks))
        except Exception:
            for t in tasks:  # the group is re-run as a whole: its other trajectories stop now
                t.cancel()
            raise

    def _sampling(self, sample: PromptSample, budget: int, k: int, turn: int) -> SamplingParams:
        sp = self.ctx.sampling_for(sample, budget)
        if self.extra_stop:
            sp.stop = list(sp.stop or []) + list(self.extra_stop)
        if sp.seed is not None:
            sp.seed = (sp.seed * 1_000_003 + k) * 1_000_003 + turn
        return sp

    async def _trajectory(self, client, sample: PromptSample, k: int) -> Trajectory:
        state: dict = {}
        await self.begin(sample, k, state)
        try:
            result = await self._turns(client, sample, k, state)
        except (asyncio.CancelledError, GeneratorExit):
            self.abandon(state)  # no await while being torn down
            raise
        except BaseException:
            await self.finish(state)
            raise
        await self.finish(state)
        return result

    async def _turns(self, client, sample: PromptSample, k: int, state: dict) -> Trajectory:
        trace, turns = TokenTrace(list(sample.prompt_ids)), []
        trace.add_context(self.forced_ids)
        segments, text, resp = 0, "", None
        for turn in range(self.max_turns):
            budget = self.ctx.budget(len(trace))
            if budget == 0:
                break
            resp = await client.agenerate(ModelRequest(list(trace.input_ids), self._sampling(sample, budget, k, turn)))
            start = len(trace)
            trace.add_generated(resp)
            segments += resp.num_segments
            text = (self.forced_prefix if turn == 0 else "") + self.completion_text(resp.output_tokens)
            last = turn == self.max_turns - 1 or resp.stop_reason == "abort"
            step = await self.step(sample, turn, text, resp, state)
            turns.append({"start": start, "end": len(trace), "reward": float(step.reward),
                          "stop_reason": resp.stop_reason, **step.info})
            if step.done or last:
                break
            between = self.turns.close(resp.output_tokens) + self.turns.messages(step.messages)
            if self.ctx.budget(len(trace) + len(between)) == 0:
                break  # the feedback would leave no room for the next answer
            trace.add_context(between)
        rewards = [t["reward"] for t in turns]
        reward = sum(r * self.turn_discount ** i for i, r in enumerate(rewards))
        return trace.to_trajectory(reward, sample.index, {
            "completion": text, "turns": turns, "turn_rewards": rewards, "num_turns": len(turns),
            "stop_reason": resp.stop_reason if resp else "length", "segments": segments})
