"""Token batches for the engine: one padded-tensor batch per step, sliced into micro-batches.

A :class:`TensorBatch` is this DP rank's share of a step, built ONCE and then only indexed: from
the step's flat arrays (`from_flat`: samples back to back, the rollout manager's layout, one
masked assignment per field and no Python per sample), per-sample lists (`from_lists`) or
trajectories (`from_trajectories`):

    tokens         [B, S] long     right-padded with 0
    lengths        [B]    long     real tokens per row
    fields[name]   [B, S] float32  token-aligned, 0 past the row's length (loss_mask, behave_logp,
                                   versions, advantages, returns, prox_logp, ref_logp, values, ...)
    sample_fields  [B]             one value per sample (rewards float64, group_ids long, ...)
    routes         [B, S, layers, k]  MoE routing replay, optional (`Routes`): expert ids int32
                                   (-1: no route) and weights float32 (NaN: none), padded with -1 / NaN

Padding carries loss_mask 0 and sits after the real tokens, so causal attention needs no mask and
every masked sum ignores it. `make_microbatches` cuts token-budget micro-batches by indexing rows
of these tensors (no per-token Python). `per_sample` gives per-row views for tools that write
variable-length lists (megarl-logprobs, test workers).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch

from megarl.data.datasets import pack_microbatches

def valid_mask(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, seq_len] bool, True on the first lengths[i] positions of row i."""
    return torch.arange(seq_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def pad_sequences(rows: Sequence[Sequence[float]], dtype=torch.float32,
                  seq_len: Optional[int] = None) -> torch.Tensor:
    """Variable-length rows -> a right-zero-padded [B, S] tensor (S = longest row unless given),
    filled by one boolean-mask assignment of the concatenated rows."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    s = int(lengths.max()) if len(rows) and seq_len is None else (seq_len or 0)
    out = torch.zeros(len(rows), s, dtype=dtype)
    # A row-major boolean assignment visits row 0's real positions first, then row 1's, ...:
    # exactly the order of the concatenated rows.
    out[valid_mask(lengths, s)] = torch.tensor(list(chain.from_iterable(rows)), dtype=dtype)
    return out


def per_sample(t: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> list[torch.Tensor]:
    """[B, S] -> B views of the real positions (row i: t[i, :lengths[i]])."""
    lens = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    return [t[i, :n] for i, n in enumerate(lens)]


def _sample_tensor(values: Any) -> torch.Tensor:
    """Per-sample values -> [B]: ints stay int64, anything else becomes float64 (a reward of 0.1
    must reach the advantage estimator as the same double it was in Python)."""
    if isinstance(values, torch.Tensor):
        return values
    values = list(values)
    exact_int = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    return torch.tensor(values, dtype=torch.long if exact_int and values else torch.float64)


def _tensor(x: Any) -> torch.Tensor:
    """A numpy array (or tensor) as a tensor, sharing its memory; a read-only array is copied
    (torch cannot share memory it may not write)."""
    if isinstance(x, torch.Tensor):
        return x
    x = np.asarray(x)
    return torch.from_numpy(x if x.flags.writeable else x.copy())


@dataclass
class Routes:
    """Per-token MoE routing of padded rows: ``ids`` int32 [B, S, layers, k] (-1 where a position
    has no route: padding, the last position of a sample, dense layers) and ``weights`` float32
    in the same layout (NaN where the rollout sent ids only)."""

    ids: torch.Tensor
    weights: torch.Tensor

    def coverage(self, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions that carry a route on every MoE layer, positions) over the positions that
        fed a sampled or prompt token, 0..length-2 of each row; MoE layers = those with a route
        somewhere in the batch (a dense layer has none)."""
        fed = valid_mask(lengths - 1, self.ids.shape[1])
        has = self.ids[..., 0] >= 0  # [B, S, layers]
        moe = has.flatten(0, 1).any(0)
        full = has[..., moe].all(-1) & fed if bool(moe.any()) else torch.zeros_like(fed)
        return full.sum(), fed.sum()

    def select(self, idx: torch.Tensor, s: int) -> "Routes":
        return Routes(self.ids[idx, :s], self.weights[idx, :s])

    def to(self, device) -> "Routes":
        return Routes(self.ids.to(device), self.weights.to(device))

    @classmethod
    def from_trajectories(cls, trajs: Sequence[Any], seq_len: int) -> Optional["Routes"]:
        """None unless every trajectory carries routes (`Trajectory.routes`)."""
        if not trajs or any(getattr(t, "routes", None) is None for t in trajs):
            return None
        layers, k = trajs[0].routes.ids.shape[1:]
        ids = torch.full((len(trajs), seq_len, layers, k), -1, dtype=torch.int32)
        w = torch.full((len(trajs), seq_len, layers, k), float("nan"), dtype=torch.float32)
        for i, t in enumerate(trajs):
            n = t.routes.rows
            ids[i, :n] = torch.from_numpy(np.ascontiguousarray(t.routes.ids, np.int32))
            w[i, :n] = torch.from_numpy(np.ascontiguousarray(t.routes.weights, np.float32))
        return cls(ids, w)


@dataclass
class TensorBatch:
    """Padded-tensor batch (module docstring). Immutable by convention: `with_fields`,
    `with_sample_fields` and `select` return new batches sharing the untouched tensors."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    sample_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    routes: Optional[Routes] = None

    def __post_init__(self):
        b = self.tokens.shape[0]
        if self.tokens.dim() != 2 or self.lengths.shape != (b,):
            raise ValueError(f"batch: tokens {tuple(self.tokens.shape)} must be [B, S] and "
                             f"lengths {tuple(self.lengths.shape)} [B]")
        if self.routes is not None and (self.routes.ids.shape[:2] != self.tokens.shape
                                        or self.routes.weights.shape != self.routes.ids.shape):
            raise ValueError(f"batch routes: ids {tuple(self.routes.ids.shape)} / weights "
                             f"{tuple(self.routes.weights.shape)} must be [B, S, layers, k] with "
                             f"[B, S] = {tuple(self.tokens.shape)}")
        for name, t in self.fields.items():
            if t.shape != self.tokens.shape:
                raise ValueError(f"batch field {name!r}: shape {tuple(t.shape)}, expected "
                                 f"{tuple(self.tokens.shape)}")
        for name, t in self.sample_fields.items():
            if t.shape != (b,):
                raise ValueError(f"batch sample field {name!r}: shape {tuple(t.shape)}, "
                                 f"expected ({b},)")
            if name in self.fields:
                raise ValueError(f"batch: {name!r} is both a token and a sample field")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_lists(cls, input_ids: Sequence[Sequence[int]],
                   fields: Optional[Mapping[str, Sequence[Sequence[float]]]] = None,
                   sample_fields: Optional[Mapping[str, Iterable]] = None) -> "TensorBatch":
        """Per-sample token lists (+ token-aligned float lists, + per-sample values)."""
        lengths = torch.tensor([len(x) for x in input_ids], dtype=torch.long)
        for name, rows in (fields or {}).items():
            bad = [i for i, (r, n) in enumerate(zip(rows, lengths.tolist())) if len(r) != n]
            if len(rows) != len(input_ids) or bad:
                raise ValueError(f"batch field {name!r}: not token-aligned with input_ids "
                                 f"({len(rows)} samples for {len(input_ids)}; rows {bad[:5]})")
        return cls(pad_sequences(input_ids, torch.long), lengths,
                   {k: pad_sequences(v) for k, v in (fields or {}).items()},
                   {k: _sample_tensor(v) for k, v in (sample_fields or {}).items()})

    @classmethod
    def from_trajectories(cls, trajs: Sequence[Any]) -> "TensorBatch":
        """Rollout trajectories (duck-typed `megarl.protocol.types.Trajectory`: input_ids,
        loss_mask, behave_logp, versions lists, reward, group_id) -> fields loss_mask,
        behave_logp, versions and sample fields rewards, group_ids; the MoE routes when every
        trajectory has them."""
        batch = cls.from_lists(
            [t.input_ids for t in trajs],
            {"loss_mask": [t.loss_mask for t in trajs],
             "behave_logp": [t.behave_logp for t in trajs],
             "versions": [t.versions for t in trajs]},
            {"rewards": torch.tensor([float(t.reward) for t in trajs], dtype=torch.float64),
             "group_ids": torch.tensor([int(t.group_id) for t in trajs], dtype=torch.long)})
        batch.routes = Routes.from_trajectories(trajs, batch.seq_len)
        batch.__post_init__()
        return batch

    @classmethod
    def from_flat(cls, input_ids: Any, lengths: Any, fields: Optional[Mapping[str, Any]] = None,
                  sample_fields: Optional[Mapping[str, Any]] = None,
                  routes: Optional[tuple[Any, Any]] = None) -> "TensorBatch":
        """Samples back to back (numpy or torch): ``input_ids`` and each of ``fields`` [T] with
        T = sum(lengths), ``sample_fields`` [B], ``routes`` (ids, weights) [T, layers, k]. Each
        padded tensor is filled by one boolean-mask assignment (row-major: row 0's tokens first,
        exactly the flat order); token fields become float32, sample fields keep their dtype."""
        lengths = _tensor(lengths).long()
        n_tok, b = int(lengths.sum()), len(lengths)
        s = int(lengths.max()) if b else 0
        mask = valid_mask(lengths, s)

        def pad(name: str, flat: Any, dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
            flat = _tensor(flat)
            if flat.shape[:1] != (n_tok,):
                raise ValueError(f"batch field {name!r}: {tuple(flat.shape)[:1]} tokens, expected "
                                 f"{n_tok} (the sum of lengths)")
            out = torch.full((b, s, *flat.shape[1:]), fill, dtype=dtype)
            out[mask] = flat.to(dtype)
            return out

        return cls(pad("input_ids", input_ids, torch.long), lengths,
                   {k: pad(k, v, torch.float32) for k, v in (fields or {}).items()},
                   {k: _tensor(v) for k, v in (sample_fields or {}).items()},
                   Routes(pad("route_ids", routes[0], torch.int32, -1),
                          pad("route_weights", routes[1], torch.float32, float("nan")))
                   if routes is not None else None)

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def __contains__(self, name: str) -> bool:
        return name in self.fields or name in self.sample_fields

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.fields:
            return self.fields[name]
        return self.sample_fields[name]

    def with_fields(self, **fields: torch.Tensor) -> "TensorBatch":
        """A new batch with these [B, S] token fields added or replaced."""
        return TensorBatch(self.tokens, self.lengths, {**self.fields, **fields},
                           dict(self.sample_fields), self.routes)

    def with_sample_fields(self, **sample_fields: Any) -> "TensorBatch":
        """A new batch with these [B] per-sample fields added or replaced."""
        new = {k: _sample_tensor(v) for k, v in sample_fields.items()}
        return TensorBatch(self.tokens, self.lengths, dict(self.fields),
                           {**self.sample_fields, **new}, self.routes)

    def select(self, indices: Sequence[int] | torch.Tensor) -> "TensorBatch":
        """Rows `indices` (in that order), padding trimmed to the longest selected row."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        # Advanced indexing copies: the new batch never aliases rows of this one.
        lengths = self.lengths[idx]
        s = int(lengths.max()) if len(idx) else 0
        return TensorBatch(self.tokens[idx, :s], lengths,
                           {k: v[idx, :s] for k, v in self.fields.items()},
                           {k: v[idx] for k, v in self.sample_fields.items()},
                           self.routes.select(idx, s) if self.routes is not None else None)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s] long, right-padded with 0
    position_ids: torch.Tensor  # [b, s]
    fields: dict[str, torch.Tensor]  # [b, s] float32, zero-padded
    lengths: torch.Tensor  # [b] long, on the device of `tokens`
    indices: torch.Tensor  # [b] long (CPU): rows of the TensorBatch
    step_tokens: float = 1.0  # loss_mask tokens in the whole step (all micro-batches, all DP)
    routes: Optional[Routes] = None  # [b, s, layers, k] MoE routing to replay, on `tokens`' device
    pack: Optional[Any] = None  # `megarl.trainer.packing.Pack` when the model runs it packed (THD)
    cp: Optional[Any] = None  # `megarl.trainer.context.CPLocal`: this rank's share under context parallelism

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]

    @property
    def valid(self) -> torch.Tensor:
        """[b, s] 1.0 on real (non-padding) positions."""
        return valid_mask(self.lengths, self.tokens.shape[1]).float()


def make_microbatches(batch: TensorBatch, max_tokens: int, device, padded: bool = True) -> list[MicroBatch]:
    """Packs rows into micro-batches of at most ``max_tokens`` tokens - padded (rows x the longest),
    or real (``padded=False``: the model runs them packed) - a longer row gets a micro-batch of its
    own; each trimmed to its longest row; deterministic, so every TP/PP peer builds the same ones."""
    out = []
    # The packer plans over B lengths (Python ints), never over tokens.
    for idx in pack_microbatches(batch.lengths.tolist(), max_tokens, padded=padded):
        sub = batch.select(idx)
        b, s = sub.tokens.shape
        # Positions restart at 0 in every row: each row is one sequence (no packing).
        pos = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous()
        out.append(MicroBatch(sub.tokens.to(device), pos.to(device),
                              {k: v.to(device) for k, v in sub.fields.items()},
                              sub.lengths.to(device), torch.as_tensor(idx, dtype=torch.long),
                              routes=sub.routes.to(device) if sub.routes is not None else None))
    return out
