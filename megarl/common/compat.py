"""Optional dependencies in one place.

megarl decides here, once, which implementation of each optional piece is used:

* Transformer Engine present *and* CUDA available -> TE layer spec; otherwise the local spec.
* apex is optional (megatron-core falls back to torch optimizers without it).
* sglang is optional (the rollout extra); the CPU rollout server needs nothing from it.
* pyarrow (Parquet prompt files), jinja2 (chat templates) and sympy (symbolic math answers) are
  the `data` extra, imported where used through :func:`require` (sympy is skipped when absent).

The CUDA->CPU shim that lets megatron-core run on CPU patches megatron-core internals, so it lives
in `megarl.mcore.cpu` (``install_cpu_shim``) with the other pinned internals.
"""
from __future__ import annotations

import importlib.util
import warnings

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
HAVE_APEX = importlib.util.find_spec("apex") is not None
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


def have_cuda() -> bool:
    """``compat.HAVE_CUDA``, decided on first use: asking torch imports it (~1.2 s), which the
    modules that only need `require` (data readers, chat templates) and a command line stopped by
    bad input do not pay."""
    if "HAVE_CUDA" not in globals():
        import torch

        globals()["HAVE_CUDA"] = torch.cuda.is_available()
    return globals()["HAVE_CUDA"]


def __getattr__(name: str):  # PEP 562: compat.HAVE_CUDA
    if name == "HAVE_CUDA":
        return have_cuda()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def use_transformer_engine() -> bool:
    """TE kernels need both the package and a GPU; anything else runs the local spec."""
    return HAVE_TE and have_cuda()


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
