"""Asynchrony without a short-response bias: on a long-tailed workload an asynchronous run trains
the same response lengths as a synchronous one, and regenerates no group for its age.

Real megarl-train runs (trainer, rollout manager, megarl-server) on the demo task with
`LongTailWorkflow`: every sample gets its own budget, P(len > x) = 4 / x on [4, 512] tokens,
generated to exactly that length (`rollout.ignore_eos`), from the same (prompt, draw) -> budget
table in both runs. Synchronous: on-policy, no partial rollouts. Asynchronous: max_staleness 2,
partial rollouts kept in place across pushes (long groups span several versions), the default
staleness rule (bound at the start, hard cap 64), two optimizer steps per RL step and
`algo.prox_logp_mode: metrics`, which recomputes log pi_prox and reports how far the loglinear
approximation is from it - on samples that span versions.

Tolerance: the mean trained response length within 10% of the synchronous run's (the issue's
target), p50 and p90 within 25% (quantiles of a Pareto tail over ~600 samples move more).
Measured: 25.6 / 25.6 tokens (p50 8 / 8, p90 48 / 48, max 512 / 512); the strict rule
(`rollout.staleness_hard_cap=0`, the old behaviour) fails it: 25.6 / 15.8 tokens, p90 48 / 35,
max 512 / 180, and it regenerates groups for their age.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAP = 512
STEPS = 20


def long_context_model(tmp_path) -> str:
    """The demo's model with room for CAP-token answers (RoPE: no position table to grow)."""
    dst = tmp_path / "model"
    shutil.copytree(os.path.join(REPO, "examples", "tiny", "model"), dst)
    config = json.loads((dst / "config.json").read_text())
    config["max_position_embeddings"] = CAP + 16
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def run(tmp_path, name: str, model: str, extra: list[str]) -> tuple[list[dict], list[dict]]:
    out = tmp_path / name
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo.yaml"),
           f"model.hf_path={model}", f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl",
           "data.eval_path=", f"train.run_dir={out}", "checkpoint.hf_export_dir=", "checkpoint.save_interval=0",
           f"train.steps={STEPS}", "train.global_batch_size=32", "rollout.group_size=4",
           "rollout.workflow=megarl.rollout.workflows:LongTailWorkflow",
           "rollout.workflow_args={min_new_tokens: 4, alpha: 1.0, seed: 3}", "rollout.ignore_eos=true",
           f"rollout.max_new_tokens={CAP}", f"train.max_seq_len={CAP + 16}", "train.micro_batch_tokens=1024",
           "rollout.eval_at_start=false", "logging.dump_generations=true", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(tmp_path),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    gens = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    return [r for r in rows if "step" in r and "response_len" in r], gens


def quantile(xs: list[int], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("long_tail")
    model = long_context_model(tmp)
    sync = run(tmp, "sync", model, ["rollout.max_staleness=0", "rollout.partial_rollout=false"])
    asyn = run(tmp, "async", model, ["rollout.max_staleness=2", "rollout.partial_rollout=true",
                                     "weights.pause_mode=in_place", "algo.prox_logp_mode=metrics",
                                     # two optimizer steps per RL step: at the second, pi_theta has
                                     # moved past pi_prox and loglinear interpolates (at the first
                                     # it equals the recompute exactly)
                                     "train.ppo_mini_batch_size=16"])
    return sync, asyn


def test_async_trains_the_lengths_a_synchronous_run_trains(runs):
    (_, sync_gens), (rows, async_gens) = runs
    s = [len(g["versions"]) for g in sync_gens]
    a = [len(g["versions"]) for g in async_gens]
    assert len(s) == len(a) == STEPS * 32
    print(f"trained response length, sync vs async: mean {statistics.fmean(s):.1f} / "
          f"{statistics.fmean(a):.1f}, p50 {quantile(s, .5):.0f} / {quantile(a, .5):.0f}, "
          f"p90 {quantile(s, .9):.0f} / {quantile(a, .9):.0f}, max {max(s)} / {max(a)}")
    assert abs(statistics.fmean(a) / statistics.fmean(s) - 1) <= 0.10
    for q in (0.5, 0.9):
        assert abs(quantile(a, q) / quantile(s, q) - 1) <= 0.25, q
    # the run was asynchronous: long groups were trained across versions, none regenerated
    assert max(r["staleness_max"] for r in rows) >= 2
    assert sum(len(set(g["versions"])) > 1 for g in async_gens) > 0
    assert rows[-1]["rollout/regenerated/too_stale"] == 0


def test_loglinear_prox_holds_on_samples_that_span_versions(runs):
    _, (rows, _) = runs
    spanning = [r for r in rows if r.get("partial_frac", 0) > 0 and r["prox_behave_abs_gap"] > 0]
    assert spanning, "no step trained a sample that spans versions"
    print("loglinear error / no-approximation error per step:",
          " ".join(f"{r['prox_approx_abs_err']:.2e}/{r['prox_behave_abs_gap']:.2e}" for r in spanning))
    # over the run the loglinear interpolation is several times closer to the recomputed
    # log pi_prox than pi_behave is (measured: 0.13-0.19 of the gap). Per step it is no worse than
    # the gap by more than noise: at a step where only a few tokens span a push the two are about
    # equal (measured 2.12e-2 vs 2.10e-2 in one CI run), so the bound there is 1.25x, not 1x.
    for r in spanning:
        assert r["prox_approx_abs_err"] < 1.25 * r["prox_behave_abs_gap"], r
    ratio = sum(r["prox_approx_abs_err"] for r in spanning) / sum(r["prox_behave_abs_gap"] for r in spanning)
    assert ratio <= 0.3, ratio
