"""The workflow plugin contract, the context every workflow is built with, and the checker.

A workflow turns one prompt into a group of scored, token-aligned trajectories:

    class MyWorkflow:
        def __init__(self, ctx: WorkflowContext, **workflow_args): ...
        async def arun_episode(self, client, sample: PromptSample) -> list[Trajectory] | None

Configs name it by import path (``rollout.workflow: "pkg.module:Class"``) and give its own
options in ``rollout.workflow_args`` (keyword arguments). `client` is the rollout client
(``await client.agenerate(ModelRequest) -> ModelResponse``, token-aligned logprobs and per-token
versions, partial rollouts handled inside). Returning None rejects the sample (the controller
counts it as filtered). The executor runs many episodes concurrently on one event loop: a
workflow must not block it (rewards go through ``ctx.reward``, which threads sync code).

`check_episode` states the contract as code - token alignment, loss mask / versions /
behave_logp consistency, group ids - so any workflow can be tested against it
(tests/unit/test_workflow_contract.py runs it over every shipped workflow).
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np

from megarl.data.chat import ChatTemplate
from megarl.data.prompts import PromptSample
from megarl.common.tokenizer import Tokenizer
from megarl.rewards.base import RewardCaller
from megarl.protocol.types import ModelResponse, RoutedExperts, SamplingParams, Trajectory

__all__ = ["WorkflowContext", "RolloutWorkflow", "TokenTrace", "load_workflow", "load_workflow_class",
           "check_episode", "completion_text", "close_envs", "workflow_envs"]


def completion_text(tokenizer, tokens: list[int]) -> str:
    """Generated tokens decoded up to (without) the first EOS: what reward functions see."""
    eos = tokenizer.eos_id
    return tokenizer.decode(tokens[: tokens.index(eos)] if eos in tokens else tokens)


@dataclass
class WorkflowContext:
    """What the system hands every workflow; its own options come as keyword arguments."""

    tokenizer: Tokenizer
    reward: RewardCaller  # await reward(prompt, completion, meta) -> float
    sampling: SamplingParams  # rollout.* sampling settings, stop at the tokenizer's EOS
    group_size: int  # trajectories per prompt (GRPO group)
    chat_template: Optional[ChatTemplate] = None  # the dataset's template (None: plain prompts)
    max_seq_len: Optional[int] = None  # longest trajectory (prompt + all turns) the trainer takes
    env: Any = None  # environment servers (megarl.envs.EnvClient: env.cls / env.urls), else None

    def budget(self, used: int) -> int:
        """New tokens allowed after `used` tokens: max_new_tokens, capped by max_seq_len."""
        room = self.sampling.max_new_tokens if self.max_seq_len is None else self.max_seq_len - used
        return max(0, min(self.sampling.max_new_tokens, room))

    def sampling_for(self, sample: PromptSample, max_new_tokens: int) -> SamplingParams:
        """The rollout sampling params for one sample's requests: its draw's seed when the run
        is seeded (rollout.seed), so two runs with the same seed sample the same tokens."""
        seed = sample.seed if sample.seed is not None else self.sampling.seed
        return dataclasses.replace(self.sampling, max_new_tokens=max_new_tokens, seed=seed)


def workflow_envs(*workflows) -> list:
    """The environment clients (`megarl.envs.EnvClient`) of `workflows` and of their sources', once each."""
    seen: list = []
    for w in workflows:
        for one in [w, *getattr(w, "workflows", {}).values()] if w is not None else []:
            env = getattr(getattr(one, "ctx", None), "env", None)
            if env is not None and all(env is not e for e in seen):
                seen.append(env)
    return seen


async def close_envs(*workflows) -> None:
    """Closes the environment clients (HTTP sessions) of `workflows` and of their sources'."""
    for env in workflow_envs(*workflows):
        await env.aclose()


class RolloutWorkflow(Protocol):
    async def arun_episode(self, client, sample: PromptSample) -> Optional[list[Trajectory]]: ...


class TokenTrace:
    """One trajectory under construction. Context tokens (prompt, forced text, environment
    feedback) get loss_mask 0, behave_logp 0.0, version -1; generated tokens get mask 1 and the
    server's logprob and per-token policy version - so a sample interrupted by weight updates
    keeps each token's own version, turn after turn."""

    def __init__(self, prompt_ids: list[int]):
        self.input_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.behave_logp: list[float] = []
        self.versions: list[int] = []
        self.routes: Optional[RoutedExperts] = None  # set by the first response that has them
        self.add_context(prompt_ids)

    def __len__(self) -> int:
        return len(self.input_ids)

    def add_context(self, ids: list[int]) -> None:
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.behave_logp += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_generated(self, resp: ModelResponse) -> None:
        if resp.routed_experts is not None:
            self._add_routes(resp)
        self.input_ids += resp.output_tokens
        self.loss_mask += [1] * len(resp.output_tokens)
        self.behave_logp += resp.output_logprobs
        self.versions += resp.output_versions

    def _add_routes(self, resp: ModelResponse) -> None:
        """Routes token-aligned with the trace (`Trajectory.routes`). The response's row q is
        position q of its request + output. When the request was this whole trace, every row
        lands on its position; rows the trace holds already (an earlier turn's) are kept, like
        `RoutedExperts.extend` keeps a resubmitted segment's prefix. Otherwise (the workflow sent
        other context) only the rows of the generated tokens are placed."""
        got = resp.routed_experts
        n_old, n_new = len(self.input_ids), len(self.input_ids) + resp.output_len
        _, layers, k = got.ids.shape
        ids = np.full((n_new, layers, k), -1, np.int32)
        w = np.full((n_new, layers, k), np.nan, np.float32)
        if self.routes is not None:
            held = self.routes.rows  # context added since then has no rows yet
            ids[:held], w[:held] = self.routes.ids, self.routes.weights
        first = 0 if resp.input_tokens == self.input_ids else resp.input_len  # response rows to place
        shift = n_old - resp.input_len  # trace position of response row q: q + shift
        rows = np.arange(first, min(got.rows, resp.input_len + resp.output_len))
        rows = rows[rows + shift >= 0]
        held = (ids >= 0).any(axis=(1, 2))  # rows of earlier turns
        rows = rows[~held[rows + shift]]
        ids[rows + shift] = got.ids[rows]
        if got.weights is not None:
            w[rows + shift] = got.weights[rows]
        self.routes = RoutedExperts(ids, w)

    def to_trajectory(self, reward: float, group_id: int, info: dict) -> Trajectory:
        routes = self.routes
        if routes is not None and routes.rows < len(self.input_ids):  # context added after the last turn
            pad = len(self.input_ids) - routes.rows
            routes = RoutedExperts(np.concatenate([routes.ids, np.full((pad, *routes.ids.shape[1:]), -1, np.int32)]),
                                   np.concatenate([routes.weights, np.full((pad, *routes.ids.shape[1:]), np.nan,
                                                                           np.float32)]))
        return Trajectory(list(self.input_ids), list(self.loss_mask), list(self.behave_logp),
                          list(self.versions), float(reward), group_id, info, routes)


def load_workflow(path: str, ctx: WorkflowContext, args: Optional[dict] = None) -> RolloutWorkflow:
    """Build ``rollout.workflow`` ("package.module:Class") as ``Class(ctx, **workflow_args)``."""
    cls = load_workflow_class(path)
    try:
        return cls(ctx, **(args or {}))
    except TypeError as e:
        raise ValueError(f"rollout.workflow_args: {path!r} cannot be built with {args or {}}: {e}") from None


def load_workflow_class(path: str) -> type:
    """The class ``rollout.workflow`` names (checked before any rank starts, by preflight)."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"rollout.workflow: expected 'module:Class', got {path!r}")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.workflow: cannot load {path!r}: {e}") from None
    if not hasattr(cls, "arun_episode"):
        raise ValueError(f"rollout.workflow: {path!r} has no arun_episode method")
    return cls


def check_episode(sample: PromptSample, result: Any, vocab_size: Optional[int] = None) -> list[str]:
    """Contract violations of one `arun_episode` result (empty = it conforms). `vocab_size` is the
    model's (possibly padded) vocabulary: a sampling server may return any id below it."""
    if result is None:
        return []
    if not isinstance(result, list) or not result:
        return [f"expected a non-empty list of Trajectory or None, got {result!r:.80}"]
    problems = []
    for k, t in enumerate(result):
        if not isinstance(t, Trajectory):
            problems.append(f"[{k}] is a {type(t).__name__}, not a Trajectory")
            continue
        problems += [f"[{k}] {p}" for p in _check_trajectory(sample, t, vocab_size)]
    return problems


def _check_trajectory(sample: PromptSample, t: Trajectory, vocab_size: Optional[int]) -> list[str]:
    n = len(t.input_ids)
    if not (len(t.loss_mask) == len(t.behave_logp) == len(t.versions) == n):
        return [f"fields are not token-aligned ({n} ids, {len(t.loss_mask)} mask, "
                f"{len(t.behave_logp)} logp, {len(t.versions)} versions)"]
    out = []
    prompt = list(sample.prompt_ids or [])
    if t.input_ids[:len(prompt)] != prompt:
        out.append("input_ids do not start with the sample's prompt_ids")
    if any(t.loss_mask[:len(prompt)]):
        out.append("loss_mask is 1 on a prompt token")
    if t.group_id != sample.index:
        out.append(f"group_id {t.group_id} != sample.index {sample.index}")
    if not isinstance(t.reward, float) or not math.isfinite(t.reward):
        out.append(f"reward {t.reward!r} is not a finite float")
    if any(not isinstance(i, int) or i < 0 or (vocab_size is not None and i >= vocab_size) for i in t.input_ids):
        out.append("a token id is not an int in [0, vocab_size)")
    for i, (m, lp, v) in enumerate(zip(t.loss_mask, t.behave_logp, t.versions)):
        if m not in (0, 1):
            out.append(f"token {i}: loss_mask {m!r} is not 0/1")
        elif m == 0 and (lp != 0.0 or v != -1):
            out.append(f"token {i}: context token needs behave_logp 0.0 and version -1, got {lp}, {v}")
        elif m == 1 and (v < 0 or not math.isfinite(lp) or lp > 0.0):
            out.append(f"token {i}: generated token needs version >= 0 and a logprob <= 0, got {lp}, {v}")
        if len(out) > 8:
            break
    return out
