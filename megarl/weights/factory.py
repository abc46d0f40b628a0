"""The transport factory: the one place that turns the run's wire plan into a `Transport`."""
from __future__ import annotations

from typing import Optional

from megarl.protocol.wire_plan import WirePlan
from megarl.weights.disk_delta import DiskDeltaTransport
from megarl.weights.shard_push import ShardRefitTransport
from megarl.weights.target import StageAdmin
from megarl.weights.transports import (DiskTransport, DistributedTransport, SharedMemoryTransport,
                                       TensorTransport)


def open_transport(wire: WirePlan, w, admin: Optional[StageAdmin], engine, dtype, run_dir: str):
    """The transport ``wire`` (`WirePlan`) names, for this rank, with the weights section ``w``'s
    settings (addresses, timeouts, disk directory): shard refit (every TP rank sends its own
    slices, `megarl.weights.shard_push`), the distributed group, HTTP tensors (``sglang_ipc``:
    SGLang on the trainer's own GPU gets CUDA-IPC handles instead of bytes), /dev/shm, or disk
    (whole checkpoints, or records against the last push with ``weights.disk_delta``)."""
    backend = "nccl" if engine.ps.device.type == "cuda" else "gloo"
    if wire.refit == "shard":
        return ShardRefitTransport(admin, engine, w.master_address, w.timeout_s, backend, dtype)
    if wire.transport == "distributed":
        return DistributedTransport(admin, w.master_address, w.timeout_s, backend, wire=wire.tensor_format)
    if wire.transport == "tensor":
        return TensorTransport(admin, w.timeout_s, wire.tensor_format)
    if wire.transport == "shm":
        return SharedMemoryTransport(admin, w.timeout_s)
    directory = w.disk_dir or f"{run_dir}/weights"
    if w.disk_delta != "off":
        return DiskDeltaTransport(admin, directory, w.keep_versions, w.timeout_s, dtype, w.disk_delta == "xor")
    return DiskTransport(admin, directory, w.keep_versions, w.timeout_s, dtype)
