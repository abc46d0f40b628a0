"""A local rollout cluster: megarl CPU servers as child processes on free loopback ports.

The one local launcher of megarl-server: used when ``rollout.servers`` is empty (the embedded CPU
demo), by make_tiny_model's evaluation, and by tests and benchmarks. The servers die with the
trainer (killed on exit, and on SIGTERM through the parent's cleanup).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from typing import Optional

from megarl.net import LOOPBACK, free_port, http_url


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


def start_server(model_dir: str, log_path: str, extra=(), ready_timeout_s: float = 60.0,
                 cpus=None) -> tuple[str, subprocess.Popen]:
    """Starts ``megarl-server`` on a free loopback port (pinned to ``cpus`` when given) and waits
    for ``/health``."""
    port = free_port()
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "megarl.rollout.server", "--model", model_dir,
                             "--port", str(port), *map(str, extra)], stdout=log, stderr=subprocess.STDOUT)
    if cpus:  # before the child starts its torch threads (they inherit the mask)
        os.sched_setaffinity(proc.pid, cpus)
    url = http_url(LOOPBACK, port)
    deadline = time.time() + ready_timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"megarl-server exited early (log {log_path}): "
                               f"{open(log_path).read()[-1500:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return url, proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"megarl-server not ready in {ready_timeout_s:.0f} s (log {log_path})")


class LocalCluster:
    """``with LocalCluster(model_dir, n=2, log_dir=...) as urls: ...``"""

    def __init__(self, model_dir: str, n: int, log_dir: str, extra=(), cpus=None):
        self.model_dir, self.n, self.log_dir, self.extra, self.cpus = model_dir, n, log_dir, extra, cpus
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def __enter__(self) -> list[str]:
        try:
            for i in range(self.n):
                url, proc = start_server(self.model_dir, os.path.join(self.log_dir, f"server{i}.log"),
                                         self.extra, cpus=self.cpus)
                self.urls.append(url)
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise
        return self.urls

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(timeout=10)
        self.procs.clear()

    def __exit__(self, *exc) -> None:
        self.close()
