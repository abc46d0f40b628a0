"""SLURM hostlists, expanded strictly: ``gpu[01-03,07],cpu1`` -> gpu01 gpu02 gpu03 gpu07 cpu1.

Used by megarl-launch (--trainer-nodes, --rollout-nodes) and by rank discovery (the first host
of SLURM_STEP_NODELIST). A hostlist that cannot mean a set of hosts is a ValueError naming the
part at fault, never a guess: unbalanced or nested brackets, a range that is not two unsigned
integers or runs backwards (``gpu[05-01]``), an empty name, a character outside
``[A-Za-z0-9._-]``, a host listed twice, or more than `MAX_HOSTS` hosts. The size is computed
before anything is expanded, so a typo like ``gpu[0-9999999999]`` is refused at once instead of
filling memory. Several bracket groups in one name expand as their product (``r[1-2]n[1-3]``).
"""
from __future__ import annotations

import itertools
import re

MAX_HOSTS = 65536
_NAME = re.compile(r"[A-Za-z0-9._-]*")


def _split_items(text: str) -> list[str]:
    """Top-level comma-separated items (commas inside brackets belong to the range)."""
    items, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            if depth:
                raise ValueError(f"{text!r}: nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"{text!r}: ']' without '['")
            depth = 0
        elif ch == "," and not depth:
            items.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if depth:
        raise ValueError(f"{text!r}: unclosed '['")
    items.append("".join(cur))
    return items


def _ranges(item: str, body: str) -> list[tuple[int, int, int]]:
    """(lo, hi, zero-padded width) of each part of one bracket group."""
    out = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"{item!r}: [{body}] is not a list of numbers and ranges like 01-04")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"{item!r}: range {part} runs backwards")
        out.append((lo, hi, len(m.group(1))))
    return out


def _expand_item(item: str, budget: int) -> list[str]:
    pieces = re.split(r"\[([^\]]*)\]", item)  # text, bracket body, text, ...
    texts, groups = pieces[0::2], pieces[1::2]
    if not "".join(texts):
        raise ValueError(f"{item!r}: no name around the range")
    for t in texts:
        if not _NAME.fullmatch(t):
            raise ValueError(f"{item!r}: host names may hold letters, digits, '.', '_' and '-' only")
    ranges = [_ranges(item, g) for g in groups]
    size = 1
    for group in ranges:
        size *= sum(hi - lo + 1 for lo, hi, _ in group)
    if size > budget:
        raise ValueError(f"{item!r}: more than {MAX_HOSTS} hosts")
    numbers = [[f"{i:0{w}d}" for lo, hi, w in group for i in range(lo, hi + 1)] for group in ranges]
    out = []
    for combo in itertools.product(*numbers):
        out.append("".join(t + n for t, n in zip(texts, list(combo) + [""])))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """The hosts of a SLURM hostlist, in order; ValueError on anything malformed (module doc)."""
    hosts: list[str] = []
    for item in _split_items(nodelist.strip()):
        if not item.strip():
            raise ValueError(f"{nodelist!r}: empty host name")
        hosts += _expand_item(item.strip(), MAX_HOSTS - len(hosts))
    seen: set[str] = set()
    for h in hosts:
        if h in seen:
            raise ValueError(f"{nodelist!r}: {h} is listed twice")
        seen.add(h)
    return hosts
