"""A mixture of RL prompt sources (``data.sources``): one index space over several files, and the
draw order that gives each source its weight's share.

    SourceMixture     the sources' prompts end to end: global index = the source's offset + its
                      own index; every sample carries its source's name (``PromptSample.source``)
    MixtureSampler    each draw takes the source furthest below its share (largest
                      weight x (draws + 1) - its draws; ties: the earlier source), then that
                      source's next prompt from its own `ResumableSampler` (shuffled per epoch,
                      seeded per source). The shares stay within one draw of the weights at every
                      point of the run; the state is integers (draws per source and each source's
                      sampler), so a resumed run draws exactly what the original would have.

The rollout controller sees one dataset and one sampler: the exactly-once ledger, the staleness
clock and resume work per draw as with one file.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from megarl.data.prompts import PromptDataset, PromptSample
from megarl.data.sampler import ResumableSampler

__all__ = ["SourceMixture", "MixtureSampler"]


class MixtureSampler:
    """Endless stream of global indices (see module docstring). Not thread-safe: one owner."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int = 0,
                 shuffles: Sequence[bool] | None = None, names: Sequence[str] | None = None):
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"a mixture needs one weight per source, got {len(sizes)} sources and {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise ValueError(f"source weights must be > 0, got {list(weights)}")
        self.names = list(names or [str(i) for i in range(len(sizes))])
        total = float(sum(weights))
        self.shares = [w / total for w in weights]
        shuffles = list(shuffles) if shuffles is not None else [True] * len(sizes)
        # source i's own order: seeded apart from the others (1_000_003, a prime), source 0 by the run's seed
        self.samplers = [ResumableSampler(n, seed=seed + 1_000_003 * i, shuffle=s)
                         for i, (n, s) in enumerate(zip(sizes, shuffles))]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.n = sum(sizes)
        self.draws = [0] * len(sizes)

    def next_source(self) -> int:
        t = sum(self.draws) + 1
        return max(range(len(self.draws)), key=lambda i: (self.shares[i] * t - self.draws[i], -i))

    def next_index(self) -> int:
        i = self.next_source()
        self.draws[i] += 1
        return self.offsets[i] + self.samplers[i].next_index()

    def next_batch(self, batch_size: int) -> list[int]:
        return [self.next_index() for _ in range(batch_size)]

    def state_dict(self) -> dict:
        return {"n": self.n, "names": list(self.names), "draws": list(self.draws),
                "sources": [s.state_dict() for s in self.samplers]}

    def load_state_dict(self, state: dict) -> None:
        if list(state.get("names", [])) != self.names:
            raise ValueError(f"sampler state is for the sources {state.get('names')}, not {self.names} "
                             "(data.sources changed since the checkpoint)")
        for name, sampler, s in zip(self.names, self.samplers, state["sources"]):
            try:
                sampler.load_state_dict(s)
            except ValueError as e:
                raise ValueError(f"source {name!r}: {e}") from None
        self.draws = [int(d) for d in state["draws"]]


class SourceMixture:
    """The prompts of several `PromptDataset`s under one index (see module docstring);
    ``datasets``: {source name: its dataset}, in data.sources order."""

    def __init__(self, datasets: dict[str, PromptDataset], weights: Sequence[float]):
        self.names = list(datasets)
        self.datasets = list(datasets.values())
        self.weights = list(weights)
        self.samples: list[PromptSample] = []
        self.bounds: list[tuple[int, int]] = []
        for name, ds in datasets.items():
            if not ds.samples:
                raise ValueError(f"data.sources {name!r} ({ds.path}): no prompts left ({ds.stats})")
            start = len(self.samples)
            self.samples += [dataclasses.replace(s, index=start + s.index, source=name) for s in ds.samples]
            self.bounds.append((start, len(self.samples)))
        self.path = ", ".join(ds.path for ds in self.datasets)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> PromptSample:
        return self.samples[i]

    def source_of(self, index: int) -> str:
        return self.samples[index].source

    @property
    def stats(self) -> dict:
        """The prompt-length accounting (`PromptDataset.stats`) summed, and per source as <name>/<key>."""
        out: dict = {}
        for name, ds in zip(self.names, self.datasets):
            for k, v in ds.stats.items():
                out[k] = out.get(k, 0) + v
                out[f"{name}/{k}"] = v
        return out

    def make_sampler(self, seed: int) -> MixtureSampler:
        return MixtureSampler([len(ds.samples) for ds in self.datasets], self.weights, seed,
                              [ds.shuffle for ds in self.datasets], self.names)
