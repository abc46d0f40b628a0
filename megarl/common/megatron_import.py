"""megatron-core's first import without two costs megarl never uses (9-10 s -> 4-6 s a process on CPU).

``import megatron.core`` runs the whole package ``__init__``, and two parts of it cost more than
the rest together on the 2-core machine, although a training process never calls them:

* ``megatron.core.jit`` binds ``jit_fuser = torch.compile`` and ~40 fused bias/activation kernels
  (``megatron.core.fusions.*``) are decorated with it at import. ``torch.compile(fn)`` compiles
  nothing until ``fn`` is called, but it loads torch's compiler stack (dynamo, inductor: ~5 s)
  on the spot.
* its inference engine and timers import ``wandb`` when installed (~1 s) for hooks megarl does
  not use; megarl's own W&B sink (megarl/trainer/metrics.py) imports it where it is wanted.

:func:`install` (run by ``import megarl``) puts a finder on ``sys.meta_path`` that acts on the
first import of ``megatron.core`` in the process only, wherever it comes from (the trainer, the
CPU shim, a conversion tool, a test worker). While that package ``__init__`` runs,
``torch.compile`` is `_deferred_compile`: the same ``torch.compile`` with the same options on the
function's first call, if one ever comes (what ``torch.compile`` does itself, minus the import),
and ``wandb`` reads as not installed. Both are restored when the import returns and the finder
removes itself. The kernels keep the deferred compile for the life of the process: on GPU with
fusions on, the first fused call compiles, as it would have.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading

_lock = threading.Lock()
_finder = None


def _deferred_compile(fn=None, **options):
    """``torch.compile`` that compiles on the first call instead of at decoration, without
    importing torch's compiler stack until then."""
    if fn is None:  # @torch.compile(...) with options
        return lambda f: _deferred_compile(f, **options)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


class _Loader(importlib.abc.Loader):
    """megatron.core's own loader; its ``exec_module`` runs with the stand-ins in place."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):  # resource readers, is_package, ... of the real loader
        return getattr(self._real, name)

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        import torch

        compile_, hide_wandb = torch.compile, "wandb" not in sys.modules
        torch.compile = _deferred_compile
        if hide_wandb:
            sys.modules["wandb"] = None  # `import wandb` raises ImportError: megatron takes its no-wandb path
        try:
            self._real.exec_module(module)
        finally:
            torch.compile = compile_
            if hide_wandb and sys.modules.get("wandb", 0) is None:
                del sys.modules["wandb"]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core":
            return None
        uninstall()  # one import only
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Adds the finder unless megatron.core is already imported (then there is nothing to save)."""
    global _finder
    with _lock:
        if _finder is None and "megatron.core" not in sys.modules:
            _finder = _Finder()
            sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    global _finder
    with _lock:
        if _finder is not None:
            if _finder in sys.meta_path:
                sys.meta_path.remove(_finder)
            _finder = None
