"""What users tune an async run with: per-step rollout metrics, idle ratios and generation dumps.

    staleness of a sample  = trainer version - oldest version among its generated tokens
    partial sample         = its generated tokens span more than one version (version_span > 1)
    trainer idle ratio     = time the trainer waited for a batch / step wall time
    rollout idle ratio     = 1 - time some segment was generating / step wall time

High trainer idle: rollout is the bottleneck (more servers, more staleness); high rollout idle:
training is (more trainer ranks, fewer servers). Both are in metrics.jsonl every step.
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import time
from typing import Optional

import numpy as np


def sample_versions(arrays: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sample of a step's flat arrays (`megarl.protocol.packing`): generated tokens, the
    oldest and the newest policy version among them (-1 and -2 with none: span 0)."""
    lengths, mask = arrays["lengths"], arrays["loss_mask"].astype(bool)
    versions = arrays["versions"].astype(np.int64)
    n = len(lengths)
    # clipped: a trailing empty sample's start would be past the end (its values are replaced below)
    starts = np.minimum(np.concatenate([[0], np.cumsum(lengths)[:-1]]), max(len(mask) - 1, 0)).astype(np.int64)
    big = np.iinfo(np.int64).max
    response = np.add.reduceat(mask.astype(np.int64), starts) if n and len(mask) else np.zeros(n, np.int64)
    lo = np.minimum.reduceat(np.where(mask, versions, big), starts) if n and len(mask) else np.full(n, big)
    hi = np.maximum.reduceat(np.where(mask, versions, -big), starts) if n and len(mask) else np.full(n, -big)
    empty = (lengths == 0) | (response == 0)  # reduceat gives an empty segment its start's value
    response = np.where(lengths == 0, 0, response)
    return response, np.where(empty, -1, lo), np.where(empty, -2, hi)


def batch_metrics(step, version: int) -> dict:
    """Reward, lengths, staleness (mean/max/histogram) and partial-rollout shape of one step
    (a `megarl.trainer.handoff.ReceivedStep`: every rank holds its arrays)."""
    response, lo, hi = sample_versions(step.arrays)
    n = len(response)
    # the oldest token decides: a partial rollout is as stale as the first version that wrote it
    stale, spans = version - lo, hi - lo + 1
    # integer sums over n: the same numbers as statistics.fmean over the samples
    out = {"reward": statistics.fmean(step.arrays["rewards"].tolist()),
           "response_len": int(response.sum()) / n,
           "staleness_mean": int(stale.sum()) / n, "staleness_max": int(stale.max()),
           "partial_frac": int((spans > 1).sum()) / n, "max_partial_span": int(spans.max()),
           "stale_samples": int((stale > 0).sum()), "trained_samples": n}
    for k, c in zip(*np.unique(stale, return_counts=True)):
        out[f"staleness_hist/{int(k)}"] = int(c)
    out.update(length_metrics(response))
    out.update(source_metrics(step, response))
    out.update(episode_metrics(step.infos))
    return out


def episode_metrics(infos: list) -> dict:
    """Multi-turn and environment episodes of the step (rank 0: the infos): mean turns, tool calls
    per episode and the share of episodes that called a tool at least once. (The environment
    servers' counts - episodes, errors, re-runs - are the manager's env/* metrics.)"""
    turns = [i["turns"] for i in infos if isinstance(i, dict) and "num_turns" in i]
    if not turns:
        return {}
    calls = [sum(t.get("tool_calls", 0) for t in ts) for ts in turns]
    return {"episode/turns": statistics.fmean(len(ts) for ts in turns),
            "episode/tool_calls": statistics.fmean(calls),
            "episode/tool_call_share": sum(c > 0 for c in calls) / len(calls)}


def length_metrics(response: np.ndarray) -> dict:
    """The trained response lengths' distribution: min, median, p90, max and a histogram over
    power-of-two buckets (``response_len_hist/<upper>``: lengths in (upper/2, upper], upper >= 64)."""
    if not len(response):
        return {}
    r = np.sort(response.astype(np.int64))
    out = {"response_len/min": int(r[0]), "response_len/p50": float(np.percentile(r, 50)),
           "response_len/p90": float(np.percentile(r, 90)), "response_len/max": int(r[-1])}
    uppers = np.maximum(64, 2 ** np.ceil(np.log2(np.maximum(r, 1))).astype(np.int64))
    for upper, count in zip(*np.unique(uppers, return_counts=True)):
        out[f"response_len_hist/{int(upper)}"] = int(count)
    return out


def source_metrics(step, response: np.ndarray, correct_at: float = 1.0) -> dict:
    """With data.sources (rank 0: the infos name each sample's source), per source of the step:
    its share of the trained samples, mean reward, mean response length and accuracy (the share
    of samples whose reward is >= ``correct_at``, the evaluation's rule)."""
    infos = step.infos
    if len(infos) != len(response) or not any("source" in i for i in infos):
        return {}
    rewards = step.arrays["rewards"].tolist()
    by: dict[str, list[int]] = {}
    for j, info in enumerate(infos):
        by.setdefault(info.get("source", ""), []).append(j)
    out = {}
    for name, rows in sorted(by.items()):
        r = [rewards[j] for j in rows]
        out[f"source/{name}/trained_share"] = len(rows) / len(infos)
        out[f"source/{name}/reward"] = statistics.fmean(r)
        out[f"source/{name}/response_len"] = int(sum(int(response[j]) for j in rows)) / len(rows)
        out[f"source/{name}/accuracy"] = sum(x >= correct_at for x in r) / len(rows)
    return out


class StepTimer:
    """Per-step phase times (``with timer.phase("push"):``) plus the idle ratios. One per run;
    ``finish()`` returns the step's metrics and starts the next step's clock."""

    def __init__(self, timeline=None):
        self.timeline = timeline
        self.t0 = time.perf_counter()
        self.phases: dict[str, float] = collections.defaultdict(float)
        self.busy0: Optional[float] = None
        self.generated0 = 0
        self.stale_total = 0

    def phase(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.start, self.wall = time.perf_counter(), time.time()

            def __exit__(self, *exc):
                timer.phases[name] += time.perf_counter() - self.start
                if timer.timeline is not None:
                    timer.timeline.record(name, self.wall, time.time())

        return _Phase()

    def finish(self, batch: dict, busy_s: Optional[float], generated_tokens: Optional[int],
               trained_tokens: int) -> dict:
        now = time.perf_counter()
        wall = max(now - self.t0, 1e-9)
        out = {f"time/{k}": v for k, v in self.phases.items()}
        out["step_time"] = wall
        out["trainer_idle_ratio"] = self.phases.get("wait", 0.0) / wall
        self.stale_total += int(batch.get("stale_samples", 0))
        out["stale_samples_total"] = self.stale_total
        # over the update phase alone: waiting for rollouts is not the trainer's speed
        out["throughput/train_tokens_per_s"] = trained_tokens / max(self.phases.get("update", wall), 1e-9)
        if busy_s is not None:  # rank 0 only: the rollout client lives there
            # busy_s is cumulative (the client's clock since start): the step's share is the difference
            if self.busy0 is not None:
                out["rollout_idle_ratio"] = max(0.0, 1.0 - (busy_s - self.busy0) / wall)
            self.busy0 = busy_s
        if generated_tokens is not None:
            out["throughput/rollout_tokens_per_s"] = (generated_tokens - self.generated0) / wall
            self.generated0 = generated_tokens
        self.t0, self.phases = now, collections.defaultdict(float)
        return out


def dump_generations(path: str, step: int, version: int, received) -> None:
    """Appends one JSON line per sample of the step (rank 0: it holds the infos): prompt index,
    group, completion, reward, generated token versions and the behaviour logprobs
    (``logging.dump_generations``); with overlong shaping, reward is the shaped one and
    reward_raw the verifier's."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    a = received.arrays
    gen = a["loss_mask"].tolist()
    ends = np.cumsum(a["lengths"]).tolist()
    ids, vers, logp = (a["input_ids"].tolist(), a["versions"].tolist(), a["behave_logp"].tolist())
    with open(path, "a") as f:
        start = 0
        for i, info in enumerate(received.infos):
            g = [j for j in range(start, ends[i]) if gen[j]]
            start = ends[i]
            f.write(json.dumps({
                "step": step, "version": version, "prompt_index": info.get("prompt_index"),
                "draw": info.get("draw"), **({"source": info["source"]} if "source" in info else {}),
                "group_id": int(a["group_ids"][i]), "completion": info.get("completion"),
                "reward": float(a["rewards"][i]),
                "response_ids": [ids[j] for j in g], "versions": [vers[j] for j in g],
                "behave_logp": [logp[j] for j in g],
                # DAPO overlong shaping (the manager's): the verifier's reward before it
                **({"reward_raw": info["reward_raw"]} if "reward_raw" in info else {})}) + "\n")
