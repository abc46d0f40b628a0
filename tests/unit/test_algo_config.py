"""AlgoConfig: validation errors name the field; build() resolves every choice once."""
import dataclasses
from pathlib import Path

import pytest

from megarl.algo import (AdvantageEstimator, AlgoConfig, CapMode, KLEstimator, LossAgg, OldLogp,
                         PolicyLossKind, ProxLogpMode, RolloutCorrection)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def test_defaults_build_and_strings_from_yaml_resolve_to_enums():
    spec = AlgoConfig().build()
    assert spec.policy_loss.kind == PolicyLossKind.DECOUPLED_PPO
    spec = AlgoConfig(policy_loss="ppo", old_logp="prox", rollout_correction="icepop",
                      behave_weight_cap_mode="clamp", prox_logp_mode="loglinear",
                      loss_agg="seq_mean_token_sum_norm", loss_agg_norm_len=512, advantage="gae",
                      kl_estimator="k2_abs", kl_coef=0.1, kl_in_reward=True, dual_clip_c=3,
                      eps_clip_high=0.28).build()
    assert spec.policy_loss.kind == PolicyLossKind.PPO and spec.policy_loss.old_logp == OldLogp.PROX
    assert spec.policy_loss.rollout_correction == RolloutCorrection.ICEPOP
    assert spec.policy_loss.behave_weight_cap_mode == CapMode.CLAMP
    assert spec.prox_logp_mode == ProxLogpMode.LOGLINEAR and spec.loss_agg == LossAgg.SEQ_MEAN_TOKEN_SUM_NORM
    assert spec.advantage.estimator == AdvantageEstimator.GAE and spec.kl_estimator == KLEstimator.K2_ABS
    assert spec.uses_ref_model and spec.kl_loss_coef == 0.0 and spec.advantage.kl_coef == 0.1


@pytest.mark.parametrize("field,value,match", [
    ("policy_loss", "grpo", "not one of"),
    ("old_logp", "old", "not one of"),
    ("rollout_correction", "tis", "not one of"),
    ("loss_agg", "token-mean", "not one of"),
    ("advantage", "ppo", "not one of"),
    ("kl_estimator", "low_var_kl", "not one of"),
    ("prox_logp_mode", "approx", "not one of"),
    ("behave_weight_cap_mode", "drop", "not one of"),
    ("eps_clip_low", -0.1, ">= 0"),
    ("eps_clip_low", 1.0, "< 1"),
    ("eps_clip_high", -0.01, ">= 0"),
    ("dual_clip_c", 1.0, "> 1"),
    ("behave_weight_cap", 0.5, ">= 1"),
    ("rollout_correction_low", 1.5, "<= 1"),
    ("rollout_correction_high", 0.9, ">= 1"),
    ("gamma", 1.1, "<= 1"),
    ("lam", -0.5, ">= 0"),
    ("kl_coef", -1.0, ">= 0"),
    ("entropy_coef", float("nan"), "finite"),
    ("overlong_buffer_len", -1, ">= 0"),
    ("overlong_buffer_len", 2.5, "integer"),
    ("loss_agg_norm_len", 0, ">= 1"),
    ("norm_adv_by_std", "yes", "true/false"),
])
def test_bad_values_raise_with_the_field_name(field, value, match):
    with pytest.raises(ValueError, match=rf"^algo\.{field}: .*{match}"):
        AlgoConfig(**{field: value}).validate()


def test_cross_field_rules():
    with pytest.raises(ValueError, match=r"^algo\.rollout_correction: .*old_logp=prox"):
        AlgoConfig(policy_loss="ppo", old_logp="behave", rollout_correction="tis_token").validate()
    with pytest.raises(ValueError, match=r"^algo\.prox_logp_mode"):
        AlgoConfig(policy_loss="ppo", old_logp="behave", prox_logp_mode="loglinear").validate()
    AlgoConfig(policy_loss="decoupled_ppo", old_logp="behave", rollout_correction="mis_seq").validate()


def test_every_field_and_choice_is_documented():
    text = DOCS.read_text()
    for f in dataclasses.fields(AlgoConfig):
        assert f"algo.{f.name}" in text, f.name
    for enum in (PolicyLossKind, OldLogp, CapMode, RolloutCorrection, ProxLogpMode, LossAgg,
                 AdvantageEstimator, KLEstimator):
        for member in enum:
            assert f"`{member.value}`" in text, member
