"""`AlgoConfig`: the `algo.*` section of a megarl config, and its typed build.

Fields are plain strings / numbers so that YAML and dotted overrides set them directly
(`algo.policy_loss=ppo`). `validate()` rejects unknown choices and impossible values with
`ValueError("algo.<field>: <problem>")`; `build()` validates and turns the strings into enums
once, returning an `AlgoSpec` that the trainer hands to the pure functions of `megarl.algo`.
Formulas for every option are in docs/algorithms.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from megarl.algo.choices import (AdvantageConfig, AdvantageEstimator, CapMode, KLEstimator, LossAgg,
                                 OldLogp, PolicyLossConfig, PolicyLossKind, ProxLogpMode,
                                 RolloutCorrection)
from megarl.common.fields import bounded, check_bounds


@dataclass
class AlgoConfig:
    """RL algorithm options (`algo.*`)."""

    policy_loss: str = "decoupled_ppo"
    """ppo | decoupled_ppo | gspo. decoupled_ppo: trust region at pi_prox, times pi_prox / pi_behave;
    gspo: sequence-level ratio (pi_theta / pi_old)^(1/|y|), clipped per sequence (Qwen3's GSPO);
    use loss_agg seq_mean_token_mean, and small clips (e.g. 3e-4 / 4e-4)."""
    old_logp: str = "prox"
    """prox | behave. pi_old of ppo and gspo (ignored by decoupled_ppo, which always uses prox)."""
    eps_clip_low: float = bounded(0.2, ge=0.0, lt=1.0)
    """Ratio clipped below at 1 - eps_clip_low; in [0, 1)."""
    eps_clip_high: float = bounded(0.2, ge=0.0)
    """Ratio clipped above at 1 + eps_clip_high; >= 0 (DAPO clip-higher: e.g. 0.28)."""
    dual_clip_c: float | None = bounded(None, gt=1.0)
    """Dual clip: per-token loss for A < 0 is at most c |A|; c > 1. null = off."""
    behave_weight_cap: float | None = bounded(5.0, ge=1.0)
    """decoupled_ppo: cap on pi_prox / pi_behave; >= 1. null = no cap."""
    behave_weight_cap_mode: str = "mask"
    """mask | clamp. mask drops tokens above the cap, clamp uses the cap as their weight."""
    rollout_correction: str = "none"
    """none | tis_token | tis_seq | mis_token | mis_seq | icepop, on rho = pi_prox / pi_behave."""
    rollout_correction_low: float = bounded(0.5, ge=0.0, le=1.0)
    """Lower edge of the kept band of rho (mis_*, icepop); in [0, 1]."""
    rollout_correction_high: float = bounded(2.0, ge=1.0)
    """Upper edge of the band (mis_*, icepop) and truncation C (tis_*); >= 1."""
    prox_logp_mode: str = "recompute"
    """recompute | loglinear | metrics. How log pi_prox is obtained (metrics: recompute and
    report the loglinear approximation error)."""
    loss_agg: str = "token_mean"
    """token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm."""
    loss_agg_norm_len: int | None = bounded(None, ge=1)
    """C of seq_mean_token_sum_norm; null = the rollout's max response length."""
    advantage: str = "grpo"
    """grpo | drgrpo | rloo | reinforce_pp | gae."""
    norm_adv_by_std: bool = True
    """grpo: divide by the group std; gae: whiten over the batch. drgrpo never divides."""
    gamma: float = bounded(1.0, ge=0.0, le=1.0)
    """Discount over generated tokens (reinforce_pp, gae); in [0, 1]."""
    lam: float = bounded(1.0, ge=0.0, le=1.0)
    """GAE lambda; in [0, 1]."""
    kl_estimator: str = "k3"
    """k1 | k2 | k2_abs | k3. Estimator of KL(pi_theta || pi_ref); k3 is "low_var_kl"."""
    kl_coef: float = bounded(0.0, ge=0.0)
    """Weight of the reference KL; 0 = no reference model needed. >= 0."""
    kl_in_reward: bool = False
    """true: subtract kl_coef * KL from the reward; false: add kl_coef * KL to the loss."""
    entropy_coef: float = bounded(0.0, ge=0.0)
    """Entropy bonus: per-token loss -entropy_coef * H_t. >= 0."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal - the rewards after overlong shaping (DAPO's
    order; both act in the rollout manager, megarl/rollout/shaping.py)."""
    overlong_buffer_len: int = bounded(0, ge=0)
    """DAPO overlong shaping over the last N tokens of rollout.max_new_tokens, added to the reward
    before dynamic sampling; 0 = off."""
    overlong_penalty_factor: float = bounded(1.0, ge=0.0)
    """Penalty at (and beyond) the max length; >= 0."""
    distill_coef: float = bounded(0.0, ge=0.0)
    """On-policy distillation (needs teacher.path): each generated token's advantage gains
    distill_coef x (log pi_teacher(y_t) - log pi_behave(y_t)), the negative per-token reverse KL
    of the sampling policy from the teacher, which the served teacher scores; 0 = off."""
    distill_reward_coef: float = bounded(1.0, ge=0.0)
    """With distillation: the weight of the task reward's advantage (algo.advantage) beside the
    teacher's signal; 0 = the teacher's signal alone."""

    def validate(self) -> None:
        """Raise ValueError("algo.<field>: <problem>") on the first bad value."""
        for name, enum in _CHOICES.items():
            _choice(name, getattr(self, name), enum)
        for name in ("norm_adv_by_std", "kl_in_reward", "dynamic_sampling"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"expected true/false, got {getattr(self, name)!r}")
        check_bounds(self, "algo")
        uses_prox = self.policy_loss == "decoupled_ppo" or self.old_logp == "prox"
        if self.policy_loss == "gspo":
            if self.loss_agg != "seq_mean_token_mean":
                _fail("loss_agg", f"{self.loss_agg} with policy_loss=gspo weights sequences by their length; "
                      "GSPO averages over sequences: set algo.loss_agg=seq_mean_token_mean")
            if self.rollout_correction in ("tis_token", "mis_token", "icepop"):
                _fail("rollout_correction", f"{self.rollout_correction} is per token; policy_loss=gspo's ratio "
                      "is per sequence: use tis_seq or mis_seq")
        if self.rollout_correction != "none" and not uses_prox:
            _fail("rollout_correction", "needs old_logp=prox (with pi_old = pi_behave the "
                  "correction ratio pi_old / pi_behave is 1)")
        if self.prox_logp_mode != "recompute" and not uses_prox and self.rollout_correction == "none":
            _fail("prox_logp_mode", f"{self.prox_logp_mode} is pointless: ppo with old_logp=behave "
                  "never uses pi_prox")

    def build(self) -> "AlgoSpec":
        """Validate, then choose every variant once."""
        self.validate()
        return AlgoSpec(
            policy_loss=PolicyLossConfig(
                kind=PolicyLossKind(self.policy_loss), old_logp=OldLogp(self.old_logp),
                eps_clip_low=float(self.eps_clip_low), eps_clip_high=float(self.eps_clip_high),
                dual_clip_c=self.dual_clip_c, behave_weight_cap=self.behave_weight_cap,
                behave_weight_cap_mode=CapMode(self.behave_weight_cap_mode),
                rollout_correction=RolloutCorrection(self.rollout_correction),
                rollout_correction_low=float(self.rollout_correction_low),
                rollout_correction_high=float(self.rollout_correction_high)),
            advantage=AdvantageConfig(
                estimator=AdvantageEstimator(self.advantage), norm_adv_by_std=self.norm_adv_by_std,
                gamma=float(self.gamma), lam=float(self.lam), kl_coef=float(self.kl_coef)),
            loss_agg=LossAgg(self.loss_agg), loss_agg_norm_len=self.loss_agg_norm_len,
            prox_logp_mode=ProxLogpMode(self.prox_logp_mode),
            kl_estimator=KLEstimator(self.kl_estimator), kl_coef=float(self.kl_coef),
            kl_in_reward=self.kl_in_reward, entropy_coef=float(self.entropy_coef),
            dynamic_sampling=self.dynamic_sampling, overlong_buffer_len=self.overlong_buffer_len,
            overlong_penalty_factor=float(self.overlong_penalty_factor),
            distill_coef=float(self.distill_coef), distill_reward_coef=float(self.distill_reward_coef))


@dataclass(frozen=True)
class AlgoSpec:
    """`AlgoConfig` with every choice resolved to an enum / typed sub-config (see `build`)."""

    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss_agg: LossAgg = LossAgg.TOKEN_MEAN
    loss_agg_norm_len: int | None = None
    prox_logp_mode: ProxLogpMode = ProxLogpMode.RECOMPUTE
    kl_estimator: KLEstimator = KLEstimator.K3
    kl_coef: float = 0.0
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    dynamic_sampling: bool = False
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    distill_coef: float = 0.0  # the teacher's per-token signal in the advantage (0 = no teacher)
    distill_reward_coef: float = 1.0  # the task advantage's weight beside it

    @property
    def uses_ref_model(self) -> bool:
        return self.kl_coef > 0.0

    @property
    def kl_loss_coef(self) -> float:
        """Coefficient of the KL loss term (0 when the KL is folded into the reward)."""
        return 0.0 if self.kl_in_reward else self.kl_coef


_CHOICES: dict[str, type[Enum]] = {
    "policy_loss": PolicyLossKind, "old_logp": OldLogp, "behave_weight_cap_mode": CapMode,
    "rollout_correction": RolloutCorrection, "prox_logp_mode": ProxLogpMode, "loss_agg": LossAgg,
    "advantage": AdvantageEstimator, "kl_estimator": KLEstimator,
}


def _fail(name: str, problem: str) -> None:
    raise ValueError(f"algo.{name}: {problem}")


def _choice(name: str, value: object, enum: type[Enum]) -> None:
    allowed = [e.value for e in enum]
    if not isinstance(value, str) or value not in allowed:
        _fail(name, f"{value!r} is not one of {', '.join(allowed)}")
