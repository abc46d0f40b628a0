"""The one config loader: strict YAML, overrides merged field by field, coercion of each value to
its field's type, which source a value came from, and output paths that belong to the run.

    cfg = load_config("configs/tiny_sft.yaml", ["train.steps=20", "parallel.tp=2"])

- A key given twice in one YAML mapping (a recipe file or an override value) is an error naming
  the file (or override), the key and both lines; PyYAML alone keeps the last one silently.
- ``section={a: 1}`` on the command line sets those fields of the section and keeps the others
  (the same as ``section.a=1``); it never replaces the whole section with defaults.
- `given` records where each ``section.field`` was set: 0 default, 1 the recipe, 2 the command
  line. Two fields that are alternatives of one knob (`max_staleness` / `staleness_threshold`)
  are settled by it: the one set by the later source wins, the same source setting both is an
  error (RolloutConfig.validate).
- Relative output paths (`OUTPUT_PATHS`) are under ``train.run_dir``; an output inside another
  run's directory (one holding that run's resolved config.yaml) is refused, so a run with an
  overridden run_dir never writes into a recipe's fixed directory of another run.
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from typing import Any, Optional

import yaml

from megarl.config.root import Config
from megarl.config.rollout import RolloutConfig
from megarl.common.errors import ConfigError


# (section, field) of every path a run writes to; relative ones are resolved under train.run_dir
OUTPUT_PATHS = (("checkpoint", "save_dir"), ("checkpoint", "hf_export_dir"), ("weights", "disk_dir"),
                ("eval", "out_dir"))


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, line: int, first: int):
        super().__init__(f"duplicate key {key!r} at line {line} (first at line {first})")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (merge keys ``<<`` excepted)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise _DuplicateKey(key, key_node.start_mark.line + 1, seen[key] + 1)
                    seen[key] = key_node.start_mark.line
                except TypeError:  # an unhashable key: SafeLoader reports it
                    continue
        return super().construct_mapping(node, deep=deep)


def _one_line(e: yaml.YAMLError) -> str:
    return str(e) if isinstance(e, _DuplicateKey) else f"not valid YAML: {str(e).splitlines()[0]}"


def read_yaml(path: str) -> dict:
    """The mapping of a YAML recipe; ConfigError naming the file on a missing file, bad YAML, a
    duplicate key or a non-mapping top level."""
    if not os.path.isfile(path):
        raise ConfigError(f"config: file not found: {path}")
    with open(path) as f:
        try:
            raw = yaml.load(f, Loader=_StrictLoader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {path}: {_one_line(e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config: {path} must hold a mapping at the top level")
    return raw


def parse_value(text: str, item: str) -> Any:
    """An override's value, parsed as YAML (``""`` stays the empty string)."""
    if text == "":
        return ""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: {_one_line(e)}") from None


def _section_type(root: type, parts: list[str]):
    """The dataclass type at ``parts`` below ``root``, or None when it is not a section."""
    tp = root
    for p in parts:
        if not dataclasses.is_dataclass(tp):
            return None
        tp = typing.get_type_hints(tp).get(p)
    return tp if dataclasses.is_dataclass(tp) else None


def apply_overrides(raw: dict, overrides, root: type) -> dict[str, int]:
    """Applies ``a.b=value`` overrides to ``raw`` in order; a mapping given for a whole section is
    merged into it key by key. Returns the dotted keys set here (level 2)."""
    given: dict[str, int] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override: expected a.b=value, got {item!r}")
        parts = key.split(".")
        node = raw
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {p} is not a section")
        value, last = parse_value(text, item), parts[-1]
        section = _section_type(root, parts) is not None
        if section and not isinstance(value, dict):
            # here, not at from_dict: a later ``key.x=...`` would find no section and be blamed
            raise ConfigError(f"{key}: expected a mapping, got {value!r} (a section: {key}.field=value "
                              "sets one field)")
        if section:
            target = node.setdefault(last, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{key}: expected a mapping in the recipe, got {target!r}")
            target.update(value)  # field by field: the section's other fields stay as they were
            given.update({f"{key}.{k}": 2 for k in value})
        else:
            node[last] = value
            given[key] = 2
    return given


def recipe_keys(raw: dict, prefix: str = "") -> dict[str, int]:
    """Every dotted ``section.field`` key of a recipe mapping (level 1)."""
    out = {}
    for k, v in raw.items():
        if isinstance(v, dict) and not prefix:
            out.update(recipe_keys(v, f"{k}."))
        else:
            out[f"{prefix}{k}"] = 1
    return out


def resolve_outputs(cfg) -> None:
    """Relative output paths (`OUTPUT_PATHS`) become absolute paths under train.run_dir."""
    run_dir = cfg.train.run_dir
    for section, name in OUTPUT_PATHS:
        value = getattr(getattr(cfg, section), name)
        if value and not os.path.isabs(value):
            setattr(getattr(cfg, section), name, os.path.abspath(os.path.join(run_dir, value)))


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def _is_run_dir(d: str) -> bool:
    """Whether ``d`` holds a megarl run's resolved config (megarl.config.save_config)."""
    path = os.path.join(d, "config.yaml")
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            saved = yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(saved, dict) and {"train", "checkpoint", "rollout"} <= set(saved)


def check_outputs(cfg) -> None:
    """Each output path is this run's: not the run dir itself or above it, and not inside the
    directory of another run."""
    run_dir = os.path.realpath(cfg.train.run_dir)
    for section, name in OUTPUT_PATHS:
        value = getattr(getattr(cfg, section), name)
        if not value:
            continue
        path = os.path.realpath(value.split("{step}")[0])
        if _inside(run_dir, path):
            raise ConfigError(f"{section}.{name}: {value} is or contains train.run_dir={cfg.train.run_dir}; "
                              "writing it would replace the run's own files")
        if _inside(path, run_dir):
            continue
        d = path
        while True:
            if _is_run_dir(d):
                raise ConfigError(f"{section}.{name}: {value} is inside the directory of another run ({d}); "
                                  f"this run's train.run_dir is {cfg.train.run_dir} (use a relative path: it "
                                  "resolves under train.run_dir)")
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent


# ----------------------------------------------------------------------------- loading

def load_config(path: Optional[str], overrides: list[str] = (), validate: bool = True) -> Config:
    """Reads a YAML recipe, applies ``a.b=c`` overrides (values parsed as YAML; a mapping for a
    whole section is merged field by field), settles alternatives by source, validates."""
    raw = read_yaml(path) if path else {}
    given = recipe_keys(raw)
    given.update(apply_overrides(raw, overrides, Config))
    cfg = from_dict(Config, raw, prefix="")
    _settle_staleness(cfg.rollout, given)
    resolve_outputs(cfg)
    if validate:
        cfg.validate()
        check_outputs(cfg)  # looks at the disk (another run's directory): the loader's, not validate's
        read_api_key_file(cfg.rollout)
    return cfg


def read_api_key_file(r: RolloutConfig) -> None:
    """rollout.api_key from rollout.api_key_file (the user's own file, readable by nobody else)."""
    if not r.api_key_file:
        return
    from megarl.protocol.handshake import read_secret_file

    try:
        key = read_secret_file(r.api_key_file, "rollout.api_key_file").decode()
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(str(e) if isinstance(e, ValueError) else
                          f"rollout.api_key_file: {r.api_key_file!r} is not text") from None
    if r.api_key and r.api_key != key:
        raise ConfigError("rollout.api_key_file: holds another key than rollout.api_key; set one of them")
    r.api_key = key


def _settle_staleness(r: RolloutConfig, given: dict[str, int]) -> None:
    """max_staleness (AReaL) and staleness_threshold (verl) are two spellings of one bound: when
    both are non-zero, the one set by the later source (default < recipe < command line) wins
    and the other becomes 0; set by the same source they must agree (RolloutConfig.validate)."""
    if not (r.max_staleness and r.staleness_threshold) or r.max_staleness == r.staleness_threshold:
        return
    ms, st = given.get("rollout.max_staleness", 0), given.get("rollout.staleness_threshold", 0)
    if st > ms:
        r.max_staleness = 0
    elif ms > st:
        r.staleness_threshold = 0.0


def from_dict(cls, data: Any, prefix: str):
    """Builds dataclass ``cls`` from a mapping, checking keys and types against annotations."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(tp, value, name):
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, prefix=name + ".")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (value == "auto" and args[0] in (int, bool)):
            return None  # an optional count's or switch's "auto" is its unset value: derived by the code
        return _coerce(args[0], value, name)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [_coerce(item_tp, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads 1e-5 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        if not math.isfinite(number):  # nan/inf would pass every range check (nan < 0 is False)
            raise ConfigError(f"{name}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `server_args=[--threads,2]`, `api_key=1234`: YAML reads numbers
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    return value


def save_config(cfg: Config, run_dir: str) -> str:
    """Writes the resolved config to ``<run_dir>/config.yaml`` (atomically) and returns the path.
    It may hold keys (rollout.api_key): a run directory made here is the user's alone (0700), and
    the file is created exclusively, mode 0600, without following a link planted at its name."""
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    tmp = path + ".tmp"
    try:
        os.unlink(tmp)  # a crashed save's leftover (or a planted link: removed, not followed)
    except FileNotFoundError:
        pass
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w") as f:
        data = dataclasses.asdict(cfg)
        if cfg.rollout.api_key_file:  # the key stays in its file; loading this config reads it again
            data["rollout"]["api_key"] = ""
        yaml.safe_dump(data, f, sort_keys=False)
    os.replace(tmp, path)
    return path
