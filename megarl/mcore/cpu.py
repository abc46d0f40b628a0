"""The CUDA->CPU shim: megatron-core on CPU-only machines (tests, the CPU demo).

megatron-core assumes CUDA in many small places (``device="cuda"``, ``Tensor.cuda()``,
``torch.cuda.*`` RNG calls, a ``'torch.cuda.FloatTensor'`` assertion in grad clipping, three
spots of the MoE layers). :func:`install_cpu_shim` redirects those to the CPU. It is installed only
when CUDA is unavailable, once per process, and never on GPU runs. The megatron-core names it
replaces are pinned in `megarl.mcore.pins.CPU_PINS`.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from megarl.common import compat

_SHIM_INSTALLED = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device=cuda``/integer devices to CPU, makes ``Tensor.cuda()`` a no-op, drops
    ``pin_memory=True`` (no pinned allocator without CUDA; context parallelism's RoPE slicing asks
    for it) and reports float CPU tensors under their CUDA type name (megatron's grad clipping
    asserts it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if (func is torch.Tensor.to and len(args) > 1
                and not isinstance(args[1], (torch.dtype, torch.Tensor)) and _is_cuda_device(args[1])):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class _CpuEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _CpuStream(_CpuEvent):
    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _CpuEvent()


def install_cpu_shim() -> None:
    """Make megatron-core run on CPU. Idempotent; a no-op when CUDA is available."""
    global _SHIM_INSTALLED
    if _SHIM_INSTALLED or compat.HAVE_CUDA:
        return
    _SHIM_INSTALLED = True
    mode = _CudaToCpuMode()
    mode.__enter__()  # process-wide: stays active for the life of the process

    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.current_stream = lambda *a, **k: _CpuStream()
    cuda.default_stream = lambda *a, **k: _CpuStream()
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, clone=False, **k: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state())
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _patch_moe_for_cpu()


def _patch_moe_for_cpu() -> None:
    """megatron-core 0.16.1's MoE layers (router, alltoall dispatcher, SequentialMLP) on CPU over
    gloo; three spots assume CUDA or TE:

    * ``moe_utils.te_general_gemm`` is only defined when TE imports, yet the router's gating
      function tests it unconditionally (NameError): define it as None (the torch.mm path).
    * ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` converts only CUDA tensors to numpy, so on
      CPU the all-to-all split sizes stay tensors, which ``all_to_all_single`` rejects: convert
      CPU tensors too.
    * ``_AllToAll.backward`` allocates on ``torch.cuda.current_device()``; the autograd engine runs
      it without the process-wide TorchFunctionMode: run it inside the mode.
    """
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    to_cpu = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    backward = mappings._AllToAll.backward

    def all_to_all_backward(ctx, *grad_output):
        with _CudaToCpuMode():
            return backward(ctx, *grad_output)

    mappings._AllToAll.backward = staticmethod(all_to_all_backward)
