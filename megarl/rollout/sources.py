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
        reward = task.reward if src.reward_args is None else dataclasses.replace(task.reward, args=dict(src.reward_args))
        out[src.name] = dataclasses.replace(task, rollout=rollout, data=data, reward=reward)
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
        reward = task.reward if es.reward_args is None else dataclasses.replace(task.reward, args=dict(es.reward_args))
        out[es.name] = dataclasses.replace(task, rollout=rollout, data=d.of_source(es), reward=reward)
    return out


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
