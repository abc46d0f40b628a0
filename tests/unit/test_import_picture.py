"""The import picture: command-line tools on top, the library below them, never the reverse.

No module outside megarl/commands/ imports megarl.commands (the tools' validation lives in the
library, `megarl.models.checks`); megarl.launch.preflight is imported only by the entries that check a run
config (megarl/train.py, megarl/eval.py); megarl.common.errors (the error types both sides share) imports nothing of megarl.
A static scan (AST, function-level imports included); a failure names file:line."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "megarl"


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every megarl import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megarl"):
            out += [(node.lineno, node.module)]
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("megarl")]
    return out


def importers_of(target: str, skip: set) -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        if any(str(rel).startswith(s) for s in skip):
            continue
        found += [f"{rel}:{line}" for line, mod in imports(path) if mod == target or mod.startswith(target + ".")]
    return sorted(set(found))


def test_no_library_module_imports_the_command_line_tools():
    assert importers_of("megarl.commands", {"megarl/commands/"}) == []


def test_preflight_is_imported_only_by_the_entries_that_check_a_run_config():
    # megarl-train, and megarl-eval (the same fields checked the same way before it starts)
    assert sorted({f.split(":")[0] for f in importers_of("megarl.launch.preflight", {"megarl/launch/preflight.py"})}) == [
        "megarl/eval.py", "megarl/train.py"]


def test_the_shared_error_module_imports_nothing_of_megarl():
    assert imports(ROOT / "common" / "errors.py") == []


def test_the_scan_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from megarl.commands.conversion import check_hf\n")
    assert imports(f) == [(2, "megarl.commands.conversion"), (2, "megarl.commands.conversion.check_hf")]


@pytest.mark.slow  # a fresh interpreter importing torch / megatron-core: not in-process
def test_loading_a_config_imports_no_torch(tmp_path):
    """megarl.config (algo.* included), a recipe's load and validation, the megarl-train and
    megarl-launch entry modules, and preflight's checks of the SFT demo (model config, layout,
    tokenizer, every data record, run_dir) stay off torch (~1.2 s of imports): a command line that
    stops at bad input exits in a fraction of a second. A fresh interpreter, so nothing is imported yet."""
    import os
    import subprocess
    import sys

    code = ("import sys, megarl.config, megarl.train, megarl.launch.plan\n"
            "from megarl.config import load_config\n"
            "for recipe in ('tiny_grpo', 'tiny_sft', 'tiny_moe_grpo', 'qwen3-30b-a3b-gsm8k'):\n"
            "    cfg = load_config(f'configs/{recipe}.yaml', ['algo.advantage=rloo'])\n"
            "    cfg.algo.build()\n"
            "from megarl.launch.preflight import check_inputs\n"
            f"check_inputs(load_config('configs/tiny_sft.yaml', ['train.run_dir={tmp_path}/run']))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent,
                         env={**os.environ, "PYTHONPATH": str(ROOT.parent)}, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[-2000:]


def _fresh(code: str) -> str:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent,
                         env={**os.environ, "PYTHONPATH": str(ROOT.parent)}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.slow  # a fresh interpreter importing torch / megatron-core: not in-process
def test_the_rollout_manager_imports_no_torch(tmp_path):
    """The manager process (its module and a manager built from the demo config) stays off torch:
    it listens ~1.8 s sooner, while the trainer imports megatron-core."""
    code = ("import sys\n"
            "from megarl.config import load_config\n"
            "from megarl.rollout.manager import ManagerSpec, RolloutManager\n"
            "from megarl.rollout.probe import check_wire\n"
            f"cfg = load_config('configs/tiny_grpo.yaml', ['train.run_dir={tmp_path}/run'])\n"
            "check_wire(cfg)\n"
            "RolloutManager(ManagerSpec.from_config(cfg)).close()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))\n")
    assert _fresh(code) == "[]"


def test_the_lazy_algo_package_exports_what_it_lists():
    """megarl.algo loads its names on first use; each listed name resolves to the object of the
    module that defines it."""
    import importlib

    import megarl.algo as algo
    from megarl.algo import choices, losses

    assert len(algo.__all__) == len(set(algo.__all__)) == 49  # the names the eager package exported (+ shape_and_filter)
    for name in algo.__all__:
        module = f"megarl.algo.{algo._MODULE_OF[name]}"
        obj = getattr(algo, name)
        assert obj is getattr(importlib.import_module(module), name)
        assert obj.__module__ == module, (name, obj.__module__)  # listed under the module defining it
    assert losses.PolicyLossKind is choices.PolicyLossKind  # the math modules re-use the torch-free enums
    try:
        algo.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
