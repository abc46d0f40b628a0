"""Asynchronous `megarl-train` with partial rollouts against real SGLang (fp32, CPU) that it
starts itself: weight pushes land while SGLang generates, and each generated token keeps the
version that produced it (SGLang's weight_versions spans), in both pause modes: abort (SGLang ends
the in-flight requests and the client resubmits prompt + tokens so far under the new weights) and
retract (what `weights.pause_mode: auto` picks for SGLang: SGLang keeps them, frees their cache and
re-prefills them under the new weights). Every drawn prompt is trained exactly once. The megarl-server counterpart is
test_async_modes.py (async_partial), with the same slow-rollout settings.
"""
import collections
import os

import pytest
from sglang_runs import demo_model, require_sglang, train

pytestmark = pytest.mark.sglang

STEPS = 4


@pytest.mark.parametrize("pause", ["abort", "retract"])
def test_partial_rollouts_resume_across_pushes(tmp_path, pause):
    require_sglang()
    model, run = demo_model(str(tmp_path / "model")), str(tmp_path / "run")
    # one episode of 8 x 25 tokens at a time (48 asked, the recipe's train.max_seq_len 32 caps
    # them), decoded 2 sequences at a time: pushes find requests in flight (test_async_modes)
    done = train(run, model, f"train.steps={STEPS}", "data.eval_path=", "rollout.eval_at_start=false",
                 "train.global_batch_size=32", "rollout.group_size=8", "rollout.max_concurrent=1",
                 "rollout.max_new_tokens=48", "rollout.ignore_eos=true", "rollout.max_staleness=2",
                 "rollout.staleness_hard_cap=0",  # the strict rule: every trained token within 2
                 "rollout.partial_rollout=true", "logging.dump_generations=true", f"weights.pause_mode={pause}",
                 server_args=["--max-running-requests", "2"])
    wall = done.wall_s
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows, gens = done.rows, done.generations
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["staleness_max"] <= 2 for r in rows)
    partial = [g for g in gens if len(set(g["versions"])) > 1]
    print(f"\n[sglang-async {pause}] {STEPS} steps in {wall:.0f} s wall; {len(partial)} of {len(gens)} samples span "
          f"2+ versions; partial_frac by step {[round(r['partial_frac'], 3) for r in rows]}")
    # abort: requests the pause ended mid-answer resume under the new weights; retract: SGLang
    # keeps them and re-prefills them under the new weights. Either way some sample spans 2+
    # versions (retract showed none while /update_weight_version's default abort_all_requests
    # ended the kept requests without their tokens: megarl.rollout.admin sends it false)
    assert partial and max(r["partial_frac"] for r in rows) > 0
    for g in partial:  # each token keeps the version (and SGLang's logprob) that produced it
        assert g["versions"] == sorted(g["versions"])
        assert len(g["behave_logp"]) == len(g["versions"]) == len(g["response_ids"])
        assert all(lp <= 0.0 for lp in g["behave_logp"])
    draws = collections.defaultdict(set)
    for g in gens:
        draws[g["draw"]].add(g["step"])
    assert len(draws) == STEPS * 4 and all(len(s) == 1 for s in draws.values())  # each draw trained once
    assert not os.path.exists(os.path.join(run, "failed_prompts.jsonl"))
