"""A console entry point's ``main(argv)`` called inside the pytest process, as ``python -m`` would
run it in a child: its argv, cwd and environment; stdout and stderr captured at the file
descriptors (what Python and C code print, in order); warnings shown as a fresh interpreter shows
them; ``SystemExit`` as the exit status, an uncaught exception as its traceback and status 1.

Only for bad-input cases refused before any work (argument parsing, config load, preflight): a
subprocess pays Python + megarl + torch imports (seconds) for a refusal that takes milliseconds.
Three guards keep the pytest process as it was, and make a case that stops refusing fail instead
of doing its work in here:

- state: what a refusal path may change process-wide is snapshotted before and restored after
  (cwd, os.environ, sys.argv/path, signal handlers and faulthandler's SIGUSR2, the wakeup fd,
  logging handlers and levels, warnings filters, torch's thread count, default dtype and grad
  mode, the switch interval, the umask). What cannot be restored is reported as a leak and fails
  the case: a thread or child process still alive, a torch function mode pushed (megarl's
  CUDA->CPU shim is one, for the life of the process), the shim installed, a process group made,
  an atexit hook added, fd 1 or 2 pointing elsewhere.
- tripwires: each place where an entry point starts its work (ranks, relaunch under torchrun,
  the server's engine and listener, the manager's listener and controller) raises `PastRefusal`
  instead while the call runs: a leak, "went past its refusal".
- a watchdog (SIGALRM) bounds the call like the subprocess timeout: rc None, ``HUNG: ...``.

Cases that start a server's engine, the megarl-train cases that wait on a rollout server, and
one case of each entry point stay real subprocesses (badinput_support.run_cli; REAL in
test_bad_input.py). Calls that must do real work (start ranks) but are many: `steps_in_a_child`.
"""
from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import importlib
import io
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings

# where each entry point starts its work: "module:attr" or "module:Class.attr"
TRIPWIRES = (
    "megarl.train:train",  # megarl-train: the ranks' setup, after preflight
    "megarl.trainer.parallel:relaunch",  # torchrun for TP/PP > 1 (train, convert, logprobs)
    "megarl.trainer.parallel:init_distributed",
    "megarl.commands.convert:_run_ranks",
    "megarl.commands.logprobs:init_ranks",
    "megarl.server.engine:GenerationEngine.start",  # megarl-server: the engine thread
    "megarl.server.__main__:_spawn_followers",
    "aiohttp.web:run_app",
    "megarl.rollout.manager:RolloutManager",
)
LISTENERS = ("megarl.rollout.manager:_listen",)  # called for real; a socket it returns is a trip


class PastRefusal(BaseException):
    """Raised by a tripwire. A BaseException: no ``except Exception`` of the entry point turns it
    into its one-line error."""


class Hung(BaseException):
    """Raised by the watchdog in the main thread."""


@dataclasses.dataclass
class Outcome:
    rc: int | None
    stdout: str
    stderr: str
    wall_s: float
    leaks: tuple[str, ...]


# ----------------------------------------------------------------------------- process state

def _torch_state() -> dict:
    """Without torch imported there is no mode, shim or group (the baseline a later import of
    torch is compared with)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {"torch function modes": 0, "CUDA->CPU shim installed": False, "process group initialised": False}
    import torch.distributed as dist

    cpu = sys.modules.get("megarl.mcore.cpu")
    return {"torch function modes": torch._C._len_torch_function_stack(),
            "CUDA->CPU shim installed": bool(cpu and cpu._SHIM_INSTALLED),
            "process group initialised": dist.is_available() and dist.is_initialized(),
            "torch threads": torch.get_num_threads(), "torch default dtype": torch.get_default_dtype(),
            "torch grad mode": torch.is_grad_enabled()}


def _loggers() -> dict:
    out = {"": (logging.root.level, tuple(logging.root.handlers), False, True)}
    for name, lg in logging.Logger.manager.loggerDict.items():
        if isinstance(lg, logging.Logger):
            out[name] = (lg.level, tuple(lg.handlers), lg.disabled, lg.propagate)
    return out


def _signals() -> dict:
    out = {}
    for sig in signal.valid_signals():
        try:
            out[sig] = signal.getsignal(sig)
        except (OSError, ValueError):
            pass
    return out


def _sigusr2_dumps() -> bool:
    """Whether faulthandler dumps stacks on SIGUSR2 (megarl's dump_stacks_on_sigusr2); the
    registration is put back as it was (faulthandler cannot be asked without unregistering)."""
    was = faulthandler.unregister(signal.SIGUSR2)
    if was:
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    return was


def _fd_id(fd: int) -> tuple:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def snapshot() -> dict:
    """What the in-process runner promises to leave as it found (compared by `diff`)."""
    umask = os.umask(0)
    os.umask(umask)
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    return {"cwd": os.getcwd(), "os.environ": dict(os.environ), "sys.argv": list(sys.argv),
            "sys.path": list(sys.path), "signal handlers": _signals(), "SIGUSR2 stack dumps": _sigusr2_dumps(),
            "signal wakeup fd": wakeup, "loggers": _loggers(), "logging.disable": logging.root.manager.disable,
            "warnings filters": list(warnings.filters), "warnings.showwarning": warnings.showwarning,
            "switch interval": sys.getswitchinterval(), "umask": umask, "atexit hooks": atexit._ncallbacks(),
            "fd 1": _fd_id(1), "fd 2": _fd_id(2), "sys.stdout": sys.stdout, "sys.stderr": sys.stderr,
            "threads": {t.ident for t in threading.enumerate()}, "child processes": _children(),
            **_torch_state()}


def diff(before: dict, after: dict) -> list[str]:
    """Human-readable differences between two snapshots (empty: the process is as it was).
    Threads and child processes count only when new; a logger only when it existed before or
    has handlers (importing a module may make loggers)."""
    out = []
    for key, old in before.items():
        new = after.get(key)
        if isinstance(old, set):
            if new - old:
                out.append(f"{key} new: {sorted(new - old)}")
        elif key == "loggers":
            changed = [k for k in old if new.get(k) != old[k]] + [k for k in new if k not in old and new[k][1]]
            if changed:
                out.append(f"loggers changed: {sorted(changed)[:8]}")
        elif isinstance(old, dict) and isinstance(new, dict):
            changed = sorted(str(k) for k in old.keys() | new.keys() if old.get(k) != new.get(k))
            if changed:
                out.append(f"{key} changed: {', '.join(changed[:8])}")
        elif new != old:
            out.append(f"{key}: {old!r} -> {new!r}")
    return out


def _restore(before: dict) -> None:
    """Puts back everything restorable; `diff` afterwards names what could not be."""
    os.chdir(before["cwd"])
    if dict(os.environ) != before["os.environ"]:
        os.environ.clear()
        os.environ.update(before["os.environ"])
    sys.argv[:] = before["sys.argv"]
    sys.path[:] = before["sys.path"]
    if faulthandler.unregister(signal.SIGUSR2) or before["SIGUSR2 stack dumps"]:
        if before["SIGUSR2 stack dumps"]:
            faulthandler.register(signal.SIGUSR2, all_threads=True)
    for sig, handler in before["signal handlers"].items():
        if handler is not None and signal.getsignal(sig) != handler:
            signal.signal(sig, handler)
    signal.set_wakeup_fd(before["signal wakeup fd"])
    loggers = logging.Logger.manager.loggerDict
    for name, (level, handlers, disabled, propagate) in before["loggers"].items():
        lg = logging.root if name == "" else loggers[name]
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.disabled, lg.propagate = disabled, propagate
    for name, lg in loggers.items():  # loggers made during the call: no handlers of their own left
        if isinstance(lg, logging.Logger) and name not in before["loggers"]:
            lg.handlers.clear()
    logging.disable(before["logging.disable"])
    sys.setswitchinterval(before["switch interval"])
    os.umask(before["umask"])
    torch = sys.modules.get("torch")
    if torch is not None and "torch threads" in before:
        if torch.get_num_threads() != before["torch threads"]:
            torch.set_num_threads(before["torch threads"])
        if torch.get_default_dtype() != before["torch default dtype"]:
            torch.set_default_dtype(before["torch default dtype"])
        if torch.is_grad_enabled() != before["torch grad mode"]:
            torch.set_grad_enabled(before["torch grad mode"])


# ----------------------------------------------------------------------------- tripwires

def _resolve(spec: str):
    mod_name, attr = spec.split(":")
    owner = importlib.import_module(mod_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _install_tripwires(hits: list[str]) -> list:
    undo = []

    def trip(spec):
        def tripwire(*args, **kwargs):
            hits.append(spec)
            raise PastRefusal(f"went past its refusal: {spec} was called")
        return tripwire

    def listen_trip(spec, real):
        def listen(*args, **kwargs):
            sock = real(*args, **kwargs)  # the refusal under test is this call failing
            sock.close()
            hits.append(spec)
            raise PastRefusal(f"went past its refusal: {spec} is listening")
        return listen

    for spec in TRIPWIRES + LISTENERS:
        owner, name = _resolve(spec)
        real = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        undo.append((owner, name, real))
        setattr(owner, name, listen_trip(spec, real) if spec in LISTENERS else trip(spec))
    return undo


# ----------------------------------------------------------------------------- the call

def _fresh_warnings() -> None:
    """The filters of a fresh interpreter (plus PYTHONWARNINGS), shown on this call's stderr;
    the caller's catch_warnings puts pytest's back. A new catch_warnings also clears the
    once-per-location registries, so a warning shown by an earlier call is shown again."""
    warnings.resetwarnings()
    for action, category, module in (("default", DeprecationWarning, "__main__"),
                                     ("ignore", DeprecationWarning, ""),
                                     ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""),
                                     ("ignore", ResourceWarning, "")):
        warnings.filterwarnings(action, category=category, module=module, append=True)
    if os.environ.get("PYTHONWARNINGS"):
        warnings._processoptions(os.environ["PYTHONWARNINGS"].split(","))  # noqa: SLF001

    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
    warnings.showwarning = show


def _exit_status(code, err) -> int:
    """SystemExit's code as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=err)
    return 1


def call_main(main, argv: list[str], prog_path: str, cwd: str, env: dict, timeout: float,
              guard: bool = True) -> Outcome:
    """``main(argv)`` as a child process would run it (see the module doc). The main thread only:
    signal handlers and the watchdog need it. ``guard=False`` (`steps_in_a_child` only): no
    tripwires and no leak report, for calls that do their work in a process made for them."""
    assert threading.current_thread() is threading.main_thread(), "in-process cases run on the main thread"
    hits: list[str] = []
    undo = _install_tripwires(hits) if guard else []  # (imports what they guard: before the snapshot)
    before = snapshot()
    sys.stdout.flush()
    sys.stderr.flush()
    out_f, err_f = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    saved_fds = os.dup(1), os.dup(2)
    saved_root = logging.root.handlers[:], logging.root.level
    rc, t0 = None, time.monotonic()
    try:
        os.dup2(out_f.fileno(), 1)
        os.dup2(err_f.fileno(), 2)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
        logging.root.handlers[:] = []  # as in a fresh interpreter: basicConfig installs its handler
        logging.root.setLevel(logging.WARNING)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv[:] = [prog_path, *argv]

        def hung(signum, frame):
            raise Hung()
        signal.signal(signal.SIGALRM, hung)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        with warnings.catch_warnings():
            _fresh_warnings()
            try:
                rc = _exit_status(main(list(argv)), sys.stderr)
            except SystemExit as e:
                rc = _exit_status(e.code, sys.stderr)
            except Hung:
                rc = None
            except KeyboardInterrupt:
                raise
            except BaseException:  # noqa: BLE001 - the interpreter's last word: traceback, status 1
                traceback.print_exc(file=sys.stderr)
                rc = 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        wall = time.monotonic() - t0
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        sys.stdout, sys.stderr = before["sys.stdout"], before["sys.stderr"]
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        for owner, name, real in undo:
            setattr(owner, name, real)
        logging.root.handlers[:], logging.root.level = saved_root
        _restore(before)
    texts = []
    for f in (out_f, err_f):
        f.seek(0)
        texts.append(f.read().decode("utf-8", "backslashreplace"))
        f.close()
    if rc is None:
        texts[1] += f"HUNG: no exit within {timeout:g} s"
    leaks = [f"went past its refusal: {spec}" for spec in hits] + _leftovers(before) if guard else []
    return Outcome(rc, texts[0], texts[1], wall, tuple(leaks))


def _leftovers(before: dict, grace_s: float = 2.0) -> list[str]:
    """What the call left that `_restore` cannot put back. Threads get ``grace_s`` to end; child
    processes it started are killed (by pid) once reported."""
    deadline = time.monotonic() + grace_s
    for t in threading.enumerate():
        if t.ident not in before["threads"]:
            t.join(max(0.0, deadline - time.monotonic()))
    after = snapshot()
    new_children = after["child processes"] - before["child processes"]
    if new_children:
        import psutil

        for pid in new_children:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
    names = {t.ident: t.name for t in threading.enumerate()}
    return [f"threads left running: {sorted(names.get(i, str(i)) for i in after['threads'] - before['threads'])}"
            if line.startswith("threads new:") else line for line in diff(before, after)]


def import_guarded() -> None:
    """Imports the modules the tripwires guard (what importing them does to the process is not
    a case's doing): before a snapshot meant to compare with one taken after in-process calls."""
    for spec in TRIPWIRES + LISTENERS:
        _resolve(spec)


# ----------------------------------------------------------------------------- calls that work

def steps_in_a_child(steps: dict, env: dict, timeout: float = 600.0) -> dict:
    """Entry-point calls that do real work (start ranks: megarl's process-wide CUDA->CPU shim, a
    process group's environment), one after another in ONE child process made for them, so
    this process pays the imports once and keeps none of it. ``steps``: {key: (MAINS key as
    "module:main", argv, noops)}, ``noops`` a list of "module:attr" replaced by a no-op during
    that call only. Returns {key: (rc, stderr)}, each call's own (`call_main`, unguarded)."""
    import json
    import subprocess

    env = dict(env, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)) + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "inprocess_cli", json.dumps(steps)], capture_output=True,
                          text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {k: tuple(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def _child(steps_json: str) -> None:
    import json

    out = {}
    for key, (entry, argv, noops) in json.loads(steps_json).items():
        owner, name = _resolve(entry)
        patched = [(o, n, getattr(o, n)) for o, n in map(_resolve, noops)]
        for o, n, _ in patched:
            setattr(o, n, lambda *a, **k: None)
        try:
            res = call_main(getattr(owner, name), argv, key, os.getcwd(), dict(os.environ), 300, guard=False)
        finally:
            for o, n, real in patched:
                setattr(o, n, real)
        out[key] = (res.rc, res.stderr)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1])
