"""The router's auxiliary losses (load balancing, z-loss) of an MoE model, per training step.

megatron-core's router adds them to the gradient (``MoEAuxLossAutoScaler``) and records each MoE
layer's value, without its coefficient, in a process-wide tracker (``save_to_aux_losses_tracker``).
Two things are decided here, at step level:

- the coefficient seen by the gradient. With per-token losses (``calculate_per_token_loss``) the
  router multiplies each micro-batch's loss by its routed tokens ``n_m`` and Megatron divides the
  summed gradient by the step's *loss* tokens ``T``; so the gradient is
  ``c * sum_m aux_m * n_m / T``. Setting the config's coefficient to ``c * T / N`` for the step
  (``N = sum_m n_m``, all DP ranks) makes it ``c * sum_m aux_m * n_m / N``: c times the
  token-weighted mean over the step, as `MoEConfig` documents, however many prompt tokens the
  step holds.
- the reported metric: ``moe_aux_loss`` / ``moe_z_loss`` = the tracker's values summed over the
  pipeline stages (each holds its own layers) and over the TP group where the router split the
  loss, averaged over micro-batches, DP ranks and MoE layers (megatron-core's own reduction).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.trainer.parallel import ParallelState
from megarl.mcore.moe import clear_router_loss_tracker, set_router_loss_coefficients, tracked_router_losses

_NAMES = {"load_balancing_loss": "moe_aux_loss", "z_loss": "moe_z_loss"}
METRICS = tuple(_NAMES.values())  # the step metrics this module adds to Engine.train_batch's result


def set_step_coefficients(tconfig, aux_coeff: float, z_coeff: float, loss_tokens: float,
                          routed_tokens: float) -> None:
    """Scale the configured coefficients by ``loss_tokens / routed_tokens`` for this step (see the
    module docstring); a coefficient of 0 stays off (the router skips a z-loss of None)."""
    scale = loss_tokens / max(routed_tokens, 1.0)
    set_router_loss_coefficients(tconfig, aux_coeff * scale, z_coeff * scale if z_coeff > 0 else None)


def clear_tracker() -> None:
    clear_router_loss_tracker()


def step_metrics(ps: ParallelState, num_microbatches: int, num_moe_layers: int, moe) -> dict[str, float]:
    """The step's router losses whose coefficient in ``moe`` (`MoEConfig`) is on (collective over
    PP, TP and DP: every rank calls it)."""
    tracked = tracked_router_losses()
    on = {"load_balancing_loss": moe.aux_loss_coeff > 0, "z_loss": moe.z_loss_coeff > 0}
    out = {}
    # Sorted: every rank runs the same collectives in the same order.
    for name in sorted(n for n in tracked if on.get(n)):
        values = tracked[name].values.detach().clone().to(ps.device, torch.float64)
        if ps.pp > 1:
            dist.all_reduce(values, group=ps.pp_group)
        if tracked[name].tp_split and ps.tp > 1:
            dist.all_reduce(values, group=ps.tp_group)  # each TP rank holds a 1/tp share
        values /= max(num_microbatches, 1)
        if ps.dp > 1:
            dist.all_reduce(values, group=ps.dp_group)
            values /= ps.dp
        out[_NAMES[name]] = float(values.sum()) / num_moe_layers
    return out
