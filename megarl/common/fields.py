"""Declared ranges of numeric config fields: the data that validation, the generated reference
(docs/configuration.md) and the generated range tests all read, so a bound is written once.

    steps: int = bounded(100, ge=1)
    top_p: float = bounded(1.0, gt=0, le=1)
    on_error_value: Optional[float] = bounded(None, unbounded="any finite reward")

`check_bounds(section, "rollout")` raises ``ValueError("rollout.top_p: must be > 0 and <= 1, got 5")``
for the first field outside its range (``None`` passes: optional fields are checked when set).
A numeric field either declares a range or says why it has none (``unbounded=``); a test holds
every section to that. Pure Python: imported by megarl.config and megarl.algo.config alike.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Any, Optional

_KEYS = ("ge", "gt", "le", "lt")


def bounded(default: Any, *, ge=None, gt=None, le=None, lt=None, unbounded: str = "",
            why: str = "") -> Any:
    """A dataclass field whose numeric value must satisfy the given bounds (``why``: appended to
    the error, e.g. why the bound exists). ``unbounded``: the reason a numeric field has no range."""
    meta = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if not meta and not unbounded:
        raise TypeError("bounded(): give a bound or say why the field is unbounded")
    if why:
        meta["why"] = why
    if unbounded:
        meta["unbounded"] = unbounded
    return dataclasses.field(default=default, metadata=meta)


def bounds(f: dataclasses.Field) -> dict:
    """The declared bounds of a field ({} when it declares none)."""
    return {k: f.metadata[k] for k in _KEYS if k in f.metadata}


def _fmt(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def range_text(f: dataclasses.Field) -> str:
    """``>= 1``, ``> 0 and <= 1``; empty without bounds."""
    ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return " and ".join(f"{ops[k]} {_fmt(v)}" for k, v in bounds(f).items())


def in_range(f: dataclasses.Field, value) -> bool:
    b = bounds(f)
    return not (("ge" in b and value < b["ge"]) or ("gt" in b and value <= b["gt"])
                or ("le" in b and value > b["le"]) or ("lt" in b and value >= b["lt"]))


def check_bounds(obj, prefix: str) -> None:
    """Raises ValueError("<prefix>.<field>: must be ..., got v") for the first declared field of
    dataclass ``obj`` whose value is not a finite number (an integer for int fields) in its
    range; None is skipped (optional fields are checked when set)."""
    for f, kind in numeric_fields(type(obj)):
        value = getattr(obj, f.name)
        if value is None:
            continue
        name = f"{prefix}.{f.name}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name}: expected a finite number, got {value!r}")
        if kind is int and not isinstance(value, int):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
        if not in_range(f, value):
            why = f.metadata.get("why")
            raise ValueError(f"{name}: must be {range_text(f)}, got {value}" + (f" ({why})" if why else ""))


@functools.lru_cache(maxsize=None)
def numeric_fields(cls) -> list[tuple[dataclasses.Field, type]]:
    """(field, int or float) for every int/float/Optional[int]/Optional[float] field of ``cls``."""
    import typing

    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        union = typing.get_origin(tp) in (typing.Union, types.UnionType)
        args = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
        if len(args) == 1 and args[0] in (int, float):
            out.append((f, args[0]))
    return out


def declared(f: dataclasses.Field) -> Optional[str]:
    """None when a numeric field declares a range or a reason for none; else what is missing."""
    return None if bounds(f) or f.metadata.get("unbounded") else f"{f.name}: no range declared"
