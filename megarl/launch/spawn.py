"""Local ranks for a command run outside any launcher (``megarl-train`` with tp*pp > 1,
``megarl-convert --tp 2``): N copies of a module on this host, torchrun's environment variables,
and no torchrun.

torchrun's agent serves the job's rendezvous store itself, and torch's store binds every
interface; here rank 0 serves it on loopback (`megarl.trainer.parallel.init_distributed`), so a job on one
host listens on nothing but 127.0.0.1 (docs/reliability.md, Security). What torchrun did for a
local job is kept: one thread per rank unless OMP_NUM_THREADS says otherwise, and when one rank
fails the others are stopped (SIGTERM, then SIGKILL after ``grace_s``) and its exit code is the
job's. A stop signal sent to this process reaches every rank (each finishes its step, saves and
exits 0: megarl.common.signals); the ranks run in a session of their own, so a terminal's Ctrl-C reaches
them only this way, once.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from megarl.common.net import LOOPBACK, free_port
from megarl.common.signals import STOP_SIGNALS, die_with_parent

POLL_S = 0.1


def rank_env(rank: int, nproc: int, port: int, base: dict) -> dict:
    """Rank ``rank``'s environment: torchrun's names, so `megarl.launch.ranks.discover_ranks` reads them."""
    env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 serves the store, nobody else does
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # N ranks on one host: torchrun's default too
    return env


def run_ranks(nproc: int, module: str, argv: list[str], grace_s: float = 30.0) -> int:
    """Runs ``python -m module argv`` as ``nproc`` local ranks; returns the job's exit code: the
    first failing rank's, else 0."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", module, *argv],
                              env=rank_env(r, nproc, port, os.environ), start_new_session=True,
                              preexec_fn=die_with_parent)
             for r in range(nproc)]

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        return _wait(procs, grace_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in procs:  # only reached alive when this process itself is unwinding
            if p.poll() is None:
                p.kill()


def _wait(procs: list[subprocess.Popen], grace_s: float) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            _stop(procs, grace_s)
            return failed[0] if failed[0] > 0 else 128 - failed[0]  # killed by signal N: 128+N
        if all(c == 0 for c in codes):
            return 0
        time.sleep(POLL_S)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """A rank failed: the others cannot finish a collective without it."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
