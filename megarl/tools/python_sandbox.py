"""The python tool: run a short model-written snippet in a resource-limited child process.

    {"name": "python", "arguments": {"code": "import math\\nmath.comb(10, 3)"}}  ->  "120"

The reply is the snippet's printed output followed by the value of its last expression (like a
REPL), or ``error: <Type>: <message>``. Each call is a fresh interpreter
(``python -I -S -X utf8 sandbox_runner.py``: isolated mode, no site-packages, empty environment,
an empty temporary working directory, its own session) with these limits:

    wall clock   `timeout_s` (default 5 s): the whole process group is killed
    CPU          `cpu_s` (default 2 s, RLIMIT_CPU: SIGXCPU, SIGKILL a second later)
    memory       `memory_mb` (default 256 MiB of address space, RLIMIT_AS: MemoryError)
    files        no writes (RLIMIT_FSIZE 0 and the audit hook), reads only from the stdlib
    processes    no fork/exec/spawn/subprocess (audit hook; RLIMIT_NPROC 0 for non-root users)
    network      no sockets (audit hook refuses socket creation and imports of socket/ssl/...)
    output       `max_output_chars` (default 2000) of stdout, and of the result, are kept

The child-side details are in `sandbox_runner.py`: an audit hook and rlimits, a guard against
accidents and casual misuse, not a boundary. The boundary is `isolation` (default ``bwrap``): the
runner runs inside `megarl.tools.sandbox` (bubblewrap: its own user, PID, network and mount
namespaces, a read-only root with /usr only, a private /tmp, process / CPU / memory limits), the
distribution's Python (``python``, default /usr/bin/python3), so a snippet that gets past the
guard still sees no file, process, socket or user of the machine's. Where bubblewrap or user
namespaces are missing, building the tool fails in one line (`SandboxUnavailable`); ``isolation:
guard`` runs the guard alone (same user and file system as the trainer) and must be asked for.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
from typing import Optional

from megarl.tools.sandbox import (Limits, Sandbox, SandboxUnavailable, default_python, end, probe,
                                  read_capped)

__all__ = ["PythonTool", "RUNNER"]

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_runner.py")


def _runner_source() -> str:
    """sandbox_runner.py's text, run with ``python -c``: inside the sandbox no megarl file exists."""
    global _RUNNER_SOURCE
    if _RUNNER_SOURCE is None:
        with open(RUNNER, encoding="utf-8") as f:
            _RUNNER_SOURCE = f.read()
    return _RUNNER_SOURCE


_RUNNER_SOURCE: Optional[str] = None


class PythonTool:
    name = "python"
    description = ("Run a short Python snippet (standard library only; no files, network or processes). "
                   "Returns what it prints and the value of its last expression.")
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def __init__(self, timeout_s: float = 5.0, cpu_s: int = 2, memory_mb: int = 256,
                 max_output_chars: int = 2000, python: Optional[str] = None, isolation: str = "bwrap"):
        if timeout_s <= 0 or cpu_s < 1 or memory_mb < 32 or max_output_chars < 1:
            raise ValueError("python tool: need timeout_s > 0, cpu_s >= 1, memory_mb >= 32, max_output_chars >= 1")
        if isolation not in ("bwrap", "guard"):
            raise ValueError(f"python tool: isolation must be 'bwrap' (a sandbox) or 'guard' (in-process guard "
                             f"only, not a boundary), got {isolation!r}")
        self.timeout_s, self.cpu_s, self.memory_mb = timeout_s, cpu_s, memory_mb
        self.max_output_chars, self.isolation = max_output_chars, isolation
        self.sandbox: Optional[Sandbox] = None
        if isolation == "bwrap":
            self.python = python or default_python()
            try:
                probe(python=self.python)
            except SandboxUnavailable as e:
                raise ValueError(f"python tool: isolation 'bwrap': {e}") from None
            # the runner sets its own CPU/memory rlimits too; the sandbox's cover bubblewrap and the
            # interpreter's start (address space: the runner's limit plus the interpreter's own)
            self.sandbox = Sandbox(Limits(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb + 256, max_procs=8,
                                          tmp_mb=1, max_output_bytes=8 * max_output_chars + 65536),
                                   python=self.python)
        else:
            self.python = python or sys.executable

    async def __call__(self, code: str) -> str:
        report = await self.run(str(code))
        if not report["ok"]:
            return f"{report['stdout']}error: {report['error']}" if report["stdout"] else f"error: {report['error']}"
        parts = [p for p in (report["stdout"].rstrip("\n"), report["result"]) if p]
        return "\n".join(parts)

    async def run(self, code: str) -> dict:
        """The runner's report {"ok", "stdout", "result", "error"} (limits turned into errors)."""
        payload = json.dumps({"code": code, "cpu_s": self.cpu_s, "memory_mb": self.memory_mb,
                              "max_output_chars": self.max_output_chars}).encode()
        if self.sandbox is not None:
            r = await self.sandbox.run([self.python, "-I", "-S", "-X", "utf8", "-c", _runner_source()], payload)
            if r.timed_out:
                return self._error(f"timed out after {self.timeout_s} s (wall clock)")
            if r.flooded:
                return self._error("output limit exceeded")
            # bubblewrap's init reports a program killed by signal s as 128 + s
            code = -(r.returncode - 128) if r.returncode > 128 else r.returncode
            return self._report(r.stdout, code)
        with tempfile.TemporaryDirectory(prefix="megarl-sandbox-") as cwd:
            proc = await asyncio.create_subprocess_exec(
                self.python, "-I", "-S", "-X", "utf8", RUNNER, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=cwd, env={},
                start_new_session=True)
            try:
                proc.stdin.write(payload)
                await proc.stdin.drain()
                proc.stdin.close()
                out, flooded = await asyncio.wait_for(
                    read_capped(proc.stdout, 8 * self.max_output_chars + 65536), self.timeout_s)
                if not flooded:
                    await asyncio.wait_for(proc.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                return self._error(f"timed out after {self.timeout_s} s (wall clock)")
            except (BrokenPipeError, ConnectionResetError):
                out, flooded = b"", False
            finally:
                await end(proc)
        if flooded:
            return self._error("output limit exceeded")
        return self._report(out, proc.returncode)

    def _report(self, out: bytes, returncode: int) -> dict:
        lines = out.decode("utf-8", "replace").strip().splitlines()
        if lines:
            try:
                report = json.loads(lines[-1])
                if isinstance(report, dict) and {"ok", "stdout", "result", "error"} <= set(report):
                    return report
            except ValueError:
                pass
        if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            return self._error(f"killed: CPU time limit ({self.cpu_s} s) or memory limit exceeded")
        if returncode == -signal.SIGXFSZ:
            return self._error("file size limit exceeded (writing files is not allowed)")
        return self._error(f"the sandbox exited with code {returncode} and no report")

    @staticmethod
    def _error(message: str) -> dict:
        return {"ok": False, "stdout": "", "result": None, "error": message}
