"""The parent's side of starting the rollout manager (`megarl.rollout.manager`) next to trainer
rank 0. What the two processes agree on is the command line and one line on stdout:

    python -m megarl.rollout.manager RUN_DIR/config.yaml --host H --port 0 --secret-fd FD
    -> prints "listening HOST:PORT" once it listens (then its stdout goes to its log)

The module is named as a string, not imported: the trainer imports nothing of the manager."""
from __future__ import annotations

import os
import subprocess
import sys

from megarl.common.procs import last_line_since
from megarl.common.signals import owned_child_setup
from megarl.protocol import handshake


def start_process(config_path: str, host: str, log_path: str, secret: bytes, cpus=None):
    """Start the manager process and return at once: it imports, listens and starts its servers
    while the caller goes on (`wait_listening` then reads its address). ``secret`` reaches it
    through an inherited pipe: never argv (world-readable in /proc), never a file."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    fd = handshake.secret_pipe(secret)
    try:
        with open(log_path, "a") as log_file:  # the child holds its own descriptor
            proc = subprocess.Popen([sys.executable, "-m", "megarl.rollout.manager", config_path, "--host", host,
                                     # port 0: the OS picks a free port and the manager prints it (no race)
                                     "--port", "0", "--secret-fd", str(fd)], stdout=subprocess.PIPE,
                                    stderr=log_file, preexec_fn=owned_child_setup, text=True, pass_fds=(fd,))
    finally:
        os.close(fd)
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    return proc


def wait_listening(proc, log_path: str, since: int = 0) -> str:
    """The "host:port" the process from `start_process` listens on, once it does. ``since``: the
    log's size before the start (`megarl.common.procs.log_size`), so a failure quotes this start's last line."""
    line = proc.stdout.readline().strip()  # "listening HOST:PORT", or EOF when it failed
    if not line.startswith("listening "):
        proc.wait(timeout=30)
        raise RuntimeError(f"rollout manager did not start (exit {proc.returncode}; log {log_path}): "
                           f"{last_line_since(log_path, since)}")
    return line.split(" ", 1)[1]
