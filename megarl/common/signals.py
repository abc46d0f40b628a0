"""Preemption-safe stopping: SIGUSR1 / SIGTERM / SIGINT ask the training loop to checkpoint and stop.

    stop = StopRequest().install()        # before the slow setup: a signal then is not lost
    for step in ...:
        ...train, push, log...
        if stop.should_stop() and step < last:   # ONE all-reduce per step, on every rank
            ckpt.save(step, ...)
            break
    stop.close()                          # restores the previous handlers

The handler only sets a flag (nothing unsafe runs inside a signal handler). Signals reach ranks
at different moments (SLURM signals every task, a user may kill one rank, srun forwards to all),
so :meth:`StopRequest.should_stop` takes the MAX of the local flags over the default group: all
ranks leave the loop after the SAME step, and no rank saves alone while the others wait in a
collective. A run stopped this way has a complete checkpoint of its last logged step, leaves
``<run_dir>/stopped_by_signal.json`` and exits 0; who sent the signal decides whether the job
comes back (launch/slurm.sbatch requeues itself when it finds the marker and was not itself told
to terminate; ``scontrol requeue`` and preemption requeue the job from outside).

    SIGUSR1  SLURM's time-limit warning (#SBATCH --signal=USR1@T): save, stop, get requeued
    SIGTERM  preemption, scontrol requeue, scancel, torchrun shutting down: save and stop within
             the grace period (SLURM's KillWait / GraceTime)
    SIGINT   Ctrl-C: the first one saves and stops, a second one interrupts at once

    SIGUSR2  not a stop: every thread's Python stack is printed to stderr (a rank or the rollout
             manager that seems hung: ``kill -USR2 PID``; the manager's goes to manager.log)

Rollout servers that a trainer rank starts itself (megarl.rollout.local) run under
:func:`owned_child_setup`: these signals are ignored and the kernel kills them when their parent
dies. A signal sent to a whole process tree (Ctrl-C in a terminal, SLURM signalling every process
of a step) therefore cannot take the servers away while the trainer finishes its step, and a
trainer that dies hard still takes them with it.
"""
from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import threading
from typing import Optional

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
STOP_MARKER = "stopped_by_signal.json"
_PR_SET_PDEATHSIG = 1


class StopRequest:
    """Signal handlers that set a flag, and the collective decision to stop (see module doc)."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: Optional[str] = None  # name of the first stop signal this rank received
        self.stopped = False  # should_stop() returned True (the loop saved and stopped)
        self._previous: dict = {}

    # ------------------------------------------------------------------ handlers
    def install(self) -> "StopRequest":
        """Installs the handlers (main thread only; elsewhere the flag can still be set by
        :meth:`request`)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def close(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def __enter__(self) -> "StopRequest":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.close()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == "SIGINT":
            signal.default_int_handler(signum, frame)  # second Ctrl-C: KeyboardInterrupt now
        self.request(signal.Signals(signum).name)

    def request(self, reason: str) -> None:
        if self.received is None:
            self.received = reason
            # print() here could re-enter a flush of the same stream; os.write cannot
            os.write(2, f"[megarl] {reason}: finishing this step, then checkpoint and stop\n".encode())

    # ------------------------------------------------------------------ decision
    def should_stop(self, group=None) -> bool:
        """Collective over ``group`` (default: the world) when torch.distributed is up: True on
        every rank when any rank has received a stop signal. Call it at the same point of every
        step on every rank."""
        import torch
        import torch.distributed as dist

        local = self.received is not None
        if dist.is_available() and dist.is_initialized():
            device = "cpu"
            if dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            flag = torch.tensor([int(local)], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            local = bool(flag.item())
        if local and not self.stopped:
            self.stopped = True
            if self.received is None:
                self.received = "peer"  # another rank got the signal
        return local


def dump_stacks_on_sigusr2() -> None:
    """SIGUSR2 prints every thread's stack to stderr and the process goes on (see module doc)."""
    if hasattr(signal, "SIGUSR2"):
        faulthandler.register(signal.SIGUSR2, all_threads=True)


def write_stop_marker(run_dir: str, reason: str) -> str:
    """Rank 0, after a signal stop: ``<run_dir>/stopped_by_signal.json``. A launcher that finds it
    after a clean exit knows the run is unfinished and resumable (launch/slurm.sbatch requeues)."""
    path = os.path.join(run_dir, STOP_MARKER)
    with open(path + ".tmp", "w") as f:
        json.dump({"signal": reason}, f)
    os.replace(path + ".tmp", path)
    return path


def clear_stop_marker(run_dir: str) -> None:
    """Rank 0, at start: a marker from an earlier incarnation no longer describes this run."""
    try:
        os.remove(os.path.join(run_dir, STOP_MARKER))
    except FileNotFoundError:
        pass


def owned_child_setup() -> None:
    """``preexec_fn`` for server processes a trainer rank owns: ignore the stop signals (the
    trainer decides when they go; an ignored disposition survives exec, and megarl-server keeps
    it) and get SIGKILL when the parent thread dies (Linux prctl; a no-op elsewhere). Runs in the
    forked child before exec, so it only makes async-signal-safe calls."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()


def die_with_parent() -> None:
    """``preexec_fn``: SIGKILL when the parent thread dies (Linux prctl; a no-op elsewhere)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _load_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # resolved in the parent, called in the child
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()
