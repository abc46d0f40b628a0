"""The rollout-side sections: `rollout.*` (servers, sampling, staleness), `reward.*` and `weights.*`
(the weight push)."""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any, Optional

from megarl.config.common import _COLD, _check, _choice
from megarl.common.errors import ConfigError
from megarl.common.fields import bounded
from megarl.common.net import server_identity


@dataclass
class RolloutConfig:
    servers: list[str] = field(default_factory=list)
    """Rollout server addresses (http://host:port): SGLang servers or megarl-server, each listed once."""
    engine: str = "megarl"
    """What the local servers are (when servers is empty): megarl (megarl-server, the CPU demo) or
    sglang (real SGLang, `python -m sglang.launch_server` from its venv: tools/sglang_cpu/install.sh,
    $MEGARL_SGLANG_VENV; on a machine without CUDA with the CPU settings that directory knows, fp32).
    Servers given in rollout.servers are used as they are, whatever this says."""
    local_servers: int = bounded(1, ge=1)
    """When servers is empty: start this many servers of rollout.engine on loopback (the CPU demo)."""
    server_threads: int = bounded(1, ge=1)
    """torch threads of each local server."""
    server_args: list[str] = field(default_factory=list)
    """Extra flags for the local servers, e.g. [--max-running-requests, 1] (one request at a time:
    logprobs then do not depend on which requests share a batch). With engine sglang they are
    SGLang's flags (megarl-server's --seed and --tp become --random-seed and --tp-size; its own
    --threads, --weights-root, --weight-version, --tp-rank, --tp-port are refused)."""
    server_cpus: list[int] = field(default_factory=list)
    """CPU ids to pin the local servers to (os.sched_setaffinity); rank 0, which starts them, is then
    pinned to the other CPUs, so generation and training never share a core. Empty = no pinning.
    On the 2-core demo machine: [1] (server on CPU 1, trainer on CPU 0). The rollout manager
    runs on the servers' CPUs too."""
    manager_address: str = ""
    """host:port of a rollout manager started apart (`megarl-rollout-manager RUN_DIR/config.yaml
    --host H --port P`, e.g. on the rollout partition); empty = trainer rank 0 starts one beside
    itself. Trainer rank 0 (and each pipeline stage's weight source) connects to it, proving the
    secret in rollout.manager_secret_file (required with it)."""
    manager_secret_file: str = ""
    """A file holding the rollout manager's channel secret (>= 16 bytes, readable by its owner
    only: chmod 600), for a manager started apart: `megarl-rollout-manager` reads it from its
    config and accepts only peers that prove it (HMAC challenge-response); the trainer reads the
    same file. Empty with rollout.manager_address empty: the trainer makes a fresh secret per run
    and hands it to the manager it starts through an inherited pipe (docs/reliability.md, Security)."""
    api_key: str = ""
    """Bearer token of rollout.servers (every route but /health); empty = none. The servers a run
    starts itself get a key made for the run when this is empty (<run_dir>/servers/api_key)."""
    api_key_file: str = ""
    """A file holding rollout.api_key (the user's own, chmod 600), read when the config is loaded
    and kept out of <run_dir>/config.yaml: a key on the command line is visible to every user of
    the node in /proc. megarl-launch keys the servers it plans with <run_dir>/servers/api_key (made
    by ``--emit servers``) and passes the trainer this field."""
    health_timeout_s: float = bounded(120.0, gt=0, le=86400)
    """Deadline for every server in rollout.servers, or each local server the job starts, to answer
    /health when the job starts (an unreachable server is an error naming it, not a hang; SGLang on
    CPU takes up to ~80 s to start, its first start on a machine ~3 min)."""
    group_size: int = bounded(8, ge=1)
    """Samples per prompt (GRPO group)."""
    max_new_tokens: int = bounded(64, ge=1)
    """Generation budget per sample."""
    temperature: float = bounded(1.0, gt=0, why=_COLD)
    """Sampling temperature T. The servers report log softmax(logits / T) as behave_logp and the
    trainer scores, and trains, the same softmax(logits / T) (as SGLang, slime and verl do)."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling; < 1 makes behave_logp differ from the sampling distribution."""
    seed: Optional[int] = bounded(None, ge=0)
    """Seed the sampling: prompt draw d samples with seed (seed, d), so two runs with the same seed
    generate the same tokens (with max_staleness 0 the batches, losses and rewards then repeat
    bitwise); null = unseeded."""
    ignore_eos: bool = False
    """Generate max_new_tokens for every sample, past EOS (benchmarks and tests of long rollouts)."""
    max_staleness: int = bounded(1, ge=0)
    """Bounded off-policyness (AReaL's eta), counted when an episode starts: by policy version v
    at most (v + 1 + max_staleness) x groups-per-step episodes have started, so generation runs at
    most max_staleness versions ahead of training. A started episode finishes under newer weights
    (partial rollouts, every token stamped with its version) and is trained whatever its length
    (docs/async.md); 0 = on-policy (each batch generated by the current weights)."""
    staleness_hard_cap: int = bounded(64, ge=0)
    """Versions: a finished group whose first token is older than this (counted from the policy
    that would train it) is generated again, not trained - a straggler, e.g. a request retried on
    a server that died and came back; counted as rollout/regenerated/too_stale. Never below
    max_staleness; 0 = max_staleness itself (every trained token within the bound - which
    selects against long responses under long tails). Unused on-policy (max_staleness 0: every
    trained group is current)."""
    staleness_threshold: float = bounded(0.0, ge=0)
    """Fractional staleness (verl fully-async): up to staleness_threshold x samples-per-push may be
    generated ahead by the previous version. The same bound as max_staleness: when both are set,
    the later source wins (command line over recipe over default; see Loading rules)."""
    placement: str = "disaggregated"
    """disaggregated (the servers run beside the trainer, on their own cores or GPUs) or colocated
    (seed 004's hybrid engine: the local servers share the trainer's devices and sleep while it
    trains - each step is wake -> push -> generate -> sleep -> train; on-policy, so
    max_staleness 0; docs/architecture.md, Placements)."""
    sleep_tags: list[str] = field(default_factory=lambda: ["kv_cache", "weights"])
    """Colocated: what the servers release while the trainer trains (SGLang's memory tags:
    kv_cache, weights); the weights are pushed in full after each wake."""
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
    eval_reward_fn: str = ""
    """Reward import path of the held-out evaluation (a function, or a class built without
    arguments); empty = rollout.reward_fn and its caller. E.g. training from a reward model
    (megarl.rewards.model:RewardModel) and measuring exact match (megarl.rewards:arith_exact_match)."""
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
    pass@1 with rollout.reward_fn (or rollout.eval_reward_fn), beside training, reported with the
    version it measured."""
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
        _choice("rollout.engine", self.engine, ("megarl", "sglang"))
        if self.engine == "sglang" and not self.servers:
            from megarl.config.server_flags import sglang_flags
            sglang_flags(self.server_args)  # a megarl-server-only flag: one line naming it
        bad = [c for c in self.server_cpus if not isinstance(c, int) or c < 0]
        if bad:
            raise ConfigError(f"rollout.server_cpus: expected CPU ids >= 0, got {bad}")
        seen: dict[str, int] = {}
        for i, s in enumerate(self.servers):
            if not s.startswith(("http://", "https://")) and ":" not in s:
                raise ConfigError(f"rollout.servers[{i}]: expected host:port or a URL, got {s!r}")
            # a server listed twice joins the weight-update group twice: the first push would hang
            # (localhost and 127.0.0.1 are one server too: its group of a dead run would then block it)
            first = seen.setdefault(server_identity(s), i)
            if first != i:
                raise ConfigError(f"rollout.servers[{i}]: {s} is listed twice (also rollout.servers[{first}]: "
                                  f"{self.servers[first]})")
        if self.staleness_threshold and self.max_staleness and self.staleness_threshold != self.max_staleness:
            raise ConfigError("rollout.staleness_threshold: set either it (verl) or rollout.max_staleness "
                              f"(AReaL), not both (got {self.staleness_threshold} and {self.max_staleness}); "
                              "see docs/configuration.md")
        _choice("rollout.placement", self.placement, ("disaggregated", "colocated"))
        bad = [t for t in self.sleep_tags if t not in ("kv_cache", "weights")]
        if bad:
            raise ConfigError(f"rollout.sleep_tags: unknown {bad} (kv_cache, weights)")
        if self.placement == "colocated":
            if self.servers:
                raise ConfigError(f"rollout.placement: colocated starts its servers on the trainer's own "
                                  f"devices; rollout.servers lists {self.servers[0]} (leave it empty)")
            if self.staleness:
                raise ConfigError(f"rollout.placement: colocated is on-policy (the servers sleep while the "
                                  f"trainer trains); set rollout.max_staleness=0 "
                                  f"(got {self.max_staleness or self.staleness_threshold})")
        if not isinstance(self.workflow_args, dict):
            raise ConfigError(f"rollout.workflow_args: expected a mapping, got {self.workflow_args!r}")
        if self.manager_address:
            host, _, port = self.manager_address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"rollout.manager_address: expected host:port, got {self.manager_address!r}")
            if not self.manager_secret_file:
                raise ConfigError("rollout.manager_address: a manager started apart needs "
                                  "rollout.manager_secret_file (the file with its channel secret)")

    @property
    def staleness(self) -> float:
        """The effective eta of the capacity formula (integer max_staleness or the fraction)."""
        return float(self.max_staleness or self.staleness_threshold)

    @property
    def stale_cap(self) -> int:
        """Versions a trained group's first token may lag (`staleness_hard_cap`, never below the
        bound; 0 on-policy)."""
        eta = self.staleness
        return 0 if eta == 0 else max(self.staleness_hard_cap, math.ceil(eta))


REWARD_MODEL_FN = "megarl.rewards.model:RewardModel"


@dataclass
class RewardModelConfig:
    """Reward-model servers the job starts itself (megarl-server on an HF sequence classifier),
    beside the policy servers, with the same health checks and restarts."""

    path: str = ""
    """HF *ForSequenceClassification directory (config.json, safetensors, tokenizer.model) to serve
    on /classify; empty = start none (reward.args.urls names servers started apart). Needs
    rollout.reward_fn megarl.rewards.model:RewardModel, whose reward.args.urls are then these
    servers."""
    servers: int = bounded(1, ge=1)
    """Local reward-model servers started (loopback, or the address ranks reach rank 0 by)."""
    threads: int = bounded(1, ge=1)
    """torch threads of each reward-model server."""
    health_interval_s: float = bounded(5.0, gt=0)
    """Seconds between /health probes of the reward-model servers; one whose process died, or
    that fails two probes in a row (3 s each), is restarted on its own port and given
    rollout.health_timeout_s to answer again (RewardModel's retries send its batches to the
    other servers meanwhile)."""

    def validate(self) -> None:
        _check(self, "reward.model")


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher (algo.distill_coef): megarl-server on an HF causal LM that
    shares the policy's tokenizer, started by the job beside the policy servers with the same
    health checks and restarts; it scores every generated token (its logprob under the teacher)."""

    path: str = ""
    """HF causal-LM directory (config.json, safetensors, tokenizer) with the policy's vocabulary;
    empty = no teacher. Needs algo.distill_coef > 0."""
    servers: int = bounded(1, ge=1)
    """Teacher servers started (loopback, or the address ranks reach rank 0 by)."""
    threads: int = bounded(1, ge=1)
    """torch threads of each teacher server."""
    health_interval_s: float = bounded(5.0, gt=0)
    """Seconds between /health probes of the teacher servers; one whose process died, or that fails
    two probes in a row, is restarted on its own port (an episode whose scoring failed meanwhile is
    retried, rollout.max_retries)."""
    timeout_s: float = bounded(60.0, gt=0)
    """Deadline of one scoring request (a group's samples)."""

    def validate(self) -> None:
        _check(self, "teacher")


@dataclass
class EnvConfig:
    """Environment servers (docs/environments.md): gym's reset / step over HTTP, driven by
    rollout.workflow megarl.rollout.workflows:EnvironmentWorkflow. Either the job serves a class
    (env.cls: megarl-env processes beside the policy servers, keyed, health-checked and restarted)
    or the user runs them (env.urls)."""

    cls: str = ""
    """Environment class the job serves, package.module:Class (an `megarl.envs.Environment`);
    empty = none, or env.urls."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of env.cls, one instance per episode."""
    urls: list[str] = field(default_factory=list)
    """Environment servers the user runs (megarl-env, or anything speaking the protocol); instead
    of env.cls."""
    api_key: str = ""
    """Key of the servers in env.urls (the job makes its own for the ones it starts). Put it in the
    recipe file, not on the command line (every user sees a command line in /proc); the run's
    config.yaml that keeps it is the user's alone (0600)."""
    servers: int = bounded(1, ge=1)
    """megarl-env processes started for env.cls; episodes go to the one with the fewest open."""
    max_episodes: int = bounded(256, ge=1)
    """Episodes one started server keeps open at once (more wait, or go to another)."""
    step_timeout_s: float = bounded(30.0, gt=0)
    """Deadline of one reset or step: over it the episode ends (and is run again,
    env.episode_retries)."""
    episode_retries: int = bounded(1, ge=0)
    """Re-runs of one trajectory whose episode failed (its server died, raised or overran); after
    them the prompt's group is retried as a whole (rollout.max_retries), then recorded as failed."""
    episode_ttl_s: float = bounded(600.0, gt=0)
    """A started server closes an episode left idle this long (its client died or was cancelled)."""
    health_interval_s: float = bounded(5.0, gt=0)
    """Seconds between /health probes of the started servers; one whose process died, that fails
    two probes in a row, or whose calls past their deadline hold half its threads, is restarted on
    its own port."""

    def validate(self) -> None:
        _check(self, "env")
        if self.cls and self.urls:
            raise ConfigError(f"env.cls: the job serves {self.cls} itself; env.urls ({self.urls[0]}, ...) "
                              "names servers run apart - set one of them")
        if self.cls and (":" not in self.cls or self.cls.startswith(":") or self.cls.endswith(":")):
            raise ConfigError(f"env.cls: expected package.module:Class, got {self.cls!r}")
        if not isinstance(self.args, dict):
            raise ConfigError(f"env.args: expected a mapping, got {self.args!r}")


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
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward-model servers started by the job (reward.model.path, .servers, .threads,
    .health_interval_s)."""

    def validate(self) -> None:
        if self.executor not in ("thread", "process"):
            raise ConfigError(f"reward.executor: must be thread or process, got {self.executor!r}")
        _check(self, "reward")
        if not isinstance(self.args, dict):
            raise ConfigError(f"reward.args: expected a mapping, got {self.args!r}")
        self.model.validate()
        if self.model.path and "urls" in self.args:
            raise ConfigError(f"reward.args.urls: the job serves reward.model.path={self.model.path} itself and "
                              "points the reward at those servers; drop reward.args.urls (or reward.model.path)")


@dataclass
class WeightSyncConfig:
    transport: str = "distributed"
    """distributed (broadcast over a gloo/NCCL group), disk (shared dir), tensor (HTTP) or shm
    (same host, megarl-server: each bucket written once into a file in /dev/shm that the server
    maps - no weight byte crosses a socket; the colocated placement's handover)."""
    bucket_mb: int = bounded(256, ge=1)
    """Bucket size cap in MiB; peak extra memory is about two buckets."""
    dtype: str = "auto"
    """Serving dtype: auto (the training dtype), float32 or bfloat16."""
    pause_mode: str = "auto"
    """How servers pause for a push: abort (requests end; the client resubmits prompt + tokens so
    far under the new weights), retract (the server keeps them, frees their KV cache and
    re-prefills them under the new weights), in_place (the server keeps them and their KV cache,
    computed by the old weights) or auto: abort with megarl-servers only, retract when an SGLang
    server is in the set (SGLang's abort pause waits out a 1 s poll: a 1.03 s push against 0.05 s
    with retract, docs/benchmarks.md), abort whenever rollout.partial_rollout is false or
    lora.rank > 0 (SGLang loads each push's adapter: a kept request would resume on the old one)."""
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
    what it holds (megarl-server's /weights_checksum: no tensor data over HTTP); 0 = off. auto (or
    unset): every 10th push (versions 0, 10, ...; train.mismatch_gate checks every step's served
    logprobs) when every server advertises /weights_checksum (megarl-server), off when one does
    not (real SGLang); N > 0 against such a server stops at preflight.
    Cost per checked push: ~8-20 ms for the demo model, ~1 s for 472 MiB (docs/reliability.md)."""
    verify_mode: str = "fail"
    """What a differing checksum does: fail (stop the run naming the server and tensor) or warn
    (print it and count it in the metric push/verify_mismatches)."""
    delta: bool = True
    """Send only the tensors that may have changed since the last push: rows whose every shard has
    requires_grad False (optim.freeze: frozen embeddings, frozen layers) were frozen at the last push too are
    skipped and the servers keep them. Exact because only the optimizer writes parameters between
    pushes, and it writes only trainable ones; applies to the distributed and tensor transports of
    a trainable engine (a forward-only engine pushes everything). A new server, a retry or a
    rebuilt server set gets every tensor. The disk transport's counterpart is weights.disk_delta."""
    disk_delta: str = "off"
    """Disk transport with megarl-server: off (write a whole HF checkpoint per push), raw (per-tensor
    records against the last push with a CRC-32 each: an unchanged tensor, e.g. a frozen one, costs
    no bytes, a changed one is written raw) or xor (a changed tensor as the zlib-compressed XOR with
    its last pushed bytes: ~0.53 of the raw bytes after an fp32 Adam step). The server rebuilds
    bitwise and refuses any mismatch; the push after a failed one writes every tensor. Needs
    weights.dtype = the server's dtype; the trainer keeps a CPU copy of the last pushed weights.
    Off by default: on this 2-core machine, for 472 MiB with the embeddings frozen, raw took 4x
    and xor 23x the time of a full write (docs/benchmarks.md); worth it where a slow shared
    filesystem, not the CPU, is the limit."""
    tensor_format: str = "auto"
    """Which weight formats: auto (chosen from what the servers advertise in /model_info, checked
    at preflight: megarl when every server is a megarl-server, else SGLang's), megarl
    (megarl-server's extensions: safetensors payloads for the tensor transport; for the
    distributed one, large tensors broadcast straight into the server's parameters and the small
    ones packed, per bucket) or sglang (SGLang 0.5.x's own: its tensor payload, one flattened
    bucket per broadcast). A setting a server cannot take stops at preflight naming it
    (megarl/config/server_wire.py)."""
    overlap: bool = True
    """Asynchronous runs (rollout.max_staleness >= 1): the trainer only stages the push - gathers,
    converts and copies its buckets - and a thread of its own pauses the servers, sends them and
    publishes the version (checksums too) while the trainer computes the next update; the trainer
    waits for it only where the next push, an evaluation or the last step needs it landed
    (push/blocking_s: the trainer's share; push/overlapped_s: the rest). Costs one copy of the
    stage's weights in the serving dtype. Synchronous, whatever this says: max_staleness 0, the
    colocated placement, the disk transport, shard refit and LoRA on SGLang (PEFT directories).
    While a flight is in the air the servers still generate with the previous version, so a group
    can now and then be trained one version past rollout.max_staleness (1 step in 1,000 of the
    demo), as stragglers are under the default rollout.staleness_hard_cap; a cap of 0 keeps every
    trained token within the bound."""
    refit: str = "gather"
    """How tensor-parallel shards reach the servers: gather (the stage source gathers each full
    tensor over its TP group and broadcasts it; any server) or shard (shard-to-shard refit: every
    trainer TP rank sends its own slices point to point to the megarl-server TP ranks that hold
    them, no full tensor on any rank; needs transport distributed, tensor_format megarl, one
    pipeline stage and a dense model; see megarl/weights/shard_push.py)."""

    def validate(self) -> None:
        _check(self, "weights")
        _choice("weights.transport", self.transport, ("distributed", "disk", "tensor", "shm"))
        if self.transport == "shm" and self.tensor_format == "sglang":
            raise ConfigError("weights.transport: shm is megarl-server's same-host handover; "
                              "weights.tensor_format=sglang (real SGLang) cannot take it")
        _choice("weights.refit", self.refit, ("gather", "shard"))
        if self.refit == "shard" and (self.transport != "distributed" or self.tensor_format == "sglang"):
            raise ConfigError("weights.refit: shard needs weights.transport=distributed and "
                              "weights.tensor_format=megarl (megarl-server)")
        _choice("weights.tensor_format", self.tensor_format, ("auto", "megarl", "sglang"))
        _choice("weights.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        _choice("weights.pause_mode", self.pause_mode, ("auto", "abort", "retract", "in_place"))
        _choice("weights.verify_mode", self.verify_mode, ("warn", "fail"))
        _choice("weights.disk_delta", self.disk_delta, ("off", "raw", "xor"))
        if self.disk_delta != "off" and self.tensor_format == "sglang":
            raise ConfigError("weights.disk_delta: real SGLang (weights.tensor_format=sglang) reads only HF "
                              "checkpoints; set it to off")
