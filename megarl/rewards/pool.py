"""Sync reward functions in worker processes (``reward.executor: process``).

A verifier that burns CPU in Python (sympy, a code checker) holds the GIL: on threads it slows the
event loop that streams rollouts and the trainer beside it. In a worker process it does not.

    pool = RewardProcessPool("pkg.mod:fn", args={}, workers=4, timeout_s=60)
    score = await pool.submit(prompt, completion, meta)      # a float, or raises
    pool.close()

Each worker is a fresh interpreter that imports the function by its path (``reward.args`` build a
class, as in-process) and serves calls over a pipe, one at a time. Each worker has a driver thread
here that takes the next call from one queue, sends it and waits for the answer. ``timeout_s``
counts from when a worker takes the call (time queued behind other calls does not count): a worker
that overruns is killed (SIGKILL) and replaced, so a hung verifier never holds a worker for
good, which a thread can (a thread cannot be stopped). A worker that dies (a crash in native
code, ``os._exit``) is replaced too; the call gets an error. Workers start on the first call,
ignore the stop signals (the trainer decides when they go: its step finishes and saves first)
and get SIGKILL when their driver thread ends (Linux), so none outlives the trainer.

The pipe protocol, one dataclass per message (pickled by `multiprocessing.connection`):

    trainer -> worker   WorkerStart(sys_path, path, args)     once, first
    worker -> trainer   WorkerReady()                         after the imports
    trainer -> worker   RewardCall(prompt, completion, meta)  then, one at a time
    worker -> trainer   RewardReply(ok, value)                value: the score, or the error text
"""
from __future__ import annotations

import asyncio
import queue
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Optional

from megarl.common.signals import owned_child_setup

__all__ = ["RewardProcessPool", "RewardWorkerDied", "deliver"]

_STOP = None
_STARTUP_S = 120.0  # a new worker's imports (the reward module's too) on a loaded machine


class RewardWorkerDied(RuntimeError):
    """The worker process serving a call exited before it answered."""


@dataclass(frozen=True)
class WorkerStart:
    """The first message to a new worker: the trainer's sys.path, the function's path and args."""

    sys_path: list
    path: str
    args: Optional[dict]


@dataclass(frozen=True)
class WorkerReady:
    """The worker imported the function (or failed to: each call then reports why)."""


@dataclass(frozen=True)
class RewardCall:
    """One reward call: ``fn(prompt, completion, meta)``."""

    prompt: str
    completion: str
    meta: dict


@dataclass(frozen=True)
class RewardReply:
    """The answer to a `RewardCall`: ``ok`` and the score, or not ``ok`` and the error's text."""

    ok: bool
    value: Any


def _worker_main(fd: int) -> None:
    """A worker's entry (``python -c``): its end of the socket pair, the trainer's sys.path and
    the function's path and args first, then calls."""
    conn = Connection(fd)
    start: WorkerStart = conn.recv()
    sys.path[:] = start.sys_path  # the trainer's, at the time of the start (tests add plugin dirs)
    _serve(conn, start.path, start.args)


def _serve(conn, path: str, args: Optional[dict]) -> None:
    """Load the function, then answer a `RewardReply` per `RewardCall`."""
    from megarl.rewards.loader import load_reward_fn

    try:
        fn = load_reward_fn(path, args)
    except Exception as e:  # noqa: BLE001 - every call reports it
        fn, load_error = None, f"{type(e).__name__}: {e}"
    conn.send(WorkerReady())  # the deadlines of calls start after the imports
    while True:
        try:
            call: RewardCall = conn.recv()
        except (EOFError, OSError):
            return  # the trainer is gone
        try:
            if fn is None:
                raise RuntimeError(load_error)
            reply = RewardReply(True, fn(call.prompt, call.completion, call.meta))
        except BaseException as e:  # noqa: BLE001 - user code: delivered to the caller
            reply = RewardReply(False, f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - e.g. a result that does not pickle
            conn.send(RewardReply(False, f"reward result cannot be sent back: {type(e).__name__}: {e}"))


class _Worker:
    """One worker process and its socket; owned by one driver thread. A plain interpreter
    (``subprocess``, not multiprocessing's spawn, which would import the trainer's main module and
    with it torch and Megatron into every worker)."""

    def __init__(self, path: str, args: Optional[dict]):
        self._path, self._args = path, args
        self.proc: Optional[subprocess.Popen] = None
        self.conn: Optional[Connection] = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_started(self) -> None:
        if self.alive():
            return
        if self.proc is not None:
            self.kill()
        ours, theirs = socket.socketpair()
        code = f"from megarl.rewards.pool import _worker_main; _worker_main({theirs.fileno()})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, preexec_fn=owned_child_setup)
        theirs.close()
        self.conn = Connection(ours.detach())
        try:
            self.conn.send(WorkerStart(list(sys.path), self._path, self._args))
            if self.conn.poll(_STARTUP_S) and isinstance(self.conn.recv(), WorkerReady):
                return
        except (EOFError, OSError):
            pass
        code = self.kill()
        raise RewardWorkerDied(f"reward worker did not start within {_STARTUP_S:.0f} s (exit code {code})")

    def call(self, request: RewardCall, timeout_s: float) -> RewardReply:
        """The reply to one call; raises TimeoutError / RewardWorkerDied (the worker is then gone)."""
        self.ensure_started()
        try:
            self.conn.send(request)
            answered = self.conn.poll(timeout_s if timeout_s > 0 else None)
            if answered:
                return self.conn.recv()
        except (EOFError, OSError):
            code = self.kill()
            raise RewardWorkerDied(f"reward worker exited (code {code}) during the call") from None
        self.kill()
        raise asyncio.TimeoutError(f"reward timed out after {timeout_s} s (worker killed)")

    def kill(self) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        self.conn.close()
        self.proc = self.conn = None
        return code


def _settle(fut: asyncio.Future, ok: bool, value) -> None:
    if not fut.done():  # cancelled by the caller meanwhile (e.g. its deadline passed)
        fut.set_result(value) if ok else fut.set_exception(value)


def deliver(loop, fut: asyncio.Future, ok: bool, value) -> None:
    """From another thread: the result (ok) or exception of `fut`, on its loop. Reward threads
    and the pool's driver threads both answer this way."""
    try:
        loop.call_soon_threadsafe(_settle, fut, ok, value)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting
        pass


class RewardProcessPool:
    """``await pool.submit(prompt, completion, meta)`` on `workers` processes (module docstring)."""

    def __init__(self, path: str, args: Optional[dict] = None, workers: int = 4, timeout_s: float = 0.0):
        if workers < 1:
            raise ValueError(f"reward.num_workers: must be >= 1, got {workers}")
        self.path, self.args, self.workers, self.timeout_s = path, dict(args or {}), workers, timeout_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.restarts = 0  # workers replaced after a timeout or a crash

    def _start(self) -> None:
        with self._lock:
            if self._threads or self._closed:
                return
            for i in range(self.workers):
                w = _Worker(self.path, self.args or None)
                t = threading.Thread(target=self._drive, args=(w,), name=f"megarl-reward-driver-{i}",
                                     daemon=True)
                t.start()
                self._threads.append(t)
                self._workers.append(w)

    def submit(self, prompt: str, completion: str, meta: dict) -> asyncio.Future:
        if self._closed:
            raise RuntimeError("reward process pool is closed")
        self._start()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._calls.put((loop, fut, RewardCall(prompt, completion, meta)))
        return fut

    def _drive(self, worker: _Worker) -> None:
        try:
            worker.ensure_started()  # all workers start together, on the first call
        except RewardWorkerDied:
            pass  # tried again (and reported) by the first call it takes
        while True:
            item = self._calls.get()
            if item is _STOP:
                worker.kill()
                return
            loop, fut, request = item
            if fut.done():  # the caller gave up while the call was queued
                continue
            if self._closed:
                deliver(loop, fut, False, RuntimeError("reward process pool is closed"))
                continue
            try:
                reply = worker.call(request, self.timeout_s)  # (re)starts the worker first
                ok, value = reply.ok, reply.value
                if not ok:
                    value = RuntimeError(value)
            except (asyncio.TimeoutError, RewardWorkerDied) as e:
                self.restarts += 1
                ok, value = False, e
            except Exception as e:  # noqa: BLE001 - e.g. arguments that do not pickle
                ok, value = False, e
            deliver(loop, fut, ok, value)

    def close(self) -> None:
        """Stop every worker; a call still running (a hung verifier) is killed. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads, self._threads = self._threads, []
        for _ in threads:
            self._calls.put(_STOP)
        for w in self._workers:  # a driver blocked on a hung call wakes up with EOF
            proc = w.proc
            if proc is not None and proc.poll() is None:
                proc.kill()
        for t in threads:
            t.join(timeout=10)
