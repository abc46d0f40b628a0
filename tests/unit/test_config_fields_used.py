"""Every config field is read by the code path it names, or it does not exist.

A field no code reads is a silent lie to the user (they set it, nothing changes). This test reads
megarl/ (outside the modules that only declare and validate the config) with `ast` and counts a
field as read only through a qualified read of its own section:

    cfg.rollout.temperature              the section reached from a config (`cfg`, `self.cfg`, ...)
    r = cfg.rollout; r.temperature       a name bound to a section (also `r, d = cfg.rollout, ...`)
    f(cfg.checkpoint) ... def f(c): c.x  a parameter that receives a section (by position/keyword)
    getattr(cfg.rollout, "temperature")
    r.staleness                          a property of the section: the fields it reads count
    def f(m: ModelConfig): m.seed        a name annotated with a section's class
    spec.model.seed                      a holder: a class with fields annotated with section
                                         classes (`model: ModelConfig`), reached through a name
                                         annotated with it, a call `Holder(...)` /
                                         `Holder.from_config(...)`, or `self.x` set from one
                                         (looked up in the method's class and its bases)
    spec.task.rollout.seed               a holder of holders (a field annotated with a holder)

Job scripts in launch/ count where they name `section.field` in full (`--get`). So
`model.temperature` on some other object, or `.dtype` of a tensor, reads nothing. A scratch
field added to a section is reported (shown below). `algo.*` fields are consumed by
`AlgoConfig.build()` into the typed spec the loss code uses, so the build method must read each.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from pathlib import Path
from typing import Optional

from megarl.algo.config import AlgoConfig
from megarl.config import Config

ROOT = Path(__file__).resolve().parents[2] / "megarl"
LAUNCH = ROOT.parent / "launch"  # job scripts read fields with `megarl-launch --get section.field`
DECLARING = {*(ROOT / "config").glob("*.py"), ROOT / "fields.py", ROOT / "algo" / "config.py"}
CONFIG_NAMES = {"cfg", "config"}  # names (and attributes, e.g. self.cfg) that hold a whole Config
CFG = "<config>"
OWNER = "<class>"  # env key: the class a scope is a method (or closure) of


def _ann(ann) -> str:
    """``ModelConfig`` of an annotation ``ModelConfig`` / ``"ModelConfig"`` / ``Optional[ModelConfig]``."""
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        ann = ast.parse(ann.value, mode="eval").body
    if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "Optional":
        ann = ann.slice
    return getattr(ann, "id", getattr(ann, "attr", ""))


def section_classes() -> dict[str, type]:
    return {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}


def property_reads(cls) -> dict[str, set[str]]:
    """{property: fields of `cls` it reads as self.<field>}."""
    out = {}
    for name, p in vars(cls).items():
        if isinstance(p, property):
            tree = ast.parse(textwrap.dedent(inspect.getsource(p.fget)))
            out[name] = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                         and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return out


def _walk_own(scope: ast.AST):
    """The nodes of a scope: a module without its functions and classes (their own scopes), a
    function with its nested functions (closures)."""
    if not isinstance(scope, ast.Module):
        yield from ast.walk(scope)
        return
    todo = list(scope.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


class Reads:
    """Qualified reads of section attributes in a set of modules (see the module docstring)."""

    def __init__(self, sections: dict[str, set[str]], trees: list[ast.AST]):
        self.sections, self.trees = sections, trees
        self.funcs: dict[str, list[tuple[ast.AST, int]]] = {}  # name -> (def, leading params to skip)
        defs = (ast.FunctionDef, ast.AsyncFunctionDef)
        for tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):  # Class(...) calls __init__
                    for item in node.body:
                        if isinstance(item, defs) and item.name == "__init__":
                            self.funcs.setdefault(node.name, []).append((item, 1))
                if isinstance(node, defs):
                    first = (node.args.posonlyargs + node.args.args)[:1]
                    skip = 1 if first and first[0].arg in ("self", "cls") else 0
                    self.funcs.setdefault(node.name, []).append((node, skip))
        self.params: dict[int, dict[str, str]] = {}  # id(def) -> {param: section or CFG}
        self.self_attrs: dict[str, str] = {}
        # holders: classes whose annotated fields hold sections; kinds "holder:<class>"
        types = {cls.__name__: s for s, cls in section_classes().items()}
        self.types = types
        self.holders: dict[str, dict[str, str]] = {}
        self.bases: dict[str, list[str]] = {}
        self.owner: dict[int, str] = {}  # id(def) -> the class whose method (or closure) it is
        self.class_attrs: dict[tuple[str, str], str] = {}  # (class, attr) -> kind of self.attr
        fields: dict[str, dict[str, str]] = {}  # class -> {field: annotation's class name}
        for tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.bases[node.name] = [getattr(b, "id", getattr(b, "attr", "")) for b in node.bases]
                    held = {i.target.id: types[_ann(i.annotation)] for i in node.body
                            if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)
                            and _ann(i.annotation) in types}
                    if held:
                        self.holders[node.name] = held
                    fields[node.name] = {i.target.id: _ann(i.annotation) for i in node.body
                                         if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)}
                    for item in node.body:
                        if isinstance(item, defs):
                            for sub in ast.walk(item):
                                if isinstance(sub, defs):
                                    self.owner[id(sub)] = node.name
        # holders of holders (`spec.task.rollout`: a field annotated with a holder class), to a fixed point
        while True:
            nested = {(c, f): f"holder:{a}" for c, fs in fields.items() for f, a in fs.items()
                      if a in self.holders and f not in self.holders.get(c, {})}
            if not nested:
                break
            for (c, f), kind in nested.items():
                self.holders.setdefault(c, {})[f] = kind

    def annotated(self, ann) -> Optional[str]:
        """The kind a name annotated ``ann`` holds: a section, a holder, or None."""
        name = _ann(ann)
        if name in self.types:
            return self.types[name]
        return f"holder:{name}" if name in self.holders else None

    def self_attr(self, cls: Optional[str], attr: str) -> Optional[str]:
        """``self.attr`` in a method of ``cls`` (set there or in a base class)."""
        if cls is None:
            return self.self_attrs.get(attr)
        seen = set()
        while cls and cls not in seen:
            seen.add(cls)
            if (cls, attr) in self.class_attrs:
                return self.class_attrs[(cls, attr)]
            cls = next((b for b in self.bases.get(cls, []) if b in self.bases), None)
        return None

    def resolve(self, e: ast.AST, env: dict[str, str]):
        """CFG for a whole config, a section name, "holder:<class>", or None."""
        if isinstance(e, ast.Name):
            return env.get(e.id) or (CFG if e.id in CONFIG_NAMES else None)
        if isinstance(e, ast.Attribute):
            if e.attr in CONFIG_NAMES:
                return CFG
            if isinstance(e.value, ast.Name) and e.value.id == "self":
                return self.self_attr(env.get(OWNER), e.attr)
            base = self.resolve(e.value, env)
            if base == CFG and e.attr in self.sections:
                return e.attr
            if base and base.startswith("holder:"):
                return self.holders[base[7:]].get(e.attr)
            return None
        if isinstance(e, ast.Call):
            func = e.func  # Holder(...), Holder.from_config(...)
            if isinstance(func, ast.Name) and func.id in self.holders:
                return f"holder:{func.id}"
            if isinstance(func, ast.Attribute) and func.attr == "from_config" \
                    and getattr(func.value, "id", None) in self.holders:
                return f"holder:{func.value.id}"
        if isinstance(e, ast.Call) and e.args:  # dataclasses.replace(cfg.model, ...), critic_config(cfg)
            name = e.func.attr if isinstance(e.func, ast.Attribute) else getattr(e.func, "id", "")
            if name in ("replace", "critic_config"):
                return self.resolve(e.args[0], env)
        return None

    def scope_env(self, scope: ast.AST) -> dict[str, str]:
        env = dict(self.params.get(id(scope), {}))
        if id(scope) in self.owner:
            env[OWNER] = self.owner[id(scope)]
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for a in scope.args.posonlyargs + scope.args.args + scope.args.kwonlyargs:
                kind = self.annotated(a.annotation) if a.annotation is not None else None
                if kind and a.arg not in env:
                    env[a.arg] = kind
        for _ in range(2):  # aliases of aliases
            for node in self.nodes(scope):
                if not isinstance(node, ast.Assign):
                    continue
                for target in node.targets:
                    pairs = [(target, node.value)]
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs = list(zip(target.elts, node.value.elts))
                    for t, v in pairs:
                        kind = self.resolve(v, env)
                        if kind and isinstance(t, ast.Name):
                            env[t.id] = kind
                        elif kind and isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                                and t.value.id == "self":
                            self.self_attrs[t.attr] = kind
                            if OWNER in env:
                                self.class_attrs[(env[OWNER], t.attr)] = kind
        return env

    def scopes(self):
        if not hasattr(self, "_scopes"):
            self._scopes = [s for tree in self.trees for s in [tree, *(
                n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]]
            self._nodes = {id(s): list(_walk_own(s)) for s in self._scopes}
        return self._scopes

    def nodes(self, scope: ast.AST) -> list[ast.AST]:
        return self._nodes[id(scope)]

    def bind_calls(self, scope: ast.AST, env: dict[str, str]) -> bool:
        """Binds parameters of called functions that receive a config or section; True if new."""
        changed = False
        for call in (n for n in self.nodes(scope) if isinstance(n, ast.Call)):
            name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
            for fn, skip in self.funcs.get(name, ()):
                names = [a.arg for a in fn.args.posonlyargs + fn.args.args][skip:]
                given = list(zip(names, call.args)) + [(k.arg, k.value) for k in call.keywords if k.arg]
                for param, arg in given:
                    kind = self.resolve(arg, env)
                    # first binding wins: a parameter passed different kinds at different calls
                    # (a Config here, a holder there) must not flip forever
                    if kind and param not in self.params.setdefault(id(fn), {}):
                        self.params[id(fn)][param] = kind
                        changed = True
        return changed

    def run(self) -> set[str]:
        while True:  # to a fixed point: a parameter bound here may pass the section on
            changed = False
            for scope in self.scopes():
                changed |= self.bind_calls(scope, self.scope_env(scope))
            if not changed:
                break
        found = set()
        for scope in self.scopes():
            env = self.scope_env(scope)
            for n in self.nodes(scope):
                target, attr = None, None
                if isinstance(n, ast.Attribute):
                    target, attr = n.value, n.attr
                elif isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr" and len(n.args) >= 2 \
                        and isinstance(n.args[1], ast.Constant):
                    target, attr = n.args[0], n.args[1].value
                section = self.resolve(target, env) if target is not None else None
                if section in self.sections and attr in self.sections[section]:
                    found.add(f"{section}.{attr}")
        return found


def unread_fields(extra: dict[str, set[str]] = {}, trees=None) -> list[str]:
    """Fields (and `extra` scratch fields) of every section but algo that no code reads."""
    classes = section_classes()
    props = {s: property_reads(cls) for s, cls in classes.items()}
    fields = {s: {f.name for f in dataclasses.fields(cls)} | extra.get(s, set()) for s, cls in classes.items()}
    attrs = {s: fields[s] | set(props[s]) for s in classes}
    if trees is None:
        trees = [ast.parse(p.read_text()) for p in sorted(ROOT.rglob("*.py")) if p not in DECLARING]
    read = Reads(attrs, trees).run()
    scripts = " ".join(p.read_text() for p in LAUNCH.iterdir() if p.is_file())
    read |= {f"{s}.{f}" for s in fields for f in fields[s] if re.search(rf"\b{s}\.{f}\b", scripts)}
    for s in classes:  # a read property reads the fields it uses
        for prop, uses in props[s].items():
            if f"{s}.{prop}" in read:
                read |= {f"{s}.{u}" for u in uses}
    return sorted(f"{s}.{f}" for s in classes if s != "algo" for f in fields[s] if f"{s}.{f}" not in read)


def test_every_config_field_is_read():
    assert unread_fields() == []


def test_a_scratch_unread_field_is_caught():
    # two scratch fields: one named like nothing else, one named like an attribute megarl reads on
    # many other objects (`.dtype` of tensors and models): neither is a read of reward.*
    assert unread_fields({"rollout": {"scratch_unread"}, "reward": {"dtype"}}) == [
        "reward.dtype", "rollout.scratch_unread"]


def test_qualified_reads_are_resolved():
    src = textwrap.dedent("""
        def build(cfg):
            r, t = cfg.rollout, cfg.train
            use(r.temperature, t.steps)
            helper(cfg.checkpoint, step=1)
            return getattr(cfg.rollout, "top_p"), cfg.rollout.staleness

        def helper(c, step):
            return c.keep_last

        def unrelated(model, rollout):
            return model.seed, rollout.group_size, model.rollout.max_new_tokens
    """)
    unread = set(unread_fields(trees=[ast.parse(src)]))
    for name in ("rollout.temperature", "train.steps", "checkpoint.keep_last", "rollout.top_p",
                 "rollout.max_staleness", "rollout.staleness_threshold"):  # the last two: the property
        assert name not in unread, name
    for name in ("model.seed", "rollout.group_size", "rollout.max_new_tokens"):
        assert name in unread, name


def test_holders_and_annotations_are_resolved():
    src = textwrap.dedent("""
        @dataclass(frozen=True)
        class PartSpec:
            model: ModelConfig
            weights: "WeightSyncConfig"
            steps: int

            @classmethod
            def from_config(cls, cfg):
                return cls(cfg.model, cfg.weights, 3)

        class Part:
            def __init__(self, spec: PartSpec, moe: MoEConfig):
                self.spec = spec
                use(moe.aux_loss_coeff)

            def run(self):
                def inner():
                    return self.spec.weights.bucket_mb
                return self.spec.model.seed, inner()

        class Other:
            def __init__(self, spec):
                self.spec = spec

            def run(self):
                return self.spec.model.dtype, self.spec.weights.dtype

        def build(cfg):
            return PartSpec.from_config(cfg).model.hf_path

        @dataclass(frozen=True)
        class OuterSpec:
            part: "PartSpec"
            rollout: Optional[RolloutConfig] = None

        def outer(spec: OuterSpec, loose):
            w = spec.part.weights
            return w.keep_versions, spec.rollout.top_p, loose.part.weights.pause_mode
    """)
    unread = set(unread_fields(trees=[ast.parse(src)]))
    for name in ("model.seed", "weights.bucket_mb", "moe.aux_loss_coeff", "model.hf_path",
                 "weights.keep_versions", "rollout.top_p"):  # the last two: a holder of holders
        assert name not in unread, name
    # Other's self.spec is not a holder, nor is an unannotated parameter
    for name in ("model.dtype", "weights.dtype", "weights.pause_mode"):
        assert name in unread, name


def test_every_algo_field_reaches_the_spec():
    build = ast.parse(textwrap.dedent(inspect.getsource(AlgoConfig.build)))
    used = {n.attr for n in ast.walk(build) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
    unread = [f.name for f in dataclasses.fields(AlgoConfig) if f.name not in used]
    assert not unread, f"algo fields AlgoConfig.build() ignores: {unread}"
