"""Child side of `PythonTool`: run one model-written snippet under limits, report one JSON line.

Executed as ``python -I -S -X utf8 sandbox_runner.py`` (never imported by megarl). Reads
``{"code", "cpu_s", "memory_mb", "max_output_chars"}`` from stdin and writes
``{"ok", "stdout", "result", "error"}`` as the last line of stdout. Before the snippet runs:

- rlimits (raising them is refused by the hook below): CPU seconds, address space, file size 0
  (no file grows), no core files, few descriptors, no new processes/threads (non-root users);
- a few stdlib modules are imported (math, fractions, itertools, ...); others load only from
  the standard library directory;
- an audit hook (it cannot be removed) refuses sockets, subprocesses, exec/fork/spawn, signals
  to other processes, file writes and file-system changes, directory listings, reads outside the
  standard library, rlimit changes, ctypes/mmap, and frame / gc introspection (the ways back to
  the hook's own state). Its tables live in a closure that snippet code cannot reach.
"""
import builtins
import io
import json
import os
import resource
import sys

PRELOAD = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections",
           "statistics", "random", "re", "string", "heapq", "bisect", "operator", "datetime", "json")


class _CappedWriter(io.TextIOBase):
    """stdout for the snippet: keeps the first `cap` characters, drops the rest."""

    def __init__(self, cap):
        self.cap, self.parts, self.size, self.dropped = cap, [], 0, 0

    def write(self, s):
        keep = max(0, min(len(s), self.cap - self.size))
        if keep:
            self.parts.append(s[:keep])
            self.size += keep
        self.dropped += len(s) - keep
        return len(s)

    def text(self):
        tail = f"\n... [{self.dropped} characters cut]" if self.dropped else ""
        return "".join(self.parts) + tail


def _set_limits(cpu_s, memory_mb):
    mem = memory_mb * 1024 * 1024
    # CPU: SIGXCPU at cpu_s, SIGKILL one second later (at the hard limit).
    for name, soft, hard in (("RLIMIT_CPU", cpu_s, cpu_s + 1), ("RLIMIT_AS", mem, mem), ("RLIMIT_FSIZE", 0, 0),
                             ("RLIMIT_CORE", 0, 0), ("RLIMIT_NOFILE", 32, 32), ("RLIMIT_NPROC", 0, 0)):
        res = getattr(resource, name, None)
        if res is not None:
            resource.setrlimit(res, (soft, hard))


def _make_hook(read_roots):
    blocked_prefixes = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                        "os.fork", "os.forkpty", "os.kill", "os.killpg", "os.remove", "os.unlink",
                        "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
                        "os.symlink", "os.link", "os.utime", "os.listdir", "os.scandir", "os.chdir",
                        "os.putenv", "os.unsetenv", "os.add_dll_directory", "shutil.", "ctypes.", "mmap.",
                        "pty.", "resource.setrlimit", "resource.prlimit", "sys._getframe",
                        "sys._current_frames", "sys.setprofile", "sys.settrace", "gc.", "object.__getattr__",
                        "object.__setattr__", "object.__delattr__", "webbrowser.", "urllib.", "http.",
                        "ftplib.", "smtplib.", "imaplib.", "poplib.", "nntplib.", "telnetlib.", "sqlite3.")
    blocked_modules = ("ctypes", "_ctypes", "socket", "_socket", "ssl", "_ssl", "subprocess", "_posixsubprocess",
                       "multiprocessing", "_multiprocessing", "select", "selectors", "asyncio", "mmap", "pty",
                       "fcntl", "resource", "shutil", "tempfile", "urllib", "http", "signal", "_signal")
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def hook(event, args):
        if event.startswith(blocked_prefixes):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in blocked_modules:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (any(c in mode for c in "wax+") if isinstance(mode, str)
                       else bool((flags or 0) & write_flags))
            if writing:
                raise PermissionError("sandbox: writing files is not allowed")
            if isinstance(path, (str, bytes)):
                p = os.path.normpath(os.path.abspath(os.fsdecode(path)))
                if not any(p == r or p.startswith(r + os.sep) for r in read_roots):
                    raise PermissionError("sandbox: reading files outside the standard library is not allowed")

    return hook


def _run(code, out):
    """(value of the last expression or None) after executing `code` with stdout -> out."""
    import ast

    tree = ast.parse(code, "<tool>", "exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    env = {"__name__": "__sandbox__", "__builtins__": builtins}
    sys.stdout = out
    try:
        exec(compile(tree, "<tool>", "exec"), env)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), env)
            return None if value is None else repr(value)
        return None
    finally:
        sys.stdout = sys.__stdout__


def main():
    req = json.loads(sys.stdin.read())
    cap = int(req.get("max_output_chars", 2000))
    for name in PRELOAD:
        __import__(name)
    stdlib = os.path.dirname(os.__file__)
    read_roots = tuple(os.path.normpath(p) for p in (stdlib, os.path.join(stdlib, "lib-dynload")))
    _set_limits(int(req.get("cpu_s", 2)), int(req.get("memory_mb", 256)))
    sys.addaudithook(_make_hook(read_roots))
    out = _CappedWriter(cap)
    report = {"ok": True, "stdout": "", "result": None, "error": None}
    try:
        result = _run(req["code"], out)
        report["result"] = result if result is None or len(result) <= cap else result[:cap] + "..."
    except BaseException as e:  # noqa: BLE001 - everything the snippet does wrong is reported
        report["ok"], report["error"] = False, f"{type(e).__name__}: {e}"[:cap]
    report["stdout"] = out.text()
    os.write(1, ("\n" + json.dumps(report) + "\n").encode())


if __name__ == "__main__":
    main()
