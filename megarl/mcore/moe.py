"""megatron-core's per-layer router-loss tracker (load-balancing and z-loss values), read by
`megarl.trainer.moe_losses` to report the step's router losses. The router's loss functions save
each layer's value into a module-level dict of `moe_utils` during the forward; nothing in
megatron-core's public API exposes it, hence this pinned wrapper (pins.MOE_LOSS_PINS)."""
from __future__ import annotations


def clear_router_loss_tracker() -> None:
    """Zero the tracked per-layer values before a step (megatron-core accumulates across calls)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def router_loss_tracker() -> dict:
    """{loss name: {"values": per-layer tensor summed over the step's micro-batches,
    "reduce_group": ..., ...}} as megatron-core's routers filled it."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return get_moe_layer_wise_logging_tracker()
