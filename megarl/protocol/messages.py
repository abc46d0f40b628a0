"""What the trainer and the rollout manager say to each other: a closed set of dataclasses, one
per thing a link may ask or answer (`MESSAGES`), carried by `megarl.protocol.channel`.

No message names a method or an endpoint to call: an admin relay is one class per server
operation the trainer needs (`ADMIN_MESSAGES`), a step of the server set one class per step
(`CLUSTER_MESSAGES`), and the manager maps each class to one fixed call. Fields are JSON values,
`megarl.protocol.wire` dataclasses, or (a `Batch` only) numpy arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional


@dataclass
class Hello:
    """First message of a connection: who connects (``role``: "driver" = global rank 0) and how
    often the manager beats while it works on this link's requests (``beat_s``)."""
    role: str
    rank: int = 0
    beat_s: float = 1.0


@dataclass
class Beat:
    """Manager -> link, every ``Hello.beat_s`` while one of its requests is being handled: the
    manager process runs (``busy_s``: how long the request in hand has run so far)."""
    busy_s: float = 0.0


@dataclass
class Init:
    """Driver -> manager, once: the DP size shares are cut for, the trainer's policy version and
    the manager's saved state (None on a fresh start). Reply: the server addresses."""
    dp: int
    version: int
    state: Optional[dict] = None


@dataclass
class BatchRequest:
    """Driver -> manager: the next ``n_groups`` finished groups. Reply: `Batch`. ``version``: the
    trainer's policy version, the one that trains them (None: the manager's own). The staleness
    hard cap counts from it, not from the manager's version, which stays behind when a push's
    deferred tail failed to publish (a server died after its buckets loaded) while the trainer
    committed the version anyway."""
    n_groups: int
    timeout_s: float = 600.0
    version: Optional[int] = None


@dataclass
class Batch:
    """One step for every DP rank, laid out as the trainer's batch (`megarl.protocol.packing`):
    flat arrays (``arrays``) ``input_ids``, ``loss_mask``, ``behave_logp``, ``versions``
    (token-aligned, all samples back to back), ``lengths``, ``rewards``, ``group_ids``,
    ``dp_rank`` (per sample); samples ordered by DP rank, so each rank's share (whole groups) is
    one contiguous run (`packing.share_slices`); with MoE routing replay also ``route_ids`` int32
    and ``route_weights`` float32, both [tokens, layers, top_k] in the token order of
    ``input_ids`` (`Trajectory.routes`). ``infos``: each sample's free-form info, in the same
    order; ``stats``: the manager's counters at hand-off; ``rejoin``: dropped servers that answer
    again (the trainer pushes them the weights)."""
    infos: list[dict]
    stats: dict
    rejoin: list[str]
    arrays: dict = field(default_factory=dict)


# ------------------------------------------------------------------ admin relay (closed set)
# One class per server operation a trainer link asks of the manager's admin connection; the
# weight transports send them as they are and one table maps each class to one fixed `AdminClient`
# call (megarl.rollout.admin.ADMIN_CALLS, run by the manager or a local `AdminRunner`). Fields follow
# that call's parameters; ``timeout_s`` is the manager's deadline for it.
@dataclass
class InitWeightsGroup:
    endpoint: ClassVar[str] = "/init_weights_update_group"
    group: Any  # wire.WeightsUpdateGroup
    rank_offsets: Optional[list] = None
    timeout_s: Optional[float] = None


@dataclass
class DestroyWeightsGroup:
    endpoint: ClassVar[str] = "/destroy_weights_update_group"
    group_name: str = "weight_update_group"
    timeout_s: Optional[float] = None


@dataclass
class UpdateFromDistributed:
    endpoint: ClassVar[str] = "/update_weights_from_distributed"
    meta: Any  # wire.DistributedWeightsMeta
    timeout_s: Optional[float] = None


@dataclass
class UpdateFromTensor:
    endpoint: ClassVar[str] = "/update_weights_from_tensor"
    update: Any  # wire.TensorWeightsUpdate
    timeout_s: Optional[float] = None


@dataclass
class UpdateFromDisk:
    endpoint: ClassVar[str] = "/update_weights_from_disk"
    update: Any  # wire.DiskWeightsUpdate
    timeout_s: Optional[float] = None


@dataclass
class ServerInfo:
    endpoint: ClassVar[str] = "/get_server_info"
    timeout_s: Optional[float] = None


@dataclass
class ShardJoin:
    """Shard refit: each server joins the update group with its own body ({address: body})."""
    endpoint: ClassVar[str] = "/init_weights_update_group"
    bodies: dict
    timeout_s: Optional[float] = None


@dataclass
class ShardAnnounce:
    """Shard refit: one bucket announced, each server's own body ({address: body})."""
    endpoint: ClassVar[str] = "/update_weights_from_distributed"
    bodies: dict
    timeout_s: Optional[float] = None


@dataclass
class WeightsChecksum:
    endpoint: ClassVar[str] = "/weights_checksum"
    names: list
    dtypes: list
    timeout_s: Optional[float] = None


@dataclass
class LoadLoRA:
    """LoRA on SGLang: every server loads the PEFT directory ``path`` under ``name``."""
    endpoint: ClassVar[str] = "/load_lora_adapter"
    name: str
    path: str
    timeout_s: Optional[float] = None


@dataclass
class UnloadLoRA:
    endpoint: ClassVar[str] = "/unload_lora_adapter"
    name: str
    timeout_s: Optional[float] = None


@dataclass
class SetThreads:
    """megarl-server only (`wire.EXT_THREADS`): generation's torch threads from the next step on
    (the trainer lends its core while it waits, `megarl.trainer.threads`)."""
    endpoint: ClassVar[str] = "/set_threads"
    threads: int
    timeout_s: Optional[float] = None


ADMIN_MESSAGES = (InitWeightsGroup, DestroyWeightsGroup, UpdateFromDistributed, UpdateFromTensor,
                  UpdateFromDisk, ServerInfo, ShardJoin, ShardAnnounce, WeightsChecksum, LoadLoRA, UnloadLoRA,
                  SetThreads)


# ------------------------------------------------------- the server set's steps (closed set)
# One class per `RolloutCluster` step the driver asks of the manager during a push and when a
# server drops out or comes back; the manager maps each to one fixed call (manager.CLUSTER_CALLS).
@dataclass
class PauseForUpdate:
    """Before a push: the servers stop (or retract) generation as weights.pause_mode says."""


@dataclass
class Resume:
    """A push that failed: the update session it opened is closed, generation goes on."""


@dataclass
class PushFailed:
    """An overlapped push failed for good (its flight could not recover): the step the trainer is
    waiting for fails at once with this error instead of stalling (the trainer learns the push's
    outcome only where it lands)."""
    error: str


@dataclass
class FinishPush:
    """The tail of a push, off the trainer's critical path: every load in, the servers' version
    flipped to ``version``, the staleness window moved, generation resumed."""
    version: int


@dataclass
class Unhealthy:
    """Which servers stopped answering. Reply: their addresses."""


@dataclass
class RemoveServer:
    address: str


@dataclass
class AddServer:
    """A dropped server answers again: admitted to pushes (work follows `Admitted`)."""
    address: str


@dataclass
class Admitted:
    """``address`` holds the current weights: it gets work again."""
    address: str


@dataclass
class Start:
    """The first step's weights are in: rollouts may start."""


@dataclass
class Sleep:
    """Colocated placement: the servers release ``tags`` (kv_cache, weights) while the trainer trains."""
    tags: list


@dataclass
class Wake:
    """Colocated placement: the servers take ``tags`` back before the push."""
    tags: list


CLUSTER_MESSAGES = (PauseForUpdate, Resume, FinishPush, Unhealthy, RemoveServer, AddServer, Admitted, Start,
                    Sleep, Wake, PushFailed)


@dataclass
class EvalSubmit:
    """Driver -> manager: evaluate the version the servers hold after ``step``; the manager runs
    the held-out sets `eval_due` at that step (the driver sends it when any set is)."""
    step: int
    version: int


def eval_due(interval: int, step: int, last_step: int) -> bool:
    """Whether a held-out set evaluates after ``step`` (the trainer's and the manager's rule):
    every ``interval`` steps (0: never in between), at the last step, and at step 0 (sent only
    with rollout.eval_at_start)."""
    return step == 0 or step >= last_step or bool(interval and step % interval == 0)


@dataclass
class EvalPoll:
    """Driver -> manager: metrics of finished evaluations; ``wait``: block until all submitted
    ones are done, at most ``timeout_s`` (then the error names what the evaluation waits on)."""
    wait: bool = False
    timeout_s: float = 600.0


@dataclass
class EvalReport:
    """Manager -> driver, the answer to `EvalPoll`: the finished evaluations' metrics (eval/*,
    empty when none finished) and how many submitted ones are still running."""
    metrics: dict
    running: int


@dataclass
class StateRequest:
    """Driver -> manager: the exactly-once ledger for a checkpoint. Reply: `Reply`(value=state)."""


@dataclass
class Close:
    """Driver -> manager: the run ended; stop the rollouts and the servers this job started."""


@dataclass
class Reply:
    """The answer to any request: ``value`` (JSON) or ``error`` (one line), plus ``elapsed_s``
    (the manager's own time on it: how the push's fixed cost splits)."""
    value: Any = None
    error: Optional[str] = None
    elapsed_s: float = 0.0


MESSAGES = {cls.__name__: cls for cls in (Hello, Beat, Init, BatchRequest, Batch, EvalSubmit, EvalPoll, EvalReport,
                                          StateRequest, Close, Reply, *ADMIN_MESSAGES, *CLUSTER_MESSAGES)}
# answers that travel as themselves, not inside a `Reply` (a batch carries arrays)
DIRECT_REPLIES = (Batch, EvalReport)
