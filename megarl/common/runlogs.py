"""The per-step logs a run appends to in its run directory, and their rollback on resume.

A resumed run repeats every step after its checkpoint, so everything it appended after that
checkpoint must go, or the repeated steps appear twice (two sets of generations for step 5, a
timeline with spans of work that was thrown away). One rule covers every such log, whatever its
rows look like: each checkpoint records the byte size of every per-step log at the moment it
was committed (``sizes``), and resuming cuts each log back to that size (``rollback``); a log
the checkpoint did not record did not exist then, so it is emptied.

    PER_STEP_LOGS    metrics.jsonl, generations.jsonl, eval_generations.jsonl,
                     failed_prompts.jsonl, timeline/*.jsonl (glob patterns under run_dir)

Logs are cut in place (``os.truncate``), not replaced: the metrics logger and the timeline hold
them open in append mode, and their next write lands right after the cut. A cut point that
falls inside a line (a row being appended by another thread at the commit) moves back to the
line's start, so a log never keeps a torn row. A log that grows per step must be listed here.

Standard library only: tools and tests import it without torch.
"""
from __future__ import annotations

import glob
import os
from typing import Optional

PER_STEP_LOGS = ("metrics.jsonl", "generations.jsonl", "eval_generations.jsonl",
                 "failed_prompts.jsonl", "timeline/*.jsonl")


def log_files(run_dir: str) -> list[str]:
    """Paths (relative to ``run_dir``) of the per-step logs that exist now."""
    found = set()
    for pattern in PER_STEP_LOGS:
        for path in glob.glob(os.path.join(glob.escape(run_dir), pattern)):
            if os.path.isfile(path):
                found.add(os.path.relpath(path, run_dir))
    return sorted(found)


def sizes(run_dir: str) -> dict[str, int]:
    """{relative path: size in bytes} of every per-step log of ``run_dir`` (recorded at a save)."""
    out = {}
    for rel in log_files(run_dir):
        try:
            out[rel] = os.path.getsize(os.path.join(run_dir, rel))
        except OSError:  # removed meanwhile
            continue
    return out


def _line_start(path: str, size: int) -> int:
    """``size``, or the start of the line it falls in when the byte before it is not a newline."""
    if size <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return size
        lo = max(0, size - (1 << 20))
        f.seek(lo)
        head = f.read(size - lo)
    cut = head.rfind(b"\n")
    return lo + cut + 1 if cut >= 0 else 0


def rollback(run_dir: str, recorded: Optional[dict[str, int]]) -> list[str]:
    """Cuts every per-step log of ``run_dir`` back to its ``recorded`` size (absent: emptied).
    ``recorded=None`` (a checkpoint from before sizes were recorded) leaves the logs alone.
    Returns ``"<log>: N bytes dropped"`` lines for what was cut."""
    if recorded is None:
        return []
    cut = []
    for rel in log_files(run_dir):
        path = os.path.join(run_dir, rel)
        size = os.path.getsize(path)
        keep = min(int(recorded.get(rel, 0)), size)
        keep = _line_start(path, keep)
        if keep < size:
            os.truncate(path, keep)
            cut.append(f"{rel}: {size - keep} bytes dropped")
    return cut
