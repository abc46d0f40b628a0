"""Rollout workflows: how one prompt becomes a group of scored trajectories.

A workflow is a plugin (``rollout.workflow: "module:Class"``) implementing

    async def arun_episode(self, client: RolloutClient, sample: PromptSample) -> list[Trajectory]

The executor calls it concurrently from the controller's event loop; it must not block the loop
(CPU-heavy reward code belongs in a thread). :class:`SingleTurnWorkflow` is the GRPO default:
``group_size`` samples of the prompt, each scored by the reward function on its decoded text.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib
import math
import random
from typing import Protocol

from megarl.data.datasets import PromptSample
from megarl.rollout.rewards import RewardFn
from megarl.rollout.types import ModelRequest, SamplingParams, Trajectory


def completion_text(tokenizer, tokens: list[int]) -> str:
    """Generated tokens decoded up to (without) the first EOS: what reward functions see."""
    eos = tokenizer.eos_id
    return tokenizer.decode(tokens[: tokens.index(eos)] if eos in tokens else tokens)


class RolloutWorkflow(Protocol):
    async def arun_episode(self, client, sample: PromptSample) -> list[Trajectory]: ...


class SingleTurnWorkflow:
    def __init__(self, tokenizer, reward_fn: RewardFn, sampling: SamplingParams, group_size: int):
        self.tokenizer, self.reward_fn = tokenizer, reward_fn
        self.sampling, self.group_size = sampling, group_size

    async def arun_episode(self, client, sample: PromptSample) -> list[Trajectory]:
        req = ModelRequest(list(sample.prompt_ids), self.sampling)
        responses = await client.agenerate_n(req, self.group_size)
        return await self.ascore(sample, responses)

    async def ascore(self, sample: PromptSample, responses) -> list[Trajectory]:
        """Rewards (in a thread: reward code may be CPU-heavy) and one Trajectory per response."""
        texts = [completion_text(self.tokenizer, r.output_tokens) for r in responses]
        rewards = await asyncio.to_thread(
            lambda: [float(self.reward_fn(sample.prompt, t, sample.meta)) for t in texts])
        out = []
        for r, reward, text in zip(responses, rewards, texts):
            p, o = len(r.input_tokens), len(r.output_tokens)
            out.append(Trajectory(
                input_ids=list(r.input_tokens) + list(r.output_tokens), loss_mask=[0] * p + [1] * o,
                behave_logp=[0.0] * p + list(r.output_logprobs), versions=[-1] * p + list(r.output_versions),
                reward=reward, group_id=sample.index,
                info={"completion": text, "stop_reason": r.stop_reason, "segments": r.num_segments}))
        return out


class LongTailWorkflow(SingleTurnWorkflow):
    """SingleTurnWorkflow whose samples each get their own generation budget from a long-tailed
    (Pareto) law, for benchmarks of asynchronous training under long-tailed response lengths:

        budget_i = min(max_new_tokens, floor(min_new_tokens * u_i ** (-1 / alpha))),  u_i ~ U(0, 1]

    so P(budget > x) = (min_new_tokens / x) ** alpha (alpha = 1: median 2 x min, a few percent at
    the cap). Run it with ``rollout.ignore_eos: true`` and every sample generates exactly its budget
    (the reward still reads the text up to the first EOS). Options come from
    ``rollout.workflow_kwargs``; budgets are seeded by (seed, prompt index, draw of the group), so a
    re-run draws the same lengths.
    """

    def __init__(self, tokenizer, reward_fn: RewardFn, sampling: SamplingParams, group_size: int,
                 min_new_tokens: int = 4, alpha: float = 1.0, seed: int = 0):
        super().__init__(tokenizer, reward_fn, sampling, group_size)
        if min_new_tokens < 1 or alpha <= 0:
            raise ValueError(f"LongTailWorkflow: min_new_tokens >= 1 and alpha > 0 required, got "
                             f"{min_new_tokens}, {alpha}")
        self.min_new_tokens, self.alpha, self.seed = int(min_new_tokens), float(alpha), int(seed)
        self._draws: dict[int, int] = {}

    def budgets(self, prompt_index: int, draw: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + prompt_index * 7_919 + draw)
        cap = self.sampling.max_new_tokens
        return [min(cap, math.floor(self.min_new_tokens * (1.0 - rng.random()) ** (-1.0 / self.alpha)))
                for _ in range(self.group_size)]

    async def arun_episode(self, client, sample: PromptSample) -> list[Trajectory]:
        draw = self._draws.get(sample.index, 0)
        self._draws[sample.index] = draw + 1
        reqs = [ModelRequest(list(sample.prompt_ids), dataclasses.replace(self.sampling, max_new_tokens=b))
                for b in self.budgets(sample.index, draw)]
        responses = await asyncio.gather(*(client.agenerate(r) for r in reqs))
        return await self.ascore(sample, responses)


def load_workflow_class(path: str):
    """"package.module:Class" -> the class (clear error naming the path)."""
    module, sep, name = path.partition(":")
    if not sep:
        raise ValueError(f"rollout.workflow: expected 'module:Class', got {path!r}")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.workflow: cannot load {path!r}: {e}") from None
    if not hasattr(cls, "arun_episode"):
        raise ValueError(f"rollout.workflow: {path!r} has no arun_episode method")
    return cls
