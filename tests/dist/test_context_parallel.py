"""Context parallelism (parallel.cp, megarl/mcore/context_parallel.py, megarl/trainer/context.py)
and the interleaved pipeline (parallel.vpp) on real megatron-core over gloo: one launch of 4 ranks
runs the same step of a tiny Llama under CP=1 (the reference, DP=4) and CP=2 alone, with TP=2,
with PP=2, packed (THD), packed with PP=2 and with many small micro-batches; then VPP=2 x PP=2
(packed: the schedule needs one shape per step) alone, with CP=2 and with TP=2, with one
micro-batch (padded to PP by a filler) and with many. Against CP=1: per-token logprobs and entropies within 1e-6
(float32: two ulps of |logp| < 8), loss and grad norm within 1e-6 relative, every full HF tensor
after one optimizer step within 1e-6 (what the export and the weight push read), the logprobs
after that step within 2e-6. The batch's rows (5-70 tokens) are not multiples of 2 x CP, so the
padding of rows and of packed sequences is on the path."""
import json

import pytest

from distrun import torchrun
from megarl.models.random_hf import tiny_config, write_random_hf

REF = "1,1,1,0"  # tp, pp, cp, packed[, micro_batch_tokens[, vpp]]
LAYOUTS = {
    "cp2": "1,1,2,0",
    "cp2_tp2": "2,1,2,0",
    "cp2_pp2": "1,2,2,0",
    "cp2_packed": "1,1,2,1",
    "cp2_pp2_packed": "1,2,2,1",
    "cp2_many_microbatches": "1,1,2,0,40",
    "cp2_packed_many_microbatches": "1,1,2,1,40",
    "pp2_packed": "1,2,1,1,40",
    "vpp2_pp2": "1,2,1,1,40,2",
    "vpp2_pp2_one_microbatch": "1,2,1,1,4096,2",
    "vpp2_pp2_cp2": "1,2,2,1,40,2",
    "vpp2_pp2_tp2": "2,2,1,1,40,2",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("cp")
    hf = write_random_hf(str(d / "hf"), tiny_config("LlamaForCausalLM"), seed=3)
    torchrun("cp_worker.py", 4, hf, d / "results.json", REF, *LAYOUTS.values())
    return json.loads((d / "results.json").read_text())


def max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def flat(t):
    if isinstance(t, list):
        for x in t:
            yield from flat(x)
    else:
        yield t


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_the_reference(results, name):
    ref, got = results[REF], results[LAYOUTS[name]]
    logp, ent = max_diff(got["logp"], ref["logp"]), max_diff(got["entropy"], ref["entropy"])
    after = max_diff(got["logp_after"], ref["logp_after"])
    moved = max_diff(ref["logp_after"], ref["logp"])
    weights = max(max(abs(x - y) for x, y in zip(flat(got["weights"][n]), flat(t)))
                  for n, t in ref["weights"].items())
    print(f"\n[layouts] {name}: |layout - reference| logp {logp:.2e} entropy {ent:.2e} weights {weights:.2e} "
          f"after a step {after:.2e} (the step moved logp by {moved:.3f}); loss {got['loss']:.6f} "
          f"vs {ref['loss']:.6f}, grad norm {got['grad_norm']:.6f} vs {ref['grad_norm']:.6f}")
    assert sorted(got["weights"]) == sorted(ref["weights"]) and len(ref["weights"]) == 39
    assert logp < 1e-6 and ent < 1e-6
    assert got["tokens"] == ref["tokens"]  # the step's loss tokens counted once, not once per CP rank
    assert abs(got["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"])
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-6 * ref["grad_norm"]
    assert weights < 1e-6
    assert moved > 1e-2 and after < 2e-6


def test_vpp_equals_pp_bitwise_at_the_same_micro_batches(results):
    """The interleaved schedule and plain 1F1B run the same micro-batches through the same layers."""
    pp, vpp = results[LAYOUTS["pp2_packed"]], results[LAYOUTS["vpp2_pp2"]]
    assert vpp["logp"] == pp["logp"] and vpp["logp_after"] == pp["logp_after"]
    assert vpp["loss"] == pp["loss"] and vpp["grad_norm"] == pp["grad_norm"]
