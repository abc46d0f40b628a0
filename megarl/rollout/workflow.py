"""Rollout workflows: how one prompt becomes a group of scored trajectories.

A workflow is a plugin (``rollout.workflow: "module:Class"``) implementing

    async def arun_episode(self, client: RolloutClient, sample: PromptSample) -> list[Trajectory]

The executor calls it concurrently from the controller's event loop; it must not block the loop
(CPU-heavy reward code belongs in a thread). :class:`SingleTurnWorkflow` is the GRPO default:
``group_size`` samples of the prompt, each scored by the reward function on its decoded text.
"""
from __future__ import annotations

import asyncio
import importlib
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
