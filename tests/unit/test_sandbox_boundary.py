"""The bubblewrap sandbox (megarl.tools.sandbox) against a hostile corpus: each program below tries
one way out - the run's files and secrets, writes outside /tmp, a fork bomb, sockets to the run's
own servers and to the world, memory, CPU, /tmp's size, signals to the trainer, /proc, privileges -
and reports what happened as JSON; the test asserts it was contained from both sides (what the
program saw, and the host after it: the file not written, the listener not reached, the trainer
process alive, no process left). Real bubblewrap, real namespaces: the machine must have them
(.ci/run installs bubblewrap); `probe` says in one line what is missing otherwise."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid

import pytest

from megarl.tools.sandbox import Limits, Sandbox, SandboxUnavailable, probe

LIMITS = Limits(timeout_s=10, cpu_s=2, memory_mb=256, max_procs=16, tmp_mb=4)


def require_sandbox() -> None:
    """The machine's answer: on a machine without bubblewrap or user namespaces these tests skip
    with `probe`'s one line - except in CI (CI set), where .ci/run installs bubblewrap, so a
    missing sandbox fails."""
    try:
        probe()
    except SandboxUnavailable as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))


@pytest.fixture(autouse=True)
def _sandbox_here(request):
    if request.node.name != "test_a_missing_bubblewrap_is_refused_in_one_line":
        require_sandbox()


def run(code: str, limits: Limits = LIMITS, **kw):
    sb = Sandbox(limits, **kw)
    return asyncio.run(sb.run([sb.python, "-I", "-S", "-c", code]))


def report(code: str, limits: Limits = LIMITS) -> dict:
    r = run(code, limits)
    assert r.returncode == 0 and not r.timed_out, (r.returncode, r.stderr[-2000:])
    return json.loads(r.stdout.decode().strip().splitlines()[-1])


def test_the_machine_provides_the_sandbox():
    probe()  # the fixture above ran it; here it must not raise (a second call answers from its cache)


def test_the_runs_files_and_secrets_are_not_there(tmp_path, monkeypatch):
    secret = tmp_path / "run" / "api_key.txt"
    secret.parent.mkdir()
    secret.write_text("sk-trainer-secret")
    monkeypatch.setenv("MEGARL_TEST_SECRET", "sk-env-secret")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [str(secret), os.path.join(repo, "README.md"), "/etc/passwd", "/etc/shadow", "/root/.bashrc",
             os.path.expanduser("~/.ssh/id_rsa"), "/proc/1/environ"]
    got = report(f"""
import json, os
seen = {{}}
for p in {paths!r}:
    try:
        seen[p] = open(p).read()[:40]
    except OSError as e:
        seen[p] = type(e).__name__
print(json.dumps({{"seen": seen, "env": dict(os.environ), "root": sorted(os.listdir("/"))}}))
""")
    for p in paths[:-1]:
        assert got["seen"][p] in ("FileNotFoundError", "PermissionError"), (p, got["seen"][p])
    assert "sk-" not in json.dumps(got)  # neither the file nor the environment variable leaked
    assert "secret" not in got["seen"]["/proc/1/environ"]
    # PWD: bubblewrap's --chdir; LC_CTYPE: Python's own C-locale coercion (PEP 538)
    assert set(got["env"]) <= {"PATH", "HOME", "PWD", "LC_CTYPE"} and got["env"]["PATH"] == "/usr/bin", got["env"]
    assert set(got["root"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev", "tmp"}


def test_writes_land_only_in_its_own_tmp():
    marker = f"megarl-escape-{uuid.uuid4().hex}"
    got = report(f"""
import json
out = {{}}
for p in ["/usr/{marker}", "/{marker}", "/proc/{marker}", "/dev/{marker}", "/tmp/{marker}"]:
    try:
        open(p, "w").write("x"); out[p] = "written"
    except OSError as e:
        out[p] = type(e).__name__
big = 0
try:
    with open("/tmp/fill", "wb") as f:
        for _ in range(64):
            f.write(b"x" * (1 << 20)); f.flush(); big += 1
except OSError as e:
    out["fill"] = type(e).__name__
out["fill_mb"] = big
print(json.dumps(out))
""")
    assert got[f"/tmp/{marker}"] == "written"  # its own tmpfs
    for p in (f"/usr/{marker}", f"/{marker}", f"/proc/{marker}", f"/dev/{marker}"):
        assert got[p] != "written", got
    assert got["fill"] == "OSError", got  # ENOSPC at tmp_mb
    assert got["fill_mb"] < LIMITS.tmp_mb + 1, got
    for host in ("/usr", "/", "/tmp", "/dev"):
        assert not os.path.exists(os.path.join(host, marker)), host  # nothing reached the host


def test_a_fork_bomb_is_contained_and_leaves_nothing():
    t0 = time.monotonic()
    bomb = run("""
import json, os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print(json.dumps({"forked": n, "error": type(e).__name__}))
""")
    assert bomb.returncode == 0 and bomb.uid is not None if os.getuid() == 0 else True, bomb
    got = json.loads(bomb.stdout.decode().strip().splitlines()[-1])
    assert got["error"] in ("BlockingIOError", "OSError") and got["forked"] < LIMITS.max_procs, got
    assert time.monotonic() - t0 < LIMITS.timeout_s  # the children did not hold the run
    time.sleep(0.5)
    # the kernel emptied the PID namespace with its init: no sandbox process is left running on the
    # host (bubblewrap's own exited processes may wait a moment as zombies for the machine's init)
    if bomb.uid is not None:  # its uid was its own (other sandboxes may be running meanwhile)
        assert not [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) == bomb.uid and _state(p) != "Z"]


def _uid(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def _state(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_no_socket_reaches_the_runs_servers_or_the_world():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.1)
    port = listener.getsockname()[1]
    try:
        got = report(f"""
import json, socket
out = {{}}
for name, addr in [("trainer", ("127.0.0.1", {port})), ("world", ("1.1.1.1", 53)), ("dns", ("example.com", 80))]:
    try:
        socket.create_connection(addr, timeout=2).close(); out[name] = "connected"
    except OSError as e:
        out[name] = type(e).__name__
print(json.dumps(out))
""")
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing ever arrived
    finally:
        listener.close()
    assert all(v != "connected" for v in got.values()), got


def test_memory_cpu_and_wall_clock_limits_end_the_program_not_the_trainer():
    got = report("""
import json
try:
    x = bytearray(1 << 30); out = "allocated"
except MemoryError:
    out = "MemoryError"
print(json.dumps({"memory": out}))
""")
    assert got["memory"] == "MemoryError"
    spin = run("while True: pass", Limits(timeout_s=60, cpu_s=1))  # 1 CPU second, however loaded the machine
    # SIGXCPU at cpu_s (SIGKILL a second later), reported by bubblewrap's init as 128 + signal
    assert spin.returncode in (128 + 24, 128 + 9) and not spin.timed_out, spin
    t0 = time.monotonic()
    sleeper = run("import time; time.sleep(60)", Limits(timeout_s=1))
    assert sleeper.timed_out and time.monotonic() - t0 < 15, sleeper  # 1 s, and the start of two processes
    flood = run("import sys\nwhile True: sys.stdout.write('x' * 65536)", Limits(max_output_bytes=1 << 16))
    assert flood.flooded and len(flood.stdout) == 1 << 16


def test_the_trainer_cannot_be_signalled_or_seen_through_proc():
    me = os.getpid()
    got = report(f"""
import json, os, signal
out = {{"pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}}
try:
    os.kill({me}, signal.SIGKILL); out["kill"] = "sent"
except OSError as e:
    out["kill"] = type(e).__name__
out["host_root"] = sorted(os.listdir("/proc/1/root"))
try:
    os.setuid(0); out["setuid"] = "root"
except OSError as e:
    out["setuid"] = type(e).__name__
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
out["userns"] = "created" if libc.unshare(0x10000000) == 0 else os.strerror(ctypes.get_errno())  # CLONE_NEWUSER
out["uid"] = os.getuid()
print(json.dumps(out))
""")
    assert len(got["pids"]) <= 3 and max(got["pids"]) < 10, got["pids"]  # its own PID namespace
    assert got["kill"] == "ProcessLookupError" or me not in got["pids"], got
    assert "work" not in got["host_root"] and "root" not in got["host_root"], got["host_root"]
    # uid 0 is not even mapped in its user namespace (EINVAL), and no new one can be made
    assert got["setuid"] != "root" and got["userns"] != "created" and got["uid"] == 65534, got


def test_a_missing_bubblewrap_is_refused_in_one_line():
    with pytest.raises(SandboxUnavailable, match=r"^sandbox: 'no-such-bwrap' \(bubblewrap\) is not installed"):
        run("pass", bwrap="no-such-bwrap")
