"""GPU tier: bf16 training steps with the local layer spec on one GPU (skipped without CUDA)."""
import math

from gpu_support import make_hf, requires_cuda, run_worker

pytestmark = requires_cuda

STEPS = 12


def test_bf16_local_spec_training_lowers_loss(tmp_path, record_property):
    """12 Adam steps (lr 3e-3, clip 1.0) on one fixed batch of counting sequences: bf16
    parameters on the GPU, every loss and grad norm finite, and the loss falls by at least a
    quarter (random init starts near ln(128) = 4.85; the next token is a function of the last)."""
    r = run_worker("train", make_hf(tmp_path / "hf", seed=0), "bfloat16", "local", str(STEPS))
    losses, norms = r["losses"], r["grad_norms"]
    record_property("loss_first", round(losses[0], 4))
    record_property("loss_last", round(losses[-1], 4))
    record_property("grad_norm_max", round(max(norms), 4))
    assert r["param_dtype"] == "torch.bfloat16" and r["device"].startswith("cuda"), r
    assert r["use_te"] is False, r
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert all(math.isfinite(g) and g > 0 for g in norms), norms
    assert 4.0 <= losses[0] <= 5.5, losses  # near ln(128): the model starts untrained
    assert losses[-1] <= 0.75 * losses[0], losses
