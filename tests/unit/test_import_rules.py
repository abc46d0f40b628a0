"""The three programs and their shared floor, as rules over the import graph.

    trainer ranks (megarl-train)      rollout manager               inference servers (megarl-server)
    trainer/ weights/ models/         rollout/ rewards/ tools/      server/
    checkpoint/ mcore/
              \\                            |                             /
               `---------------- protocol/ (the shared floor) ---------'
                    neutral: config/, data/, algo/, launch/; under everything: common/

1. The floor (`megarl.protocol`) imports nothing of megarl but itself, and of the rest only the
   standard library, numpy and torch (safetensors too, inside `tensor_wire`: torch's tensor file
   format, loaded on first use).
2. The server imports, of megarl, only itself, the floor and `megarl.common` (the generic helpers:
   errors, command line, net, signals, the one tokenizer loader the manager uses too).
3. The trainer side imports nothing of the manager's packages (nor of the server).
4. The manager's packages import nothing of the trainer side (nor of the server).
5. Rules 2-4 hold for everything a program reaches, not only what it names: an import of a
   neutral module counts with all that module imports, and importing ``a.b.c`` runs ``a`` and
   ``a.b``'s ``__init__`` too.
6. No import circle between modules, nor between packages.
7. `megarl.common` (under everything) imports nothing of megarl but itself.

A static scan (`ast`): module-level and function-level imports alike, relative ones resolved.
A failure names file:line and the chain that reached the forbidden module."""
import ast
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
ROOT = REPO / "megarl"

FLOOR = ("megarl.protocol",)
SERVER = ("megarl.server",)
MANAGER = ("megarl.rollout", "megarl.rewards", "megarl.tools")
TRAINER = ("megarl.trainer", "megarl.weights", "megarl.models", "megarl.checkpoint", "megarl.mcore")
SERVER_MAY_USE = FLOOR + SERVER + ("megarl.common",)
FLOOR_THIRD_PARTY = {"numpy", "torch", "safetensors"}


def under(mod: str, rooms) -> bool:
    return any(mod == r or mod.startswith(r + ".") for r in rooms)


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth; ``from m import x`` gives m and,
    when m.x is a module of megarl, m.x."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names if f"{mod}.{a.name}" in MODULES]
    return out


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
GRAPH = {m: imports(p) for m, p in MODULES.items()}


def runs(mod: str) -> list[str]:
    """The megarl modules an import of ``mod`` executes: its packages' __init__s and itself."""
    parts = mod.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in MODULES]


def where(mod: str, line: int) -> str:
    return f"{MODULES[mod].relative_to(REPO)}:{line}"


def reached(start: str, stop_at) -> dict:
    """{module: chain of file:line that reached it} for every megarl module ``start`` reaches,
    not walking further into modules for which ``stop_at`` is true (they are reported, not followed)."""
    seen, todo = {start: []}, [start]
    while todo:
        m = todo.pop()
        for line, target in GRAPH[m]:
            for t in runs(target):
                if t not in seen:
                    seen[t] = seen[m] + [f"{where(m, line)} -> {t}"]
                    if not stop_at(t):
                        todo.append(t)
    return seen


def violations(programs, allowed) -> list[str]:
    out = []
    for m in MODULES:
        if not under(m, programs):
            continue
        for t, chain in reached(m, lambda t: not allowed(t)).items():
            if t.startswith("megarl") and not allowed(t):
                out.append(" ; ".join(chain))
    return sorted(set(out))


def test_the_floor_stands_on_the_standard_library_numpy_and_torch():
    bad = []
    for m in MODULES:
        if under(m, FLOOR):
            for line, target in GRAPH[m]:
                top = target.split(".")[0]
                if top == "megarl" and not under(target, FLOOR):
                    bad.append(f"{where(m, line)}: {target}")
                elif top != "megarl" and top not in sys.stdlib_module_names and top not in FLOOR_THIRD_PARTY:
                    bad.append(f"{where(m, line)}: {target}")
    assert bad == []


def test_the_server_imports_only_the_floor_and_generic_helpers():
    assert violations(SERVER, lambda t: under(t, SERVER_MAY_USE) or t == "megarl") == []


def test_the_trainer_side_imports_nothing_of_the_manager_or_the_server():
    assert violations(TRAINER, lambda t: not under(t, MANAGER + SERVER)) == []


def test_the_manager_imports_nothing_of_the_trainer_side_or_the_server():
    assert violations(MANAGER, lambda t: not under(t, TRAINER + SERVER)) == []


def test_the_generic_helpers_import_only_each_other():
    common = ("megarl.common",)
    assert violations(common, lambda t: under(t, common) or t == "megarl") == []


def circles(edges: dict, hop) -> list[str]:
    """Every circle of the directed graph ``edges`` found by a depth-first walk, as its hops."""
    found, state = [], {}

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                loop = stack[stack.index(t):] + [t]
                found.append(" -> ".join(hop(a, b) for a, b in zip(loop, loop[1:])))
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    return found


def first_line(a: str, b: str) -> str:
    return where(a, next(ln for ln, x in GRAPH[a] if b in runs(x)))


def test_no_import_circle():
    """A circle of modules (any import, at any depth) is reported as its file:line hops. A module's
    own packages do not count: their __init__ is running already when it is imported."""
    edges = {m: {t for _, target in GRAPH[m] for t in runs(target) if not (m + ".").startswith(t + ".")}
             for m in MODULES}
    assert circles(edges, first_line) == []


def room(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


def test_no_circle_between_packages():
    """The packages of megarl (megarl.trainer, megarl.rollout, ...; a root module is its own) form
    floors: no two import each other, directly or around a circle."""
    edges, why = {}, {}
    for m in MODULES:
        edges.setdefault(room(m), set())
        for line, target in GRAPH[m]:
            for t in runs(target):
                if room(t) not in (room(m), "megarl"):
                    edges[room(m)].add(room(t))
                    why.setdefault((room(m), room(t)), where(m, line))
    assert circles(edges, lambda a, b: f"{a} ({why[a, b]}) -> {b}") == []


def test_the_scan_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    src = tmp_path / "megarl" / "trainer" / "m.py"
    src.parent.mkdir(parents=True)
    src.write_text("def g():\n    from megarl.rollout.client import RolloutClient\n\nfrom ..protocol import wire\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert sorted(imports(src)) == [(2, "megarl.rollout.client"), (4, "megarl.protocol"), (4, "megarl.protocol.wire")]


def test_a_violation_names_the_file_line_and_the_chain(monkeypatch):
    graph = dict(GRAPH, **{"megarl.trainer.actor": [(7, "megarl.config")], "megarl.config": [(9, "megarl.rollout.client")]})
    monkeypatch.setattr(sys.modules[__name__], "GRAPH", graph)
    found = violations(("megarl.trainer.actor",), lambda t: not under(t, MANAGER))
    assert "megarl/trainer/actor.py:7 -> megarl.config ; megarl/config/__init__.py:9 -> megarl.rollout" in found
