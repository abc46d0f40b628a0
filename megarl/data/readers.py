"""Record readers for prompt/SFT files: JSONL (one object a line) and Parquet (one row a record).

Both yield ``(location, record)`` so every later error can name ``file:line`` (JSONL) or
``file:row N`` (Parquet, 1-based). Parquet needs the optional `pyarrow` (``megarl[data]``); the
file is read whole (prompt sets are small next to a model). Nested fields - e.g. verl-style
``{"reward_model": {"ground_truth": ...}}`` - are addressed with dotted keys by `get_field`.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from megarl.compat import require

__all__ = ["read_jsonl", "read_parquet", "read_records", "get_field", "has_field"]

_MISSING = object()


def read_jsonl(path: str, required_keys: Sequence[str] = ()) -> list[tuple[int, dict]]:
    """(line number, record) for each non-blank line; bad JSON or a missing key names file:line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            _check_keys(f"{path}:{lineno}", row, required_keys)
            rows.append((lineno, row))
    return rows


def read_parquet(path: str, required_keys: Sequence[str] = ()) -> list[tuple[int, dict]]:
    """(row number from 1, record) for each row; list/struct columns come back as lists/dicts."""
    pq = require("pyarrow.parquet", f"reading the Parquet file {path}")
    rows = []
    for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        _check_keys(f"{path}:row {i}", row, required_keys)
        rows.append((i, row))
    return rows


def read_records(path: str, required_keys: Sequence[str] = ()) -> list[tuple[str, dict]]:
    """(location, record) from a ``.parquet`` file, else JSONL; location is "file:line" / "file:row N"."""
    if path.endswith((".parquet", ".pq")):
        return [(f"{path}:row {i}", r) for i, r in read_parquet(path, required_keys)]
    return [(f"{path}:{i}", r) for i, r in read_jsonl(path, required_keys)]


def _lookup(row: dict, key: str) -> Any:
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def get_field(row: dict, key: str, *default: Any) -> Any:
    """row["a"]["b"] for key "a.b" (a literal "a.b" key wins); KeyError unless a default is given."""
    value = _lookup(row, key)
    if value is _MISSING:
        if default:
            return default[0]
        raise KeyError(key)
    return value


def has_field(row: dict, key: str) -> bool:
    return _lookup(row, key) is not _MISSING


def _check_keys(where: str, row: dict, required: Sequence[str]) -> None:
    missing = [k for k in required if not has_field(row, k)]
    if missing:
        raise KeyError(f"{where}: missing key(s) {missing}; has {sorted(row)}")
