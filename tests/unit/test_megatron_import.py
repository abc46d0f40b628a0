"""megatron-core's first import without torch's compiler stack or wandb, wherever it comes from
(megarl/common/megatron_import.py, installed by `import megarl`)."""
import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys
import megarl, torch
real = torch.compile
import megatron.core.models.gpt  # no install_cpu_shim first: the trainer's own order
from megatron.core import jit
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
from megarl.common.megatron_import import _deferred_compile
out = {"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules,
       "wandb": "wandb" in sys.modules, "compile_restored": torch.compile is real,
       "kernel_deferred": (jit.jit_fuser is _deferred_compile,
                           bias_swiglu.__code__ is _deferred_compile(lambda: 0).__code__, bias_swiglu.__name__),
       "finder_gone": not any(type(f).__module__ == "megarl.common.megatron_import" for f in sys.meta_path)}
twice = _deferred_compile(lambda x: 2 * x + 1, backend="eager")
out["first_call"] = (twice(torch.ones(2)).tolist(), "torch._dynamo" in sys.modules)  # compiles now
import wandb  # megarl's own W&B sink imports it later: still importable
out["wandb_after"] = wandb.__name__
print(json.dumps(out))
"""


@pytest.mark.slow  # a fresh interpreter importing megatron-core
def test_megatron_imports_without_dynamo_inductor_or_wandb_and_puts_everything_back():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"dynamo": False, "inductor": False, "wandb": False, "compile_restored": True,
                   "kernel_deferred": [True, True, "bias_swiglu"], "finder_gone": True,
                   "first_call": [[3.0, 3.0], True], "wandb_after": "wandb"}
