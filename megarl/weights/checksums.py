"""Push verification (``weights.verify_interval``): the servers must hold exactly what the trainer
pushed, checked without reading a tensor back.

The trainer records the sha256 of every tensor it sends (from the buckets, on the sending thread;
transports that never see buckets - disk, shard refit - hash the resharder's tensors again), and
compares them with the checksums each server computes of what it holds, in the pushed dtype
(megarl-server's ``/weights_checksum``): one HTTP call per server, from the driver rank."""
from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist

from megarl.protocol.channel import ManagerStalled
from megarl.protocol.messages import WeightsChecksum
from megarl.protocol.wire import tensor_digest
from megarl.weights.transports import PushError


class Checksums:
    """One rank's record of what it sent: ``{name: (dtype, sha256)}``, kept across pushes (a delta
    push's skipped tensors keep the digest of the push that last sent them). ``merged``: LoRA on
    megarl-server - the servers hold these base weights merged with the pushed adapters, so they
    are checked through the adapters' checksums, not against the base rows."""

    def __init__(self, every: int, merged: frozenset = frozenset()):
        self.every, self.merged = every, merged
        self.digests: dict[str, tuple[str, str]] = {}
        self.digest_s = 0.0

    def due(self, version: int) -> bool:
        """Whether the push of ``version`` is checked (``weights.verify_interval``)."""
        return bool(self.every) and version % self.every == 0

    def record(self, bucket) -> None:
        """Checksums of a bucket once it is sent (stage sources, pushes that are `due`)."""
        t0 = time.perf_counter()
        for name, dtype, t in zip(bucket.names, bucket.dtypes, bucket.tensors):
            if name not in self.merged:
                self.digests[name] = (dtype, tensor_digest(t.cpu()))
        self.digest_s += time.perf_counter() - t0

    def forget(self, bucket) -> None:
        """A push that does not record: the digests of what it sent are stale, drop them (a later
        delta push that skips those tensors leaves them unchecked rather than falsely differing)."""
        for name in bucket.names:
            self.digests.pop(name, None)

    def gather(self, resharder, ps) -> dict[str, tuple[str, str]]:
        """The checksums of every tensor the resharder yields (stage by stage; TP peers gather
        with their source, which hashes). For the transports whose push never sees buckets."""
        out: dict[str, tuple[str, str]] = {}
        for stage in range(ps.pp):
            if ps.pp_rank == stage:
                for bucket in resharder.iter_buckets():
                    if ps.is_pp_source:
                        out.update((n, (d, tensor_digest(t.cpu())))
                                   for n, d, t in zip(bucket.names, bucket.dtypes, bucket.tensors))
            dist.barrier()
        return out

    def verify(self, local: dict, driver: bool, admin, timeout_s: float, group=None) -> list[str]:
        """Collective over ``group`` (default: the world): every rank's ``local`` digests against
        the servers' checksums; returns ``["addr:name", ...]``, one entry per differing tensor
        and server, on every rank; raises `PushError` when a server cannot answer (real SGLang
        has no such endpoint)."""
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local, group=group)
        want = {name: d for part in parts for name, d in part.items()}
        if not want:  # same on every rank
            raise PushError("weights.verify_interval: verify() needs a push that recorded checksums "
                            "(one whose version is due)")
        box: list = [None]
        if driver:
            try:
                box = [("ok", compare(admin, want, timeout_s))]
            except ManagerStalled as e:  # the manager, not the endpoint: its own line on every rank
                box = [("stalled", str(e))]
            except Exception as e:  # noqa: BLE001 - every rank raises the same error below
                box = [("error", f"{type(e).__name__}: {e}")]
        dist.broadcast_object_list(box, src=0, group=group)
        kind, value = box[0]
        if kind == "stalled":
            raise ManagerStalled(value)
        if kind == "error":
            raise PushError(f"weights.verify_interval: /weights_checksum failed ({value}); a server "
                            "without it (real SGLang) needs weights.verify_interval=0")
        return value


def compare(admin, want: dict[str, tuple[str, str]], timeout_s: float) -> list[str]:
    """Driver: the servers' checksums of every name in ``want`` ({name: (dtype, hex)})."""
    names = sorted(want)
    dtypes = [want[n][0] for n in names]
    got = admin.request(WeightsChecksum(names, dtypes), timeout_s)
    return [f"{addr}:{n}" for addr in sorted(got) for n in names if got[addr].get(n) != want[n][1]]


def mismatch_line(bad: list[str], version: int) -> Optional[str]:
    """One line naming the first differing tensor and every server that differs (None: none)."""
    if not bad:
        return None
    servers = sorted({b.rsplit(":", 1)[0] for b in bad})
    first_server, first_tensor = bad[0].rsplit(":", 1)
    return (f"weights.verify_interval: server {first_server} holds a different {first_tensor} than "
            f"the trainer pushed as version {version} ({len(bad)} tensor(s) differ on "
            f"{len(servers)} server(s): {', '.join(servers)})")


def judge_mismatches(bad: list[str], mode: str, version: int, rank: int) -> int:
    """``weights.verify_mode`` on a check's differing tensors: fail raises `PushError` naming the
    first one, warn prints it (rank 0) and counts them. Returns the count."""
    what = mismatch_line(bad, version)
    if what is None:
        return 0
    if mode == "fail":
        raise PushError(what + "; weights.verify_mode=warn counts them in push/verify_mismatches instead")
    if rank == 0:
        print(f"[weights] WARNING {what}", flush=True)
    return len(bad)
