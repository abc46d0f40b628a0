"""Rollout nodes under a batch launcher: start a node's servers, wait for /health, stop on a file.

    python -m megarl.rollout.supervise serve --commands FILE --stop-file FILE
    python -m megarl.rollout.supervise wait --timeout S --write ADDRESS_FILE URL [URL ...]

``serve`` runs each line of FILE (a shell command, as ``megarl-launch --emit servers`` prints
them) in its own process group, with SIGTERM/SIGUSR1/SIGINT ignored, by the supervisor and, by
inheritance, by the servers. SLURM sends a preemption or requeue SIGTERM to every process of
every step at once; the servers must keep answering while the trainer finishes its step and saves
its checkpoint (megarl.common.signals). They go when the stop file appears (launch/slurm.sbatch creates
it after the trainer has exited), when one of them dies (exit 1: a node without its servers is
useless), or with the supervisor itself (parent-death signal).

``wait`` polls every URL's /health until all answer 200, then writes the URLs, one per line,
atomically to the address file; on timeout it exits 1 naming the servers that never answered.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request

from megarl.common.signals import STOP_SIGNALS, owned_child_setup


def serve(commands: list[str], stop_file: str, poll_s: float = 0.5) -> int:
    for sig in STOP_SIGNALS:
        # ignored here and inherited by the servers: a preemption SIGTERM must not take them before the trainer saved
        signal.signal(sig, signal.SIG_IGN)
    procs = []
    for cmd in commands:
        print(f"[supervise] starting: {cmd}", flush=True)
        # exec: the server replaces bash, so its pid (and process group) is the one we kill
        procs.append(subprocess.Popen(["bash", "-c", "exec " + cmd], start_new_session=True,
                                      preexec_fn=owned_child_setup))
    code = 0
    while True:
        if os.path.exists(stop_file):
            print(f"[supervise] {stop_file} exists: stopping {len(procs)} server(s)", flush=True)
            break
        dead = [(c, p.returncode) for c, p in zip(commands, procs) if p.poll() is not None]
        if dead:
            print(f"[supervise] a server exited ({dead[0][1]}): {dead[0][0]}", flush=True)
            code = 1
            break
        time.sleep(poll_s)
    for p in procs:  # the group: SGLang forks a scheduler and a detokenizer
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    return code


def healthy(url: str) -> bool:
    try:
        # 2 s: a server that takes longer to say it is healthy is not ready to serve rollouts
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait(urls: list[str], timeout_s: float, write: str = "", poll_s: float = 0.5) -> int:
    pending = list(urls)
    deadline = time.monotonic() + timeout_s
    while pending:
        pending = [u for u in pending if not healthy(u)]
        if pending and time.monotonic() > deadline:
            print(f"[supervise] not healthy after {timeout_s:.0f} s: {' '.join(pending)}", file=sys.stderr)
            return 1
        if pending:
            time.sleep(poll_s)
    if write:
        tmp = write + ".tmp"
        with open(tmp, "w") as f:
            f.write("".join(u + "\n" for u in urls))
        # atomic: the trainer, polling for the file, never reads half a list
        os.replace(tmp, write)
    print(f"[supervise] {len(urls)} server(s) healthy", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megarl.rollout.supervise", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run a node's server commands until the stop file appears")
    s.add_argument("--commands", required=True, help="file: one shell command per line")
    s.add_argument("--stop-file", required=True)
    w = sub.add_parser("wait", help="wait for every URL's /health; write the address file")
    w.add_argument("urls", nargs="+")
    w.add_argument("--timeout", type=float, default=900.0)
    w.add_argument("--write", default="", help="address file to write once all are healthy")
    args = p.parse_args(argv)
    if args.cmd == "serve":
        with open(args.commands) as f:
            commands = [line.strip() for line in f if line.strip()]
        return serve(commands, args.stop_file)
    return wait(args.urls, args.timeout, args.write)


if __name__ == "__main__":
    sys.exit(main())
