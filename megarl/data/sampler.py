"""`ResumableSampler`: the prompt order of RL training - shuffled by (seed, epoch), endless,
resumable from three integers. One owner (the rollout controller) draws from it.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

__all__ = ["ResumableSampler"]


class ResumableSampler:
    """Endless stream of indices in [0, n): a fresh permutation each epoch, fixed by (seed, epoch).

    The state is three integers, so a restored sampler yields exactly the indices the original
    would have yielded next. Not thread-safe: one owner (the controller) draws from it.
    """

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True):
        if n < 1:
            raise ValueError(f"cannot sample from an empty dataset (n={n})")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def next_index(self) -> int:
        if self.position == self.n:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        idx = int(self._order[self.position])
        self.position += 1
        return idx

    def next_batch(self, batch_size: int) -> list[int]:
        """The next `batch_size` indices; a batch may straddle an epoch boundary."""
        return [self.next_index() for _ in range(batch_size)]

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self.next_index()

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["n"]) != self.n:
            raise ValueError(f"sampler state is for a dataset of {state['n']} samples, not {self.n}")
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
