"""A sandbox that is a boundary: one untrusted program behind bubblewrap's kernel namespaces.

    sandbox = Sandbox(Limits(cpu_s=2, memory_mb=256, timeout_s=5, max_procs=16, tmp_mb=16))
    result = await sandbox.run(["/usr/bin/python3", "-I", "-c", code], stdin=b"")

Each run is a fresh `bwrap` (bubblewrap, the distribution's package; the sandbox Flatpak uses)
with every namespace it has unshared - user, PID, network, mount, IPC, UTS, cgroup - so the
program sees:

    file system   a read-only root holding /usr (and the interpreter's own prefix when it is
                  elsewhere) read-only, a private /proc of its own PID namespace, a minimal
                  read-only /dev, and /tmp, an empty
                  tmpfs of `tmp_mb` (its only writable place, gone when it exits). Nothing
                  else exists: no /etc, /home, /root, the run directory or any other path.
    processes     its own PID namespace (pid 1 is bubblewrap's init; no other process of the
                  machine is visible or signalable); `max_procs` processes (RLIMIT_NPROC)
    network       a network namespace with a loopback that is down: no route anywhere, the
                  run's own servers on 127.0.0.1 included
    user          not the caller: run as root, megarl starts it as an unused uid/gid of its own
                  (`uid_base` + k, locked machine-wide for the run, no supplementary groups, as
                  IOI's isolate does), so its process count is its own; run as a user, it is that user, and `max_procs`
                  counts that user's processes (RLIMIT_NPROC is per uid) on top of those it had.
                  Inside: uid/gid 65534, no capabilities, no further user namespaces.
    limits        CPU seconds (RLIMIT_CPU), address space per process (RLIMIT_AS), core files
                  off, wall clock `timeout_s` (then SIGKILL: bubblewrap's init dies and the
                  kernel kills everything in its PID namespace), stdout/stderr capped
    environment   empty (PATH=/usr/bin only)

The machine must provide bubblewrap and unprivileged user namespaces; `probe` checks both once
and `SandboxUnavailable` says in one line what is missing. There is no fallback to a weaker
isolation: a caller that asked for the sandbox gets it or an error.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import fcntl
import signal
import stat
import sys
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Limits", "Sandbox", "SandboxResult", "SandboxUnavailable", "default_python", "end", "kill_group",
           "probe", "read_capped"]

_NOBODY = 65534


class SandboxUnavailable(RuntimeError):
    """This machine cannot provide the sandbox (no bubblewrap, no user namespaces, ...)."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0  # wall clock of the whole run
    cpu_s: int = 2  # CPU seconds per process (SIGXCPU, SIGKILL a second later)
    memory_mb: int = 256  # address space per process
    max_procs: int = 16  # processes and threads (bubblewrap's two included)
    tmp_mb: int = 16  # size of the writable /tmp
    max_output_bytes: int = 1 << 20  # of stdout and of stderr each; more ends the run

    def __post_init__(self):
        if (self.timeout_s <= 0 or self.cpu_s < 1 or self.memory_mb < 32 or self.max_procs < 3
                or self.tmp_mb < 1 or self.max_output_bytes < 1):
            raise ValueError("sandbox limits: need timeout_s > 0, cpu_s >= 1, memory_mb >= 32, max_procs >= 3, "
                             f"tmp_mb >= 1, max_output_bytes >= 1; got {self}")


@dataclass
class SandboxResult:
    returncode: int  # negative: killed by that signal
    stdout: bytes
    stderr: bytes
    timed_out: bool = False  # killed at timeout_s
    flooded: bool = False  # killed for writing more than max_output_bytes
    uid: Optional[int] = None  # the uid it ran as on the host (root-started), else None (the caller's)


def default_python() -> str:
    """The distribution's Python (readable by any uid; the trainer's may live under /root)."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(path, os.X_OK):
            return path
    return sys.executable


_probed: dict[tuple, Optional[str]] = {}
_probe_lock = threading.Lock()


def probe(bwrap: str = "bwrap", python: Optional[str] = None) -> None:
    """Raises `SandboxUnavailable` (one line) unless a sandboxed `python -c pass` runs here; the
    answer is cached per (bwrap, python)."""
    python = python or default_python()
    key = (bwrap, python)
    with _probe_lock:
        if key not in _probed:
            _probed[key] = _probe(bwrap, python)
    if _probed[key] is not None:
        raise SandboxUnavailable(_probed[key])


def _probe(bwrap: str, python: str) -> Optional[str]:
    import subprocess

    exe = shutil.which(bwrap)
    if exe is None:
        return (f"sandbox: {bwrap!r} (bubblewrap) is not installed; install the distribution's bubblewrap "
                "package (apt-get install bubblewrap / dnf install bubblewrap)")
    if not os.path.isabs(python) or not os.access(python, os.X_OK):
        return f"sandbox: the interpreter {python!r} is not an executable file given by its absolute path"
    sb = Sandbox(Limits(timeout_s=20), python=python, bwrap=exe)
    try:
        taken = _SLOTS.take(sb.uid_base, sb.slots) if os.getuid() == 0 else None
    except SandboxUnavailable as e:
        return str(e)
    try:
        argv, kw = sb._spawn_args([python, "-I", "-S", "-c", "pass"], taken[0] if taken else None)
        r = subprocess.run(argv, capture_output=True, timeout=30, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sandbox: {exe} could not be started: {e}"
    finally:
        if taken:
            _SLOTS.give(taken[1])
    if r.returncode != 0:
        err = r.stderr.decode("utf-8", "replace").strip().splitlines()
        why = err[-1] if err else f"exit code {r.returncode}"
        return (f"sandbox: bubblewrap cannot create its namespaces here ({why}); it needs unprivileged user "
                "namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0) and "
                f"{python} readable by an unprivileged user")
    return None


class _Slots:
    """The uids root-started sandboxes run as, one per running sandbox on the machine: uid_base + k
    is taken by an exclusive flock of `LOCK_DIR`/uid-<uid>.lock (so two megarl processes - the
    manager, a reward server, another run - never share one), tried round robin from after the
    last one this process took (a uid comes back only after the others, by when its exited
    sandbox's zombies have been reaped)."""

    def __init__(self):
        self.lock, self.next = threading.Lock(), 0

    def take(self, base: int, n: int) -> Optional[tuple[int, int]]:
        """(uid, fd holding its lock), or None when all n are taken."""
        directory = _lock_dir()
        with self.lock:
            for i in range(n):
                k = (self.next + i) % n
                fd = os.open(os.path.join(directory, f"uid-{base + k}.lock"),
                             os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.next = k + 1
                return base + k, fd
        return None

    @staticmethod
    def give(fd: int) -> None:
        os.close(fd)  # releases the flock


_SLOTS = _Slots()
LOCK_DIR = "/run/megarl-sandbox"


def _lock_dir() -> str:
    """`LOCK_DIR` (or /tmp/megarl-sandbox-0 where /run is not writable), root's own: made 0700, and
    refused in one line when someone else made it first (they could hold every uid's lock)."""
    directory = LOCK_DIR if os.access(os.path.dirname(LOCK_DIR), os.W_OK) else "/tmp/megarl-sandbox-0"
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
        raise SandboxUnavailable(f"sandbox: {directory} is not a directory of root's with mode 0700; remove it "
                                 "(another user made it: it would decide which uids sandboxes get)")
    return directory


def kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the process group `proc` leads (started with start_new_session), if it still runs."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def end(proc: asyncio.subprocess.Process) -> None:
    """Kill `proc`'s group, reap it and close its pipes now: a pipe left open (a run cut short by
    its clock or its output cap) would otherwise be closed by the garbage collector after the event
    loop is gone, an exception in __del__."""
    kill_group(proc)
    await proc.wait()
    transport = getattr(proc, "_transport", None)  # asyncio's Process has no public close()
    if transport is not None:
        transport.close()


async def read_capped(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, bool]:
    """(up to `limit` bytes until EOF, whether more was written)."""
    chunks, size = [], 0
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return b"".join(chunks), False
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(chunks)[:limit], True


def _user_processes() -> int:
    """Processes (threads included: RLIMIT_NPROC counts tasks) of this uid now."""
    uid, n = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                st = os.stat(f"/proc/{pid}")
                if st.st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return n


class Sandbox:
    """Runs programs in bubblewrap under `limits`. `python` (default: the distribution's) is what
    a sandboxed `python` means: its prefix is bound read-only when it is not under /usr."""

    def __init__(self, limits: Limits = Limits(), python: Optional[str] = None, bwrap: str = "bwrap",
                 uid_base: int = 60000, slots: int = 256):
        if not 1000 <= uid_base < 2 ** 31 - slots or slots < 1:
            raise ValueError(f"sandbox: uid_base must be in [1000, 2^31 - slots) and slots >= 1; got {uid_base}, "
                             f"{slots}")
        self.limits, self.python, self.bwrap = limits, python or default_python(), bwrap
        self.uid_base, self.slots = uid_base, slots

    def _binds(self) -> list[str]:
        args = ["--ro-bind", "/usr", "/usr"]
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            path = f"/{top}"
            if os.path.islink(path):  # merged /usr: /lib -> usr/lib
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(self.python)))
        if not (prefix == "/usr" or prefix.startswith("/usr/")):
            args += ["--ro-bind", prefix, prefix]
        return args

    def command(self, program: Sequence[str]) -> list[str]:
        """The bubblewrap command line that runs `program`."""
        lim = self.limits
        return [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(_NOBODY),
                "--gid", str(_NOBODY), "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                *self._binds(), "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
                "--size", str(lim.tmp_mb << 20), "--perms", "1777", "--tmpfs", "/tmp", "--chdir", "/tmp",
                "--remount-ro", "/", "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/tmp",
                "--", *program]

    def _spawn_args(self, program: Sequence[str], uid: Optional[int]) -> tuple[list[str], dict]:
        """(argv with the rlimits applied by prlimit, the subprocess options that set the user:
        `uid`, taken for this run, when started by root)."""
        lim, kw = self.limits, {}
        nproc = lim.max_procs
        if uid is not None:
            kw = {"user": uid, "group": uid, "extra_groups": []}
        else:
            nproc += _user_processes()
        prlimit = shutil.which("prlimit") or "prlimit"
        mem = lim.memory_mb << 20
        argv = [prlimit, f"--nproc={nproc}", f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}", f"--as={mem}", "--core=0",
                "--", *self.command(program)]
        return argv, kw

    async def run(self, program: Sequence[str], stdin: bytes = b"") -> SandboxResult:
        probe(self.bwrap, self.python)
        if os.getuid() != 0:
            return await self._run(program, stdin, None)
        taken = _SLOTS.take(self.uid_base, self.slots)
        while taken is None:  # more sandboxes running on the machine than uids: wait for one
            await asyncio.sleep(0.01)
            taken = _SLOTS.take(self.uid_base, self.slots)
        try:
            return await self._run(program, stdin, taken[0])
        finally:
            _SLOTS.give(taken[1])

    async def _run(self, program, stdin: bytes, uid: Optional[int]) -> SandboxResult:
        argv, kw = self._spawn_args(program, uid)
        lim = self.limits
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, env={"PATH": "/usr/bin:/bin"}, cwd="/", **kw)

        def kill() -> None:  # bwrap's session: its init dies and the kernel empties the PID namespace
            kill_group(proc)

        async def read(stream) -> tuple[bytes, bool]:
            out, flooded = await read_capped(stream, lim.max_output_bytes)
            if flooded:
                kill()
            return out, flooded

        async def communicate():
            try:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass
            outs = await asyncio.gather(read(proc.stdout), read(proc.stderr))
            await proc.wait()
            return outs

        timed_out = False
        try:
            (out, flood_o), (err, flood_e) = await asyncio.wait_for(communicate(), lim.timeout_s)
        except asyncio.TimeoutError:
            timed_out, out, err, flood_o, flood_e = True, b"", b"", False, False
        finally:
            await end(proc)
        return SandboxResult(proc.returncode, out, err, timed_out, flood_o or flood_e, uid)
