"""Outside megarl/mcore/, megarl uses only megatron-core's public API: no import from a module not in
megarl.mcore.pins.PUBLIC_MODULES, no private (underscore) name, no assignment onto a megatron-core
module or class. A static scan (AST) of every module; a failure names file:line."""
import ast
import importlib.util
import pathlib
import re

from megarl.mcore.pins import PUBLIC_MODULES

ROOT = pathlib.Path(__file__).resolve().parents[2] / "megarl"


MEGATRON_DIRS = [pathlib.Path(d) for d in importlib.util.find_spec("megatron").submodule_search_locations]


def _is_module(dotted: str) -> bool:
    """Whether ``megatron.x.y`` is a module or package of the installed megatron (no import)."""
    rel = pathlib.Path(*dotted.split(".")[1:])
    return any((d / rel).is_dir() or (d / rel).with_suffix(".py").is_file() for d in MEGATRON_DIRS)


def _reexported(package: str, name: str) -> bool:
    """Whether the package's ``__init__`` imports ``name`` (a function named like its module, e.g.
    ``megatron.core.distributed.finalize_model_grads``, is then the public name)."""
    rel = pathlib.Path(*package.split(".")[1:], "__init__.py")
    for d in MEGATRON_DIRS:
        if (d / rel).is_file():
            return re.search(rf"import[^\n]*\b{name}\b", (d / rel).read_text()) is not None
    return False


def _root_name(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def violations(source: str, where: str) -> list[str]:
    """file:line: what, for each use of megatron-core beyond its public API in ``source``."""
    tree = ast.parse(source)
    aliases, out = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "megatron":
            if node.module not in PUBLIC_MODULES:
                out.append(f"{where}:{node.lineno}: imports from {node.module} (not public megatron-core)")
            for a in node.names:
                if a.name.startswith("_"):
                    out.append(f"{where}:{node.lineno}: imports private {node.module}.{a.name}")
                sub = f"{node.module}.{a.name}"
                if _is_module(sub) and sub not in PUBLIC_MODULES and not _reexported(node.module, a.name):
                    out.append(f"{where}:{node.lineno}: imports {sub} (not public megatron-core)")
                aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "megatron":
                    if a.name not in PUBLIC_MODULES and a.name != "megatron":
                        out.append(f"{where}:{node.lineno}: imports {a.name} (not public megatron-core)")
                    aliases.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and _root_name(node) in aliases:
            out.append(f"{where}:{node.lineno}: uses private {ast.unparse(node)}")
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, (ast.Attribute, ast.Subscript)) and _root_name(t) in aliases:
                out.append(f"{where}:{node.lineno}: patches megatron-core attribute {ast.unparse(t)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and _root_name(node.args[0]) in aliases:
            out.append(f"{where}:{node.lineno}: patches megatron-core attribute via {node.func.id}")
    return sorted(set(out), key=lambda v: (int(v.split(":")[1]), v))


def test_no_module_outside_megarl_mcore_uses_megatron_internals():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if (ROOT / "mcore") in path.parents:
            continue
        found += violations(path.read_text(), str(path.relative_to(ROOT.parent)))
    assert not found, "move these into megarl/mcore/ (and pin them):\n  " + "\n  ".join(found)


def test_megarl_mcore_is_where_the_internals_are():
    # the scan sees what it guards against: the package that is allowed to is full of it
    found = []
    for path in sorted((ROOT / "mcore").rglob("*.py")):
        found += violations(path.read_text(), path.name)
    assert any("cpu.py" in f and "patches" in f for f in found), found
    assert any("checkpoint.py" in f and "private" in f for f in found), found
    assert any("sdpa.py" in f and "not public" in f for f in found), found


def test_the_scan_names_file_and_line_of_each_kind():
    src = ("from megatron.core.tensor_parallel import random as mrandom\n"
           "from megatron.core import tensor_parallel\n"
           "from megatron.core.optimizer.clip_grads import clip_grad_norm_fp32\n"
           "from megatron.core.tensor_parallel.random import _get_cuda_rng_state\n"
           "import megatron.core.transformer.moe.moe_utils as mu\n"
           "def f():\n"
           "    mrandom._set_cuda_rng_state = None\n"
           "    mu.te_general_gemm = None\n"
           "    setattr(tensor_parallel, 'x', 1)\n"
           "    return tensor_parallel._private\n")
    assert set(violations(src, "m.py")) == {
        "m.py:1: imports megatron.core.tensor_parallel.random (not public megatron-core)",
        "m.py:3: imports from megatron.core.optimizer.clip_grads (not public megatron-core)",
        "m.py:4: imports from megatron.core.tensor_parallel.random (not public megatron-core)",
        "m.py:4: imports private megatron.core.tensor_parallel.random._get_cuda_rng_state",
        "m.py:5: imports megatron.core.transformer.moe.moe_utils (not public megatron-core)",
        "m.py:7: patches megatron-core attribute mrandom._set_cuda_rng_state",
        "m.py:7: uses private mrandom._set_cuda_rng_state",
        "m.py:8: patches megatron-core attribute mu.te_general_gemm",
        "m.py:9: patches megatron-core attribute via setattr",
        "m.py:10: uses private tensor_parallel._private",
    }
    assert violations("from megatron.core import parallel_state as mpu\nmpu.get_tensor_model_parallel_rank()\n",
                      "ok.py") == []


def test_architecture_doc_shows_the_pin_table():
    from megarl.mcore.pins import markdown_table

    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    begin = doc.index("<!-- mcore-pins:begin")
    shown = doc[doc.index("\n", begin) + 1:doc.index("<!-- mcore-pins:end -->")].strip()
    assert shown == markdown_table(), "docs/architecture.md's megatron-core table is stale: paste markdown_table()"
