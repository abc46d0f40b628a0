"""Builds the rollout side of a run from its config: the task parts (tokenizer, template, reward,
sampling), the prompt datasets, the controller and the held-out evaluation. Runs in the rollout
manager's process (megarl.rollout.manager); nothing here touches a trainer rank."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megarl.data.chat import load_chat_template
from megarl.data.datasets import PromptDataset
from megarl.data.tokenizer import load_tokenizer
from megarl.rewards import RewardCaller
from megarl.rollout.controller import RolloutController
from megarl.rollout.evaluation import PeriodicEval
from megarl.rollout.types import SamplingParams
from megarl.rollout.workflows import WorkflowContext, load_workflow


def groups_per_step(cfg) -> int:
    return cfg.train.step_batch_size // cfg.rollout.group_size


def task_parts(cfg, with_reward: bool = True):
    """(tokenizer, chat template, reward caller, sampling params) shared by training rollouts
    and evaluation: the same reward function and dataset fields for both."""
    r, d = cfg.rollout, cfg.data
    tok_path = d.tokenizer_path or cfg.model.hf_path
    tok, template = load_tokenizer(tok_path), load_chat_template(d.chat_template, tok_path)
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              stop_token_ids=None if r.ignore_eos else [tok.eos_id],  # a stop id stops even with ignore_eos
                              ignore_eos=r.ignore_eos)
    reward = RewardCaller.from_config(r.reward_fn, cfg.reward) if with_reward else None
    return tok, template, reward, sampling


def prompt_dataset(cfg, path: str, tok, template, tools=None) -> PromptDataset:
    d = cfg.data
    return PromptDataset(path, tok, prompt_key=d.prompt_key, answer_key=d.answer_key or None,
                         chat_template=template, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                         tools=tools, shuffle=d.shuffle)


def build_controller(cfg, cluster, timeline=None) -> RolloutController:
    r = cfg.rollout
    tok, template, reward, sampling = task_parts(cfg)
    workflow = load_workflow(r.workflow, WorkflowContext(tok, reward, sampling, r.group_size, template,
                                                         cfg.train.max_seq_len), r.workflow_args)
    dataset = prompt_dataset(cfg, cfg.data.train_path, tok, template, getattr(workflow, "tool_schemas", None))
    # the staleness clock ticks once per push, which covers trigger_parameter_sync_step steps
    per_version = groups_per_step(cfg) * cfg.train.trigger_parameter_sync_step
    return RolloutController(
        dataset, workflow, cluster.addresses, cluster, batch_groups=per_version,
        max_staleness=r.staleness, max_concurrent=r.max_concurrent, seed=cfg.train.seed,
        api_key=r.api_key or None, dynamic_sampling=cfg.algo.dynamic_sampling,
        partial_rollout=r.partial_rollout, max_retries=r.max_retries,
        failed_log=os.path.join(cfg.train.run_dir, "failed_prompts.jsonl"), timeline=timeline,
        sampling_seed=r.seed)


def build_eval(cfg, reward: RewardCaller) -> Optional[PeriodicEval]:
    """Held-out evaluation with the configured dataset fields and the training rollouts' reward
    caller (one set of reward threads / worker processes; its counts include eval)."""
    if not cfg.data.eval_path:
        return None
    tok, template, _, sampling = task_parts(cfg, with_reward=False)
    samples = prompt_dataset(cfg, cfg.data.eval_path, tok, template).samples[:cfg.rollout.eval_size]
    if cfg.rollout.ignore_eos:  # evaluation answers stop at EOS whatever the training rollouts do
        sampling = dataclasses.replace(sampling, ignore_eos=False, stop_token_ids=[tok.eos_id])
    return PeriodicEval(samples, reward, sampling, tok, k=cfg.rollout.eval_k, max_len=cfg.train.max_seq_len)
