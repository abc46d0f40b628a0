"""Typed configuration: one dataclass per component, YAML recipes, dotted overrides.

    cfg = load_config("configs/tiny_sft.yaml", ["train.steps=20", "parallel.tp=2"])

Every field has a type and a docstring (the string literal under it). Loading fails at once,
with a one-line :class:`ConfigError` naming the field, on an unknown key, a value of the wrong
type, or an impossible value (TP not dividing the heads, PP above the layer count, ...). The
resolved config is written into the run directory by :func:`save_config`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from megarl.algo.config import AlgoConfig


class ConfigError(ValueError):
    """A bad configuration value; the message starts with the dotted field name."""


@dataclass
class ModelConfig:
    hf_path: str = ""
    """HF model directory: config.json (architecture, sizes) and, for init=hf, safetensors."""
    init: str = "hf"
    """hf: load the HF safetensors in hf_path; random: fresh init from config.json only."""
    dtype: str = "float32"
    """Parameter/compute dtype: float32 or bfloat16 (bf16 needs a GPU)."""
    seed: int = 1234
    """Seed for weight init and dropout."""
    spec: str = "auto"
    """Layer spec: auto (TE when TE and CUDA are present, else local), te, or local."""
    recompute: bool = False
    """Full activation recomputation (saves memory for large models)."""
    ref_hf_path: str = ""
    """Reference policy for the KL term (HF directory, loaded frozen with the same parallel
    layout when algo.kl_coef > 0); empty = the initial weights (model.hf_path)."""

    def validate(self) -> None:
        _choice("model.init", self.init, ("hf", "random"))
        _choice("model.dtype", self.dtype, ("float32", "bfloat16"))
        _choice("model.spec", self.spec, ("auto", "te", "local"))
        if not self.hf_path:
            raise ConfigError("model.hf_path: required (an HF model directory with config.json)")


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size; must divide attention heads and query groups."""
    pp: int = 1
    """Pipeline-parallel size; at most the number of layers."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved 1F1B): not supported yet, must stay null."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs the TE spec and TP > 1)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over DP (Megatron distributed optimizer)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl on GPU, gloo on CPU), nccl or gloo."""
    world_size: Optional[int] = None
    """Ranks to start when run directly (not under torchrun/srun/mpirun); default tp*pp."""

    def validate(self) -> None:
        _positive("parallel.tp", self.tp)
        _positive("parallel.pp", self.pp)
        if self.vpp is not None:
            # Checked on CPU with megatron-core 0.16.1: the interleaved schedule with token-budget
            # micro-batches gave wrong gradients (and hung with fewer micro-batches than stages),
            # so it is refused rather than trained on silently.
            raise ConfigError("parallel.vpp: the interleaved (virtual) pipeline schedule is not "
                              "supported yet; use parallel.pp without vpp")
        _choice("parallel.backend", self.backend, ("auto", "nccl", "gloo"))
        if self.world_size is not None:
            _positive("parallel.world_size", self.world_size)
            if self.world_size % (self.tp * self.pp):
                raise ConfigError(f"parallel.world_size: {self.world_size} is not divisible by "
                                  f"tp*pp={self.tp * self.pp}")


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global grad-norm clip; 0 disables clipping."""
    lr_warmup_steps: int = 0
    """Linear warmup steps."""
    lr_decay_style: str = "constant"
    """constant, linear or cosine."""
    lr_decay_steps: Optional[int] = None
    """Steps over which to decay (default: train.steps)."""

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr: must be > 0, got {self.lr}")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr: must be in [0, optim.lr], got {self.min_lr}")
        if self.clip_grad < 0:
            raise ConfigError(f"optim.clip_grad: must be >= 0, got {self.clip_grad}")
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"optim.lr_warmup_steps: must be >= 0, got {self.lr_warmup_steps}")
        _choice("optim.lr_decay_style", self.lr_decay_style, ("constant", "linear", "cosine"))


@dataclass
class TrainConfig:
    algorithm: str = "sft"
    """sft (supervised fine-tuning) or grpo (asynchronous RL; advantage per algo.advantage)."""
    steps: int = 100
    """Optimizer steps to run (RL: one step per global batch)."""
    global_batch_size: int = 32
    """Sequences per optimizer step, across all DP ranks."""
    micro_batch_tokens: int = 4096
    """Token budget of one micro-batch (padded length x sequences)."""
    max_seq_len: int = 512
    """Longest sequence (prompt + response) in tokens; longer SFT samples are truncated."""
    run_dir: str = "runs/default"
    """Directory for the resolved config, metrics.jsonl and checkpoints by default."""
    seed: int = 1234
    """Data-order seed (also seeds the PPO mini-batch shuffle)."""
    torch_threads: int = 0
    """torch intra-op threads of each trainer rank; 0 = torch's default (OMP_NUM_THREADS, else
    one per core, which oversubscribes the cores a local rollout server also uses)."""
    ppo_epochs: int = 1
    """RL: passes over each step's trajectories (one optimizer step per mini-batch per pass)."""
    ppo_mini_batch_size: int = 0
    """RL: sequences per optimizer step across all DP ranks; 0 = the whole step (one mini-batch)."""
    require_batches: int = 0
    """RL (verl fully-async): a step takes require_batches x ppo_mini_batch_size sequences (whole
    groups); 0 = global_batch_size. Setting it replaces global_batch_size."""
    trigger_parameter_sync_step: int = 1
    """RL (verl fully-async): training steps per weight push; the policy version advances once per
    push, so staleness is counted in pushes of trigger_parameter_sync_step x batch samples."""
    stop_at_eval_accuracy: float = 0.0
    """RL: end the run after the first evaluation whose held-out accuracy reaches this (time-to-
    accuracy benchmarks; checkpoint and export are written as at the last step); 0 = off."""

    def validate(self) -> None:
        _choice("train.algorithm", self.algorithm, ("sft", "grpo"))
        for name in ("steps", "global_batch_size", "micro_batch_tokens", "max_seq_len", "ppo_epochs",
                     "trigger_parameter_sync_step"):
            _positive(f"train.{name}", getattr(self, name))
        if self.ppo_mini_batch_size < 0:
            raise ConfigError(f"train.ppo_mini_batch_size: must be >= 0, got {self.ppo_mini_batch_size}")
        if self.require_batches < 0:
            raise ConfigError(f"train.require_batches: must be >= 0, got {self.require_batches}")
        if not 0.0 <= self.stop_at_eval_accuracy <= 1.0:
            raise ConfigError(f"train.stop_at_eval_accuracy: must be in [0, 1], got {self.stop_at_eval_accuracy}")
        if self.require_batches and not self.ppo_mini_batch_size:
            raise ConfigError("train.require_batches: needs train.ppo_mini_batch_size > 0 "
                              "(a step takes require_batches x ppo_mini_batch_size sequences)")

    @property
    def step_batch_size(self) -> int:
        """Sequences one RL step trains on (require_batches x ppo_mini_batch_size when set)."""
        if self.require_batches:
            return self.require_batches * self.ppo_mini_batch_size
        return self.global_batch_size


@dataclass
class DataConfig:
    train_path: str = ""
    """JSONL: SFT lines {prompt, response}; RL lines {prompt, answer, ...}."""
    eval_path: str = ""
    """Optional held-out JSONL, same format."""
    prompt_key: str = "prompt"
    """Key of the prompt text in each JSONL line."""
    response_key: str = "response"
    """Key of the response text (SFT)."""
    tokenizer_path: str = ""
    """Tokenizer directory or file; empty = model.hf_path."""

    def validate(self) -> None:
        if not self.train_path:
            raise ConfigError("data.train_path: required")


@dataclass
class CheckpointConfig:
    save_dir: str = ""
    """Training checkpoints (Megatron dist-checkpoint); empty = <run_dir>/checkpoints."""
    save_interval: int = 0
    """Save every N steps; 0 = only at the end."""
    keep_last: int = 2
    """Keep the newest N complete checkpoints."""
    resume: bool = True
    """Resume from the latest complete checkpoint in save_dir if there is one."""
    hf_export_dir: str = ""
    """Where to write the HF-format model (safetensors + config + tokenizer); empty = off."""
    hf_export_interval: int = 0
    """Export every N steps; 0 = only at the end."""

    def validate(self) -> None:
        if self.save_interval < 0:
            raise ConfigError(f"checkpoint.save_interval: must be >= 0, got {self.save_interval}")
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last: must be >= 1, got {self.keep_last}")
        if self.hf_export_interval < 0:
            raise ConfigError(
                f"checkpoint.hf_export_interval: must be >= 0, got {self.hf_export_interval}")


@dataclass
class LoggingConfig:
    log_interval: int = 1
    """Print a metrics line every N steps (metrics.jsonl gets every step)."""
    tensorboard: bool = False
    """Also write TensorBoard event files under <run_dir>/tb."""
    wandb_project: str = ""
    """Weights & Biases project; empty = off (WANDB_MODE=offline works without a network)."""
    timeline: bool = True
    """RL: record spans (generate per server, wait, update, push, eval) to <run_dir>/timeline/ for
    tools/plot_timeline.py."""
    dump_generations: bool = False
    """RL: append every trained sample (prompt index, completion, reward, per-token versions and
    behaviour logprobs) to <run_dir>/generations.jsonl."""

    def validate(self) -> None:
        _positive("logging.log_interval", self.log_interval)


@dataclass
class RolloutConfig:
    servers: list[str] = field(default_factory=list)
    """Rollout server addresses (http://host:port): SGLang servers or megarl-server."""
    local_servers: int = 1
    """When servers is empty: start this many megarl CPU servers on loopback (the CPU demo)."""
    server_threads: int = 1
    """torch threads of each local server."""
    server_cpus: list[int] = field(default_factory=list)
    """CPU ids to pin the local servers to (os.sched_setaffinity); rank 0, which starts them, is then
    pinned to the other CPUs, so generation and training never share a core. Empty = no pinning.
    On the 2-core demo machine: [1] (server on CPU 1, trainer on CPU 0)."""
    api_key: str = ""
    """Bearer token for the servers' admin endpoints; empty = none."""
    group_size: int = 8
    """Samples per prompt (GRPO group)."""
    max_new_tokens: int = 64
    """Generation budget per sample."""
    temperature: float = 1.0
    """Sampling temperature (1.0: behave_logp is the policy's own logprob)."""
    top_p: float = 1.0
    """Nucleus sampling; < 1 makes behave_logp differ from the sampling distribution."""
    ignore_eos: bool = False
    """Generate max_new_tokens for every sample, past EOS (benchmarks and tests of long rollouts)."""
    max_staleness: int = 1
    """Bounded off-policyness (AReaL's eta): an episode started at policy version v is trained by
    version v + max_staleness; 0 = on-policy (each batch generated by the current weights)."""
    staleness_threshold: float = 0.0
    """Fractional staleness (verl fully-async): up to staleness_threshold x samples-per-push may be
    generated ahead by the previous version. Use it OR max_staleness (set max_staleness: 0)."""
    partial_rollout: bool = True
    """At a weight push, true: in-flight requests are interrupted and continue under the new
    weights (one sample may span versions); false: they finish under the old weights first."""
    max_retries: int = 2
    """Re-runs of an episode whose workflow raised; then its prompt is recorded as failed
    (<run_dir>/failed_prompts.jsonl)."""
    max_concurrent: int = 64
    """Episodes (prompt groups) generating at once."""
    reward_fn: str = "megarl.rollout.rewards:arith_exact_match"
    """Reward function import path: fn(prompt, completion, meta) -> float."""
    workflow: str = "megarl.rollout.workflow:SingleTurnWorkflow"
    """Workflow class import path (arun_episode(client, sample) -> list[Trajectory])."""
    workflow_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments of the workflow class, e.g. {min_new_tokens: 4, alpha: 1.0} for
    megarl.rollout.workflow:LongTailWorkflow (long-tailed per-sample lengths; docs/benchmarks.md)."""
    eval_interval: int = 0
    """Greedy accuracy on data.eval_path every N steps (0 = only at the end, if eval_path is set)."""
    eval_size: int = 500
    """Held-out prompts per evaluation."""
    eval_at_start: bool = False
    """Also evaluate before the first step of a fresh run, logged as step 0 (the start accuracy of
    the learning curve)."""

    def validate(self) -> None:
        bad = [c for c in self.server_cpus if not isinstance(c, int) or c < 0]
        if bad:
            raise ConfigError(f"rollout.server_cpus: expected CPU ids >= 0, got {bad}")
        for i, s in enumerate(self.servers):
            if not s.startswith(("http://", "https://")) and ":" not in s:
                raise ConfigError(f"rollout.servers[{i}]: expected host:port or a URL, got {s!r}")
        for name in ("local_servers", "server_threads", "group_size", "max_new_tokens", "max_concurrent",
                     "eval_size"):
            _positive(f"rollout.{name}", getattr(self, name))
        if self.max_staleness < 0:
            raise ConfigError(f"rollout.max_staleness: must be >= 0, got {self.max_staleness}")
        if self.staleness_threshold < 0:
            raise ConfigError(f"rollout.staleness_threshold: must be >= 0, got {self.staleness_threshold}")
        if self.staleness_threshold and self.max_staleness:
            raise ConfigError("rollout.staleness_threshold: set either it (verl) or rollout.max_staleness "
                              f"(AReaL), not both (got {self.staleness_threshold} and {self.max_staleness}); "
                              "see docs/async.md")
        if self.max_retries < 0:
            raise ConfigError(f"rollout.max_retries: must be >= 0, got {self.max_retries}")

    @property
    def staleness(self) -> float:
        """The effective eta of the capacity formula (integer max_staleness or the fraction)."""
        return float(self.max_staleness or self.staleness_threshold)
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature: must be > 0 for RL sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p: must be in (0, 1], got {self.top_p}")


@dataclass
class WeightSyncConfig:
    transport: str = "distributed"
    """distributed (broadcast over a gloo/NCCL group), disk (shared dir) or tensor (HTTP)."""
    bucket_mb: int = 256
    """Bucket size cap in MiB; peak extra memory is about two buckets."""
    dtype: str = "auto"
    """Serving dtype: auto (the training dtype), float32 or bfloat16."""
    pause_mode: str = "abort"
    """How servers pause for a push: abort (partial rollouts resume), retract or in_place."""
    timeout_s: float = 120.0
    """Deadline of every step of a push (HTTP calls and broadcasts)."""
    master_address: str = "127.0.0.1"
    """Address the servers use to reach this job's source ranks (distributed transport)."""
    disk_dir: str = ""
    """Shared directory for the disk transport; empty = <run_dir>/weights."""
    keep_versions: int = 2
    """Versions kept in disk_dir."""
    verify: bool = False
    """After a push, compare per-tensor checksums against the servers (slow; for debugging)."""
    tensor_format: str = "megarl"
    """Tensor-transport payload: megarl (safetensors, megarl-server) or sglang (real SGLang)."""

    def validate(self) -> None:
        _choice("weights.transport", self.transport, ("distributed", "disk", "tensor"))
        _choice("weights.tensor_format", self.tensor_format, ("megarl", "sglang"))
        _choice("weights.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        _choice("weights.pause_mode", self.pause_mode, ("abort", "retract", "in_place"))
        _positive("weights.bucket_mb", self.bucket_mb)
        _positive("weights.keep_versions", self.keep_versions)
        if self.timeout_s <= 0:
            raise ConfigError(f"weights.timeout_s: must be > 0, got {self.timeout_s}")


@dataclass
class CriticConfig:
    hf_path: str = ""
    """Critic backbone (HF directory) for algo.advantage=gae; empty = model.hf_path. Its LM head is
    replaced by a fresh scalar value head."""
    lr: Optional[float] = None
    """Critic peak learning rate; null = optim.lr (other optimizer settings from optim)."""
    value_clip: Optional[float] = 0.2
    """Value clip c: the loss also scores V_old + clip(V - V_old, -c, c); null = off."""
    warmup_steps: int = 0
    """RL steps that train only the critic before the actor starts updating."""

    def validate(self) -> None:
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"critic.lr: must be > 0, got {self.lr}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ConfigError(f"critic.value_clip: must be > 0 or null, got {self.value_clip}")
        if self.warmup_steps < 0:
            raise ConfigError(f"critic.warmup_steps: must be >= 0, got {self.warmup_steps}")


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
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            try:
                section.validate()
            except ConfigError:
                raise
            except ValueError as e:  # sections from megarl.algo raise plain ValueError
                raise ConfigError(str(e)) from None
        validate_against_model(self)
        if self.train.algorithm == "grpo":
            name = "train.require_batches" if self.train.require_batches else "train.global_batch_size"
            if self.train.step_batch_size % self.rollout.group_size:
                raise ConfigError(f"{name}: a step of {self.train.step_batch_size} sequences is not whole "
                                  f"groups of rollout.group_size={self.rollout.group_size}")
            if not self.rollout.partial_rollout and self.weights.pause_mode != "abort":
                raise ConfigError(f"weights.pause_mode: {self.weights.pause_mode} keeps requests running "
                                  "across the push, which rollout.partial_rollout=false forbids; use abort")


def validate_against_model(cfg: Config) -> None:
    """Checks that need the HF config.json: TP vs heads and query groups, PP vs layers."""
    path = os.path.join(cfg.model.hf_path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"model.hf_path: no config.json in {cfg.model.hf_path!r}")
    with open(path) as f:
        hf = json.load(f)
    heads = hf.get("num_attention_heads")
    groups = hf.get("num_key_value_heads") or heads
    layers = hf.get("num_hidden_layers")
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if heads and heads % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide num_attention_heads={heads}")
    if groups and groups % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide num_key_value_heads={groups}")
    if layers and pp > layers:
        raise ConfigError(f"parallel.pp: {pp} is greater than num_hidden_layers={layers}")
    vpp = cfg.parallel.vpp
    if layers and vpp and layers % (pp * vpp):
        raise ConfigError(f"parallel.vpp: pp*vpp={pp * vpp} does not divide num_hidden_layers={layers}")


def check_world_size(cfg: Config, world_size: int) -> int:
    """Returns the data-parallel size; the world must be a multiple of TP*PP."""
    mp = cfg.parallel.tp * cfg.parallel.pp
    if world_size % mp:
        raise ConfigError(
            f"parallel.tp: world size {world_size} is not divisible by tp*pp={mp} "
            f"(tp={cfg.parallel.tp}, pp={cfg.parallel.pp})")
    return world_size // mp


# ----------------------------------------------------------------------------- loading

def load_config(path: Optional[str], overrides: list[str] = (), validate: bool = True) -> Config:
    """Reads a YAML recipe, applies ``a.b=c`` overrides (values parsed as YAML), validates."""
    raw: dict = {}
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config: file not found: {path}")
        with open(path) as f:
            try:
                raw = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"config: {path} is not valid YAML: {str(e).splitlines()[0]}")
        if not isinstance(raw, dict):
            raise ConfigError(f"config: {path} must hold a mapping at the top level")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override: expected a.b=value, got {item!r}")
        node = raw
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {p} is not a section")
        node[parts[-1]] = yaml.safe_load(value) if value != "" else ""
    cfg = from_dict(Config, raw, prefix="")
    if validate:
        cfg.validate()
    return cfg


def from_dict(cls, data: Any, prefix: str):
    """Builds dataclass ``cls`` from a mapping, checking keys and types against annotations."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(tp, value, name):
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, prefix=name + ".")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, name)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [_coerce(item_tp, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    return value


def save_config(cfg: Config, run_dir: str) -> str:
    """Writes the resolved config to ``<run_dir>/config.yaml`` (atomically) and returns the path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(dataclasses.asdict(cfg), f, sort_keys=False)
    os.replace(tmp, path)
    return path


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: must be one of {', '.join(map(str, allowed))}; got {value!r}")


def _positive(name: str, value) -> None:
    if value < 1:
        raise ConfigError(f"{name}: must be >= 1, got {value}")
