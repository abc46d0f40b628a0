"""Builds the rollout side of a run from its config: the task parts (tokenizer, template, reward,
sampling), the workflow, the prompt datasets, the controller and the held-out evaluation (the
same workflow, greedy). Runs in the rollout manager's process (megarl.rollout.manager); nothing
here touches a trainer rank."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megarl.data.chat import load_chat_template
from megarl.data.datasets import PromptDataset
from megarl.data.tokenizer import load_tokenizer
from megarl.rewards import RewardCaller
from megarl.rollout.controller import RolloutController
from megarl.rollout.evaluation import EvalWorkflows, PeriodicEval
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


def make_workflow(cfg, tok, template, reward: Optional[RewardCaller], sampling: SamplingParams,
                  group_size: int, for_eval: bool = False):
    """``rollout.workflow`` built with ``rollout.workflow_args``. Evaluation builds it with its own
    group size and sampling (a ``group_size`` in workflow_args is training's, so it is left out)."""
    r = cfg.rollout
    args = {k: v for k, v in r.workflow_args.items() if not (for_eval and k == "group_size")}
    ctx = WorkflowContext(tok, reward, sampling, group_size, template, cfg.train.max_seq_len)
    return load_workflow(r.workflow, ctx, args)


def routed_experts(cfg) -> Optional[tuple[int, int]]:
    """(decoder layers, experts per token) when the run replays the rollout's MoE routing
    (moe.routing_replay: rollout): the client asks every /generate for the routes."""
    if cfg.moe.routing_replay != "rollout":
        return None
    from megarl.models.registry import read_model_args

    args = read_model_args(cfg.model.hf_path)
    return args.num_layers, args.moe_topk


def route_flags(cfg) -> list[str]:
    """megarl-server flags of the local servers: routes returned when the run replays them."""
    return ["--enable-return-routed-experts"] if cfg.moe.routing_replay == "rollout" else []


def build_controller(cfg, cluster, timeline=None) -> RolloutController:
    r = cfg.rollout
    routes = routed_experts(cfg)
    tok, template, reward, sampling = task_parts(cfg)
    workflow = make_workflow(cfg, tok, template, reward, sampling, r.group_size)
    dataset = prompt_dataset(cfg, cfg.data.train_path, tok, template, getattr(workflow, "tool_schemas", None))
    # the staleness clock ticks once per push, which covers trigger_parameter_sync_step steps
    per_version = groups_per_step(cfg) * cfg.train.trigger_parameter_sync_step
    return RolloutController(
        dataset, workflow, cluster.addresses, cluster, batch_groups=per_version,
        max_staleness=r.staleness, max_concurrent=r.max_concurrent, seed=cfg.train.seed,
        api_key=r.api_key or None, dynamic_sampling=cfg.algo.dynamic_sampling,
        partial_rollout=r.partial_rollout, max_retries=r.max_retries,
        failed_log=os.path.join(cfg.train.run_dir, "failed_prompts.jsonl"), timeline=timeline,
        sampling_seed=r.seed, max_consecutive_failures=r.max_consecutive_failures,
        hold_timeout_s=cfg.weights.timeout_s,
        client_kwargs={"routed_experts": routes} if routes is not None else None)


def build_eval(cfg, reward: RewardCaller) -> Optional[PeriodicEval]:
    """Held-out evaluation through the configured workflow (greedy, and k sampled episodes with
    rollout.eval_k), its prompts rendered with the workflow's tool schemas as training's are;
    the training rollouts' reward caller (one set of reward threads / worker processes)."""
    if not cfg.data.eval_path:
        return None
    r = cfg.rollout
    tok, template, _, sampling = task_parts(cfg, with_reward=False)
    if r.ignore_eos:  # evaluation answers stop at EOS whatever the training rollouts do
        sampling = dataclasses.replace(sampling, ignore_eos=False, stop_token_ids=[tok.eos_id])
    greedy = make_workflow(cfg, tok, template, reward, dataclasses.replace(sampling, temperature=0.0), 1,
                           for_eval=True)
    sampled = make_workflow(cfg, tok, template, reward, sampling, r.eval_k, for_eval=True) if r.eval_k else None
    samples = prompt_dataset(cfg, cfg.data.eval_path, tok, template,
                             getattr(greedy, "tool_schemas", None)).samples[:r.eval_size]
    dump = os.path.join(cfg.train.run_dir, "eval_generations.jsonl") if cfg.logging.dump_eval_generations else None
    return PeriodicEval(samples, EvalWorkflows(greedy, sampled, tok, r.eval_k), dump_path=dump)
