"""Runs a fix on an SGLang module right after the module executes, in whichever order SGLang
imports things (the fixes to its CPU path in `_host_memory` and `_lora_cpu`)."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, fix: Callable):
        self.target, self.fix = target, fix

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # find the real spec, then stay out of the way
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.fix(module)

        spec.loader.exec_module = exec_module
        return spec


def after_import(target: str, fix: Callable) -> None:
    """``fix(module)`` once ``target`` is imported (now, if it already is)."""
    if target in sys.modules:
        fix(sys.modules[target])
    elif not any(isinstance(f, _AfterImport) and f.target == target for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(target, fix))
