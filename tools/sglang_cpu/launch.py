"""Run real SGLang (PyPI) as a CPU rollout server: the `sglang` test tier's server and a baseline
for megarl-server.

    python tools/sglang_cpu/launch.py --model DIR --port 30000 [-- extra sglang args]

The launch settings live in megarl/rollout/sglang_local.py (also what `megarl-train` uses with
``rollout.engine: sglang``). SGLang's kernels are CUDA-only, so on a CPU-only machine it runs with
what this directory carries:
its own virtualenv (``install.sh``, outside the repository), the stand-in ``sgl_kernel`` package
(``sgl_kernel_cpu/``) first on ``PYTHONPATH``, ``SGLANG_USE_CPU_ENGINE=1``, the torch-native
attention and sampling backends, fp32 (its bf16 logprobs are 0.03-0.08 off an fp32 reference) and
an explicit KV-cache size (its default takes a fraction of the host's memory). Start-up takes
40-80 s on two cores.

From Python (tests): ``SGLangServer(model_dir).start().wait_ready()`` ... ``.stop()``.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Optional

from megarl.rollout.sglang_local import (MEGARL_ARCHS, STANDIN_KERNEL, VERSION, installed_python,  # noqa: F401
                                         server_args, server_env, venv_dir)

HERE = os.path.dirname(os.path.abspath(__file__))
INSTALL_SH = os.path.join(HERE, "install.sh")


def ensure_installed(timeout_s: float = 1200.0) -> str:
    """Runs install.sh (a no-op when the venv is complete); returns the venv's python.
    Progress goes to this process's stderr."""
    out = subprocess.run(["bash", INSTALL_SH], stdout=subprocess.PIPE, text=True, timeout=timeout_s,
                         check=False)
    py = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0 or not os.path.isfile(py):
        raise RuntimeError(f"tools/sglang_cpu/install.sh failed (exit {out.returncode}); see its output above")
    return py


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SGLangServer:
    """One SGLang server subprocess on a free loopback port (its own process group)."""

    def __init__(self, model: str, *, port: Optional[int] = None, python: Optional[str] = None,
                 log_path: Optional[str] = None, **kw):
        self.model, self.port = model, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.python, self.log_path, self.kw = python, log_path, kw
        self.proc: Optional[subprocess.Popen] = None
        self.ready_s = 0.0

    def start(self) -> "SGLangServer":
        py = self.python or ensure_installed()
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen([py, *server_args(self.model, self.port, **self.kw)],
                                     env=server_env(python=py), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._t0 = time.monotonic()
        return self

    def wait_ready(self, timeout: float = 300.0) -> "SGLangServer":
        """Until /model_info answers (SGLang serves it only after its warm-up request)."""
        while time.monotonic() - self._t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang exited with {self.proc.returncode} during start-up{self._log_hint()}")
            try:
                req = urllib.request.Request(self.url + "/model_info")
                if self.kw.get("api_key"):
                    req.add_header("Authorization", f"Bearer {self.kw['api_key']}")
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        self.ready_s = time.monotonic() - self._t0
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"SGLang on {self.url} not ready in {timeout:.0f} s{self._log_hint()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the whole process group (SGLang forks a scheduler and a detokenizer)."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children that outlived the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _log_hint(self) -> str:
        if not self.log_path or not os.path.isfile(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        return f"; log tail ({self.log_path}):\n{tail}"


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after `--` go to sglang.launch_server unchanged.")
    p.add_argument("--model", required=True, help="HF model dir (config.json, safetensors, tokenizer)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV-cache size in tokens")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--api-key", default=None)
    p.add_argument("--all-models", action="store_true",
                   help=f"import every SGLang model module (default: only {', '.join(MEGARL_ARCHS)})")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    py = ensure_installed()
    args = server_args(a.model, a.port, a.host, max_total_tokens=a.max_total_tokens,
                       max_running_requests=a.max_running_requests, api_key=a.api_key, extra=extra)
    os.execve(py, [py, *args], server_env(python=py, models=None if a.all_models else MEGARL_ARCHS))


if __name__ == "__main__":
    main()
