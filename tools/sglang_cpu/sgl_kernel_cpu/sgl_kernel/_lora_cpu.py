"""One fix to SGLang 0.5.23's LoRA path on the CPU engine, applied when SGLang imports this stand-in.

With ``--enable-lora`` SGLang keeps small host-side index tensors of its LoRA layers
(``sglang.srt.lora.layers``: the output offsets) and of its torch-native LoRA backend
(``sglang.srt.lora.backend.torch_backend``: each batch's segment lengths, ranks and scalings) in
page-locked memory: ``torch.tensor(..., pin_memory=True)`` and ``.pin_memory()``. Without CUDA that
dies while the scheduler builds the model, or at the first batch::

    File ".../sglang/srt/lora/layers.py", line 475, in __init__ ... pin_memory=True,
    RuntimeError: Found no NVIDIA driver on your system. ...

Pinning only speeds up copies to a GPU; on the CPU engine those copies are ordinary memory. So
these modules see a ``torch`` whose tensor factories drop ``pin_memory``, and, in a process without
CUDA, ``Tensor.pin_memory()`` returns the tensor itself (it can only raise there otherwise).
Nothing else of SGLang is changed.
"""
from __future__ import annotations

import types

import torch

from ._after_import import after_import

TARGETS = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")
FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange")


def _unpinned(factory):
    def make(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)
    return make


class _UnpinnedTorch(types.ModuleType):
    """``torch`` as the patched modules see it: the FACTORIES without ``pin_memory``."""

    def __init__(self):
        super().__init__("torch")
        for name in FACTORIES:
            setattr(self, name, _unpinned(getattr(torch, name)))

    def __getattr__(self, name):  # everything else is torch's own
        return getattr(torch, name)


def _tensor_itself(self, device=None):
    del device
    return self


def _fix(module) -> None:
    module.torch = _UnpinnedTorch()
    if not torch.cuda.is_available():
        torch.Tensor.pin_memory = _tensor_itself


def install() -> None:
    for target in TARGETS:
        after_import(target, _fix)
