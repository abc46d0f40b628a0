"""The transport factory: the one place that turns the weights section into a `Transport`."""
from __future__ import annotations

from typing import Optional

from megarl.weights.disk_delta import DiskDeltaTransport
from megarl.weights.shard_push import ShardRefitTransport
from megarl.weights.target import StageAdmin
from megarl.weights.transports import (DiskTransport, DistributedTransport, PushError, SharedMemoryTransport,
                                       TensorTransport)


def resolved_format(tensor_format: str) -> str:
    if tensor_format == "auto":  # guessing here is what once sent megarl's wire to real SGLang
        raise PushError("weights.tensor_format: auto was not resolved against the servers "
                        "(megarl.config.server_wire.resolve_wire, run by megarl-train's preflight)")
    return tensor_format


def open_transport(w, admin: Optional[StageAdmin], engine, dtype, run_dir: str, colocated: bool):
    """The transport ``w`` (the weights section) names, for this rank: shard refit (every TP rank
    sends its own slices, `megarl.weights.shard_push`), the distributed group, HTTP tensors (SGLang
    on the trainer's own GPU: CUDA IPC handles instead of bytes), /dev/shm, or disk (whole
    checkpoints, or records against the last push with ``weights.disk_delta``)."""
    cuda = engine.ps.device.type == "cuda"
    backend = "nccl" if cuda else "gloo"
    if w.refit == "shard":
        return ShardRefitTransport(admin, engine, w.master_address, w.timeout_s, backend, dtype)
    if w.transport == "distributed":
        return DistributedTransport(admin, w.master_address, w.timeout_s, backend,
                                    wire=resolved_format(w.tensor_format))
    if w.transport == "tensor":
        wire = resolved_format(w.tensor_format)
        if wire == "sglang" and colocated and cuda:
            wire = "sglang_ipc"  # SGLang on the trainer's GPU: hand over memory, not bytes
        return TensorTransport(admin, w.timeout_s, wire)
    if w.transport == "shm":
        return SharedMemoryTransport(admin, w.timeout_s)
    directory = w.disk_dir or f"{run_dir}/weights"
    if w.disk_delta != "off":
        return DiskDeltaTransport(admin, directory, w.keep_versions, w.timeout_s, dtype, w.disk_delta == "xor")
    return DiskTransport(admin, directory, w.keep_versions, w.timeout_s, dtype)
