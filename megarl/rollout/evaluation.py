"""Held-out evaluation as a rollout workflow: greedy completions through the async client, scored
by a reward function.

Every sample is one greedy request (temperature 0, whatever the given params say) sent at once
through :class:`~megarl.rollout.client.RolloutClient`, so evaluation gets the client's load
balancing, retries and partial-rollout resubmission and the servers batch the requests
themselves. A completion is decoded up to its first EOS (as in training,
:func:`~megarl.rollout.workflow.completion_text`) and scored with the reward contract
``reward_fn(prompt, completion, meta)``. With a 0/1 verifier such as
:func:`~megarl.rewards.arith_exact_match`, ``accuracy`` is the exact-answer rate.
"""
from __future__ import annotations

import asyncio
import dataclasses
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from megarl.data.datasets import PromptSample
from megarl.rewards import RewardFn
from megarl.rewards.base import RewardCaller
from megarl.rollout.types import ModelRequest, SamplingParams
from megarl.rollout.workflows.base import completion_text


@dataclass(frozen=True)
class EvalResult:
    n: int  # samples scored
    accuracy: float  # fraction with reward >= correct_at (1.0: a full-credit answer): pass@1 greedy
    mean_reward: float
    mean_reward_at_k: Optional[float] = None  # mean reward of k sampled completions per prompt
    versions: tuple[int, ...] = ()  # policy versions that produced the completions


async def evaluate_samples(client, samples: Sequence[PromptSample], reward_fn: RewardFn,
                           sampling: SamplingParams, tokenizer, correct_at: float = 1.0,
                           k: int = 0, max_len: Optional[int] = None) -> EvalResult:
    """Greedy completion of every sample (concurrently), scored by ``reward_fn``; with ``k`` > 0
    also k completions per prompt at ``sampling``'s temperature (mean reward at k).

    Requests are marked atomic: a weight push waits for them instead of interrupting them, so
    one evaluation reports one policy version. ``samples`` need ``prompt_ids`` (a
    `PromptDataset` built with a tokenizer); ``tokenizer`` decodes the completions. Raises
    ValueError on an empty sample list. ``max_len``: prompt + completion at most this many tokens
    (train.max_seq_len; a server refuses a budget past its context).
    """
    if not samples:
        raise ValueError("evaluation needs at least one prompt sample")

    def request(s, params: SamplingParams) -> ModelRequest:
        if max_len is not None:
            params = dataclasses.replace(params, max_new_tokens=max(
                1, min(params.max_new_tokens, max_len - len(s.prompt_ids))))
        return ModelRequest(list(s.prompt_ids), params, metadata={"atomic": True})

    greedy = dataclasses.replace(sampling, temperature=0.0)
    reqs = [(s, request(s, greedy)) for s in samples]
    for i in range(k):
        seeded = dataclasses.replace(sampling, seed=None if sampling.seed is None else sampling.seed + i)
        reqs += [(s, request(s, seeded)) for s in samples]
    responses = await asyncio.gather(*(client.agenerate(r) for _, r in reqs))
    texts = [completion_text(tokenizer, r.output_tokens) for r in responses]
    # sync rewards run on the caller's threads (the contract allows blocking code), async ones here
    caller = reward_fn if isinstance(reward_fn, RewardCaller) else RewardCaller(reward_fn)
    rewards = await asyncio.gather(*(caller(s.prompt, t, s.meta) for (s, _), t in zip(reqs, texts)))
    n = len(samples)
    greedy_rewards, sampled = rewards[:n], rewards[n:]
    versions = tuple(sorted({v for r in responses for v in r.output_versions}))
    return EvalResult(n=n, accuracy=sum(r >= correct_at for r in greedy_rewards) / n,
                      mean_reward=statistics.fmean(greedy_rewards),
                      mean_reward_at_k=statistics.fmean(sampled) if sampled else None,
                      versions=versions)


class PeriodicEval:
    """Evaluation that does not block training: ``submit`` starts one on the rollout controller's
    event loop (its client, all servers) at the current policy version; ``poll`` returns the
    metrics of those that finished, tagged with the version they measured."""

    def __init__(self, samples: Sequence[PromptSample], reward_fn: RewardFn, sampling: SamplingParams,
                 tokenizer, k: int = 0, max_len: Optional[int] = None):
        self.samples, self.reward_fn, self.sampling = list(samples), reward_fn, sampling
        self.tokenizer, self.k, self.max_len = tokenizer, k, max_len
        self._running: list[tuple[int, int, object]] = []  # (step, version, future)

    def submit(self, controller, step: int, version: int) -> None:
        fut = controller.submit(lambda client: evaluate_samples(
            client, self.samples, self.reward_fn, self.sampling, self.tokenizer, k=self.k, max_len=self.max_len))
        self._running.append((step, version, fut))

    @property
    def running(self) -> int:
        return len(self._running)

    def poll(self, wait: bool = False, timeout_s: float = 600.0) -> dict:
        """Metrics of the finished evaluations (the newest wins when several finished at once);
        ``wait``: block until all submitted ones are done (the last step)."""
        out: dict = {}
        still = []
        for step, version, fut in self._running:
            if not (wait or fut.done()):
                still.append((step, version, fut))
                continue
            res: EvalResult = fut.result(timeout=timeout_s)
            # atomic requests finish under the version they started with: normally just one
            measured = res.versions[-1] if len(res.versions) == 1 else version
            out = {"eval_accuracy": res.accuracy, "eval/mean_reward": res.mean_reward,
                   "eval/version": measured, "eval/step": step, "eval/n": res.n}
            if res.mean_reward_at_k is not None:
                out[f"eval/mean_reward_at_{self.k}"] = res.mean_reward_at_k
        self._running = still
        return out
