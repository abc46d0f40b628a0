"""Builds the rollout side of a run from its sections: the task parts (tokenizer, template, reward,
sampling), the workflow, the prompt datasets, the controller and the held-out evaluation (the
same workflow, greedy). Runs in the rollout manager's process (megarl.rollout.manager); nothing
here touches a trainer rank.

    TaskSpec        rollout, data, reward sections + tokenizer path + max_seq_len  (shared)
    ControllerSpec  a TaskSpec + the staleness clock, seeds, failure policy, MoE routes
    EvalSpec        a TaskSpec + where the generations are dumped
    each made by ``from_config(cfg)``, or directly from its sections (the unit tests do)
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from megarl.config import DataConfig, RewardConfig, RolloutConfig
from megarl.data.chat import load_chat_template
from megarl.data.datasets import PromptDataset
from megarl.data.mixture import SourceMixture
from megarl.common.tokenizer import load_tokenizer
from megarl.protocol.packing import groups_per_step
from megarl.rewards import RewardCaller, load_reward_fn
from megarl.rollout.controller import RolloutController
from megarl.rollout.evaluation import EvalSuite, EvalWorkflows, PeriodicEval
from megarl.rollout.shaping import GroupShaping
from megarl.rollout.sources import SourceWorkflows, eval_set_tasks, source_tasks
from megarl.protocol.types import SamplingParams
from megarl.rollout.workflows import WorkflowContext, load_workflow


@dataclass(frozen=True)
class TaskSpec:
    """What training rollouts and evaluation share: the same tokenizer, template, reward function,
    dataset fields and workflow (``tokenizer_path``: data.tokenizer_path, else model.hf_path)."""

    rollout: RolloutConfig
    data: DataConfig
    reward: RewardConfig
    tokenizer_path: str
    max_seq_len: int
    # the environment servers (EnvClient's urls, api_key, timeout_s, and the workflow's retries):
    # env.urls' from the config, or set by the manager once it started env.cls's; None = no environment
    env: Optional[dict] = None

    @classmethod
    def from_config(cls, cfg) -> "TaskSpec":
        e = cfg.env
        env = env_spec(e.urls, e.api_key, e) if e.urls else None
        return cls(cfg.rollout, cfg.data, cfg.reward, cfg.data.tokenizer_path or cfg.model.hf_path,
                   cfg.train.max_seq_len, env)


def env_spec(urls: list[str], api_key: str, env_cfg) -> dict:
    """`TaskSpec.env` for ``urls`` (env.urls, or the servers the manager started)."""
    return {"urls": list(urls), "api_key": api_key or None, "timeout_s": env_cfg.step_timeout_s,
            "episode_retries": env_cfg.episode_retries}


@dataclass(frozen=True)
class ControllerSpec:
    """What a `RolloutController` is built from besides its task.

    ``batch_groups``: groups per policy version (the staleness clock ticks once per push, which
    covers train.trigger_parameter_sync_step steps); ``routes``: (decoder layers, experts per
    token) when the run replays the rollout's MoE routing, else None."""

    task: TaskSpec
    batch_groups: int
    seed: int
    dynamic_sampling: bool = False
    hold_timeout_s: float = 600.0
    failed_log: Optional[str] = None
    routes: Optional[tuple[int, int]] = None
    overlong_buffer_len: int = 0  # algo.overlong_*: shaped here, before dynamic sampling (DAPO)
    overlong_penalty_factor: float = 1.0
    lora_adapters: bool = False  # LoRA on SGLang: requests select the pushed adapter (lora_path)
    # on-policy distillation: TeacherClient's arguments (addresses, api_key, timeout_s), set by the
    # manager once it started the teacher servers (teacher.path); None = no teacher
    teacher: Optional[dict] = None

    @classmethod
    def from_config(cls, cfg, lora_adapters: bool = False) -> "ControllerSpec":
        """``lora_adapters``: the run's wire plan names PEFT adapters (`WirePlan.peft`)."""
        return cls(TaskSpec.from_config(cfg), groups_per_step(cfg) * cfg.train.trigger_parameter_sync_step,
                   cfg.train.seed, cfg.algo.dynamic_sampling, cfg.weights.timeout_s,
                   os.path.join(cfg.train.run_dir, "failed_prompts.jsonl"), routed_experts(cfg),
                   cfg.algo.overlong_buffer_len, cfg.algo.overlong_penalty_factor, lora_adapters)

    def shaping(self) -> GroupShaping:
        return GroupShaping(self.task.rollout.max_new_tokens, self.overlong_buffer_len,
                            self.overlong_penalty_factor, self.dynamic_sampling)


@dataclass(frozen=True)
class EvalSpec:
    """Held-out evaluation: its task (data.eval_path, rollout.eval_size / eval_k) and the file
    its generations are dumped to (logging.dump_eval_generations), else None; ``n``: sampled
    episodes per prompt (megarl-eval's eval.n), 0 = rollout.eval_k."""

    task: TaskSpec
    dump_path: Optional[str] = None
    n: int = 0  # sampled episodes per prompt behind pass@k (eval.n); 0 = rollout.eval_k
    last_step: int = 0  # train.steps: every held-out set (data.eval_sets) is evaluated there

    @classmethod
    def from_config(cls, cfg) -> "EvalSpec":
        dump = cfg.logging.dump_eval_generations and os.path.join(cfg.train.run_dir, "eval_generations.jsonl")
        return cls(TaskSpec.from_config(cfg), dump or None, last_step=cfg.train.steps)


def task_parts(task: TaskSpec, with_reward: bool = True):
    """(tokenizer, chat template, reward caller, sampling params) shared by training rollouts
    and evaluation: the same reward function and dataset fields for both."""
    r = task.rollout
    tok = load_tokenizer(task.tokenizer_path)
    template = load_chat_template(task.data.chat_template, task.tokenizer_path)
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              stop_token_ids=None if r.ignore_eos else [tok.eos_id],  # a stop id stops even with ignore_eos
                              ignore_eos=r.ignore_eos)
    # evaluation passes training's caller instead: one set of reward threads / worker processes
    reward = RewardCaller.from_config(r.reward_fn, task.reward) if with_reward else None
    return tok, template, reward, sampling


def prompt_dataset(data: DataConfig, path: str, tok, template, tools=None) -> PromptDataset:
    return PromptDataset(path, tok, prompt_key=data.prompt_key, answer_key=data.answer_key or None,
                         chat_template=template, max_prompt_length=data.max_prompt_length,
                         truncation=data.truncation, tools=tools, shuffle=data.shuffle)


def make_workflow(task: TaskSpec, tok, template, reward: Optional[RewardCaller], sampling: SamplingParams,
                  group_size: int, for_eval: bool = False):
    """``rollout.workflow`` built with ``rollout.workflow_args``. Evaluation builds it with its own
    group size and sampling (a ``group_size`` in workflow_args is training's, so it is left out)."""
    r = task.rollout
    # evaluation's group size is its own (1 greedy, eval_k sampled), whatever training's args say
    args = {k: v for k, v in r.workflow_args.items() if not (for_eval and k == "group_size")}
    env = None
    if task.env is not None:
        from megarl.envs.client import EnvClient

        env = EnvClient(task.env["urls"], task.env["api_key"], task.env["timeout_s"],
                        episode_retries=task.env["episode_retries"])
    ctx = WorkflowContext(tok, reward, sampling, group_size, template, task.max_seq_len, env)
    return load_workflow(r.workflow, ctx, args)


def routed_experts(cfg) -> Optional[tuple[int, int]]:
    """(decoder layers, experts per token) when the run replays the rollout's MoE routing
    (moe.routing_replay: rollout): the client asks every /generate for the routes."""
    if cfg.moe.routing_replay != "rollout":
        return None
    from megarl.protocol.hf_model import read_model_args

    args = read_model_args(cfg.model.hf_path)
    return args.num_layers, args.moe_topk


def training_task(task: TaskSpec, group_size: int):
    """(workflow, prompt dataset) of the training rollouts: data.train_path's with the run's
    workflow, or with data.sources a `SourceMixture` and each source's own workflow and reward."""
    if task.data.sources:
        workflows, datasets = {}, {}
        for name, sub in source_tasks(task).items():
            workflows[name], datasets[name] = training_task(sub, group_size)
        return SourceWorkflows(workflows), SourceMixture(datasets, [s.weight for s in task.data.sources])
    tok, template, reward, sampling = task_parts(task)
    workflow = make_workflow(task, tok, template, reward, sampling, group_size)
    # built after the workflow: a tool-calling workflow's schemas go into every rendered prompt
    return workflow, prompt_dataset(task.data, task.data.train_path, tok, template,
                                    getattr(workflow, "tool_schemas", None))


def build_controller(spec: ControllerSpec, cluster, timeline=None) -> RolloutController:
    r = spec.task.rollout
    workflow, dataset = training_task(spec.task, r.group_size)
    return RolloutController(
        dataset, workflow, cluster.addresses, cluster, batch_groups=spec.batch_groups,
        max_staleness=r.staleness, max_concurrent=r.max_concurrent, seed=spec.seed,
        api_key=r.api_key or None, dynamic_sampling=spec.dynamic_sampling, shaping=spec.shaping(),
        partial_rollout=r.partial_rollout, max_retries=r.max_retries,
        failed_log=spec.failed_log, timeline=timeline,
        sampling_seed=r.seed, max_consecutive_failures=r.max_consecutive_failures,
        hold_timeout_s=spec.hold_timeout_s, stale_cap=r.stale_cap, teacher=spec.teacher,
        # with routing replay every /generate asks for the routes of each token (R3)
        client_kwargs={"routed_experts": spec.routes, "lora_adapters": spec.lora_adapters})


def eval_reward(task: TaskSpec, training: Optional[RewardCaller]) -> RewardCaller:
    """The evaluation's reward caller: rollout.eval_reward_fn's when set (e.g. exact match while
    training from a reward model), else the training rollouts' ``training``."""
    path = task.rollout.eval_reward_fn
    if not path:
        # with data.sources each source has its own caller: the evaluation builds rollout.reward_fn's
        return training if training is not None else RewardCaller.from_config(task.rollout.reward_fn, task.reward)
    return RewardCaller(load_reward_fn(path), task.reward.timeout_s, task.reward.on_error_value)


def build_eval(spec: EvalSpec, reward: Optional[RewardCaller]):
    """The run's held-out evaluation: data.eval_path's (`build_one_eval`), or with data.eval_sets
    an `EvalSuite` of one evaluation per set, each scored by its own reward (the set's reward_fn,
    built here with its reward_args; else ``reward``), run at its own interval; None without
    either. ``last_step``: train.steps (every set evaluates there)."""
    task = spec.task
    if not task.data.eval_sets:
        return build_one_eval(spec, reward)
    sets = []
    for es, (name, sub) in zip(task.data.eval_sets, eval_set_tasks(task).items()):
        # ``reward`` is already the run's evaluation reward (`eval_reward`); a set's own is built here
        caller = RewardCaller.from_config(es.reward_fn, sub.reward) if es.reward_fn else reward
        sets.append((name, build_one_eval(dataclasses.replace(spec, task=sub), caller), sub.rollout.eval_interval))
    return EvalSuite(sets, spec.last_step)


def build_one_eval(spec: EvalSpec, reward: RewardCaller) -> Optional[PeriodicEval]:
    """Held-out evaluation through the configured workflow (greedy, and k sampled episodes with
    rollout.eval_k), its prompts rendered with the workflow's tool schemas as training's are;
    ``reward``: `eval_reward` of the training rollouts' caller (one set of reward threads / worker
    processes). None when data.eval_path is empty."""
    task, r = spec.task, spec.task.rollout
    if not task.data.eval_path:
        return None
    tok, template, _, sampling = task_parts(task, with_reward=False)
    if r.ignore_eos:  # evaluation answers stop at EOS whatever the training rollouts do
        sampling = dataclasses.replace(sampling, ignore_eos=False, stop_token_ids=[tok.eos_id])
    greedy = make_workflow(task, tok, template, reward, dataclasses.replace(sampling, temperature=0.0), 1,
                           for_eval=True)
    # pass@k from n >= k samples per prompt (the unbiased estimator needs n >= k)
    n = max(spec.n, r.eval_k)
    sampled = make_workflow(task, tok, template, reward, sampling, n, for_eval=True) if r.eval_k else None
    samples = prompt_dataset(task.data, task.data.eval_path, tok, template,
                             getattr(greedy, "tool_schemas", None)).samples[:r.eval_size]
    return PeriodicEval(samples, EvalWorkflows(greedy, sampled, tok, r.eval_k), dump_path=spec.dump_path)
