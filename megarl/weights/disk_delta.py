"""``DiskDeltaTransport``: the disk transport writing `megarl.protocol.delta_format` (weights.disk_delta
with megarl-server): per stage one file of raw/same/XOR+zlib records with per-tensor CRC-32s."""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch.distributed as dist

from megarl.protocol.delta_format import MANIFEST, encode
from megarl.protocol.messages import UpdateFromDisk
from megarl.weights.transports import DiskTransport, PushError
from megarl.protocol.wire import DiskWeightsUpdate


class DiskDeltaTransport(DiskTransport):
    """DiskTransport writing the delta format (same ``finish(version, engine)`` contract, collective)."""

    def __init__(self, admin, directory: str, keep: int, timeout_s: float, dtype, xor: bool = False):
        super().__init__(admin, directory, keep, timeout_s, dtype)
        self.xor = xor  # weights.disk_delta=xor: changed tensors as XOR+zlib records, else raw
        self.base: Optional[dict] = None  # this writer's last pushed bytes; None: next push is raw
        self.base_version: Optional[str] = None
        self.written = 0  # bytes written by the last push (all stages; rank 0)

    def finish(self, version: str, engine) -> None:
        from megarl.models.hf_io import iter_hf_tensors, serves_weights

        ps = engine.ps
        path = os.path.join(self.dir, f"v{version}")
        tmp = path + ".tmp-delta"
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        writer = ps.first_replica and ps.tp_rank == 0
        part = None
        if serves_weights(ps):
            tensors = iter_hf_tensors(engine.chunks, engine.args, ps, engine.use_te, self.dtype)
            if writer:
                with open(os.path.join(tmp, f"stage{ps.pp_rank}.bin"), "wb") as f:
                    entries, new = encode(tensors, self.base, f, self.xor)
                    part = (entries, f.tell())
            else:
                for _ in tensors:  # the gather is collective over the TP group
                    pass
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, part)
        ok = [True]
        if dist.get_rank() == 0:
            man = {"base": self.base_version if self.base is not None else None, "version": version,
                   "tensors": {n: e for p in parts if p for n, e in p[0].items()}}
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(man, f)
            self.written = sum(p[1] for p in parts if p)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)  # a server never reads a half-written version
            try:
                self.admin.request(UpdateFromDisk(DiskWeightsUpdate(path, version)), self.timeout_s)
            except Exception as e:  # noqa: BLE001
                ok = [f"{type(e).__name__}: {e}"]
            self._prune(keep_also=path)
        dist.broadcast_object_list(ok, src=0)
        if ok[0] is not True:  # the servers may hold anything now: the next push is raw
            self.base, self.base_version = None, None
            if dist.get_rank() == 0:
                raise PushError(f"update_weights_from_disk {path}: {ok[0]}")
        elif part is not None:
            self.base, self.base_version = new, version
