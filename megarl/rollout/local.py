"""Local rollout servers: child processes on free ports of one host, started by the rollout manager.

The one local launcher of megarl-server (and, with ``rollout.engine: sglang``, of real SGLang:
`megarl.rollout.sglang_local.SGLangLauncher`): used when ``rollout.servers`` is empty (the embedded
CPU demo), by make_tiny_model's evaluation, and by tests and benchmarks. The servers bind to loopback,
or to the address every rank reached rank 0 by when the job spans nodes (megarl.common.net.serving_host).
They belong to the process that started them (in a run, the rollout manager): stop signals sent
to the whole process tree are ignored by them, they are killed when it leaves the `LocalServers`
context, and the kernel kills them if it dies, SIGKILL included (megarl.common.signals.owned_child_setup). A server that dies during a run is
relaunched on its own port by `LocalServers.restart` (the RolloutCluster re-admits it once it
answers /health and has been given the current weights). ``<log_dir>/servers.json`` lists them.
"""
from __future__ import annotations

import concurrent.futures

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request

from megarl.common.net import LOOPBACK, free_port, http_url
from megarl.common.procs import last_line_since, log_size
from megarl.common.signals import owned_child_setup
from megarl.protocol.handshake import secret_pipe

def spawn_server(model_dir: str, log_path: str, port: int, extra=(), host: str = LOOPBACK,
                 cpus=None, api_key: str | None = None) -> subprocess.Popen:
    """Starts ``megarl-server`` on ``host:port`` (pinned to ``cpus`` when given) and returns at once.
    ``api_key`` reaches it through an inherited pipe (``--api-key-fd``), never argv."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    cmd = [sys.executable, "-m", "megarl.server", "--model", model_dir, "--host", host, "--port", str(port),
           *map(str, extra)]
    with open(log_path, "a") as log, key_pipe(api_key) as fds:  # append: a restart keeps its predecessor's log
        if fds:
            cmd += ["--api-key-fd", str(fds[0])]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=owned_child_setup,
                                pass_fds=fds)
    if cpus:  # right after the fork, before the child starts its torch threads (they inherit it)
        os.sched_setaffinity(proc.pid, cpus)
    return proc


@contextlib.contextmanager
def key_pipe(api_key: str | None):
    """() without a key; else (fd,): a pipe's read end holding it, for one child to inherit."""
    if not api_key:
        yield ()
        return
    fd = secret_pipe(api_key.encode())
    try:
        yield (fd,)
    finally:
        os.close(fd)


def key_run_servers(rollout, run_dir: str) -> None:
    """The servers a run starts itself (``rollout.servers`` empty) answer only that run: without
    ``rollout.api_key``, a key made for the run (their every route but /health refuses a request
    without it). It stays in the process that starts them and reaches them through pipes; its one
    copy at rest is <run_dir>/servers/api_key, for the run's own user (tools, tests)."""
    if rollout.servers or rollout.api_key:
        return
    rollout.api_key = secrets.token_urlsafe(32)
    write_key_file(os.path.join(run_dir, "servers", "api_key"), rollout.api_key)


def write_key_file(path: str, api_key: str) -> None:
    """``api_key`` into ``path``, mode 0600, its directory 0700. Created exclusively without
    following links: a previous run's file (a resume) is removed first, and a name planted there
    in between is refused, never written through."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(path), 0o700)
    try:
        os.unlink(path)  # a link is removed, not its target
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(api_key)


def root_flags(weights_roots) -> list[str]:
    flags = []
    for root in weights_roots:
        os.makedirs(root, exist_ok=True)  # the server checks that each root exists
        flags += ["--weights-root", os.path.abspath(root)]
    return flags


def wait_ready(url: str, proc: subprocess.Popen, log_path: str, ready_timeout_s: float = 60.0,
               name: str = "megarl-server", since: int = 0) -> None:
    """Waits for ``url``/health; ``since``: the log's size when ``proc`` started (`log_size`)."""
    deadline = time.time() + ready_timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            # dead before /health: its last line says why (bad model dir, port taken), no point waiting out the deadline
            raise RuntimeError(f"{name} exited early (log {log_path}): {last_line_since(log_path, since)}")
        try:
            # a loaded node answers slowly (SGLang's /health asks its scheduler): a probe may take
            # seconds, and a 1 s limit once never saw a server that answered every probe in ~2 s
            urllib.request.urlopen(url + "/health", timeout=max(1.0, min(10.0, deadline - time.time())))
            return
        except OSError:
            # 0.2 s between probes: readiness is seen at once without a busy loop that takes its CPU
            time.sleep(0.2)
    raise RuntimeError(f"{name} on {url} not ready in {ready_timeout_s:.0f} s (log {log_path})")


class MegarlLauncher:
    """Spawns one megarl-server per `LocalServers` slot (SGLang's: sglang_local.SGLangLauncher)."""

    name = "megarl-server"

    def __init__(self, model_dir: str, extra=(), weights_roots=(), api_key: str | None = None):
        self.model_dir, self.api_key = model_dir, api_key
        self.extra = [*extra, *root_flags(weights_roots)]  # restarts get the same flags

    def spawn(self, port: int, log_path: str, host: str, cpus=None) -> subprocess.Popen:
        return spawn_server(self.model_dir, log_path, port, self.extra, host, cpus, self.api_key)

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        # not the group: megarl-server shares the trainer's process group
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def start_server(model_dir: str, log_path: str, extra=(), ready_timeout_s: float = 60.0,
                 host: str = LOOPBACK, weights_roots=(), cpus=None,
                 api_key: str | None = None) -> tuple[str, subprocess.Popen]:
    """Starts ``megarl-server`` on a free port of ``host`` and waits for ``/health``.
    ``weights_roots``: where ``/update_weights_from_disk`` may read (the run's disk-transport
    directory); empty = the server's default (the model dir and its parent)."""
    port = free_port(host)
    extra = [*extra, *root_flags(weights_roots)]
    since = log_size(log_path)
    proc = spawn_server(model_dir, log_path, port, extra, host, cpus, api_key)
    url = http_url(host, port)
    try:
        wait_ready(url, proc, log_path, ready_timeout_s, since=since)
    except BaseException:
        MegarlLauncher.kill(proc)
        raise
    return url, proc


class LocalServers:
    """``with LocalServers(model_dir, n=2, log_dir=...) as urls: ...``; ``launcher``: what each
    slot runs (default: megarl-server with ``extra`` flags). All servers start at once, then the
    cluster waits up to ``ready_timeout_s`` for each /health."""

    def __init__(self, model_dir: str, n: int, log_dir: str, extra=(), host: str = LOOPBACK,
                 weights_roots=(), cpus=None, launcher=None, ready_timeout_s: float = 60.0,
                 api_key: str | None = None):
        self.model_dir, self.n, self.log_dir, self.host, self.cpus = model_dir, n, log_dir, host, cpus
        self.launcher = launcher or MegarlLauncher(model_dir, extra, weights_roots, api_key)
        self.ready_timeout_s = ready_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.restarts = 0
        # restarts are spawned from one thread that lives as long as this object: a server gets
        # SIGKILL when the thread that forked it ends (PR_SET_PDEATHSIG), and `restart` is called
        # from whichever trainer link's thread dropped the server - a push link ends with its push
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-spawn")

    def __enter__(self) -> list[str]:
        try:
            starts = []  # each log's size before its server started: an error quotes this start only
            for i in range(self.n):
                port = free_port(self.host)
                self.urls.append(http_url(self.host, port))
                starts.append(log_size(self._log(i)))
                self.procs.append(self.launcher.spawn(port, self._log(i), self.host, self.cpus))
            for i, (url, proc) in enumerate(zip(self.urls, self.procs)):
                wait_ready(url, proc, self._log(i), self.ready_timeout_s, self.launcher.name, starts[i])
        except BaseException:
            self.close()
            raise
        self._write_index()
        return self.urls

    def _log(self, i: int) -> str:
        return os.path.join(self.log_dir, f"server{i}.log")

    def _write_index(self) -> None:
        rows = [{"url": u, "pid": p.pid} for u, p in zip(self.urls, self.procs)]
        tmp = os.path.join(self.log_dir, "servers.json.tmp")
        with open(tmp, "w") as f:
            json.dump(rows, f)
        os.replace(tmp, os.path.join(self.log_dir, "servers.json"))  # readers never see half a file

    def restart(self, url: str) -> bool:
        """Relaunches the server of ``url`` on the same port (what is left of its old process is
        killed, e.g. hung, or SGLang's scheduler outliving its leader); returns at once -
        readiness is polled by the caller."""
        if url not in self.urls:
            return False
        i = self.urls.index(url)
        self.launcher.kill(self.procs[i])  # a hung one still holds the port
        # the same port: the address the cluster dropped is the one it will re-admit
        port = int(url.rsplit(":", 1)[1])
        self.procs[i] = self._spawner.submit(self.launcher.spawn, port, self._log(i), self.host, self.cpus).result()
        self.restarts += 1
        self._write_index()
        return True

    def close(self) -> None:
        # SIGKILL, no grace: the servers hold no state worth saving (the trainer has the weights)
        for p in self.procs:
            self.launcher.kill(p)
        self.procs.clear()
        self._spawner.shutdown(wait=False)

    def __exit__(self, *exc) -> None:
        self.close()
