"""Helpers for the torchrun tier: real megatron-core over gloo on CPU, several ranks per test."""
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int, *args, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs tests/dist/<script> under torchrun on loopback; fails the test with the tail of the
    output if any rank fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(HERE, script), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {script} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-6000:]}")
    return proc


def start_server(model_dir: str, log_path: str, extra=()) -> tuple[str, subprocess.Popen]:
    """A real megarl CPU rollout server on a free loopback port; waits for /health."""
    import time
    import urllib.request

    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "megarl.rollout.server", "--model", model_dir,
                             "--port", str(port), *extra], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early; log: {open(log_path).read()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return url, proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server not ready in 60 s; log: {open(log_path).read()[-2000:]}")
