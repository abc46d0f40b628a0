"""What the rollout manager does to a finished group before buffering it: DAPO's overlong reward
shaping, then dynamic sampling on the shaped rewards (`megarl.algo.filters.shape_and_filter`).

    workflow -> group (verifier rewards r_i) -> r'_i = r_i + R_len(L_i) -> all r' equal? drop : buffer

Both act here, once per group, so the filter sees the reward the trainer trains on (shaping in the
trainer after a filter on the raw reward would keep groups the shaping leaves without signal, and
drop groups only the shaping gives one). Each shaped sample keeps the verifier's reward in
``info["reward_raw"]`` and its penalty in ``info["overlong_penalty"]`` (the trainer's
overlong_* metrics read them). torch is imported only when one of the two knobs is on.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.rollout.types import Trajectory


@dataclass(frozen=True)
class GroupShaping:
    """algo.overlong_buffer_len / overlong_penalty_factor over rollout.max_new_tokens, and
    algo.dynamic_sampling."""

    max_new_tokens: int
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    dynamic_sampling: bool = False

    @property
    def active(self) -> bool:
        return self.overlong_buffer_len > 0 or self.dynamic_sampling

    def __call__(self, group: list[Trajectory]) -> bool:
        """Shapes the group's rewards in place; False when dynamic sampling drops it."""
        if not self.active or not group:
            return True
        import torch

        from megarl.algo.filters import shape_and_filter

        out = shape_and_filter(torch.tensor([t.reward for t in group], dtype=torch.float64),
                               torch.tensor([t.response_len for t in group]), [0] * len(group),
                               self.max_new_tokens, self.overlong_buffer_len, self.overlong_penalty_factor,
                               self.dynamic_sampling)
        if self.overlong_buffer_len:
            for t, shaped, penalty in zip(group, out.rewards.tolist(), out.penalty.tolist()):
                # the verifier's reward is kept: dumps and metrics can say what it said
                t.info["reward_raw"], t.info["overlong_penalty"] = t.reward, penalty
                t.reward = shaped
        return bool(out.keep.all())
