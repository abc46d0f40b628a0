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

from ._after_import import after_import

TARGET = "sglang.srt.mem_cache.pool_host.common"


def alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """``alloc_with_host_register`` without ``cudaHostRegister`` (``pin_memory`` has no meaning here)."""
    del pin_memory, registration_granularity_bytes
    return allocator.allocate(dims, dtype=dtype, device=device)


def _fix(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned


def install() -> None:
    after_import(TARGET, _fix)
