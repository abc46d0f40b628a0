"""The choices of the `algo.*` section as enums, and the typed variant configs built from them.

Pure Python (no torch): `megarl.algo.config` validates `algo.*` against these enums when a config
loads, so `import megarl.config` - and a command line that stops at a bad config - never pays for
importing torch. The math that uses them (`megarl.algo.losses`, `.advantages`, ...) imports them
from here; `megarl.algo` exports them with the math.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class AdvantageEstimator(str, Enum):
    """`algo.advantage`."""

    GRPO = "grpo"
    DRGRPO = "drgrpo"
    RLOO = "rloo"
    REINFORCE_PP = "reinforce_pp"
    GAE = "gae"

    @property
    def group_relative(self) -> bool:
        """The baseline comes from the other samples of the prompt's group (a group of one: A = 0)."""
        return self in (AdvantageEstimator.GRPO, AdvantageEstimator.DRGRPO, AdvantageEstimator.RLOO)


@dataclass(frozen=True)
class AdvantageConfig:
    """The advantage variant, chosen once (built by `AlgoConfig.build()`)."""

    estimator: AdvantageEstimator = AdvantageEstimator.GRPO
    """Which estimator (module docstring)."""
    norm_adv_by_std: bool = True
    """grpo: divide by the group std; gae: whiten advantages over the batch. drgrpo never divides;
    reinforce_pp always whitens (that is the method)."""
    gamma: float = 1.0
    """Discount over generated tokens (reinforce_pp, gae)."""
    lam: float = 1.0
    """GAE lambda."""
    kl_coef: float = 0.0
    """Coefficient of the KL folded into the reward (used only when a `kl` tensor is passed)."""
    eps: float = 1e-6
    """Added to standard deviations before dividing."""


class LossAgg(str, Enum):
    """`algo.loss_agg`."""

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"


class RolloutCorrection(str, Enum):
    """`algo.rollout_correction`."""

    NONE = "none"
    TIS_TOKEN = "tis_token"
    TIS_SEQ = "tis_seq"
    MIS_TOKEN = "mis_token"
    MIS_SEQ = "mis_seq"
    ICEPOP = "icepop"


class KLEstimator(str, Enum):
    """`algo.kl_estimator`."""

    K1 = "k1"
    K2 = "k2"
    K2_ABS = "k2_abs"
    K3 = "k3"


class PolicyLossKind(str, Enum):
    """`algo.policy_loss`."""

    PPO = "ppo"
    DECOUPLED_PPO = "decoupled_ppo"
    GSPO = "gspo"


class OldLogp(str, Enum):
    """`algo.old_logp`: which logprob is pi_old in standard PPO."""

    PROX = "prox"
    BEHAVE = "behave"


class CapMode(str, Enum):
    """`algo.behave_weight_cap_mode`: what happens to a behaviour weight above the cap."""

    MASK = "mask"
    CLAMP = "clamp"


@dataclass(frozen=True)
class PolicyLossConfig:
    """The policy-loss variant, chosen once (built by `AlgoConfig.build()`)."""

    kind: PolicyLossKind = PolicyLossKind.DECOUPLED_PPO
    """ppo: ratio against one old logprob; decoupled_ppo: trust region at pi_prox, times pi_prox/pi_behave;
    gspo: the length-normalised sequence ratio against one old logprob, clipped per sequence."""
    old_logp: OldLogp = OldLogp.PROX
    """ppo and gspo: pi_old = pi_prox (recomputed) or pi_behave (rollout engine)."""
    eps_clip_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - eps_clip_low."""
    eps_clip_high: float = 0.2
    """Upper clip: the ratio is clipped at 1 + eps_clip_high (clip-higher when > eps_clip_low)."""
    dual_clip_c: float | None = None
    """Dual clip constant c > 1: for A < 0 the per-token loss is at most c |A|. None = off."""
    behave_weight_cap: float | None = 5.0
    """Decoupled PPO only: cap on the behaviour weight pi_prox / pi_behave. None = no cap."""
    behave_weight_cap_mode: CapMode = CapMode.MASK
    """mask: drop tokens whose weight exceeds the cap; clamp: use min(weight, cap)."""
    rollout_correction: RolloutCorrection = RolloutCorrection.NONE
    """Training-inference mismatch correction on rho = pi_prox / pi_behave."""
    rollout_correction_low: float = 0.5
    """Lower edge of the accepted band for mis_token / mis_seq / icepop."""
    rollout_correction_high: float = 2.0
    """Upper edge of the band (mis_*, icepop) and truncation C (tis_*)."""

    @property
    def needs_prox_logp(self) -> bool:
        return (self.kind == PolicyLossKind.DECOUPLED_PPO or self.old_logp == OldLogp.PROX
                or self.rollout_correction != RolloutCorrection.NONE)


class ProxLogpMode(str, Enum):
    """`algo.prox_logp_mode`."""

    RECOMPUTE = "recompute"
    LOGLINEAR = "loglinear"
    METRICS = "metrics"
