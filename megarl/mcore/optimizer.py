"""Megatron's optimizer step, taken apart so that a non-finite gradient norm skips the update.

``MegatronOptimizer.step()`` is prepare_grads -> get_grad_norm -> clip -> step_with_ready_grads;
with the FP32 optimizer a NaN/inf norm would be used to clip and write NaN into every weight.
:func:`step_unless_nonfinite` runs the same four parts and stops after the norm when it is not
finite. The parts are pinned in `megarl.mcore.pins.OPTIMIZER_PINS`.
"""
from __future__ import annotations

import math


def step_unless_nonfinite(optimizer, clip_grad: float) -> tuple[bool, float]:
    """One optimizer step unless the loss scaler found inf/NaN or the gradient norm is not finite.
    The norm is the same on every rank (DDP reduced the grads; the norm is reduced over the
    model-parallel ranks), so all ranks skip together. Returns (updated, grad norm)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():  # mixed precision: the loss scaler found inf/nan
        return False, float("nan")
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        return False, grad_norm
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = part.get_parameters()
        if clip_grad > 0.0 and params:
            # clip by the norm computed above (Megatron's step does the same: no second reduction)
            clip_grad_by_total_norm_fp32(
                params, clip_grad, grad_norm, part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return bool(optimizer.step_with_ready_grads()), grad_norm
