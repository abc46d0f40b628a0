"""The whole config (`Config`: one field per section) and the rules that span sections."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megarl.algo.config import AlgoConfig
from megarl.config.eval import EvalConfig
from megarl.config.launch import LaunchConfig
from megarl.config.lora import LoRAConfig
from megarl.config.model import CriticConfig, ModelConfig, OptimConfig, ParallelConfig
from megarl.config.rollout import (REWARD_MODEL_FN, EnvConfig, RewardConfig, RolloutConfig, TeacherConfig,
                                   WeightSyncConfig)
from megarl.config.train import CheckpointConfig, DataConfig, LoggingConfig, TrainConfig
from megarl.common.errors import ConfigError
from megarl.config.moe import MoEConfig

ENV_WORKFLOW = "megarl.rollout.workflows:EnvironmentWorkflow"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def validate(self) -> None:
        """Types, ranges and rules across fields; no file reads, no model code (the checks against
        the model's files are `megarl.models.checks`, run by `megarl.launch.preflight`)."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            try:
                section.validate()
            except ConfigError:
                raise
            except ValueError as e:  # sections from megarl.algo raise plain ValueError
                raise ConfigError(str(e)) from None
        if self.rollout.placement == "colocated" and self.train.trigger_parameter_sync_step != 1:
            raise ConfigError("train.trigger_parameter_sync_step: rollout.placement=colocated pushes after "
                              f"every update (the servers wake to a push); got {self.train.trigger_parameter_sync_step}")
        if self.reward.model.path and self.rollout.reward_fn != REWARD_MODEL_FN:
            raise ConfigError(f"reward.model.path: the job's reward-model servers are scored through "
                              f"rollout.reward_fn={REWARD_MODEL_FN}; got {self.rollout.reward_fn}")
        if self.weights.transport == "shm":
            from megarl.common.net import is_loopback, url_host

            remote = [u for u in self.rollout.servers if not is_loopback(url_host(u))]
            if remote:
                raise ConfigError(f"weights.transport: shm hands the weights over in this host's memory; "
                                  f"rollout.servers {remote[0]} is not on loopback (use "
                                  "weights.transport=distributed)")
        if self.weights.refit == "shard" and self.parallel.pp > 1:
            raise ConfigError("weights.refit: shard supports dense models on one pipeline stage "
                              f"(parallel.pp={self.parallel.pp}); use weights.refit=gather")
        if self.lora.enabled:
            validate_lora(self)
        if self.train.pack_sequences is True and self.model.attention == "unfused" and self.model.spec != "te":
            raise ConfigError("train.pack_sequences: megatron-core's unfused attention takes no packed "
                              "sequences; use model.attention=sdpa")
        validate_parallel(self)
        if self.moe.replay_check and self.algo.prox_logp_mode == "loglinear":
            raise ConfigError("moe.replay_check: needs algo.prox_logp_mode recompute or metrics (loglinear "
                              "runs no prox recompute to check)")
        if self.moe.routing_replay != "none" and self.model.recompute and self.parallel.pp > 1:
            # a recomputed layer reads the routes of the micro-batch last fed to its stage, which under
            # 1F1B is not the one being recomputed
            raise ConfigError("moe.routing_replay: not supported with model.recompute and parallel.pp > 1")
        if self.eval.n and not self.eval.n >= self.rollout.eval_k > 0:
            raise ConfigError(f"eval.n: {self.eval.n} samples per prompt need rollout.eval_k = k with "
                              f"1 <= k <= n (pass@k from n samples); got rollout.eval_k={self.rollout.eval_k}")
        validate_teacher(self)
        validate_env(self)
        validate_data(self)
        if self.train.is_rl:
            validate_learning_signal(self)
            if self.algo.overlong_buffer_len > self.rollout.max_new_tokens:
                raise ConfigError(f"algo.overlong_buffer_len: {self.algo.overlong_buffer_len} is longer than "
                                  f"rollout.max_new_tokens={self.rollout.max_new_tokens}")
            name = "train.require_batches" if self.train.require_batches else "train.global_batch_size"
            if self.train.step_batch_size % self.rollout.group_size:
                raise ConfigError(f"{name}: a step of {self.train.step_batch_size} sequences is not whole "
                                  f"groups of rollout.group_size={self.rollout.group_size}")
            if not self.rollout.partial_rollout and self.weights.pause_mode not in ("abort", "auto"):
                raise ConfigError(f"weights.pause_mode: {self.weights.pause_mode} keeps requests running "
                                  "across the push, which rollout.partial_rollout=false forbids; use abort")


def validate_parallel(cfg: Config) -> None:
    """The interleaved pipeline and context parallelism against the batch and the attention."""
    if cfg.parallel.vpp is not None:
        if cfg.parallel.pp < 2:
            raise ConfigError(f"parallel.vpp: the interleaved schedule splits pipeline stages; needs "
                              f"parallel.pp >= 2, got pp={cfg.parallel.pp}")
        if cfg.train.pack_sequences is False or cfg.model.attention == "unfused" and cfg.model.spec != "te":
            # megarl.models.builder.transformer_config: why one activation shape per step
            raise ConfigError("parallel.vpp: the interleaved schedule needs micro-batches of one shape per "
                              "step (megatron-core 0.16.1 mixes up messages of different shapes at PP=2): "
                              "packed sequences, train.pack_sequences auto or true with model.attention sdpa")
    if cfg.parallel.cp > 1:
        if cfg.train.micro_batch_tokens % 2:
            raise ConfigError(f"train.micro_batch_tokens: {cfg.train.micro_batch_tokens} is odd; with "
                              f"parallel.cp={cfg.parallel.cp} a micro-batch of micro_batch_tokens x cp tokens "
                              f"splits in 2 x cp equal chunks, so it must be even")
        if cfg.model.attention == "unfused" and cfg.model.spec != "te":
            raise ConfigError("parallel.cp: megatron-core's unfused attention has no context parallelism; "
                              "use model.attention=sdpa (CPU) or the TE spec (GPU)")


def validate_teacher(cfg: Config) -> None:
    """On-policy distillation: a teacher and its weight together, in RL, beside the job's own servers."""
    if bool(cfg.teacher.path) != (cfg.algo.distill_coef > 0):
        raise ConfigError("algo.distill_coef: on-policy distillation needs both a teacher (teacher.path) and "
                          f"a weight for its signal (> 0); got teacher.path={cfg.teacher.path!r}, "
                          f"algo.distill_coef={cfg.algo.distill_coef}")
    if cfg.teacher.path and not cfg.train.is_rl:
        raise ConfigError("teacher.path: on-policy distillation is RL (the teacher scores sampled tokens)")
    if cfg.teacher.path and cfg.rollout.servers:
        raise ConfigError("teacher.path: the teacher servers are started by the job beside its own policy "
                          f"servers; with rollout.servers ({cfg.rollout.servers[0]}, ...) none are")


def validate_data(cfg: Config) -> None:
    """Data fields of the other training kind (SFT conversations, RL mixtures and held-out sets)."""
    if cfg.data.messages_key and cfg.train.is_rl:
        raise ConfigError("data.messages_key: conversations for SFT; RL reads chat prompts from data.prompt_key")
    for name in ("sources", "eval_sets"):
        if getattr(cfg.data, name) and not cfg.train.is_rl:
            raise ConfigError(f"data.{name}: RL prompt files (a mixture, held-out sets); SFT reads data.train_path")


def validate_env(cfg: Config) -> None:
    """An environment (env.cls / env.urls) exactly when a workflow drives one, and only in RL."""
    env = cfg.env
    if (env.cls or env.urls) and not cfg.train.is_rl:
        raise ConfigError("env.cls: environments answer sampled turns (RL); SFT reads fixed conversations")
    workflows = {cfg.rollout.workflow, *(s.workflow for s in cfg.data.sources if s.workflow),
                 *(e.workflow for e in cfg.data.eval_sets if e.workflow)}
    # a custom workflow is imported (to see whether it subclasses EnvironmentWorkflow) only when an
    # environment is configured
    drives = any(_drives_env(w, resolve=bool(env.cls or env.urls)) for w in workflows)
    if (env.cls or env.urls) and not drives:
        raise ConfigError(f"env.{'cls' if env.cls else 'urls'}: environments are driven by "
                          f"rollout.workflow={ENV_WORKFLOW} (or a subclass); got {cfg.rollout.workflow}")
    if drives and not (env.cls or env.urls):
        raise ConfigError(f"rollout.workflow: {ENV_WORKFLOW} needs an environment: env.cls (served by the "
                          "job) or env.urls (servers you run)")


def _drives_env(path: str, resolve: bool) -> bool:
    """Whether workflow ``path`` is EnvironmentWorkflow or a subclass (imported only when it is
    not named as shipped; a path that does not import is left to the workflow loader's error)."""
    shipped = (ENV_WORKFLOW, "megarl.rollout.workflows.environment:EnvironmentWorkflow")
    if path in shipped:
        return True
    if resolve and not path.startswith("megarl.rollout.workflow") and ":" in path:
        import importlib

        module, _, name = path.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return False
        # by name along the MRO: the config package imports nothing of the rollout side
        return isinstance(cls, type) and any(f"{c.__module__}:{c.__qualname__}" in shipped for c in cls.__mro__)
    return False


def validate_learning_signal(cfg: Config) -> None:
    """RL settings that run to the end while learning nothing are refused at load."""
    from megarl.algo.choices import AdvantageEstimator

    r = cfg.rollout
    if r.group_size == 1 and AdvantageEstimator(cfg.algo.advantage).group_relative:
        raise ConfigError(f"rollout.group_size: 1 with algo.advantage={cfg.algo.advantage} (a group-relative "
                          "baseline) gives every sample advantage 0 and nothing is learned; use group_size "
                          ">= 2 or algo.advantage=reinforce_pp or gae")
    if r.group_size == 1 and cfg.algo.dynamic_sampling:
        raise ConfigError("algo.dynamic_sampling: drops groups whose rewards are all equal, which is every "
                          "group of rollout.group_size=1: no batch would ever fill")


def validate_lora(cfg: Config) -> None:
    """LoRA trains adapters on a frozen base; settings that would train or push something else
    are refused at load."""
    if cfg.optim.freeze:
        raise ConfigError("optim.freeze: lora.rank > 0 already freezes every base weight; leave optim.freeze empty")
    if cfg.parallel.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel: not supported with lora.rank > 0")
    if cfg.train.is_rl:
        if cfg.weights.refit != "gather":
            raise ConfigError(f"weights.refit: lora.rank > 0 pushes the adapters by the gather path; got "
                              f"{cfg.weights.refit!r} (use weights.refit=gather)")
        if cfg.weights.pause_mode in ("retract", "in_place") and (
                cfg.rollout.engine == "sglang" or cfg.weights.tensor_format == "sglang"):
            # a paused request keeps its adapter: it would resume on the old one, stamped with the
            # new version, and hold that adapter loaded (SGLang's unload waits for it)
            raise ConfigError(f"weights.pause_mode: {cfg.weights.pause_mode} keeps paused requests on the "
                              "previous LoRA adapter on SGLang; lora.rank > 0 needs abort (or auto)")
        if cfg.weights.transport == "disk":
            raise ConfigError("weights.transport: disk writes whole HF checkpoints; lora.rank > 0 pushes the "
                              "adapters over distributed, tensor or shm")
        if cfg.rollout.placement == "colocated":
            raise ConfigError("rollout.placement: colocated is not supported with lora.rank > 0 (use disaggregated)")
        if cfg.algo.advantage == "gae":
            raise ConfigError("algo.advantage: gae trains a critic, which lora.rank > 0 does not adapt; use a "
                              "critic-free estimator (grpo, rloo, reinforce_pp)")


def check_world_size(cfg: Config, world_size: int) -> int:
    """Returns the data-parallel size; the world must be a multiple of TP*PP*CP."""
    par = cfg.parallel
    mp = par.model_parallel
    if world_size % mp:
        raise ConfigError(
            f"parallel.tp: world size {world_size} is not divisible by tp*pp*cp={mp} "
            f"(tp={par.tp}, pp={par.pp}, cp={par.cp})")
    if (world_size // mp) % par.ep:
        raise ConfigError(f"parallel.ep: {par.ep} does not divide the data-parallel size "
                          f"{world_size // mp} (world size {world_size})")
    return world_size // mp
