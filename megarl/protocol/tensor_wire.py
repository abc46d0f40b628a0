"""Payload encoders for ``/update_weights_from_tensor`` (one ``serialized_named_tensors`` entry).

Trainer side only (the tensor transport); megarl-server decodes with
``megarl.server.weights.decode_named_tensors``.

Three wire formats, chosen once per transport:

- ``"megarl"``: base64 safetensors, ``load_format: "safetensors_b64"`` (megarl-server; no code
  runs on load).
- ``"sglang"``: what real SGLang reads - base64 of a pickle of ``[(name, tensor), ...]`` that its
  restricted unpickler accepts, with ``load_format`` left out. SGLang's own serializer pickles
  CPU tensors as shared-memory handles, which only a process on the same host can open, and only
  once (a re-sent payload fails); here each tensor is pickled *by value* (torch's storage bytes),
  so the payload travels over HTTP and can be re-sent. megarl only produces this format; it never
  unpickles anything.
- ``"sglang_ipc"``: the same request with SGLang's serializer on CUDA tensors: CUDA-IPC handles,
  no bytes (the colocated placement on GPU: trainer and SGLang on the same device).
"""
from __future__ import annotations

import base64
import io
import pickle
from typing import Literal, Optional

import torch

from megarl.protocol.types import SAFETENSORS_B64, TensorWeightsUpdate

WireFormat = Literal["megarl", "sglang", "sglang_ipc"]


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor that owns exactly its bytes (a view would pickle its whole base)."""
    t = t.detach().cpu().contiguous()
    # a view (a parameter's gate rows, an embedding without padding) would serialize its whole
    # storage: pickle writes storages, safetensors refuses tensors that share one
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


def encode_megarl(tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save

    # base64: the payload rides in a JSON body (SGLang's request shape), which carries text only
    return base64.b64encode(save({k: _owned(v) for k, v in tensors.items()})).decode("ascii")


def encode_sglang(tensors: dict[str, torch.Tensor]) -> str:
    buf = io.BytesIO()
    # protocol 4: what SGLang's restricted unpickler reads; by value, not shared-memory handles
    pickle.Pickler(buf, protocol=4).dump([(k, _owned(v)) for k, v in tensors.items()])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_sglang_ipc(tensors: dict[str, torch.Tensor]) -> str:
    """SGLang's own same-GPU handover (seed 004's colocated path, `MultiprocessingSerializer`):
    torch's ForkingPickler turns each CUDA tensor into a CUDA-IPC handle (type, shape, stride,
    the handle and an event), so no weight byte is copied - the server opens the trainer's memory.
    The tensors must stay alive until the server answered (the push waits for it). CPU tensors
    would travel as shared-memory file handles; use "sglang" for them."""
    bad = [k for k, v in tensors.items() if not v.is_cuda]
    if bad:
        raise ValueError(f"sglang_ipc: {bad[0]} is not a CUDA tensor (CUDA-IPC hands over GPU memory only)")
    return base64.b64encode(fork_pickle([(k, v.detach().contiguous()) for k, v in tensors.items()])).decode("ascii")


def fork_pickle(obj) -> bytes:
    """``obj`` pickled the way SGLang's `MultiprocessingSerializer` does (torch's reducers: a CUDA
    tensor becomes its CUDA-IPC handle, a CPU tensor a shared-memory handle), protocol 4."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reducers (CUDA tensor -> IPC handle)
    buf = io.BytesIO()
    # positional: ForkingPickler.__init__ takes *args only (protocol=4 is a TypeError on 3.11/3.12)
    ForkingPickler(buf, 4).dump(obj)
    return buf.getvalue()


def tensor_update(tensors: dict[str, torch.Tensor], wire: WireFormat = "megarl", *,
                  weight_version: Optional[str] = None, flush_cache: bool = True) -> TensorWeightsUpdate:
    """A ``/update_weights_from_tensor`` body for one bucket in the given wire format."""
    if wire == "megarl":
        return TensorWeightsUpdate([encode_megarl(tensors)], SAFETENSORS_B64, flush_cache, weight_version)
    if wire == "sglang":
        return TensorWeightsUpdate([encode_sglang(tensors)], None, flush_cache, weight_version)
    if wire == "sglang_ipc":
        return TensorWeightsUpdate([encode_sglang_ipc(tensors)], None, flush_cache, weight_version)
    raise ValueError(f"unknown tensor wire format {wire!r}; use 'megarl', 'sglang' or 'sglang_ipc'")
