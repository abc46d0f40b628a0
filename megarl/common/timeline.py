"""A run timeline: every process records named spans (generate, train step, prox recompute, push,
wait, eval) to its own JSONL file under ``<run_dir>/timeline/``; `tools/plot_timeline.py` draws
them as a Gantt chart showing where rollout and training overlap and where each waits.

One line per span: {"name", "lane", "start", "end", ...attrs}. ``start``/``end`` are wall-clock
seconds (time.time) so the files of different processes line up; lanes group spans in the chart
(a trainer rank, a rollout server). Writes are line-buffered and thread-safe: the controller's
event loop and the trainer thread record into the same file.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Iterator, Optional


class Timeline:
    def __init__(self, path: Optional[str], lane: str = "trainer"):
        self.lane = lane
        self._lock = threading.Lock()
        self._file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", buffering=1)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def record(self, name: str, start: float, end: float, lane: Optional[str] = None, **attrs) -> None:
        if self._file is None:
            return
        line = json.dumps({"name": name, "lane": lane or self.lane, "start": round(start, 6),
                           "end": round(end, 6), **attrs})
        with self._lock:
            self._file.write(line + "\n")

    @contextlib.contextmanager
    def span(self, name: str, lane: Optional[str] = None, **attrs) -> Iterator[None]:
        t0 = time.time()
        try:
            yield
        finally:
            self.record(name, t0, time.time(), lane, **attrs)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_timeline(directory: str) -> list[dict]:
    """All spans of all processes of a run, sorted by start."""
    spans = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                spans += [json.loads(line) for line in f if line.strip()]
    return sorted(spans, key=lambda s: s["start"])
