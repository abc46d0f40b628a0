"""The import picture: command-line tools on top, the library below them, never the reverse.

No module outside megarl/tools_cli/ imports megarl.tools_cli (the tools' validation lives in the
library, `megarl.models.checks`); megarl.preflight is imported only by the megarl-train entry
(megarl/train.py); megarl.errors (the error types both sides share) imports nothing of megarl.
A static scan (AST, function-level imports included); a failure names file:line."""
import ast
import pathlib

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
    assert importers_of("megarl.tools_cli", {"megarl/tools_cli/"}) == []


def test_preflight_is_imported_only_by_the_train_entry():
    assert [f.split(":")[0] for f in importers_of("megarl.preflight", {"megarl/preflight.py"})] == [
        "megarl/train.py"]


def test_the_shared_error_module_imports_nothing_of_megarl():
    assert imports(ROOT / "errors.py") == []


def test_the_scan_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from megarl.tools_cli.conversion import check_hf\n")
    assert imports(f) == [(2, "megarl.tools_cli.conversion"), (2, "megarl.tools_cli.conversion.check_hf")]
