"""The weight wire a run decided (`WirePlan`): what the trainer's pusher sends and the rollout
manager expects, in one value. `WirePlan.decide` turns a resolved weights section
(`megarl.config.server_wire.resolve_wire`, run by megarl-train's preflight, has turned every
auto into what the servers advertise) and the run's shape into the plan; rank 0 saves it beside
the run's config as ``<run_dir>/wire.json`` and prints it, and the rollout manager the job starts
reads that file (a manager run apart, with no trainer's run directory, decides from its own
resolved config by the same function).

    field          values                        decided from
    transport      distributed tensor shm disk   weights.transport
    refit          gather shard                  weights.refit
    tensor_format  megarl sglang sglang_ipc      the resolved weights.tensor_format; sglang over
                                                 the tensor transport of a colocated run hands
                                                 over CUDA-IPC handles (preflight refuses
                                                 colocated SGLang without CUDA)
    adapters       none merged peft              lora.rank and the format: SGLang loads each
                                                 push's PEFT directory, megarl-server merges
                                                 the adapter tensors it is pushed
    pause_mode     abort retract in_place        the resolved weights.pause_mode
    verify_every   N (0 = off)                   the resolved weights.verify_interval
    overlap        true false                    weights.overlap where it applies: staleness
                                                 >= 1, disaggregated, buckets on the wire (not
                                                 disk, not shard refit), no PEFT directories

Standard library only (the floor): the weights section is read by its attribute names.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Optional

WIRE_FILE = "wire.json"


@dataclass(frozen=True)
class WirePlan:
    transport: str = "distributed"
    refit: str = "gather"
    tensor_format: str = "megarl"
    adapters: str = "none"
    pause_mode: str = "abort"
    verify_every: int = 0
    overlap: bool = False

    @classmethod
    def decide(cls, weights, colocated: bool = False, asynchronous: bool = False,
               lora_rank: int = 0) -> "WirePlan":
        """The plan for a resolved ``weights`` section (`WeightSyncConfig`); ``colocated``:
        rollout.placement, ``asynchronous``: rollout.max_staleness >= 1, ``lora_rank``: lora.rank
        when LoRA is on. Raises ValueError naming the field still auto."""
        for field in ("tensor_format", "pause_mode"):
            if getattr(weights, field) == "auto":
                raise ValueError(f"weights.{field}: auto was not resolved against the servers "
                                 "(megarl.config.server_wire.resolve_wire, run by megarl-train's preflight)")
        if weights.verify_interval is None:
            raise ValueError("weights.verify_interval: auto was not resolved against the servers "
                             "(megarl.config.server_wire.resolve_wire, run by megarl-train's preflight)")
        fmt = weights.tensor_format
        if fmt == "sglang" and colocated and weights.transport == "tensor":
            fmt = "sglang_ipc"  # SGLang on the trainer's GPU: hand over memory, not bytes
        adapters = "none" if lora_rank <= 0 else ("peft" if weights.tensor_format == "sglang" else "merged")
        plan = cls(weights.transport, weights.refit, fmt, adapters, weights.pause_mode,
                   int(weights.verify_interval), False)
        overlap = (weights.overlap and asynchronous and not colocated and plan.streams_buckets
                   and not plan.peft)
        return dataclasses.replace(plan, overlap=bool(overlap))

    @classmethod
    def of_config(cls, cfg) -> "WirePlan":
        """The plan of a run's resolved config (`megarl.config.Config`)."""
        return cls.decide(cfg.weights, cfg.rollout.placement == "colocated", cfg.rollout.max_staleness >= 1,
                          cfg.lora.rank if cfg.lora.enabled else 0)

    @classmethod
    def for_run(cls, cfg) -> "WirePlan":
        """What the rollout manager reads: the plan megarl-train saved in the run directory, or
        (a manager run apart on a config of its own) the one its resolved config decides."""
        saved = cls.load(cfg.train.run_dir)
        return saved if saved is not None else cls.of_config(cfg)

    @property
    def streams_buckets(self) -> bool:
        """Buckets go over the wire: not the disk transport (whole checkpoints through the
        engine's export), nor shard refit (each TP rank sends its own slices, no buckets)."""
        return self.transport != "disk" and self.refit != "shard"

    @property
    def peft(self) -> bool:
        """LoRA on SGLang: each push's adapters go as a PEFT directory (/load_lora_adapter) that
        every request names; megarl-server instead merges the adapter tensors in the buckets."""
        return self.adapters == "peft"

    def describe(self) -> str:
        """One line for the run's log."""
        transport = "shard refit" if self.refit == "shard" else self.transport
        verify = f"checksums every {self.verify_every} pushes" if self.verify_every else "no checksums"
        return (f"{transport}, {self.tensor_format} format, adapters {self.adapters}, pause {self.pause_mode}, "
                f"{verify}, {'overlapped' if self.overlap else 'synchronous'} pushes")

    def save(self, run_dir: str) -> str:
        """Writes ``<run_dir>/wire.json`` atomically (a temporary file created exclusively, mode
        0600, never through a link planted at its name) and returns its path."""
        path = os.path.join(run_dir, WIRE_FILE)
        tmp = path + ".tmp"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, run_dir: str) -> Optional["WirePlan"]:
        """The plan saved in ``run_dir``, or None when there is none; a file that is not a plan
        raises ValueError naming it."""
        path = os.path.join(run_dir, WIRE_FILE)
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a weight wire plan ({e})") from None
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != set(names):
            raise ValueError(f"{path}: not a weight wire plan (fields {sorted(data) if isinstance(data, dict) else data!r})")
        return cls(**data)
