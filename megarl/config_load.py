"""Reading a config without silent surprises: strict YAML, overrides merged field by field, which
source a value came from, and output paths that belong to the run.

- A key given twice in one YAML mapping (a recipe file or an override value) is an error naming
  the file (or override), the key and both lines; PyYAML alone keeps the last one silently.
- ``section={a: 1}`` on the command line sets those fields of the section and keeps the others
  (the same as ``section.a=1``); it never replaces the whole section with defaults.
- `given` records where each ``section.field`` was set: 0 default, 1 the recipe, 2 the command
  line. Two fields that are alternatives of one knob (`max_staleness` / `staleness_threshold`)
  are settled by it: the one set by the later source wins, the same source setting both is an
  error (megarl.config).
- Relative output paths (`OUTPUT_PATHS`) are under ``train.run_dir``; an output inside another
  run's directory (one holding that run's resolved config.yaml) is refused, so a run with an
  overridden run_dir never writes into a recipe's fixed directory of another run.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad configuration value; the message starts with the dotted field name."""


# (section, field) of every path a run writes to; relative ones are resolved under train.run_dir
OUTPUT_PATHS = (("checkpoint", "save_dir"), ("checkpoint", "hf_export_dir"), ("weights", "disk_dir"))


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
        if _section_type(root, parts) is not None and isinstance(value, dict):
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
