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

from megarl.net import LOOPBACK, free_port, http_url


def start_server(model_dir: str, log_path: str, extra=(), ready_timeout_s: float = 60.0,
                 weights_roots=()) -> tuple[str, subprocess.Popen]:
    """Starts ``megarl-server`` on a free loopback port and waits for ``/health``.
    ``weights_roots``: where ``/update_weights_from_disk`` may read (the run's disk-transport
    directory); empty = the server's default (the model dir's parent)."""
    port = free_port()
    for root in weights_roots:
        os.makedirs(root, exist_ok=True)  # the server checks that each root exists
        extra = [*extra, "--weights-root", os.path.abspath(root)]
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "megarl.rollout.server", "--model", model_dir,
                             "--port", str(port), *map(str, extra)], stdout=log, stderr=subprocess.STDOUT)
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

    def __init__(self, model_dir: str, n: int, log_dir: str, extra=(), weights_roots=()):
        self.model_dir, self.n, self.log_dir, self.extra = model_dir, n, log_dir, extra
        self.weights_roots = weights_roots
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def __enter__(self) -> list[str]:
        try:
            for i in range(self.n):
                url, proc = start_server(self.model_dir, os.path.join(self.log_dir, f"server{i}.log"),
                                         self.extra, weights_roots=self.weights_roots)
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
