"""Optional dependencies in one place, and the CUDA->CPU shim for megatron-core.

megarl decides here, once, which implementation of each optional piece is used:

* Transformer Engine present *and* CUDA available -> TE layer spec; otherwise the local spec.
* apex is optional (megatron-core falls back to torch optimizers without it).
* sglang is optional (the rollout extra); the CPU rollout server needs nothing from it.
* pyarrow (Parquet prompt files), jinja2 (chat templates) and sympy (symbolic math answers) are
  the `data` extra, imported where used through :func:`require` (sympy is skipped when absent).

megatron-core assumes CUDA in many small places (``device="cuda"``, ``Tensor.cuda()``,
``torch.cuda.*`` RNG calls, a ``'torch.cuda.FloatTensor'`` assertion in grad clipping, three
spots of the MoE layers). On CPU-only machines :func:`install_cpu_shim` redirects those to the CPU. It is installed only when
CUDA is unavailable, once per process, and never on GPU runs.
"""
from __future__ import annotations

import contextlib
import importlib.util
import warnings

import torch
from torch.overrides import TorchFunctionMode

HAVE_CUDA = torch.cuda.is_available()
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
HAVE_APEX = importlib.util.find_spec("apex") is not None
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None

_SHIM_INSTALLED = False


def use_transformer_engine() -> bool:
    """TE kernels need both the package and a GPU; anything else runs the local spec."""
    return HAVE_TE and HAVE_CUDA


def _is_cuda_device(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device=cuda``/integer devices to CPU, makes ``Tensor.cuda()`` a no-op and
    reports float CPU tensors under their CUDA type name (megatron's grad clipping asserts it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
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
    if _SHIM_INSTALLED or HAVE_CUDA:
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


def quiet_megatron_warnings() -> None:
    """megatron-core warns at import about missing TE/apex; on CPU that is expected."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="megatron")


# ----------------------------------------------------------------------------- data/reward extras
# Pure-Python extras (`pip install "megarl[data]"`): imported where used, through `require`, so a
# missing one fails with the feature and the install line instead of a bare ImportError.
HAVE_PYARROW = importlib.util.find_spec("pyarrow") is not None
HAVE_JINJA2 = importlib.util.find_spec("jinja2") is not None
HAVE_SYMPY = importlib.util.find_spec("sympy") is not None


def require(module: str, purpose: str, extra: str = "data"):
    """Import an optional module or raise ImportError naming the feature and the install line."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{purpose} needs the optional package {module.split('.')[0]!r}: "
                          f"pip install \"megarl[{extra}]\" (or pip install {module.split('.')[0]})") from e
