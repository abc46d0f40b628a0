"""The PPO actor and the GAE critic under TP / PP / DP and micro-batch splits (real megatron-core,
4 gloo ranks on CPU, one torchrun launch): every layout gives the TP=1 loss, grad norm and
post-update logprobs; the micro-batch budget changes nothing; metrics match hand computation."""
import json
import math

import pytest

from actor_worker import VERSION, make_step
from distrun import torchrun
from megarl.models.random_hf import tiny_config, write_random_hf

REF = "actor,1,1,4096,0"  # TP=1 PP=1 DP=4, one mini-batch, 2 epochs (2 optimizer steps)
LAYOUTS = {
    "many_microbatches": "actor,1,1,24,0",
    "tp2_dp2": "actor,2,1,4096,0",
    "pp2_dp2": "actor,1,2,4096,0",
    "tp2_pp2_microbatches": "actor,2,2,24,0",
}
MINI = ("actor,1,1,4096,4", "actor,1,1,24,4")  # 2 mini-batches x 2 epochs, two budgets
LOGLINEAR = ("loglinear,1,1,4096,0", "loglinear,2,1,24,0")
CRITIC = ("critic,1,1,4096", "critic,2,2,24")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("actor")
    hf = write_random_hf(str(d / "hf"), tiny_config("LlamaForCausalLM"), seed=3)
    out = d / "results.json"
    torchrun("actor_worker.py", 4, hf, out, REF, *LAYOUTS.values(), *MINI, *LOGLINEAR, *CRITIC)
    return json.loads(out.read_text())


def max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def assert_same_update(got, ref):
    assert max_diff(got["logp"], ref["logp"]) <= 1e-5
    for key in ("loss", "pg_loss", "grad_norm", "grad_norm_max", "entropy", "kl_ref"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key
    for key in ("clip_frac_low", "clip_frac_high", "behave_weight_capped_frac", "dropped_frac"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], abs=1e-9), key
    # parameters after the update agree: the logprobs they give agree
    assert max_diff(got["logp_after"], ref["logp_after"]) <= 1e-5


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_tp1(results, name):
    assert_same_update(results[LAYOUTS[name]], results[REF])


def test_minibatches_independent_of_microbatch_budget(results):
    a, b = (results[k] for k in MINI)
    assert a["metrics"]["n_minibatches"] == 2 and a["metrics"]["optimizer_steps"] == 4
    assert_same_update(b, a)
    # a different update than the single mini-batch one
    assert max_diff(a["logp_after"], results[REF]["logp_after"]) > 1e-2


def test_loglinear_prox_matches_across_layouts(results):
    a, b = (results[k] for k in LOGLINEAR)
    assert_same_update(b, a)
    assert "prox_approx_abs_err" not in a["metrics"]


def test_update_metrics_match_hand_computation(results):
    ref = results[REF]
    m = ref["metrics"]
    _, mask, noise, _, _, _ = make_step()
    tokens = [e for row, ms in zip(noise, mask) for e, k in zip(row, ms) if k]
    # behave_logp = trainer logp + noise: the first mini-batch sees |logp - behave| = |noise|
    assert m["logp_gap"] == pytest.approx(sum(abs(e) for e in tokens) / len(tokens), abs=1e-6)
    assert m["logp_gap_max"] == pytest.approx(max(abs(e) for e in tokens), abs=1e-6)
    # behaviour weight pi_prox / pi_behave = exp(-noise); cap 1.15 in mask mode
    assert m["behave_weight_max"] == pytest.approx(math.exp(-min(tokens)), rel=1e-5)
    capped = sum(math.exp(-e) > 1.15 for e in tokens) / len(tokens)
    assert 0 < capped == pytest.approx(m["behave_weight_capped_frac"])
    assert m["dropped_frac"] == pytest.approx(capped)
    assert m["n_minibatches"] == 1 and m["optimizer_steps"] == 2
    assert ref["updates"] == 1  # one PPO update (the version is the cluster's, not the actor's)
    # epoch 2 moved away from pi_prox and pi_ref: clipping, KL and the loglinear error show up
    assert m["clip_frac_low"] + m["clip_frac_high"] > 0
    assert m["kl_ref"] > 0 and m["approx_kl_k3"] > 0 and m["prox_approx_abs_err"] > 0
    assert 4.0 < m["entropy"] < math.log(128) + 1e-6
    assert max_diff(ref["logp_after"], ref["logp"]) > 1e-2
    assert all(r["adv_ok"] for k, r in results.items() if not k.startswith("critic"))


def test_critic_matches_across_layouts_and_learns(results):
    a, b = (results[k] for k in CRITIC)
    for key in ("values", "advantages", "values_after"):
        assert max_diff(a[key], b[key]) <= 1e-5, key
    for key in ("value_loss", "grad_norm", "value_clip_frac", "value_abs_err"):
        assert b["metrics"][key] == pytest.approx(a["metrics"][key], rel=1e-5), key
    assert all(row[0] == 0.0 for row in a["values"])  # V_0 is never used (prompt position)
    assert a["metrics2"]["value_loss"] < a["metrics"]["value_loss"]
    assert max_diff(a["values_after"], a["values"]) > 1e-3
