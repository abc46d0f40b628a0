"""Held-out evaluation as a rollout workflow: greedy completions through the async client, scored
by a reward function.

Every sample is one greedy request (temperature 0, whatever the given params say) sent at once
through :class:`~megarl.rollout.client.RolloutClient`, so evaluation gets the client's load
balancing, retries and partial-rollout resubmission and the servers batch the requests
themselves. A completion is decoded up to its first EOS (as in training,
:func:`~megarl.rollout.workflow.completion_text`) and scored with the reward contract
``reward_fn(prompt, completion, meta)``. With a 0/1 verifier such as
:func:`~megarl.rollout.rewards.arith_exact_match`, ``accuracy`` is the exact-answer rate.
"""
from __future__ import annotations

import asyncio
import dataclasses
import statistics
from dataclasses import dataclass
from typing import Sequence

from megarl.data.datasets import PromptSample
from megarl.rollout.rewards import RewardFn
from megarl.rollout.types import ModelRequest, SamplingParams
from megarl.rollout.workflows.base import completion_text


@dataclass(frozen=True)
class EvalResult:
    n: int  # samples scored
    accuracy: float  # fraction with reward >= correct_at (1.0: a full-credit answer)
    mean_reward: float


async def evaluate_samples(client, samples: Sequence[PromptSample], reward_fn: RewardFn,
                           sampling: SamplingParams, tokenizer, correct_at: float = 1.0) -> EvalResult:
    """Greedy completion of every sample (concurrently), scored by ``reward_fn``.

    ``samples`` need ``prompt_ids`` (a `PromptDataset` built with a tokenizer); ``tokenizer``
    decodes the completions. Raises ValueError on an empty sample list.
    """
    if not samples:
        raise ValueError("evaluation needs at least one prompt sample")
    greedy = dataclasses.replace(sampling, temperature=0.0)
    responses = await asyncio.gather(*(client.agenerate(ModelRequest(list(s.prompt_ids), greedy))
                                       for s in samples))
    texts = [completion_text(tokenizer, r.output_tokens) for r in responses]
    # the reward contract allows blocking code: score off the event loop
    rewards = await asyncio.to_thread(
        lambda: [float(reward_fn(s.prompt, t, s.meta)) for s, t in zip(samples, texts)])
    return EvalResult(n=len(samples), accuracy=sum(r >= correct_at for r in rewards) / len(rewards),
                      mean_reward=statistics.fmean(rewards))
