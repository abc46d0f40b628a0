"""Metrics as masked sums with explicit denominators.

Every function in `megarl.algo` that reports metrics returns `dict[str, Stat]`. A `Stat` is NOT a
mean: it is a sum (or a max) over the loss tokens of one micro-batch together with the number of
tokens behind it. The caller merges the stats of all micro-batches (`merge_stats`), all-reduces
`value` (SUM, or MAX for `Reduce.MAX`) and `count` (SUM) over the data-parallel group once per
step, and only then divides (`Stat.result`). This keeps a metric independent of how a step was cut
into micro-batches and DP shards, which a per-micro-batch mean is not.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class Reduce(str, Enum):
    """How `value` combines across micro-batches and ranks (`count` always sums)."""

    SUM = "sum"
    MAX = "max"


@dataclass
class Stat:
    """One metric: `value` is a masked sum (or max), `count` the number of tokens it covers.

    Both are detached 0-dim tensors on the device of the inputs, so a caller can stack many stats
    into one tensor for a single all-reduce.
    """

    value: torch.Tensor
    count: torch.Tensor
    reduce: Reduce = Reduce.SUM

    @classmethod
    def masked_mean(cls, x: torch.Tensor, mask: torch.Tensor) -> "Stat":
        """sum_{t: mask_t} x_t over count = sum_t mask_t; `result()` gives the masked mean."""
        m = mask.bool()
        x = x.detach()
        value = torch.where(m, x, torch.zeros_like(x)).sum()
        return cls(value, m.sum().to(value.dtype), Reduce.SUM)

    @classmethod
    def masked_max(cls, x: torch.Tensor, mask: torch.Tensor) -> "Stat":
        """max_{t: mask_t} x_t (-inf when no token is masked in)."""
        m = mask.bool()
        x = x.detach()
        filled = torch.where(m, x, torch.full_like(x, float("-inf")))
        value = filled.max() if filled.numel() else x.new_tensor(float("-inf"))
        return cls(value, m.sum().to(value.dtype), Reduce.MAX)

    def merge(self, other: "Stat") -> "Stat":
        if self.reduce != other.reduce:
            raise ValueError(f"cannot merge a {self.reduce.value} stat with a {other.reduce.value} stat")
        if self.reduce == Reduce.SUM:
            value = self.value + other.value
        else:
            value = torch.maximum(self.value, other.value)
        return Stat(value, self.count + other.count, self.reduce)

    def result(self) -> float:
        """The final number: value / count for SUM, value for MAX; 0.0 when count == 0."""
        if float(self.count) == 0.0:
            return 0.0
        if self.reduce == Reduce.SUM:
            return float(self.value) / float(self.count)
        return float(self.value)


def merge_stats(a: dict[str, Stat], b: dict[str, Stat]) -> dict[str, Stat]:
    """Union of two stat dicts; stats present in both are merged (micro-batch accumulation)."""
    out = dict(a)
    for name, stat in b.items():
        out[name] = out[name].merge(stat) if name in out else stat
    return out


def stats_results(stats: dict[str, Stat]) -> dict[str, float]:
    """`Stat.result()` for every entry (call after the cross-rank reduction)."""
    return {name: stat.result() for name, stat in stats.items()}
