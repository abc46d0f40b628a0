"""The step hand-off on the trainer: the manager's `Batch` keeps one form, flat arrays laid out as
the trainer's batch (`megarl.protocol.packing`), from the socket to this rank's `TensorBatch`.

    rank 0      Link.request -> Batch: numpy views of the one buffer the frame was read into
    all ranks   receive_step: one object broadcast (array names/dtypes/shapes, servers to re-admit)
                + one uint8 broadcast of the arrays' bytes; every rank's arrays are views of it
    each rank   step.share(dp_rank): its samples' contiguous run -> `TensorBatch.from_flat`
                (a padded tensor per field, one masked assignment each; no Python per sample)

The step-level numbers (rollout metrics, trained tokens) read the whole step's flat arrays
(`megarl.trainer.rollout_stats.batch_metrics`); per-sample infos (free-form dicts, for metrics
and dumps) stay on rank 0, as do the manager's stats.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megarl.protocol.packing import OPTIONAL_TOKEN_FIELDS, SAMPLE_FIELDS, TOKEN_FIELDS, share_slices
from megarl.trainer.batch import TensorBatch

_ALIGN = 16  # each array starts at a multiple of this in the broadcast buffer (aligned numpy views)


@dataclass
class ReceivedStep:
    """One step's arrays (the `Batch` layout, on every rank), plus what only rank 0 holds
    (``infos``, ``stats``; empty elsewhere) and the servers every rank re-admits (``rejoin``)."""

    arrays: dict[str, np.ndarray]
    infos: list[dict] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    rejoin: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.arrays["lengths"])

    @property
    def tokens(self) -> int:
        return int(self.arrays["lengths"].sum())

    def share(self, dp_rank: int) -> TensorBatch:
        """DP rank ``dp_rank``'s samples as one padded batch: token fields loss_mask, behave_logp,
        versions (and teacher_logp with distillation); sample fields rewards, group_ids; the MoE
        routes when the step has them."""
        a = self.arrays
        rows, toks = share_slices(a, dp_rank)
        routes = (a["route_ids"][toks], a["route_weights"][toks]) if "route_ids" in a else None
        return TensorBatch.from_flat(a["input_ids"][toks], a["lengths"][rows],
                                     {k: a[k][toks] for k in (*TOKEN_FIELDS, *OPTIONAL_TOKEN_FIELDS) if k in a},
                                     {k: a[k][rows] for k in SAMPLE_FIELDS}, routes)


def _offsets(layout: list) -> tuple[list[int], int]:
    at, out = 0, []
    for _, dt, shape in layout:
        out.append(at)
        at += -(-int(np.dtype(dt).itemsize * int(np.prod(shape))) // _ALIGN) * _ALIGN
    return out, at


def receive_step(batch, ps) -> ReceivedStep:
    """Rank 0's `Batch` (None on other ranks) -> the step on every rank: an object broadcast of
    the layout and a byte broadcast of the arrays (none with one rank)."""
    if ps.world_size == 1:
        return ReceivedStep(dict(batch.arrays), batch.infos, batch.stats, list(batch.rejoin))
    head = [None]
    if ps.rank == 0:
        arrays = {k: np.ascontiguousarray(v) for k, v in batch.arrays.items()}
        head = [{"layout": [[k, v.dtype.str, list(v.shape)] for k, v in arrays.items()], "rejoin": batch.rejoin}]
    dist.broadcast_object_list(head, src=0)
    layout, rejoin = head[0]["layout"], head[0]["rejoin"]
    offsets, size = _offsets(layout)
    buf = np.zeros(size, dtype=np.uint8)
    if ps.rank == 0:
        for (k, _, _), at in zip(layout, offsets):
            raw = arrays[k].reshape(-1).view(np.uint8)
            buf[at:at + raw.size] = raw
    dist.broadcast(torch.from_numpy(buf), src=0)
    out = {k: np.frombuffer(buf, dtype=np.dtype(dt), count=int(np.prod(shape)), offset=at).reshape(shape)
           for (k, dt, shape), at in zip(layout, offsets)}
    if ps.rank == 0:
        return ReceivedStep(out, batch.infos, batch.stats, list(rejoin))
    return ReceivedStep(out, rejoin=list(rejoin))
