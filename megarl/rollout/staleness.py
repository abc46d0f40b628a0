"""Staleness control and backpressure for asynchronous rollouts (AReaL's bounded off-policyness).

A unit of work is one *episode* (one prompt's group of samples). The trainer consumes
``batch_size`` episodes per policy version (one push; with verl's trigger_parameter_sync_step = k,
k training steps' worth). An episode submitted while the trainer is at version v must be consumed
by version v + max_staleness at the latest, so the number of episodes ever submitted must stay
within

    accepted + running  <=  floor((max_staleness + v + 1) * batch_size)

and at most ``max_concurrent`` run at once. Hence the number of episodes that may start now:

    capacity = min(max_concurrent - running,
                   floor((max_staleness + v + 1) * batch_size) - (accepted + running))

``max_staleness = 0`` is on-policy RL: the next batch starts only after the weights it needs
exist. A fractional max_staleness is verl's staleness_threshold: at most that fraction of a
version's samples is generated ahead (stale by one version). Rejected episodes (filtered out,
failed) free their slot without counting as accepted. After a restart the buffered and running
episodes are gone, so ``rebase(consumed)`` restarts the count from what was trained (AReaL's
recovery: accepted = version x batch_size when pushes align with checkpoints).
"""
from __future__ import annotations

import enum
import math
import threading
from dataclasses import dataclass
from typing import Protocol


class VersionProvider(Protocol):
    def get_version(self) -> int: ...


class EpisodeState(enum.Enum):
    RUNNING = "running"
    ACCEPTED = "accepted"
    REJECTED = "rejected"


@dataclass
class StalenessStats:
    version: int
    running: int
    accepted: int
    rejected: int
    capacity: int


class StalenessManager:
    """Thread-safe counters; the executor asks :meth:`capacity` before starting episodes."""

    def __init__(self, batch_size: int, max_staleness: float, max_concurrent: int,
                 versions: VersionProvider):
        if batch_size < 1 or max_staleness < 0 or max_concurrent < 1:
            raise ValueError("staleness: batch_size >= 1, max_staleness >= 0, max_concurrent >= 1")
        self.batch_size, self.max_staleness, self.max_concurrent = batch_size, max_staleness, max_concurrent
        self.versions = versions
        self._lock = threading.Lock()
        self._count = {s: 0 for s in EpisodeState}

    def _capacity(self) -> int:
        running, accepted = self._count[EpisodeState.RUNNING], self._count[EpisodeState.ACCEPTED]
        v = self.versions.get_version()
        # floor of a float product: +1e-9 keeps e.g. (0.5 + 1) * 4 = 6 from rounding down to 5
        by_staleness = math.floor((self.max_staleness + v + 1) * self.batch_size + 1e-9) - (accepted + running)
        # max(0, ...): after a rebase or an unaccept the bound can be overdrawn; nothing starts until it recovers
        return max(0, min(self.max_concurrent - running, by_staleness))

    def capacity(self) -> int:
        with self._lock:
            return self._capacity()

    def try_start(self, n: int = 1) -> int:
        """Reserves up to ``n`` episode slots atomically; returns how many were granted."""
        # check and reserve under one lock: the executor and finish() run on different threads
        with self._lock:
            granted = min(n, self._capacity())
            self._count[EpisodeState.RUNNING] += granted
            return granted

    def finish(self, state: EpisodeState) -> None:
        """A running episode ended as ACCEPTED (delivered to the buffer) or REJECTED."""
        if state is EpisodeState.RUNNING:
            raise ValueError("finish() needs ACCEPTED or REJECTED")
        with self._lock:
            if self._count[EpisodeState.RUNNING] < 1:
                raise RuntimeError("staleness: finish() without a running episode")
            self._count[EpisodeState.RUNNING] -= 1
            # rejected episodes count nowhere in the bound: their slot is free for a new prompt at once
            self._count[state] += 1

    def stats(self) -> StalenessStats:
        with self._lock:
            c = self._count
            return StalenessStats(self.versions.get_version(), c[EpisodeState.RUNNING],
                                  c[EpisodeState.ACCEPTED], c[EpisodeState.REJECTED], self._capacity())

    def state_dict(self) -> dict:
        """Accepted/rejected totals (running episodes are lost on restart and not counted)."""
        with self._lock:
            return {"accepted": self._count[EpisodeState.ACCEPTED],
                    "rejected": self._count[EpisodeState.REJECTED]}

    def unaccept(self) -> None:
        """An accepted episode was discarded before training (too stale): its slot is free again."""
        with self._lock:
            self._count[EpisodeState.ACCEPTED] -= 1

    def rebase(self, accepted: int) -> None:
        """A fresh start from a checkpoint: ``accepted`` episodes were trained, none runs."""
        # trained groups, not the saved accepted count: buffered groups of the old run were never trained
        with self._lock:
            self._count[EpisodeState.ACCEPTED] = int(accepted)
            self._count[EpisodeState.REJECTED] = 0
            self._count[EpisodeState.RUNNING] = 0

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self._count[EpisodeState.ACCEPTED] = int(state["accepted"])
            self._count[EpisodeState.REJECTED] = int(state["rejected"])
            self._count[EpisodeState.RUNNING] = 0
