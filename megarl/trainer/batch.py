"""Token batches for the engine: variable-length samples -> padded, token-budget micro-batches.

A :class:`SequenceBatch` is this DP rank's share of a step: ``input_ids`` per sample plus
token-aligned float fields (``loss_mask``, ``behave_logp``, ``advantages``, ...). Micro-batches
are right-padded (padding carries loss_mask 0, so causal attention needs no mask).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.data.datasets import pack_microbatches


@dataclass
class SequenceBatch:
    input_ids: list[list[int]]
    fields: dict[str, list[list[float]]] = field(default_factory=dict)
    """Token-aligned per-sample lists (same length as the sample's input_ids)."""

    def __post_init__(self):
        for name, values in self.fields.items():
            if len(values) != len(self.input_ids):
                raise ValueError(f"batch field {name!r}: {len(values)} samples, "
                                 f"expected {len(self.input_ids)}")
            for i, (v, ids) in enumerate(zip(values, self.input_ids)):
                if len(v) != len(ids):
                    raise ValueError(f"batch field {name!r}: sample {i} has {len(v)} entries "
                                     f"for {len(ids)} tokens")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> list[int]:
        return [len(x) for x in self.input_ids]

    def select(self, indices: list[int]) -> "SequenceBatch":
        return SequenceBatch([self.input_ids[i] for i in indices],
                             {k: [v[i] for i in indices] for k, v in self.fields.items()})


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s] long, right-padded with 0
    position_ids: torch.Tensor  # [b, s]
    fields: dict[str, torch.Tensor]  # [b, s] float32, zero-padded
    lengths: list[int]
    indices: list[int]  # positions in the SequenceBatch
    step_tokens: float = 1.0  # loss_mask tokens in the whole step (all micro-batches, all DP)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]

    @property
    def valid(self) -> torch.Tensor:
        """[b, s] 1.0 on real (non-padding) positions."""
        s = self.tokens.shape[1]
        return (torch.arange(s).unsqueeze(0) < torch.tensor(self.lengths).unsqueeze(1)).float()


def make_microbatches(batch: SequenceBatch, max_tokens: int, device) -> list[MicroBatch]:
    """Packs samples into micro-batches of at most ``max_tokens`` padded tokens (a longer sample
    gets a micro-batch of its own); deterministic, so every TP/PP peer builds the same ones."""
    out = []
    for idx in pack_microbatches(batch.lengths, max_tokens):
        lens = [len(batch.input_ids[i]) for i in idx]
        s = max(lens)
        tokens = torch.zeros(len(idx), s, dtype=torch.long)
        fields = {k: torch.zeros(len(idx), s, dtype=torch.float32) for k in batch.fields}
        for row, i in enumerate(idx):
            n = lens[row]
            tokens[row, :n] = torch.tensor(batch.input_ids[i], dtype=torch.long)
            for k, v in batch.fields.items():
                fields[k][row, :n] = torch.tensor(v[i], dtype=torch.float32)
        pos = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(len(idx), s).contiguous()
        out.append(MicroBatch(tokens.to(device), pos.to(device),
                              {k: v.to(device) for k, v in fields.items()}, lens, list(idx)))
    return out
