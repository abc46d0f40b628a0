"""megatron-core's MoE router losses as megarl steers and reads them.

- The coefficients: the router looks up ``config.moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` at
  each forward (it does not copy them at construction) and skips the z-loss when its coefficient
  is None, so `set_router_loss_coefficients` can set a per-step value on the model's config
  (`megarl.trainer.moe_losses` decides the value).
- The per-layer tracker: the router's loss functions save each layer's value into a module-level
  dict of `moe_utils` during the forward; `tracked_router_losses` reads it.

Nothing in megatron-core's public API exposes either, hence these pinned functions
(pins.MOE_LOSS_PINS: the fields, the tracker's keys and the router's forward-time reads)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def set_router_loss_coefficients(tconfig, aux_coeff: float, z_coeff: Optional[float]) -> None:
    """The coefficients the routers of a model built from ``tconfig`` (its TransformerConfig) apply
    from their next forward on; a z coefficient of None turns the z-loss off."""
    tconfig.moe_aux_loss_coeff = aux_coeff
    tconfig.moe_z_loss_coeff = z_coeff


def clear_router_loss_tracker() -> None:
    """Zero the tracked per-layer values before a step (megatron-core accumulates across calls)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


@dataclass
class TrackedLoss:
    """One router loss as the routers tracked it since the last clear."""

    values: torch.Tensor  # [num_layers]: each MoE layer's value (no coefficient), summed over forwards
    tp_split: bool  # the router split the loss over a group (TP x CP): each rank holds a share


def tracked_router_losses() -> dict[str, TrackedLoss]:
    """{megatron-core's loss name ("load_balancing_loss", "z_loss", ...): TrackedLoss}."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return {name: TrackedLoss(entry["values"], entry.get("reduce_group") is not None)
            for name, entry in get_moe_layer_wise_logging_tracker().items()}
