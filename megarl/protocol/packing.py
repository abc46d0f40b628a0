"""A step's trajectories as the channel's `Batch`, laid out as the trainer's batch: samples
ordered by DP rank (whole groups per rank, balanced by tokens), each rank's share one contiguous
run of the flat arrays. The manager packs (`pack_batch`); each trainer rank takes its share with
`share_slices` and pads it into tensors (`megarl.trainer.batch.TensorBatch.from_flat`) without
building a Python object per sample.

    tokens       input_ids int64 [T]          T = sum(lengths), samples back to back
    per token    loss_mask int8, behave_logp float64, versions int32  [T]   (TOKEN_FIELDS)
    per sample   lengths int64, rewards float64, group_ids int64  [N]        (SAMPLE_FIELDS)
    layout       dp_rank int32 [N], non-decreasing: rank r's share = the samples with dp_rank r
    routes       route_ids int32 / route_weights float32 [T, layers, k]   (MoE routing replay)
    teacher      teacher_logp float64 [T]   (on-policy distillation: OPTIONAL_TOKEN_FIELDS)
"""
from __future__ import annotations

import numpy as np

from megarl.protocol.messages import Batch

TOKEN_FIELDS = ("loss_mask", "behave_logp", "versions")  # token-aligned with input_ids
SAMPLE_FIELDS = ("rewards", "group_ids")  # one value per sample (the trainer's sample fields)
OPTIONAL_TOKEN_FIELDS = ("teacher_logp",)  # token-aligned, present when every sample has them


def groups_per_step(cfg) -> int:
    """Prompt groups in one step's batch: what the trainer asks for (`BatchRequest`) and what the
    manager's staleness clock counts per step (``cfg``: the run's `Config`)."""
    return cfg.train.step_batch_size // cfg.rollout.group_size


def balance_groups(group_tokens: list[int], n_ranks: int) -> list[int]:
    """Rank of each group: longest first to the rank with the fewest tokens (LPT). Groups stay
    whole, so group-relative advantages never need another rank's samples."""
    loads = [0] * n_ranks
    rank = [0] * len(group_tokens)
    # ties broken by index (group, then rank): every run of the same batch gives the same placement
    for g in sorted(range(len(group_tokens)), key=lambda g: (-group_tokens[g], g)):
        r = min(range(n_ranks), key=lambda r: (loads[r], r))
        rank[g] = r
        loads[r] += group_tokens[g]
    return rank


def pack_batch(trajs, dp: int, stats: dict, rejoin: list[str]) -> Batch:
    """A step's trajectories as flat arrays (module docstring), ordered by DP rank; within a rank
    the samples keep the order the controller handed them over in."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trajs):
        groups.setdefault(t.group_id, []).append(i)
    gids = list(groups)
    ranks = balance_groups([sum(len(trajs[i].input_ids) for i in groups[g]) for g in gids], dp)
    dp_rank = np.zeros(len(trajs), dtype=np.int32)
    for g, r in zip(gids, ranks):
        dp_rank[groups[g]] = r
    order = np.argsort(dp_rank, kind="stable")  # stable: a rank's samples in hand-over order
    trajs = [trajs[i] for i in order]
    cat = lambda name, dt: np.fromiter((x for t in trajs for x in getattr(t, name)), dtype=dt)  # noqa: E731
    arrays = {"input_ids": cat("input_ids", np.int64), "loss_mask": cat("loss_mask", np.int8),
              "behave_logp": cat("behave_logp", np.float64), "versions": cat("versions", np.int32),
              "lengths": np.array([len(t.input_ids) for t in trajs], dtype=np.int64),
              "rewards": np.array([t.reward for t in trajs], dtype=np.float64),
              "group_ids": np.array([t.group_id for t in trajs], dtype=np.int64), "dp_rank": dp_rank[order]}
    for name in OPTIONAL_TOKEN_FIELDS:
        if trajs and all(getattr(t, name) is not None for t in trajs):
            arrays[name] = cat(name, np.float64)
    if trajs and all(t.routes is not None for t in trajs):  # MoE routing replay: [tokens, layers, k]
        arrays["route_ids"] = np.concatenate([t.routes.ids for t in trajs]).astype(np.int32)
        arrays["route_weights"] = np.concatenate([t.routes.weights for t in trajs]).astype(np.float32)
    return Batch(infos=[t.info for t in trajs], stats=stats, rejoin=rejoin, arrays=arrays)


def share_slices(arrays: dict, rank: int) -> tuple[slice, slice]:
    """(samples, tokens) of DP rank ``rank``'s share in a `Batch`'s arrays (module docstring)."""
    dp_rank = arrays["dp_rank"]
    if len(dp_rank) > 1 and bool((np.diff(dp_rank) < 0).any()):
        raise ValueError("Batch.arrays['dp_rank']: samples are not ordered by DP rank")
    lo, hi = (int(x) for x in np.searchsorted(dp_rank, [rank, rank + 1]))
    lengths = arrays["lengths"]
    t0 = int(lengths[:lo].sum())
    return slice(lo, hi), slice(t0, t0 + int(lengths[lo:hi].sum()))
