"""Outside megarl/mcore/, megarl uses only megatron-core's public API: no import from a module not in
megarl.mcore.pins.PUBLIC_MODULES (nor one reached through attributes or import_module), no private
(underscore) name, no assignment, setattr, mock.patch or other reflection onto a megatron-core
module or class. A static scan (AST) of every module; a failure names file:line. Attributes of
megatron *instances* (``model._postprocess``) are beyond a static scan: see `violations`."""
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


_REFLECT = {"getattr", "setattr", "delattr", "hasattr", "vars"}  # builtins given an object and a name
_PATCH = re.compile(r"(^|\.)(patch(\.(object|dict|multiple))?|setattr|delattr|__setattr__|__delattr__)$")
_IMPORT = re.compile(r"(^|\.)(import_module|__import__)$")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _deep_module(dotted: str, start: int) -> str | None:
    """The longest module in ``dotted`` (a megatron name, ``a.b.c``) past its first ``start`` parts
    that is neither public nor re-exported by its package under the same name, or None."""
    parts = dotted.split(".")
    for n in range(len(parts), start, -1):
        mod = ".".join(parts[:n])
        if _is_module(mod):
            parent = ".".join(parts[:n - 1])
            if mod in PUBLIC_MODULES or _reexported(parent, parts[n - 1]):
                return None
            return mod
    return None


class _Scan:
    """The megatron names bound in one module and what each expression of it resolves to."""

    def __init__(self):
        self.names: dict[str, str] = {}  # local name -> the megatron name it holds

    def megatron(self, node) -> tuple[str, int] | None:
        """(dotted megatron name, parts bound by an import) of an attribute chain rooted at an alias
        or at ``import_module("megatron...")``; None for anything else."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.names:
            base = self.names[node.id]
        elif (isinstance(node, ast.Call) and _IMPORT.search(ast.unparse(node.func)) and node.args
              and _megatron_string(node.args[0])):
            base = node.args[0].value
        else:
            return None
        return ".".join([base] + attrs[::-1]), len(base.split("."))

    def rooted(self, node) -> bool:
        """Whether ``node`` is an attribute / subscript chain rooted at a megatron name."""
        while isinstance(node, ast.Subscript):
            node = node.value
        return self.megatron(node) is not None


def _megatron_string(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and \
        (node.value == "megatron" or node.value.startswith("megatron."))


def violations(source: str, where: str) -> list[str]:
    """file:line: what, for each use of megatron-core beyond its public API in ``source``.

    Seen: imports (of a non-public module, of a private name); attribute chains rooted at a name
    bound to megatron (by an import, by ``x = alias.attr`` or by ``import_module("megatron...")``)
    that reach a private name or a non-public module; assignments and deletions through such a
    chain; getattr/setattr/delattr/hasattr/vars, ``object.__setattr__``, ``mock.patch*`` and
    ``monkeypatch.setattr`` given such a chain or a "megatron." string. Not seen: attributes of
    *instances* (``model._postprocess``, ``model.decoder.layers``): an instance of a megatron class
    is not statically known, so those are covered only by keeping such code in megarl/mcore/ (and
    its pins) by review."""
    tree = ast.parse(source)
    scan, out = _Scan(), []

    def say(node, what):
        out.append(f"{where}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "megatron":
            if node.module not in PUBLIC_MODULES:
                say(node, f"imports from {node.module} (not public megatron-core)")
            for a in node.names:
                if a.name.startswith("_"):
                    say(node, f"imports private {node.module}.{a.name}")
                sub = f"{node.module}.{a.name}"
                if _is_module(sub) and sub not in PUBLIC_MODULES and not _reexported(node.module, a.name):
                    say(node, f"imports {sub} (not public megatron-core)")
                scan.names[a.asname or a.name] = sub
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "megatron":
                    if a.name not in PUBLIC_MODULES and a.name != "megatron":
                        say(node, f"imports {a.name} (not public megatron-core)")
                    if a.asname:
                        scan.names[a.asname] = a.name
                    else:  # import megatron.core.x binds "megatron"
                        scan.names["megatron"] = "megatron"
    # x = alias.attr / x = import_module("megatron..."): x holds a megatron name too (chains of
    # such assignments followed to a fixed point; a name's first binding wins)
    assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and len(n.targets) == 1
               and isinstance(n.targets[0], ast.Name)]
    changed = True
    while changed:
        changed = False
        for n in assigns:
            hit = scan.megatron(n.value)
            if hit and n.targets[0].id not in scan.names:
                scan.names[n.targets[0].id] = hit[0]
                changed = True
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # not a whole chain

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _IMPORT.search(ast.unparse(node.func)) and node.args \
                and _megatron_string(node.args[0]) and node.args[0].value not in PUBLIC_MODULES | {"megatron"}:
            say(node, f"imports {node.args[0].value} (not public megatron-core)")
        if isinstance(node, ast.Attribute):
            hit = scan.megatron(node)
            if hit and _private(node.attr):
                say(node, f"uses private {ast.unparse(node)}")
            if hit and id(node) not in inner:
                deep = _deep_module(hit[0], hit[1])
                if deep:
                    say(node, f"reaches {deep} (not public megatron-core)")
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, (ast.Attribute, ast.Subscript)) and (scan.rooted(t) or _vars_of_megatron(scan, t)):
                say(node, f"patches megatron-core attribute {ast.unparse(t)}")
        if isinstance(node, ast.Call):
            _check_call(scan, node, say)
    return sorted(set(out), key=lambda v: (int(v.split(":")[1]), v))


def _vars_of_megatron(scan, node) -> bool:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" \
        and bool(node.args) and scan.rooted(node.args[0])


def _check_call(scan, node, say) -> None:
    """Reflection and patching calls whose object is a megatron name (see `violations`)."""
    func = ast.unparse(node.func)
    first = node.args[0] if node.args else None
    if first is None:
        return
    if isinstance(node.func, ast.Name) and func in _REFLECT:
        if not scan.rooted(first):
            return
        name = node.args[1] if len(node.args) > 1 else None
        if func in ("setattr", "delattr"):
            say(node, f"patches megatron-core attribute via {func}")
        elif func == "vars":
            say(node, "reads a megatron-core namespace via vars")
        elif not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            say(node, f"{func} of a computed name on {ast.unparse(first)}")
        elif _private(name.value):
            say(node, f"uses private {ast.unparse(first)}.{name.value} via {func}")
        else:
            hit = scan.megatron(first)
            deep = hit and _deep_module(f"{hit[0]}.{name.value}", hit[1])
            if deep:
                say(node, f"reaches {deep} (not public megatron-core) via {func}")
    elif _PATCH.search(func) and (scan.rooted(first) or _megatron_string(first)):
        say(node, f"patches megatron-core via {func}")


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


# Each: (source, {line: words every violation reported on that line contains}); the module's own
# imports are public, so every violation comes from the pattern itself.
_HEADER = ("import importlib\n"
           "from unittest import mock\n"
           "from megatron.core import tensor_parallel as tp\n"
           "from megatron.core import transformer\n"
           "from megatron.core.models.gpt import GPTModel\n")
_PATTERNS = {
    "import_module of a deep module, patched": (
        'importlib.import_module("megatron.core.tensor_parallel.random")._set_cuda_rng_state = None\n',
        {6: "megatron.core.tensor_parallel.random"}),
    "import_module of a public module, private attribute": (
        'importlib.import_module("megatron.core.tensor_parallel")._private\n', {6: "private"}),
    "a local alias of a deep module": (
        "r = tp.random\nr._set_cuda_rng_state = None\n",
        {6: "reaches megatron.core.tensor_parallel.random", 7: "r._set_cuda_rng_state"}),
    "getattr of a private name": ('getattr(tp, "_private")\n', {6: "private tp._private via getattr"}),
    "getattr of a computed name": ("getattr(tp, name)\n", {6: "computed name"}),
    "a deep module through attributes": (
        "transformer.moe.moe_utils.get_moe_layer_wise_logging_tracker()\n",
        {6: "reaches megatron.core.transformer.moe.moe_utils"}),
    "vars of a module": ('vars(tp)["_X"] = 1\n', {6: "vars"}),
    "mock.patch.object": ('mock.patch.object(tp, "split_tensor_along_last_dim")\n', {6: "mock.patch.object"}),
    "mock.patch of a dotted name": ('mock.patch("megatron.core.tensor_parallel.random._y")\n', {6: "mock.patch"}),
    "object.__setattr__": ('object.__setattr__(GPTModel, "forward", None)\n', {6: "object.__setattr__"}),
}


def test_the_scan_sees_reflection_patching_and_deep_chains():
    for what, (pattern, expected) in _PATTERNS.items():
        found = violations(_HEADER + pattern, "s.py")
        lines = {int(v.split(":")[1]) for v in found}
        assert lines == set(expected), (what, found)
        for v in found:
            assert expected[int(v.split(":")[1])] in v, (what, v)
    # the same shapes on public names, or on objects that are not megatron's, are fine
    ok = ("import os\n"
          "from unittest import mock\n"
          "from megatron.core import parallel_state as mpu\n"
          "from megatron.core import distributed\n"
          "f = mpu.get_tensor_model_parallel_rank\n"
          "f()\n"
          'getattr(mpu, "get_data_parallel_world_size")()\n'
          "distributed.finalize_model_grads\n"
          'setattr(os, "x", mpu)\n'
          'mock.patch.object(os, "getcwd")\n'
          'mock.patch("os.getcwd")\n'
          'importlib.import_module("megatron.core.parallel_state").get_data_parallel_rank()\n')
    assert violations(ok, "ok.py") == []
