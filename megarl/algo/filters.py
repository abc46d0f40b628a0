"""DAPO extras: dynamic-sampling group filter and overlong reward shaping.

Dynamic sampling (`algo.dynamic_sampling`): a group whose rewards are all equal has zero
group-relative advantage everywhere and only dilutes the batch, so it is dropped (a one-sample
group is trivially all-equal and is dropped too). The caller keeps sampling until the batch is
full again.

Overlong shaping (`algo.overlong_buffer_len` = N, `algo.overlong_penalty_factor` = f), added to
the outcome reward, with L the response length and L_max the rollout's max response length:

    R_len(L) = 0                               L <= L_max - N
             = -f (L - (L_max - N)) / N        L_max - N < L <= L_max
             = -f                              L > L_max

Composed as DAPO defines them (`shape_and_filter`): the reward is shaped first, then a group is
dropped when its *shaped* rewards are all equal. So a group of equal verifier rewards whose
lengths differ inside the buffer is kept (the shaping alone gives it a learning signal), and a
group whose verifier rewards differ only by what the shaping cancels is dropped. Both act in
the rollout manager, on each finished group, before it is buffered.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from megarl.algo.advantages import group_stats


def dynamic_sampling_keep(rewards: torch.Tensor,
                          group_id: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Bool [B]: True for samples whose group has at least two distinct reward values."""
    return ~group_stats(rewards, group_id).all_equal


def dynamic_sampling_indices(rewards: torch.Tensor,
                             group_id: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Indices (ascending, int64) of the samples `dynamic_sampling_keep` keeps."""
    return torch.nonzero(dynamic_sampling_keep(rewards, group_id)).flatten()


def response_lengths(loss_mask: torch.Tensor) -> torch.Tensor:
    """L_i = number of generated tokens of row i (sum of loss_mask), int64 [B]."""
    return loss_mask.bool().sum(dim=-1)


def overlong_penalty(lengths: torch.Tensor, max_response_len: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """R_len(L) of the module docstring for every length in `lengths` [B] (float32); all zeros
    when buffer_len == 0 (shaping off)."""
    if buffer_len < 0 or buffer_len > max_response_len:
        raise ValueError(f"overlong buffer_len={buffer_len} must be in [0, {max_response_len}]")
    lengths = lengths.to(torch.float32)
    if buffer_len == 0:
        return torch.zeros_like(lengths)
    excess = lengths - (max_response_len - buffer_len)
    return -penalty_factor * (excess / buffer_len).clamp(0.0, 1.0)


class ShapedGroup(NamedTuple):
    rewards: torch.Tensor  # [B] float64: r_i + R_len(L_i)
    penalty: torch.Tensor  # [B] float64: R_len(L_i) (zeros when shaping is off)
    keep: torch.Tensor  # [B] bool: the sample's group survives dynamic sampling (all True when off)


def shape_and_filter(rewards: torch.Tensor, lengths: torch.Tensor, group_id: Sequence[int] | torch.Tensor,
                     max_response_len: int, buffer_len: int = 0, penalty_factor: float = 1.0,
                     dynamic_sampling: bool = False) -> ShapedGroup:
    """DAPO's order: r'_i = r_i + R_len(L_i) (overlong shaping, module docstring), then keep_i =
    [the rewards r' of i's group are not all equal] under dynamic sampling. ``rewards`` [B] are
    the verifier's, ``lengths`` [B] the response lengths L_i."""
    penalty = overlong_penalty(lengths, max_response_len, buffer_len, penalty_factor).to(torch.float64)
    shaped = rewards.to(torch.float64) + penalty
    keep = (dynamic_sampling_keep(shaped, group_id) if dynamic_sampling
            else torch.ones(shaped.shape, dtype=torch.bool))
    return ShapedGroup(shaped, penalty, keep)
