"""TP / PP / DP layouts of one tiny model give the same logprobs, loss and grad norm
(real megatron-core, 4 gloo ranks on CPU); also for an odd shape: vocab 333 (padded to 384 rows at
TP=1, 512 at TP=2) and 3 layers split unevenly over PP=2. Both models run in one torchrun launch."""
import json

import pytest

from distrun import torchrun
from megarl.models.random_hf import tiny_config, write_random_hf

REF = "1,1,4096,0"  # TP=1 PP=1 (DP=4), one micro-batch per rank
LAYOUTS = {
    "tp1_many_microbatches": "1,1,40,0",
    "tp2_dp2": "2,1,4096,0",
    "pp2_dp2": "1,2,4096,0",
    "tp2_pp2": "2,2,64,0",
    "tp2_dp2_distributed_optimizer": "2,1,4096,1",
}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One launch: the tiny model's layouts, then the odd model's; {"plain"|"odd": results}."""
    d = tmp_path_factory.mktemp("layouts")
    hf = write_random_hf(str(d / "hf"), tiny_config("LlamaForCausalLM"), seed=3)
    odd = write_random_hf(str(d / "odd_hf"), tiny_config("LlamaForCausalLM", vocab_size=333,
                                                         num_hidden_layers=3), seed=4)
    torchrun("layouts_worker.py", 4, hf, d / "results.json", REF, *LAYOUTS.values(),
             "+", odd, d / "odd_results.json", REF, *ODD_LAYOUTS.values())
    return {"plain": json.loads((d / "results.json").read_text()),
            "odd": json.loads((d / "odd_results.json").read_text())}


@pytest.fixture(scope="module")
def results(launch):
    return launch["plain"]


def max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_tp1(results, name):
    ref, got = results[REF], results[LAYOUTS[name]]
    assert len(got["logp"]) == len(ref["logp"]) == 8
    assert max_diff(got["logp"], ref["logp"]) <= 1e-5
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    # parameters after the optimizer step agree: the logprobs they give agree
    assert max_diff(got["logp_after"], ref["logp_after"]) <= 1e-5


def test_step_changes_the_model_and_loss_is_the_nll(results):
    ref = results[REF]
    assert max_diff(ref["logp_after"], ref["logp"]) > 1e-3
    # SFT loss is the token-mean NLL over loss-masked tokens, recomputable from the logprobs
    assert ref["loss"] == pytest.approx(ref["nll"], rel=1e-6)
    assert 3.0 < ref["loss"] < 6.0  # ~log(128) for a random 128-token vocab


ODD_LAYOUTS = {"pp2_uneven_dp2": "1,2,4096,0", "tp2_pp2_uneven": "2,2,64,0",
               "tp2_dp2_distributed_optimizer": "2,1,4096,1"}


@pytest.fixture(scope="module")
def odd_results(launch):
    return launch["odd"]


@pytest.mark.parametrize("name", list(ODD_LAYOUTS))
def test_padded_vocab_uneven_pp_layout_matches_tp1(odd_results, name):
    ref, got = odd_results[REF], odd_results[ODD_LAYOUTS[name]]
    assert max_diff(got["logp"], ref["logp"]) <= 1e-5
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    # the padded rows get no gradient: the norm is the unpadded model's at every padding
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    # one Adam step at lr 1e-2 normalises each gradient entry: fp32 reduction-order noise in the
    # near-zero ones moves the post-step logprobs by ~1.5e-5 here (2.5e-6 relative)
    assert max_diff(got["logp_after"], ref["logp_after"]) <= 5e-5
    assert 5.0 < ref["loss"] < 7.0  # ~log(333): the padding (up to 512 ids) takes no probability
