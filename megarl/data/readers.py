"""Record readers for prompt/SFT files: JSONL (one object a line) and Parquet (one row a record).

Both yield ``(location, record)`` so every later error can name ``file:line`` (JSONL) or
``file:row N`` (Parquet, 1-based). ``iter_*`` stream (one line / one record batch at a time: what
preflight uses to check every record cheaply); ``read_*`` are their lists. Parquet needs the
optional `pyarrow` (``megarl[data]``). Nested fields - e.g. verl-style
``{"reward_model": {"ground_truth": ...}}`` - are addressed with dotted keys by `get_field`.
"""
from __future__ import annotations

import json
from typing import Any, Iterator, Sequence

from megarl.common.compat import require

__all__ = ["iter_jsonl", "iter_parquet", "iter_records", "read_jsonl", "read_parquet", "read_records",
           "get_field", "has_field", "text_field_problem"]

_MISSING = object()


def iter_jsonl(path: str, required_keys: Sequence[str] = ()) -> Iterator[tuple[int, dict]]:
    """(line number, record) for each non-blank line, one at a time; bad JSON or a missing key
    names file:line."""
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
            yield lineno, row


def read_jsonl(path: str, required_keys: Sequence[str] = ()) -> list[tuple[int, dict]]:
    """``iter_jsonl`` as a list."""
    return list(iter_jsonl(path, required_keys))


def iter_parquet(path: str, required_keys: Sequence[str] = ()) -> Iterator[tuple[int, dict]]:
    """(row number from 1, record) for each row, a record batch at a time; list/struct columns
    come back as lists/dicts."""
    pq = require("pyarrow.parquet", f"reading the Parquet file {path}")
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=4096)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors on a file that is not Parquet
        raise ValueError(f"{path}: cannot read as Parquet ({str(e).strip().splitlines()[0][:200]})") from None
    i = 0
    for batch in batches:
        for row in batch.to_pylist():
            i += 1
            _check_keys(f"{path}:row {i}", row, required_keys)
            yield i, row


def read_parquet(path: str, required_keys: Sequence[str] = ()) -> list[tuple[int, dict]]:
    """``iter_parquet`` as a list."""
    return list(iter_parquet(path, required_keys))


def iter_records(path: str, required_keys: Sequence[str] = ()) -> Iterator[tuple[str, dict]]:
    """(location, record) from a ``.parquet`` file, else JSONL, streamed; location is
    "file:line" / "file:row N"."""
    if path.endswith((".parquet", ".pq")):
        return ((f"{path}:row {i}", r) for i, r in iter_parquet(path, required_keys))
    return ((f"{path}:{i}", r) for i, r in iter_jsonl(path, required_keys))


def read_records(path: str, required_keys: Sequence[str] = ()) -> list[tuple[str, dict]]:
    """``iter_records`` as a list."""
    return list(iter_records(path, required_keys))


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


def text_field_problem(value: Any, *, chat: bool = False, empty_ok: bool = False) -> str | None:
    """Why ``value`` cannot be a prompt/response text (None when it can): a non-empty string
    (``empty_ok``: any string), or with ``chat`` a non-empty list of ``{"role": str, "content":
    ...}`` messages. The one rule the datasets and preflight share."""
    if isinstance(value, str):
        return None if empty_ok or value.strip() else "is empty"
    if chat and isinstance(value, (list, tuple)):
        if value and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                         for m in value):
            return None
        return "must be a list of {'role': str, 'content': ...} messages" if value else "is an empty chat"
    what = "null" if value is None else type(value).__name__
    return f"is {what}; expected a non-empty string" + (" or a list of chat messages" if chat else "")
