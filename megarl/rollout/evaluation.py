"""Held-out evaluation through the run's own workflow: the task training is scored on.

    eval prompts (data.eval_path, rendered with the workflow's tool schemas, as training's are)
        |  greedy workflow: group of 1, temperature 0  -> eval_accuracy (greedy pass@1), mean reward
        |  sampled workflow: group of k, rollout temperature (rollout.eval_k > 0) -> pass@1, pass@k
        v
    workflow.arun_episode(AtomicClient(client), sample)     turns, tool calls, rewards: as in training
        v
    EvalResult -> metrics (eval/*) and, when asked, rows of <run_dir>/eval_generations.jsonl

The workflow is the configured ``rollout.workflow`` built a second (and third) time with an
evaluation context, so a multi-turn or tool-calling run is evaluated on the same conversation it
trains on, not on one greedy completion of a bare prompt. Requests go through
:class:`AtomicClient`: a weight push waits for them instead of interrupting them, so one
evaluation measures one policy version. A sample counts as correct when its reward (the
workflow's, e.g. discounted over turns) is >= ``correct_at``.

pass@k is the unbiased estimator over the n >= k samples of each prompt, c of them correct:
``1 - C(n - c, k) / C(n, k)``, averaged over prompts (a prompt the workflow rejected scores 0).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megarl.data.datasets import PromptSample
from megarl.rewards import RewardFn
from megarl.rewards.base import RewardCaller
from megarl.protocol.messages import eval_due
from megarl.protocol.types import SamplingParams, Trajectory
from megarl.rollout.workflows.base import WorkflowContext
from megarl.rollout.workflows.single_turn import SingleTurnWorkflow

log = logging.getLogger("megarl.eval")


class EvalStalled(TimeoutError):
    """An evaluation the step waits for did not finish within train.stall_timeout_s."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that k of the n samples, drawn without replacement, include one of the c
    correct ones: ``1 - C(n - c, k) / C(n, k)`` (unbiased for pass@k). Needs 1 <= k <= n."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class AtomicClient:
    """The rollout client as evaluation hands it to a workflow: every request is marked atomic."""

    def __init__(self, client):
        self.client = client

    @staticmethod
    def _mark(req):
        # atomic: a push waits for it instead of aborting it, so one evaluation measures one version
        return dataclasses.replace(req, metadata={**req.metadata, "atomic": True})

    async def agenerate(self, req):
        return await self.client.agenerate(self._mark(req))

    async def agenerate_n(self, req, n: int):
        return await self.client.agenerate_n(self._mark(req), n)

    def __getattr__(self, name):
        return getattr(self.client, name)


@dataclass
class EvalWorkflows:
    """The workflow twice: ``greedy`` (group of 1, temperature 0) and ``sampled`` (group of k at
    the rollout temperature; None when k == 0). ``tokenizer`` decodes the dumped completions."""

    greedy: object
    sampled: Optional[object]
    tokenizer: object
    k: int = 0
    correct_at: float = 1.0


@dataclass(frozen=True)
class EvalResult:
    n: int  # prompts evaluated
    accuracy: float  # greedy pass@1: fraction with reward >= correct_at
    mean_reward: float  # of the greedy episodes
    k: int = 0
    pass_at_k: Optional[float] = None  # over the k sampled episodes per prompt
    pass_at_1: Optional[float] = None  # the same samples, pass@1 (mean fraction correct)
    mean_reward_at_k: Optional[float] = None
    versions: tuple[int, ...] = ()  # policy versions that produced the completions
    mean_turns: Optional[float] = None  # greedy episodes of a multi-turn workflow
    tool_calls: Optional[float] = None  # tool calls per greedy episode (tool-calling workflows)
    failed: int = 0  # episodes (greedy and sampled) that raised: counted as wrong
    rows: tuple[dict, ...] = ()  # one per episode: what eval_generations.jsonl records


def _row(tok, s: PromptSample, t: Trajectory, kind: str) -> dict:
    turns = t.info.get("turns") or []
    return {"index": s.index, "kind": kind, "prompt": s.prompt,
            "completion": tok.decode(t.input_ids[len(s.prompt_ids):]),  # every turn after the prompt
            "final": t.info.get("completion"), "reward": t.reward, "version": t.min_version,
            "turns": t.info.get("num_turns", 1), "tool_calls": sum(x.get("tool_calls", 0) for x in turns)}


async def evaluate(client, samples: Sequence[PromptSample], wfs: EvalWorkflows) -> EvalResult:
    """Every sample through the greedy workflow (and the sampled one with k > 0), concurrently."""
    if not samples:
        raise ValueError("evaluation needs at least one prompt sample")
    atomic = AtomicClient(client)
    runs = [wfs.greedy.arun_episode(atomic, s) for s in samples]
    if wfs.sampled is not None:
        runs += [wfs.sampled.arun_episode(atomic, s) for s in samples]
    results = await asyncio.gather(*runs, return_exceptions=True)
    # an episode that failed for good (e.g. its environment server died past its re-runs) counts
    # as a wrong answer, as a rejected one does; a failed evaluation would stop the run
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        log.warning("evaluation: %d of %d episodes failed, counted as wrong (first: %s: %s)", len(failed),
                    len(results), type(failed[0]).__name__, failed[0])
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r  # cancelled: the evaluation itself is being stopped
    groups = [[] if r is None or isinstance(r, Exception) else r for r in results]  # None: rejected
    n, tok = len(samples), wfs.tokenizer
    # the gather keeps order: the first n groups are the greedy runs, the rest the sampled ones
    greedy = [g[:1] for g in groups[:n]]
    rows = [_row(tok, s, t, "greedy") for s, g in zip(samples, greedy) for t in g]
    # a prompt the workflow rejected counts as wrong (reward 0): the denominator stays n
    rewards = [g[0].reward if g else 0.0 for g in greedy]
    out = {"n": n, "accuracy": sum(r >= wfs.correct_at for r in rewards) / n,
           "mean_reward": statistics.fmean(rewards), "failed": len(failed)}
    if wfs.sampled is not None:
        sampled = groups[n:]
        rows += [_row(tok, s, t, "sampled") for s, g in zip(samples, sampled) for t in g]
        out["k"] = wfs.k
        out["pass_at_1"], out["pass_at_k"] = (statistics.fmean(
            # a group with fewer than j samples (some rejected) cannot show pass@j: it counts as 0
            pass_at_k(len(g), sum(t.reward >= wfs.correct_at for t in g), j) if len(g) >= j else 0.0
            for g in sampled) for j in (1, wfs.k))
        out["mean_reward_at_k"] = statistics.fmean([t.reward for g in sampled for t in g] or [0.0])
    firsts = [g[0] for g in greedy if g]
    if firsts and "num_turns" in firsts[0].info:
        out["mean_turns"] = statistics.fmean(t.info["num_turns"] for t in firsts)
        out["tool_calls"] = statistics.fmean(r["tool_calls"] for r in rows if r["kind"] == "greedy")
    out["versions"] = tuple(sorted({v for g in groups for t in g for v, m in zip(t.versions, t.loss_mask) if m}))
    return EvalResult(rows=tuple(rows), **out)


def single_turn_workflows(reward: RewardCaller, sampling: SamplingParams, tokenizer, k: int = 0,
                          max_len: Optional[int] = None, correct_at: float = 1.0) -> EvalWorkflows:
    """Evaluation of plain prompts with `SingleTurnWorkflow` (no chat template, no tools)."""
    def ctx(params: SamplingParams, group: int) -> WorkflowContext:
        return WorkflowContext(tokenizer, reward, params, group, None, max_len)

    greedy = SingleTurnWorkflow(ctx(dataclasses.replace(sampling, temperature=0.0), 1))
    sampled = SingleTurnWorkflow(ctx(sampling, k)) if k else None
    return EvalWorkflows(greedy, sampled, tokenizer, k, correct_at)


async def evaluate_samples(client, samples: Sequence[PromptSample], reward_fn: RewardFn,
                           sampling: SamplingParams, tokenizer, correct_at: float = 1.0,
                           k: int = 0, max_len: Optional[int] = None) -> EvalResult:
    """Single-turn evaluation of plain prompts (tools/make_tiny_model.py): one greedy completion
    per sample (temperature 0, whatever ``sampling`` says), k sampled ones with ``k`` > 0.
    ``max_len``: prompt + completion at most this many tokens."""
    if not samples:
        raise ValueError("evaluation needs at least one prompt sample")
    caller = reward_fn if isinstance(reward_fn, RewardCaller) else RewardCaller(reward_fn)
    wfs = single_turn_workflows(caller, sampling, tokenizer, k, max_len, correct_at)
    return await evaluate(client, samples, wfs)


class PeriodicEval:
    """Evaluation that does not block training: ``submit`` starts one on the rollout controller's
    event loop (its client, all servers) at the current policy version; ``poll`` returns the
    metrics of those that finished, tagged with the version they measured, and appends their
    episodes to ``dump_path`` (logging.dump_eval_generations)."""

    def __init__(self, samples: Sequence[PromptSample], workflows: EvalWorkflows, dump_path: Optional[str] = None,
                 name: str = ""):
        self.samples, self.workflows, self.dump_path = list(samples), workflows, dump_path
        self.name = name  # the held-out set's (data.eval_sets), written into each dumped episode
        self._running: list[tuple[int, int, object]] = []  # (step, version, future)

    def submit(self, controller, step: int, version: int) -> None:
        fut = controller.submit(lambda client: evaluate(client, self.samples, self.workflows))
        self._running.append((step, version, fut))

    @property
    def running(self) -> int:
        return len(self._running)

    def poll(self, wait: bool = False, timeout_s: float = 600.0,
             diagnose: Optional[Callable[[], str]] = None) -> dict:
        """Metrics of the finished evaluations (the newest wins when several finished at once);
        ``wait``: block until all submitted ones are done, at most ``timeout_s`` in all (then
        `EvalStalled`, with ``diagnose()``'s account of what the rollouts wait on)."""
        out: dict = {}
        still = []
        deadline = time.monotonic() + timeout_s
        for step, version, fut in self._running:
            if not (wait or fut.done()):
                still.append((step, version, fut))
                continue
            try:
                # one deadline for all waited-on evaluations, not timeout_s each
                res: EvalResult = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise EvalStalled(f"evaluation stalled: the evaluation of step {step} not done after "
                                  f"{timeout_s:g} s (train.stall_timeout_s); "
                                  f"{diagnose() if diagnose else ''}") from None
            out = self.metrics(res, step, version)
            self._dump(res, step, out["eval/version"])
        self._running = still
        return out

    @staticmethod
    def metrics(res: EvalResult, step: int, version: int) -> dict:
        # atomic requests finish under the version they started with: normally just one
        # one version in the completions is what was measured; several (should not happen: atomic) fall back to the submit version
        measured = res.versions[-1] if len(res.versions) == 1 else version
        out = {"eval_accuracy": res.accuracy, "eval/greedy_pass@1": res.accuracy,
               "eval/mean_reward": res.mean_reward, "eval/version": measured, "eval/step": step, "eval/n": res.n,
               "eval/failed": res.failed}
        if res.pass_at_k is not None:  # over the k sampled episodes per prompt
            out["eval/pass@1"], out[f"eval/pass@{res.k}"] = res.pass_at_1, res.pass_at_k
            out[f"eval/mean_reward_at_{res.k}"] = res.mean_reward_at_k
        if res.mean_turns is not None:
            out["eval/mean_turns"], out["eval/tool_calls"] = res.mean_turns, res.tool_calls
        return out

    def all_workflows(self) -> list:
        """Its workflows (the controller closes their environment clients when it stops)."""
        return [w for w in (self.workflows.greedy, self.workflows.sampled) if w is not None]

    def _dump(self, res: EvalResult, step: int, version: int) -> None:
        if not self.dump_path:
            return
        with open(self.dump_path, "a") as f:
            named = {"eval_set": self.name} if self.name else {}
            for row in res.rows:
                f.write(json.dumps({"step": step, "eval_version": version, **named, **row}) + "\n")


class EvalSuite:
    """Several held-out sets (data.eval_sets), each a `PeriodicEval` with its own interval; the
    interface of one (submit, poll, running). Each set's metrics are reported under its name,
    eval/<name>/accuracy (greedy pass@1), eval/<name>/mean_reward, eval/<name>/pass@k, ...; the
    first set's also as the run's eval_accuracy, eval/step and eval/version (what
    train.stop_at_eval_accuracy and the learning curve's headline read)."""

    def __init__(self, sets: Sequence[tuple[str, PeriodicEval, int]], last_step: int):
        self.sets, self.last_step = list(sets), last_step
        for name, ev, _ in self.sets:
            ev.name = name

    def all_workflows(self) -> list:
        return [w for _, ev, _ in self.sets for w in ev.all_workflows()]

    def submit(self, controller, step: int, version: int) -> None:
        for _, ev, interval in self.sets:
            if eval_due(interval, step, self.last_step):
                ev.submit(controller, step, version)

    @property
    def running(self) -> int:
        return sum(ev.running for _, ev, _ in self.sets)

    def poll(self, wait: bool = False, timeout_s: float = 600.0,
             diagnose: Optional[Callable[[], str]] = None) -> dict:
        out: dict = {}
        deadline = time.monotonic() + timeout_s  # one deadline for every set, as for one
        for i, (name, ev, _) in enumerate(self.sets):
            got = ev.poll(wait=wait, timeout_s=max(0.0, deadline - time.monotonic()), diagnose=diagnose)
            if not got:
                continue
            for key, value in got.items():
                if key == "eval_accuracy":
                    out[f"eval/{name}/accuracy"] = value
                elif key != "eval/greedy_pass@1":  # the same number as accuracy
                    out[f"eval/{name}/{key.removeprefix('eval/')}"] = value
            if i == 0:
                out.update({k: got[k] for k in ("eval_accuracy", "eval/step", "eval/version")})
        return out
