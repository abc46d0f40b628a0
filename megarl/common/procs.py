"""Helpers for a parent process and the children it starts: which CPUs each side gets, and what a
child wrote to its (appended) log since it started, so a failed start quotes its own last line.
Used by the trainer (starting the rollout manager) and the manager (starting local servers)."""
from __future__ import annotations

import os
from typing import Optional


def split_cpus(server_cpus) -> tuple[Optional[set[int]], Optional[set[int]]]:
    """(server CPUs, trainer CPUs) for ``rollout.server_cpus``: the given ids that this process may
    use, and the rest of them; (None, None) - no pinning, with a note - when either side would be
    left without a CPU (e.g. a 1-CPU machine running the 2-core demo config)."""
    allowed = os.sched_getaffinity(0)
    server = set(server_cpus) & allowed
    trainer = allowed - server
    if not server or not trainer:
        print(f"[rollout] rollout.server_cpus={list(server_cpus)}: this process may use CPUs "
              f"{sorted(allowed)}, not enough to give servers and trainer their own; not pinning", flush=True)
        return None, None
    return server, trainer


def log_size(path: str) -> int:
    """Bytes in ``path`` now (0 when absent): where the lines of a process started next begin in
    its log, which is appended to (a restart, a resumed run in the same run_dir)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def last_line_since(path: str, offset: int) -> str:
    """The last non-empty line written to ``path`` after byte ``offset`` (`log_size` at the
    process's start): what this process said last, never a line of an earlier run."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else "(nothing logged)"
