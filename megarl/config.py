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
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from megarl.algo.config import AlgoConfig
from megarl.config_load import (ConfigError, apply_overrides, check_outputs, read_yaml, recipe_keys,
                                resolve_outputs)
from megarl.fields import bounded, check_bounds
from megarl.models.moe_config import MoEConfig


_COLD = ("temperature 0 samples every completion of a group alike: the advantages are all 0 and "
         "nothing is learned")


def _check(section, prefix: str) -> None:
    """The declared ranges of a section's numeric fields (megarl.fields), as ConfigError."""
    try:
        check_bounds(section, prefix)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass
class ModelConfig:
    hf_path: str = ""
    """HF model directory: config.json (architecture, sizes) and, for init=hf, safetensors."""
    init: str = "hf"
    """hf: load the HF safetensors in hf_path; random: fresh init from config.json only."""
    dtype: str = "float32"
    """Parameter/compute dtype: float32 or bfloat16 (bf16 needs a GPU)."""
    seed: int = bounded(1234, ge=0)
    """Seed for weight init and dropout."""
    spec: str = "auto"
    """Layer spec: auto (TE when TE and CUDA are present, else local), te, or local."""
    attention: str = "sdpa"
    """Core attention of the local spec: sdpa (torch's fused scaled_dot_product_attention) or
    unfused (megatron-core's DotProductAttention). The TE spec uses TE's kernels either way."""
    recompute: bool = False
    """Full activation recomputation (saves memory for large models)."""
    ref_hf_path: str = ""
    """Reference policy for the KL term (HF directory, loaded frozen with the same parallel
    layout when algo.kl_coef > 0); empty = the initial weights (model.hf_path)."""
    make_vocab_size_divisible_by: int = bounded(128, ge=1)
    """Megatron pads the embedding and output layer to a multiple of this times parallel.tp (as
    Megatron's trainer does); the padding is stripped from every export and masked in logprobs."""

    def validate(self) -> None:
        _check(self, "model")
        _choice("model.init", self.init, ("hf", "random"))
        _choice("model.dtype", self.dtype, ("float32", "bfloat16"))
        _choice("model.spec", self.spec, ("auto", "te", "local"))
        _choice("model.attention", self.attention, ("sdpa", "unfused"))
        if not self.hf_path:
            raise ConfigError("model.hf_path: required (an HF model directory with config.json)")


@dataclass
class ParallelConfig:
    tp: int = bounded(1, ge=1)
    """Tensor-parallel size; must divide attention heads and query groups."""
    pp: int = bounded(1, ge=1)
    """Pipeline-parallel size, up to the number of layers (uneven splits: docs/models.md)."""
    first_stage_layers: Optional[int] = bounded(None, ge=1)
    """Layers on the first pipeline stage (Megatron's num_layers_in_first_pipeline_stage; the
    middle stages split the rest evenly); null = automatic."""
    last_stage_layers: Optional[int] = bounded(None, ge=1)
    """Layers on the last pipeline stage (num_layers_in_last_pipeline_stage); null = automatic."""
    ep: int = bounded(1, ge=1)
    """Expert-parallel size for MoE models (experts split over this many ranks of the DP
    dimension; must divide the experts and the DP size). 1 for dense models."""
    vpp: Optional[int] = bounded(None, ge=1)
    """Virtual pipeline stages per rank (interleaved 1F1B): not supported yet, must stay null."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs the TE spec and TP > 1)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over DP (Megatron distributed optimizer)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl on GPU, gloo on CPU), nccl or gloo."""
    world_size: Optional[int] = bounded(None, ge=1)
    """Ranks to start when run directly (not under torchrun/srun/mpirun); default tp*pp."""

    def validate(self) -> None:
        _check(self, "parallel")
        if self.vpp is not None:
            # Checked on CPU with megatron-core 0.16.1: the interleaved schedule with token-budget
            # micro-batches gave wrong gradients (and hung with fewer micro-batches than stages),
            # so it is refused rather than trained on silently.
            raise ConfigError("parallel.vpp: the interleaved (virtual) pipeline schedule is not "
                              "supported yet; use parallel.pp without vpp")
        _choice("parallel.backend", self.backend, ("auto", "nccl", "gloo"))
        if self.world_size is not None:
            if self.world_size % (self.tp * self.pp):
                raise ConfigError(f"parallel.world_size: {self.world_size} is not divisible by "
                                  f"tp*pp={self.tp * self.pp}")


@dataclass
class OptimConfig:
    lr: float = bounded(1e-5, gt=0)
    """Peak learning rate."""
    min_lr: float = bounded(0.0, ge=0)
    """Learning rate at the end of decay."""
    weight_decay: float = bounded(0.0, ge=0)
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = bounded(0.9, ge=0, lt=1)
    """Adam beta1."""
    adam_beta2: float = bounded(0.999, ge=0, lt=1)
    """Adam beta2."""
    adam_eps: float = bounded(1e-8, gt=0)
    """Adam epsilon."""
    clip_grad: float = bounded(1.0, ge=0)
    """Global grad-norm clip; 0 disables clipping."""
    lr_warmup_steps: int = bounded(0, ge=0)
    """Linear warmup steps."""
    lr_decay_style: str = "constant"
    """constant, linear or cosine."""
    lr_decay_steps: Optional[int] = bounded(None, ge=1)
    """Steps over which to decay (default: train.steps)."""

    def validate(self) -> None:
        _check(self, "optim")
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr: must be in [0, optim.lr], got {self.min_lr}")
        _choice("optim.lr_decay_style", self.lr_decay_style, ("constant", "linear", "cosine"))


@dataclass
class TrainConfig:
    algorithm: str = "sft"
    """sft (supervised fine-tuning) or rl (asynchronous RL: the estimator is algo.advantage, e.g.
    grpo, rloo, reinforce_pp, gae). "grpo" is read as rl (older recipes)."""
    steps: int = bounded(100, ge=1)
    """Optimizer steps to run (RL: one step per global batch)."""
    global_batch_size: int = bounded(32, ge=1)
    """Sequences per optimizer step, across all DP ranks."""
    micro_batch_tokens: int = bounded(4096, ge=1)
    """Token budget of one micro-batch (padded length x sequences)."""
    max_seq_len: int = bounded(512, ge=2)
    """Longest sequence (prompt + response) in tokens; longer SFT samples are truncated."""
    run_dir: str = "runs/default"
    """Directory for the resolved config, metrics.jsonl and checkpoints by default."""
    seed: int = bounded(1234, ge=0)
    """Data-order seed (also seeds the PPO mini-batch shuffle)."""
    torch_threads: int = bounded(0, ge=0)
    """torch intra-op threads of each trainer rank; 0 = torch's default (OMP_NUM_THREADS, else
    one per core, which oversubscribes the cores a local rollout server also uses)."""
    ppo_epochs: int = bounded(1, ge=1)
    """RL: passes over each step's trajectories (one optimizer step per mini-batch per pass)."""
    ppo_mini_batch_size: int = bounded(0, ge=0)
    """RL: sequences per optimizer step across all DP ranks; 0 = the whole step (one mini-batch)."""
    require_batches: int = bounded(0, ge=0)
    """RL (verl fully-async): a step takes require_batches x ppo_mini_batch_size sequences (whole
    groups); 0 = global_batch_size. Setting it replaces global_batch_size."""
    stop_at_eval_accuracy: float = bounded(0.0, ge=0, le=1)
    """RL: end the run after the first evaluation whose held-out accuracy reaches this (time-to-
    accuracy benchmarks; checkpoint and export are written as at the last step); 0 = off."""
    max_nonfinite_steps: int = bounded(3, ge=1)
    """An update whose gradient norm is NaN/inf is skipped (weights untouched, counted as
    skipped_updates); this many steps in a row with one stop the run with an error."""
    trigger_parameter_sync_step: int = bounded(1, ge=1)
    """RL (verl fully-async): training steps per weight push; the policy version advances once per
    push, so staleness is counted in pushes of trigger_parameter_sync_step x batch samples."""
    stall_timeout_s: float = bounded(600.0, gt=0, le=86400)
    """RL: longest wait for a step's batch and for an evaluation the step waits on; past it the
    run stops with one line naming the stalled phase (generate, reward, held for a push, ...), the
    servers with requests in flight and the last errors (docs/reliability.md). Nothing is saved."""
    mismatch_gate: bool = True
    """RL: stop the run at the first step whose on-policy tokens (generated by the very weights the
    step starts from) have a mean |logp_trainer - logp_rollout| (metric mismatch/mean) above
    train.mismatch_threshold: the rollout engine computes another model (wrong conversion, tokenizer,
    chat template, server dtype). Steps without on-policy tokens are not checked."""
    mismatch_threshold: Optional[float] = bounded(None, gt=0)
    """Nats for train.mismatch_gate; unset = by dtype: 1e-4 when the trainer (model.dtype) and the
    pushed weights (weights.dtype) are float32, 5e-2 when either is bfloat16 (docs/reliability.md)."""

    def validate(self) -> None:
        _check(self, "train")
        _choice("train.algorithm", self.algorithm, ("sft", "rl", "grpo"))
        if self.require_batches and not self.ppo_mini_batch_size:
            raise ConfigError("train.require_batches: needs train.ppo_mini_batch_size > 0 "
                              "(a step takes require_batches x ppo_mini_batch_size sequences)")

    @property
    def is_rl(self) -> bool:
        return self.algorithm != "sft"

    @property
    def step_batch_size(self) -> int:
        """Sequences one RL step trains on (require_batches x ppo_mini_batch_size when set)."""
        if self.require_batches:
            return self.require_batches * self.ppo_mini_batch_size
        return self.global_batch_size


@dataclass
class DataConfig:
    train_path: str = ""
    """JSONL or Parquet (.parquet): SFT records {prompt, response}; RL records {prompt, answer, ...},
    where an RL prompt may be a chat [{role, content}, ...]."""
    eval_path: str = ""
    """Optional held-out JSONL, same format."""
    prompt_key: str = "prompt"
    """Key of the prompt (text, or chat messages for RL) in each record; dotted for nested fields."""
    response_key: str = "response"
    """Key of the response text (SFT)."""
    answer_key: str = "answer"
    """RL: key of the reference answer, copied to meta["answer"] for the reward; dotted for nested
    fields (e.g. reward_model.ground_truth); empty = no answer required."""
    tokenizer_path: str = ""
    """Tokenizer directory or file; empty = model.hf_path."""
    chat_template: str = ""
    """RL chat prompts: Jinja chat template as a file path or inline text; empty = the model's own
    (chat_template in tokenizer_config.json or chat_template.jinja)."""
    max_prompt_length: int = bounded(0, ge=0)
    """RL: longest prompt in tokens (after the chat template); 0 = no limit. See data.truncation."""
    truncation: str = "filter"
    """RL prompts over data.max_prompt_length: filter (drop), error (fail at load), left (keep the
    last tokens), right (keep the first tokens) or middle (keep both ends). Counted in data/* metrics."""
    shuffle: bool = True
    """RL: shuffle the prompt order each epoch (seeded by train.seed); false = file order."""

    def validate(self) -> None:
        _check(self, "data")
        if not self.train_path:
            raise ConfigError("data.train_path: required")
        _choice("data.truncation", self.truncation, ("filter", "error", "left", "right", "middle"))


@dataclass
class CheckpointConfig:
    save_dir: str = ""
    """Training checkpoints (Megatron dist-checkpoint); empty = <run_dir>/checkpoints. A relative
    path is under train.run_dir; a path inside another run's directory is refused."""
    save_interval: int = bounded(0, ge=0)
    """Save every N steps; 0 = only at the end."""
    keep_last: int = bounded(2, ge=1)
    """Keep the newest N complete checkpoints."""
    resume: bool = True
    """Resume from the latest complete checkpoint in save_dir if there is one."""
    hf_export_dir: str = ""
    """Where to write the HF-format model (safetensors + config + tokenizer); empty = off. A
    relative path is under train.run_dir (so a run with another run_dir never overwrites this
    recipe's other runs); an absolute one inside another run's directory is refused."""
    hf_export_interval: int = bounded(0, ge=0)
    """Export every N steps; 0 = only at the end."""

    def validate(self) -> None:
        _check(self, "checkpoint")


@dataclass
class LoggingConfig:
    log_interval: int = bounded(1, ge=1)
    """Print a metrics line every N steps (metrics.jsonl gets every step)."""
    tensorboard: bool = False
    """Also write TensorBoard event files under <run_dir>/tensorboard."""
    wandb_project: str = ""
    """Weights & Biases project; empty = off (WANDB_MODE=offline works without a network)."""
    timeline: bool = True
    """RL: record spans (generate per server, wait, update, push, eval) to <run_dir>/timeline/ for
    tools/plot_timeline.py."""
    dump_generations: bool = False
    """RL: append every trained sample (prompt index, completion, reward, per-token versions and
    behaviour logprobs) to <run_dir>/generations.jsonl."""
    dump_eval_generations: bool = False
    """RL: append every evaluation episode (step, version, prompt, completion, reward, greedy or
    sampled) to <run_dir>/eval_generations.jsonl when the evaluation is reported."""

    def validate(self) -> None:
        _check(self, "logging")


@dataclass
class RolloutConfig:
    servers: list[str] = field(default_factory=list)
    """Rollout server addresses (http://host:port): SGLang servers or megarl-server."""
    local_servers: int = bounded(1, ge=1)
    """When servers is empty: start this many megarl CPU servers on loopback (the CPU demo)."""
    server_threads: int = bounded(1, ge=1)
    """torch threads of each local server."""
    server_args: list[str] = field(default_factory=list)
    """Extra megarl-server flags for the local servers, e.g. [--max-running-requests, 1] (one
    request at a time: logprobs then do not depend on which requests share a batch)."""
    server_cpus: list[int] = field(default_factory=list)
    """CPU ids to pin the local servers to (os.sched_setaffinity); rank 0, which starts them, is then
    pinned to the other CPUs, so generation and training never share a core. Empty = no pinning.
    On the 2-core demo machine: [1] (server on CPU 1, trainer on CPU 0). The rollout manager
    runs on the servers' CPUs too."""
    manager_address: str = ""
    """host:port of a rollout manager started apart (`megarl-rollout-manager RUN_DIR/config.yaml
    --host H --port P`, e.g. on the rollout partition); empty = trainer rank 0 starts one beside
    itself. Trainer rank 0 (and each pipeline stage's weight source) connects to it."""
    api_key: str = ""
    """Bearer token for the servers' admin endpoints; empty = none."""
    health_timeout_s: float = bounded(120.0, gt=0, le=86400)
    """Deadline for every server in rollout.servers to answer /health when the job starts (an
    unreachable server is an error naming it, not a hang; SGLang on CPU takes up to ~80 s to start)."""
    group_size: int = bounded(8, ge=1)
    """Samples per prompt (GRPO group)."""
    max_new_tokens: int = bounded(64, ge=1)
    """Generation budget per sample."""
    temperature: float = bounded(1.0, gt=0, why=_COLD)
    """Sampling temperature (1.0: behave_logp is the policy's own logprob)."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling; < 1 makes behave_logp differ from the sampling distribution."""
    seed: Optional[int] = bounded(None, ge=0)
    """Seed the sampling: prompt draw d samples with seed (seed, d), so two runs with the same seed
    generate the same tokens (with max_staleness 0 the batches, losses and rewards then repeat
    bitwise); null = unseeded."""
    ignore_eos: bool = False
    """Generate max_new_tokens for every sample, past EOS (benchmarks and tests of long rollouts)."""
    max_staleness: int = bounded(1, ge=0)
    """Bounded off-policyness (AReaL's eta): an episode started at policy version v is trained by
    version v + max_staleness; 0 = on-policy (each batch generated by the current weights)."""
    staleness_threshold: float = bounded(0.0, ge=0)
    """Fractional staleness (verl fully-async): up to staleness_threshold x samples-per-push may be
    generated ahead by the previous version. The same bound as max_staleness: when both are set,
    the later source wins (command line over recipe over default; see Loading rules)."""
    partial_rollout: bool = True
    """At a weight push, true: in-flight requests are interrupted and continue under the new
    weights (one sample may span versions); false: they finish under the old weights first."""
    min_live_servers: int = bounded(1, ge=1)
    """A server that dies or hangs is dropped (restarted when megarl-train started it, re-admitted
    when its /health answers again) and training goes on; below this many the run stops."""
    max_retries: int = bounded(2, ge=0)
    """Re-runs of an episode whose workflow raised; then its prompt is recorded as failed
    (<run_dir>/failed_prompts.jsonl). A request the server refused (HTTP 4xx) is not re-run."""
    max_consecutive_failures: int = bounded(8, ge=1)
    """Prompts failing in a row with the same error (none trained in between) before the run
    stops with that error: a server refusing every request (HTTP 4xx) or a reward that always
    raises ends the run in seconds, not after train.stall_timeout_s of retries."""
    max_concurrent: int = bounded(64, ge=1)
    """Episodes (prompt groups) generating at once."""
    reward_fn: str = "megarl.rewards:arith_exact_match"
    """Reward import path: fn(prompt, completion, meta) -> float, sync or async; or a class built
    once with reward.args (e.g. megarl.rewards:HttpReward)."""
    workflow: str = "megarl.rollout.workflow:SingleTurnWorkflow"
    """Workflow class import path, built as cls(ctx, **workflow_args); arun_episode(client,
    sample) -> list[Trajectory] or None (sample rejected). Shipped: megarl.rollout.workflows:
    SingleTurnWorkflow, MultiTurnWorkflow, ToolCallingWorkflow."""
    workflow_args: dict[str, Any] = field(default_factory=dict)
    """The workflow's own options, passed as keyword arguments (e.g. {max_turns: 4, tools:
    [calculator, python]}); see docs/tasks.md."""
    eval_interval: int = bounded(0, ge=0)
    """Evaluate on data.eval_path every N steps (0 = only at the end, if eval_path is set): the
    configured rollout.workflow (turns, tools and their schemas) run greedily (temperature 0),
    pass@1 with rollout.reward_fn, beside training, reported with the version it measured."""
    eval_size: int = bounded(500, ge=1)
    """Held-out prompts per evaluation."""
    eval_at_start: bool = False
    """Also evaluate before the first step of a fresh run, logged as step 0 (the start accuracy of
    the learning curve)."""
    eval_k: int = bounded(0, ge=0)
    """Also run the workflow k times per eval prompt at rollout.temperature and report the
    unbiased pass@k (eval/pass@k) and their mean reward (eval/mean_reward_at_k); 0 = greedy
    pass@1 only."""

    def validate(self) -> None:
        _check(self, "rollout")
        bad = [c for c in self.server_cpus if not isinstance(c, int) or c < 0]
        if bad:
            raise ConfigError(f"rollout.server_cpus: expected CPU ids >= 0, got {bad}")
        for i, s in enumerate(self.servers):
            if not s.startswith(("http://", "https://")) and ":" not in s:
                raise ConfigError(f"rollout.servers[{i}]: expected host:port or a URL, got {s!r}")
        if self.staleness_threshold and self.max_staleness and self.staleness_threshold != self.max_staleness:
            raise ConfigError("rollout.staleness_threshold: set either it (verl) or rollout.max_staleness "
                              f"(AReaL), not both (got {self.staleness_threshold} and {self.max_staleness}); "
                              "see docs/configuration.md")
        if not isinstance(self.workflow_args, dict):
            raise ConfigError(f"rollout.workflow_args: expected a mapping, got {self.workflow_args!r}")

    @property
    def staleness(self) -> float:
        """The effective eta of the capacity formula (integer max_staleness or the fraction)."""
        return float(self.max_staleness or self.staleness_threshold)


@dataclass
class RewardConfig:
    executor: str = "thread"
    """Where sync reward functions run: thread (a daemon thread per call) or process (a pool of
    reward.num_workers worker processes: a CPU-heavy verifier does not hold the trainer's GIL,
    and one that overruns is killed and replaced). Coroutine functions always run on the loop."""
    num_workers: int = bounded(4, ge=1)
    """Worker processes of reward.executor=process (started on the first call)."""
    timeout_s: float = bounded(60.0, ge=0)
    """Deadline of one reward call (a batch for batched rewards); 0 = none. A sync function that
    overruns on a thread keeps that thread until it returns; in a process pool the deadline counts
    from when a worker takes the call, and the worker is killed."""
    on_error_value: Optional[float] = bounded(None, unbounded="any finite reward value")
    """Reward used when the reward function raises or times out (counted in reward/errors,
    reward/timeouts); null = the episode fails instead."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments when rollout.reward_fn names a class, e.g. {url: http://host:port/score,
    max_batch: 32, max_wait_ms: 20} for HttpReward."""

    def validate(self) -> None:
        if self.executor not in ("thread", "process"):
            raise ConfigError(f"reward.executor: must be thread or process, got {self.executor!r}")
        _check(self, "reward")
        if not isinstance(self.args, dict):
            raise ConfigError(f"reward.args: expected a mapping, got {self.args!r}")


@dataclass
class WeightSyncConfig:
    transport: str = "distributed"
    """distributed (broadcast over a gloo/NCCL group), disk (shared dir) or tensor (HTTP)."""
    bucket_mb: int = bounded(256, ge=1)
    """Bucket size cap in MiB; peak extra memory is about two buckets."""
    dtype: str = "auto"
    """Serving dtype: auto (the training dtype), float32 or bfloat16."""
    pause_mode: str = "abort"
    """How servers pause for a push: abort (partial rollouts resume), retract or in_place."""
    timeout_s: float = bounded(120.0, gt=0)
    """Deadline of every step of a push (HTTP calls and broadcasts)."""
    master_address: str = "auto"
    """Address the servers use to reach this job's pipeline-stage source ranks (distributed
    transport); auto = each source rank's own address on its route to the servers (never another
    node's loopback), or a fixed address/hostname for single-node jobs with unusual routing."""
    disk_dir: str = ""
    """Shared directory for the disk transport; empty = <run_dir>/weights. A relative path is under
    train.run_dir."""
    keep_versions: int = bounded(2, ge=1)
    """Versions kept in disk_dir."""
    verify_interval: Optional[int] = bounded(None, ge=0)
    """Every N pushes compare a sha256 of every pushed tensor with the one each server computes of
    what it holds (megarl-server's /weights_checksum: no tensor data over HTTP); 0 = off. Unset:
    every push with megarl-server (tensor_format megarl), off with real SGLang (no such endpoint).
    Cost per checked push: ~8 ms for the demo model, ~1 s for 472 MiB (docs/reliability.md)."""
    verify_mode: str = "fail"
    """What a differing checksum does: fail (stop the run naming the server and tensor) or warn
    (print it and count it in the metric push/verify_mismatches)."""
    delta: bool = True
    """Send only the tensors that may have changed since the last push: rows whose every shard has
    requires_grad False (frozen embeddings, frozen layers) were frozen at the last push too are
    skipped and the servers keep them. Exact because only the optimizer writes parameters between
    pushes, and it writes only trainable ones; applies to the distributed and tensor transports of
    a trainable engine (the disk transport writes whole checkpoints; a forward-only engine pushes
    everything). A new server, a retry or a rebuilt server set gets every tensor."""
    tensor_format: str = "megarl"
    """Which server's weight formats: megarl (megarl-server: safetensors payloads for the tensor
    transport; for the distributed one, large tensors broadcast straight into the server's
    parameters and the small ones packed, per bucket) or sglang (real SGLang: its tensor payload,
    one broadcast per tensor)."""

    refit: str = "gather"
    """How tensor-parallel shards reach the servers: gather (the stage source gathers each full
    tensor over its TP group and broadcasts it; any server) or shard (shard-to-shard refit: every
    trainer TP rank sends its own slices point to point to the megarl-server TP ranks that hold
    them, no full tensor on any rank; needs transport distributed, tensor_format megarl, one
    pipeline stage and a dense model; see megarl/weights/shard_push.py)."""

    def validate(self) -> None:
        _check(self, "weights")
        _choice("weights.transport", self.transport, ("distributed", "disk", "tensor"))
        _choice("weights.refit", self.refit, ("gather", "shard"))
        if self.refit == "shard" and (self.transport != "distributed" or self.tensor_format != "megarl"):
            raise ConfigError("weights.refit: shard needs weights.transport=distributed and "
                              "weights.tensor_format=megarl (megarl-server)")
        _choice("weights.tensor_format", self.tensor_format, ("megarl", "sglang"))
        _choice("weights.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        _choice("weights.pause_mode", self.pause_mode, ("abort", "retract", "in_place"))
        _choice("weights.verify_mode", self.verify_mode, ("warn", "fail"))
        if self.tensor_format == "sglang" and self.verify_interval:
            raise ConfigError("weights.verify_interval: real SGLang (weights.tensor_format=sglang) has no "
                              "/weights_checksum, a megarl-server extension; set it to 0 or leave it unset")

    @property
    def verify_every(self) -> int:
        """Pushes between checksum checks (0 = off): verify_interval, or by server kind when unset."""
        if self.verify_interval is not None:
            return self.verify_interval
        return 0 if self.tensor_format == "sglang" else 1


@dataclass
class CriticConfig:
    hf_path: str = ""
    """Critic backbone (HF directory) for algo.advantage=gae; empty = model.hf_path. Its LM head is
    replaced by a fresh scalar value head."""
    lr: Optional[float] = bounded(None, gt=0)
    """Critic peak learning rate; null = optim.lr (other optimizer settings from optim)."""
    value_clip: Optional[float] = bounded(0.2, gt=0)
    """Value clip c: the loss also scores V_old + clip(V - V_old, -c, c); null = off."""
    warmup_steps: int = bounded(0, ge=0)
    """RL steps that train only the critic before the actor starts updating."""

    def validate(self) -> None:
        _check(self, "critic")


@dataclass
class LaunchConfig:
    server: str = "auto"
    """Server program the launcher (megarl-launch, launch/slurm.sbatch) starts on rollout nodes:
    auto (sglang on GPU nodes, megarl on CPU nodes), sglang (python -m sglang.launch_server) or
    megarl (megarl-server)."""
    server_tp: int = bounded(1, ge=1)
    """GPUs per rollout server for tensor parallelism (SGLang --tp-size)."""
    server_dp: int = bounded(1, ge=1)
    """Data-parallel replicas inside one SGLang server (--dp-size); GPUs per server = tp * dp."""
    servers_per_node: int = bounded(0, ge=0)
    """Servers per rollout node; 0 = the node's GPUs // (server_tp * server_dp), 1 on CPU nodes."""
    server_port: int = bounded(30000, ge=1, le=65535)
    """Port of a node's first server; the node's further servers take the next ports."""
    server_args: list[str] = field(default_factory=list)
    """Extra flags appended to every server command (e.g. ["--mem-fraction-static", "0.8"])."""
    health_timeout_s: float = bounded(900.0, gt=0, le=86400)
    """How long the launcher waits for every server's /health before it gives up."""
    router: bool = False
    """Also start SGLang's router (sglang-router) in front of the servers on the first rollout
    node, for generation clients; weight pushes still go to every server directly."""
    router_port: int = bounded(30100, ge=1, le=65535)
    """Port of the router."""
    router_policy: str = "cache_aware"
    """Router load-balancing policy: cache_aware, round_robin, random or power_of_two."""

    def validate(self) -> None:
        _check(self, "launch")
        _choice("launch.server", self.server, ("auto", "sglang", "megarl"))
        _choice("launch.router_policy", self.router_policy,
                ("cache_aware", "round_robin", "random", "power_of_two"))
        if self.router and self.server == "megarl":
            raise ConfigError("launch.router: SGLang's router fronts SGLang servers; "
                              "set launch.server to sglang (or auto on GPU nodes)")


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
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

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
        check_outputs(self)
        if self.train.is_rl:
            validate_learning_signal(self)
            if self.algo.overlong_buffer_len > self.rollout.max_new_tokens:
                raise ConfigError(f"algo.overlong_buffer_len: {self.algo.overlong_buffer_len} is longer than "
                                  f"rollout.max_new_tokens={self.rollout.max_new_tokens}")
            name = "train.require_batches" if self.train.require_batches else "train.global_batch_size"
            if self.train.step_batch_size % self.rollout.group_size:
                raise ConfigError(f"{name}: a step of {self.train.step_batch_size} sequences is not whole "
                                  f"groups of rollout.group_size={self.rollout.group_size}")
            if not self.rollout.partial_rollout and self.weights.pause_mode != "abort":
                raise ConfigError(f"weights.pause_mode: {self.weights.pause_mode} keeps requests running "
                                  "across the push, which rollout.partial_rollout=false forbids; use abort")


def validate_learning_signal(cfg: Config) -> None:
    """RL settings that run to the end while learning nothing are refused at load."""
    from megarl.algo.advantages import AdvantageEstimator

    r = cfg.rollout
    if r.group_size == 1 and AdvantageEstimator(cfg.algo.advantage).group_relative:
        raise ConfigError(f"rollout.group_size: 1 with algo.advantage={cfg.algo.advantage} (a group-relative "
                          "baseline) gives every sample advantage 0 and nothing is learned; use group_size "
                          ">= 2 or algo.advantage=reinforce_pp or gae")
    if r.group_size == 1 and cfg.algo.dynamic_sampling:
        raise ConfigError("algo.dynamic_sampling: drops groups whose rewards are all equal, which is every "
                          "group of rollout.group_size=1: no batch would ever fill")


def _check_shape_fields(path: str) -> None:
    """The config.json fields the layout checks divide by must be positive integers (a string or
    a bool there would otherwise surface as a formatting TypeError)."""
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        return  # read_model_args names the missing file
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise ConfigError(f"model.hf_path: cannot read {path}: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.hf_path: {path} must hold a JSON object")
    for key in ("num_attention_heads", "num_key_value_heads", "num_hidden_layers"):
        v = hf.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"model.hf_path: {path}: {key} must be a positive integer, got {v!r}")


def validate_against_model(cfg: Config) -> None:
    """Checks that need the HF config.json: TP vs heads and query groups, the pipeline split of
    the layers (uneven first/last stages included), sliding-window attention vs the layer spec."""
    from megarl.models import stages
    from megarl.models.builder import moe_kwargs
    from megarl.models.registry import read_model_args

    _check_shape_fields(os.path.join(cfg.model.hf_path, "config.json"))
    try:
        args = read_model_args(cfg.model.hf_path)
    except FileNotFoundError:
        raise ConfigError(f"model.hf_path: no config.json in {cfg.model.hf_path!r}") from None
    except (OSError, ValueError) as e:  # unreadable, bad JSON or UTF-8, missing or mistyped keys
        raise ConfigError(f"model.hf_path: {e}") from None
    tp, pp, vpp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp
    if cfg.weights.refit == "shard" and (pp > 1 or args.num_experts):
        raise ConfigError("weights.refit: shard supports dense models on one pipeline stage "
                          f"(parallel.pp={pp}, {args.architecture}); use weights.refit=gather")
    if args.num_heads % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide num_attention_heads={args.num_heads}")
    if args.num_kv_heads % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide num_key_value_heads={args.num_kv_heads}")
    try:
        stages.resolve(args.num_layers, pp, vpp, cfg.parallel.first_stage_layers,
                       cfg.parallel.last_stage_layers)
        if args.num_experts:
            moe_kwargs(args, tp, cfg.parallel.ep)
        elif cfg.parallel.ep > 1:
            raise ValueError(f"parallel.ep: {cfg.parallel.ep} > 1 needs an MoE model "
                             f"({args.architecture} is dense)")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.moe.routing_replay != "none" and not args.num_experts:
        raise ConfigError(f"moe.routing_replay: {cfg.moe.routing_replay} needs an MoE model "
                          f"({args.architecture} is dense)")
    if cfg.moe.replay_check and cfg.algo.prox_logp_mode == "loglinear":
        raise ConfigError("moe.replay_check: needs algo.prox_logp_mode recompute or metrics (loglinear "
                          "runs no prox recompute to check)")
    if cfg.moe.routing_replay != "none" and cfg.model.recompute and cfg.parallel.pp > 1:
        # a recomputed layer reads the routes of the micro-batch last fed to its stage, which under
        # 1F1B is not the one being recomputed
        raise ConfigError("moe.routing_replay: not supported with model.recompute and parallel.pp > 1")


def check_world_size(cfg: Config, world_size: int) -> int:
    """Returns the data-parallel size; the world must be a multiple of TP*PP."""
    mp = cfg.parallel.tp * cfg.parallel.pp
    if world_size % mp:
        raise ConfigError(
            f"parallel.tp: world size {world_size} is not divisible by tp*pp={mp} "
            f"(tp={cfg.parallel.tp}, pp={cfg.parallel.pp})")
    if (world_size // mp) % cfg.parallel.ep:
        raise ConfigError(f"parallel.ep: {cfg.parallel.ep} does not divide the data-parallel size "
                          f"{world_size // mp} (world size {world_size})")
    return world_size // mp


# ----------------------------------------------------------------------------- loading

def load_config(path: Optional[str], overrides: list[str] = (), validate: bool = True) -> Config:
    """Reads a YAML recipe, applies ``a.b=c`` overrides (values parsed as YAML; a mapping for a
    whole section is merged field by field), settles alternatives by source, validates."""
    raw = read_yaml(path) if path else {}
    given = recipe_keys(raw)
    given.update(apply_overrides(raw, overrides, Config))
    cfg = from_dict(Config, raw, prefix="")
    _settle_staleness(cfg.rollout, given)
    resolve_outputs(cfg)
    if validate:
        cfg.validate()
    return cfg


def _settle_staleness(r: RolloutConfig, given: dict[str, int]) -> None:
    """max_staleness (AReaL) and staleness_threshold (verl) are two spellings of one bound: when
    both are non-zero, the one set by the later source (default < recipe < command line) wins
    and the other becomes 0; set by the same source they must agree (RolloutConfig.validate)."""
    if not (r.max_staleness and r.staleness_threshold) or r.max_staleness == r.staleness_threshold:
        return
    ms, st = given.get("rollout.max_staleness", 0), given.get("rollout.staleness_threshold", 0)
    if st > ms:
        r.max_staleness = 0
    elif ms > st:
        r.staleness_threshold = 0.0


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
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads 1e-5 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        if not math.isfinite(number):  # nan/inf would pass every range check (nan < 0 is False)
            raise ConfigError(f"{name}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `server_args=[--threads,2]`, `api_key=1234`: YAML reads numbers
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
