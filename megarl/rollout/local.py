"""A local rollout cluster: megarl CPU servers as child processes on free ports of one host.

The one local launcher of megarl-server: used when ``rollout.servers`` is empty (the embedded CPU
demo), by make_tiny_model's evaluation, and by tests and benchmarks. The servers bind to loopback,
or to the address every rank reached rank 0 by when the job spans nodes
(megarl.net.serving_host). They belong to the trainer: stop signals sent to the whole process
tree are ignored by them, they are killed when the trainer leaves the cluster's context, and the
kernel kills them if the trainer dies (megarl.signals.owned_child_setup).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

from megarl.net import free_port, http_url
from megarl.signals import owned_child_setup


def start_server(model_dir: str, log_path: str, extra=(), ready_timeout_s: float = 60.0,
                 host: str = "127.0.0.1") -> tuple[str, subprocess.Popen]:
    """Starts ``megarl-server`` on a free port of ``host`` and waits for ``/health``."""
    port = free_port(host)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "megarl.rollout.server", "--model", model_dir,
                             "--host", host, "--port", str(port), *map(str, extra)],
                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=owned_child_setup)
    url = http_url(host, port)
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

    def __init__(self, model_dir: str, n: int, log_dir: str, extra=(), host: str = "127.0.0.1"):
        self.model_dir, self.n, self.log_dir, self.extra, self.host = model_dir, n, log_dir, extra, host
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def __enter__(self) -> list[str]:
        try:
            for i in range(self.n):
                url, proc = start_server(self.model_dir, os.path.join(self.log_dir, f"server{i}.log"),
                                         self.extra, host=self.host)
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
