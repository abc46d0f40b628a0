"""`MoEConfig`: the `moe.*` section of a megarl config (mixture-of-experts training and RL).

Read by the model builder (router options handed to megatron-core's TransformerConfig), the
trainer (routing replay) and the rollout side (asking the servers for the routes). Every field is
ignored by dense models. Pure Python, like `megarl.algo.config`: imported by `megarl.config`.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.fields import check_bounds


@dataclass
class MoEConfig:
    """Mixture-of-experts options (`moe.*`); dense models ignore them."""

    def validate(self) -> None:
        """Raise ValueError("moe.<field>: <problem>") on the first bad value."""
        check_bounds(self, "moe")
