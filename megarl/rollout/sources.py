"""The rollout side of a mixture of prompt sources (``data.sources``): each source's task (the
run's rollout, data and reward sections with the source's own fields in place) and the workflow
that runs a prompt through its own source's workflow and reward.

    source_tasks(task)   {name: TaskSpec} in data.sources order
    eval_set_tasks(task) {name: TaskSpec} in data.eval_sets order (its size, interval and k as
                         rollout.eval_size, eval_interval and eval_k; its reward as eval_reward_fn)
    SourceWorkflows      arun_episode(client, sample) -> the workflow of sample.source
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megarl.config.rollout import REWARD_MODEL_FN

__all__ = ["SourceWorkflows", "eval_set_tasks", "source_tasks"]


def source_tasks(task) -> dict[str, Any]:
    """The `megarl.rollout.setup.TaskSpec` of each source: a field the source leaves unset is the
    run's (rollout.workflow and workflow_args, rollout.reward_fn, reward.args, data.prompt_key,
    answer_key, chat_template, max_prompt_length, truncation)."""
    r, d = task.rollout, task.data
    out = {}
    for src in d.sources:
        rollout = dataclasses.replace(
            r, workflow=src.workflow or r.workflow, reward_fn=src.reward_fn or r.reward_fn,
            workflow_args=dict(r.workflow_args if src.workflow_args is None else src.workflow_args))
        data = d.of_source(src)
        out[src.name] = dataclasses.replace(task, rollout=rollout, data=data,
                                            reward=_own_reward(task.reward, rollout.reward_fn, src.reward_args))
    return out


def eval_set_tasks(task) -> dict[str, Any]:
    """The `megarl.rollout.setup.TaskSpec` of each held-out set: the run's evaluation with the
    set's own fields in place (`megarl.config.train.EvalSet`)."""
    r, d = task.rollout, task.data
    out = {}
    for es in d.eval_sets:
        rollout = dataclasses.replace(
            r, workflow=es.workflow or r.workflow, eval_reward_fn=es.reward_fn or r.eval_reward_fn,
            workflow_args=dict(r.workflow_args if es.workflow_args is None else es.workflow_args),
            eval_size=r.eval_size if es.size is None else es.size,
            eval_interval=r.eval_interval if es.interval is None else es.interval,
            eval_k=r.eval_k if es.k is None else es.k)
        reward = _own_reward(task.reward, rollout.eval_reward_fn or rollout.reward_fn, es.reward_args)
        out[es.name] = dataclasses.replace(task, rollout=rollout, data=d.of_source(es), reward=reward)
    return out


def _own_reward(run_reward, reward_fn: str, args):
    """The reward section an entry scores with: the run's, or with ``args`` (its reward_args) in
    place of reward.args - keeping the addresses and key of the reward-model servers the job
    serves (reward.model.path) for an entry whose reward is that model."""
    if args is None:
        return run_reward
    args = dict(args)
    if reward_fn == REWARD_MODEL_FN and "urls" in run_reward.args and "urls" not in args:
        args.update({k: run_reward.args[k] for k in ("urls", "api_key") if k in run_reward.args})
    return dataclasses.replace(run_reward, args=args)


class SourceWorkflows:
    """One workflow per source; an episode runs the workflow of its prompt's source
    (`PromptSample.source`, set by `megarl.data.mixture.SourceMixture`)."""

    def __init__(self, workflows: dict[str, Any]):
        self.workflows = dict(workflows)

    async def arun_episode(self, client, sample):
        try:
            workflow = self.workflows[sample.source]
        except KeyError:
            raise ValueError(f"prompt {sample.index} names the source {sample.source!r}, which is not one of "
                             f"data.sources ({', '.join(self.workflows)})") from None
        return await workflow.arun_episode(client, sample)

    @property
    def rewards(self) -> list:
        """Each source's `RewardCaller` once (the controller closes them and sums their counts)."""
        out = []
        for w in self.workflows.values():
            reward = getattr(getattr(w, "ctx", None), "reward", None)
            if reward is not None and all(reward is not o for o in out):
                out.append(reward)
        return out
