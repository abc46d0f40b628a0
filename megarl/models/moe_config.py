"""`MoEConfig`: the `moe.*` section of a megarl config (mixture-of-experts training and RL).

Read by the model builder (router options handed to megatron-core's TransformerConfig), the
trainer (routing replay) and the rollout side (asking the servers for the routes). Every field is
ignored by dense models. Pure Python, like `megarl.algo.config`: imported by `megarl.config`.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.fields import check_bounds

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

    def validate(self) -> None:
        """Raise ValueError("moe.<field>: <problem>") on the first bad value."""
        check_bounds(self, "moe")
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"moe.routing_replay: must be one of {', '.join(ROUTING_REPLAY)}; "
                             f"got {self.routing_replay!r}")
        if self.replay_check and self.routing_replay != "rollout":
            raise ValueError("moe.replay_check: needs moe.routing_replay: rollout")
