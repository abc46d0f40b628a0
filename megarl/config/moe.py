"""`MoEConfig`: the `moe.*` section of a megarl config (mixture-of-experts training and RL).

Read by the model builder (router options handed to megatron-core's TransformerConfig), the
trainer (routing replay) and the rollout side (asking the servers for the routes). Every field is
ignored by dense models. Pure Python, like `megarl.algo.config`: imported by `megarl.config`.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.common.fields import bounded, check_bounds

ROUTING_REPLAY = ("none", "rollout")


@dataclass
class MoEConfig:
    """Mixture-of-experts options (`moe.*`); dense models ignore them."""

    routing_replay: str = "none"
    """Routing replay (R3): none (the trainer's router picks the experts) or rollout (the rollout
    servers return every token's expert ids and weights per MoE layer - local servers are started
    with --enable-return-routed-experts - and the trainer's forward, backward and prox-logprob
    recompute use them; ids-only servers such as SGLang: the weights are recomputed by the
    trainer's router over the replayed ids). docs/models.md, "Routing replay"."""

    replay_check: bool = False
    """With routing_replay rollout: score each step's prox-logprob recompute a second time without
    replay and report moe/replay_logp_delta_{mean,max} (|logp replayed - logp own routing| over the
    loss tokens) - what the replay changes, at the cost of one more forward per step. Needs
    algo.prox_logp_mode recompute (or metrics), where that recompute runs."""

    aux_loss_coeff: float = bounded(0.0, ge=0.0, le=1.0)
    """Coefficient of the auxiliary load-balancing loss (Switch style, megatron-core's
    ``moe_router_load_balancing_type="aux_loss"``): per MoE layer and micro-batch
    ``E * sum_i f_i * P_i`` with ``f_i`` = fraction of the (token, top-k slot) pairs routed to expert
    i, ``P_i`` = the mean router softmax probability of expert i, over the micro-batch's tokens
    (prompt and response; padding excluded). The gradient adds coeff x the sum over MoE layers of its
    token-weighted mean over the step's micro-batches (`megarl/trainer/moe_losses.py`). 0 = off (RL
    fine-tuning usually keeps the router as trained). When on, reported per step as ``moe_aux_loss``
    (without the coefficient, mean over layers; 1 = balanced, at most experts/top-k)."""
    z_loss_coeff: float = bounded(0.0, ge=0.0, le=1.0)
    """Coefficient of the router z-loss (ST-MoE, megatron-core's ``moe_z_loss_coeff``): the mean
    over tokens of ``logsumexp(router logits)^2``, keeping router logits small. 0 = off; reported
    per step as ``moe_z_loss`` when on."""

    def validate(self) -> None:
        """Raise ValueError("moe.<field>: <problem>") on the first bad value."""
        check_bounds(self, "moe")
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"moe.routing_replay: must be one of {', '.join(ROUTING_REPLAY)}; "
                             f"got {self.routing_replay!r}")
        if self.replay_check and self.routing_replay != "rollout":
            raise ValueError("moe.replay_check: needs moe.routing_replay: rollout")
