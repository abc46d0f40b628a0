"""GPU tier: the Transformer Engine layer spec and the local spec compute the same per-token
logprobs from the same HF weights (skipped without CUDA or without transformer-engine)."""
import pytest

from gpu_support import make_hf, requires_cuda, run_worker

pytestmark = requires_cuda

# fp32: both specs do the same math with different kernels (TE fuses the norms into its linears);
# differences come from summation order and, if a kernel uses TF32, its 10-bit mantissa.
FP32_MAX_ABS = 1e-3
# bf16: 8-bit mantissa activations; per-token logprobs near -4.8 differ in the 2nd-3rd digit.
BF16_MAX_ABS, BF16_MEAN_ABS = 0.1, 0.02


@pytest.mark.parametrize("dtype,max_abs,mean_abs", [("float32", FP32_MAX_ABS, FP32_MAX_ABS),
                                                    ("bfloat16", BF16_MAX_ABS, BF16_MEAN_ABS)])
def test_te_spec_logprobs_match_local_spec(tmp_path, record_property, dtype, max_abs, mean_abs):
    pytest.importorskip("transformer_engine", reason="transformer-engine is not installed")
    r = run_worker("specs", make_hf(tmp_path / "hf", seed=0), dtype)
    record_property(f"{dtype}_max_abs", r["max_abs"])
    record_property(f"{dtype}_mean_abs", r["mean_abs"])
    assert r["tokens"] == 6 * 19, r
    assert r["max_abs"] <= max_abs and r["mean_abs"] <= mean_abs, r


def test_moe_te_spec_runs_grouped_gemm_and_matches_local_spec(tmp_path):
    """A tiny Qwen3-MoE (4 experts, top-2): on the TE spec the experts are one grouped GEMM
    (TEGroupedMLP, its weight0..3 mapped to the HF experts by megarl.models.hf_io), on the local
    spec a SequentialMLP; fp32 logprobs agree as the dense ones do."""
    pytest.importorskip("transformer_engine", reason="transformer-engine is not installed")
    from megarl.models.random_hf import tiny_config, write_random_hf

    hf = write_random_hf(str(tmp_path / "moe"), tiny_config("Qwen3MoeForCausalLM"), seed=0, std=0.05)
    r = run_worker("specs", hf, "float32")
    assert r["experts"] == {"te": "TEGroupedMLP", "local": "SequentialMLP"}, r
    assert r["tokens"] == 6 * 19 and r["max_abs"] <= FP32_MAX_ABS, r
