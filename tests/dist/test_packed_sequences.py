"""Packed sequences (train.pack_sequences, megarl/trainer/packing.py) on real megatron-core over
gloo (tests/dist/packing_worker.py): at TP=1, TP=2 and PP=2 the same
engine weights give the same per-token logprobs and entropies packed (THD through
`megarl.mcore.sdpa.SDPAttention`, RoPE per sequence) as padded within 1e-6, the same loss and
grad norm for one optimizer step and the same logprobs after it, on a long-tailed batch whose
padded micro-batches are mostly padding."""
import json

import pytest

from distrun import torchrun
from megarl.models.random_hf import tiny_config, write_random_hf


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return write_random_hf(str(tmp_path_factory.mktemp("packing") / "hf"), tiny_config("LlamaForCausalLM"), seed=5)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_packed_equals_padded(tmp_path, hf, tp, pp):
    out = tmp_path / "out.json"
    torchrun("packing_worker.py", tp * pp, hf, tp, pp, 0, out)  # sequence parallelism: TE only (GPU)
    r = json.loads(out.read_text())
    print(f"\n[packing] tp={tp} pp={pp}: |padded - packed| logp {r['logp_diff']:.2e}, entropy "
          f"{r['entropy_diff']:.2e}, after a step {r['after_diff']:.2e} (the step moved logp by {r['moved']:.3f}); "
          f"micro-batches {r['microbatches']}, real tokens {r['real_tokens']} of {r['padded_tokens']} padded")
    assert r["logp_diff"] < 1e-6 and r["entropy_diff"] < 1e-6
    assert r["zeros_outside"]  # entry 0 and padding: 0.0, as the padded path
    assert abs(r["loss"][0] - r["loss"][1]) < 1e-6 * max(1.0, abs(r["loss"][0]))
    assert abs(r["grad_norm"][0] - r["grad_norm"][1]) < 1e-5 * r["grad_norm"][0]
    assert r["moved"] > 1e-3 and r["after_diff"] < 1e-5
    assert r["real_tokens"] < 0.5 * r["padded_tokens"]  # the batch is mostly padding when padded
    assert r["microbatches"][1] <= r["microbatches"][0]  # packed, the 96-token budget holds more rows
