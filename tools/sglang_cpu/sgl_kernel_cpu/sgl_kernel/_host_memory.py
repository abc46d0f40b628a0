"""One fix to SGLang 0.5.23's CPU path, applied when SGLang imports this stand-in package.

With ``--enable-return-routed-experts`` SGLang keeps the routes of every KV slot in a host buffer
(``state_capturer.base.BaseHostCache``) allocated through
``mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS[device]``. For ``device == "cpu"`` that is
``alloc_with_host_register``, which pins the buffer with ``cudaHostRegister`` and so dies on a
machine without CUDA, at start-up::

    File ".../sglang/srt/mem_cache/pool_host/common.py", line 147, in _cuda_host_register
        cudart = torch.cuda.cudart()
    RuntimeError: Found no NVIDIA driver on your system. ...

Pinning only speeds up copies to a GPU; on the CPU engine the buffer is ordinary memory. So the
``"cpu"`` entry becomes the same allocation without the registration (SGLang's own
``HostTensorAllocator``, an mmap'd tensor). Nothing else of SGLang is changed.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "sglang.srt.mem_cache.pool_host.common"


def alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """``alloc_with_host_register`` without ``cudaHostRegister`` (``pin_memory`` has no meaning here)."""
    del pin_memory, registration_granularity_bytes
    return allocator.allocate(dims, dtype=dtype, device=device)


def _fix(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned


class _AfterImport(importlib.abc.MetaPathFinder):
    """Applies `_fix` to TARGET right after it executes, in whichever order SGLang imports things."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real spec, then stay out of the way
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _fix(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if TARGET in sys.modules:
        _fix(sys.modules[TARGET])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
