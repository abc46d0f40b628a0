"""Helpers of the GPU tier: the skip condition, tiny random HF checkpoints, a `megarl-server`
child process on a chosen device, and `run_worker` (gpu_worker.py in a fresh process: Megatron's
parallel state is per process). Test modules import them from here (``from gpu_support import``);
tests/gpu is put on sys.path by its conftest."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_worker.py")

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"needs a CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False)")


def child_env() -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)  # each worker is its own one-rank job on a free port
    return env


def make_hf(path: str, seed: int, std: float = 0.05) -> str:
    """A tiny random Llama (4 layers, hidden 64, vocab 128) in HF format."""
    from megarl.models.random_hf import tiny_config, write_random_hf

    return write_random_hf(str(path), tiny_config(), seed=seed, std=std)


def run_worker(*args: str, timeout: float = 600.0, env_extra: dict | None = None) -> dict:
    """gpu_worker.py ARGS in a child process; its last stdout line, parsed as JSON."""
    env = dict(child_env(), **(env_extra or {}))
    proc = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"gpu_worker {args[0]} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Server:
    """``python -m megarl.server`` on a free loopback port (the device and dtype as given)."""

    def __init__(self, model_dir: str, *flags: str):
        from megarl.common.net import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "megarl.server", "--model", model_dir, "--port", str(self.port),
               "--log-level", "WARNING", *flags]
        self.proc = subprocess.Popen(cmd, env=child_env())

    def wait_ready(self, timeout: float = 120.0) -> "Server":
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"megarl-server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"megarl-server on {self.url} not ready in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
