"""What a `megarl.weights.push.WeightPusher` is built from (`PushSpec`: the weights section and
the run's wire plan) and what a push reports (`PushMetrics`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megarl.config import WeightSyncConfig
from megarl.protocol.wire_plan import WirePlan


@dataclass(frozen=True)
class PushSpec:
    """What a `WeightPusher` is built from: the weights section (bucket size, dtype, timeouts,
    delta, verify mode), the run directory (the disk transport's default directory is
    <run_dir>/weights) and the run's wire plan (`megarl.protocol.wire_plan.WirePlan`: transport,
    format, adapters, checksums, overlap - decided once, saved as <run_dir>/wire.json)."""

    weights: WeightSyncConfig
    run_dir: str
    wire: WirePlan

    @classmethod
    def from_config(cls, cfg) -> "PushSpec":
        return cls(cfg.weights, cfg.train.run_dir, WirePlan.of_config(cfg))


@dataclass
class PushMetrics:
    version: int
    bytes: int
    buckets: int
    gather_s: float
    convert_s: float
    send_s: float
    total_s: float
    pause_s: float = 0.0  # the driver's wait for the servers to pause (step 1)
    digest_s: float = 0.0  # checksums of the sent tensors (pushes that weights.verify_interval checks)
    # wall time of step 2 (+ the transport's finish): gather/convert on the caller's thread overlap
    # the sender thread's send_s and digest_s, so the four sum to more than this
    stream_s: float = 0.0
    adapter_bytes: int = 0  # LoRA: the adapters' bytes in the serving dtype (+ the 4-byte scale), all stages
    # the trainer's own time in the push call; synchronous pushes: total_s. Overlapped: staging this
    # version plus any wait for the previous flight to land; the other times are that flight's
    blocking_s: Optional[float] = None
    overlapped_s: float = 0.0  # the landed flight's time that ran beside the trainer's work
    verify_mismatches: Optional[int] = None  # a checked flight's (synchronous pushes: the step checks)
    landed: bool = True  # False: an overlapped push call in which no earlier flight landed

    @classmethod
    def summed(cls, version: int, nbytes: int, t, send_s: float, digest_s: float, pause_s: float, stream_s: float,
               total_s: float, adapter_nbytes: int = 0, group=None) -> "PushMetrics":
        """Every rank's sum (sources hold the counts; times summed over stages); ``t``: this
        rank's `ReshardTimes`. Collective over ``group`` (default: the world)."""
        import torch
        import torch.distributed as dist

        stats = torch.tensor([nbytes, t.buckets, t.gather_s, t.convert_s, send_s, digest_s, adapter_nbytes],
                             dtype=torch.float64)
        dist.all_reduce(stats, group=group)
        b, n, g, c, s, h, a = stats.tolist()
        return cls(version, int(b), int(n), g, c, s, total_s, pause_s, h, stream_s, int(a))

    @classmethod
    def waited(cls, blocking_s: float) -> "PushMetrics":
        """An overlapped push call that landed no flight: only the trainer's own time to report."""
        return cls(-1, 0, 0, 0.0, 0.0, 0.0, 0.0, blocking_s=blocking_s, landed=False)

    @property
    def fixed_s(self) -> float:
        """The protocol's share of the push time: everything but streaming the bytes (pause, the
        tail when it is awaited, agreement all-reduces)."""
        return max(0.0, self.total_s - self.stream_s)

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.stream_s, 1e-9) / 1e9

    def as_dict(self) -> dict:
        """The step's push/* metrics: the push's (synchronous) or the flight's that landed during
        the step (overlapped; ``push/version`` names it, and a step where none landed reports only
        ``push/blocking_s``)."""
        blocking = self.total_s if self.blocking_s is None else self.blocking_s
        if not self.landed:
            return {"push/blocking_s": blocking}
        return {"push/version": self.version, "push/bytes": self.bytes, "push/buckets": self.buckets, "push/gather_s": self.gather_s,
                "push/convert_s": self.convert_s, "push/send_s": self.send_s,
                "push/total_s": self.total_s, "push/gbps": self.gbps, "push/pause_s": self.pause_s,
                "push/fixed_s": self.fixed_s, "push/digest_s": self.digest_s,
                "push/stream_s": self.stream_s, "push/blocking_s": blocking,
                "push/overlapped_s": self.overlapped_s,
                **({"push/adapter_bytes": self.adapter_bytes} if self.adapter_bytes else {}),
                **({"push/verify_mismatches": self.verify_mismatches}
                   if self.verify_mismatches is not None else {})}
