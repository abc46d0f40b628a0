"""Pure RL math for megarl: policy losses, rollout corrections, the proximal-logprob
approximation, loss aggregation, advantages, KL, DAPO filters.

Imports torch only (never megatron), so everything here is unit-tested on CPU. Tensors are
[batch, seq] with `loss_mask` = 1 on generated tokens; three log-probabilities travel together:
`logp` (pi_theta), `prox_logp` (pi_prox), `behave_logp` (pi_behave). Metrics are `Stat`s (masked
sums with counts) so that they reduce over micro-batches and DP ranks before dividing.

    from megarl.algo import AlgoConfig
    spec = AlgoConfig(policy_loss="decoupled_ppo").build()   # choose variants once
    adv = compute_advantages(spec.advantage, rewards, loss_mask, group_id).advantages
    W = token_weights(loss_mask, spec.loss_agg, all_reduced(step_denominators(loss_mask)))
    out = policy_loss(logp, prox_logp, behave_logp, adv, loss_mask, spec.policy_loss)
    loss = aggregate(out.loss, W)
"""
from megarl.algo.advantages import (AdvantageConfig, AdvantageEstimator, AdvantageOutput,
                                    broadcast_to_tokens, compute_advantages, discounted_returns,
                                    gae_advantages, grpo_advantages, group_stats, masked_whiten,
                                    reinforce_pp_advantages, rloo_advantages, token_level_rewards)
from megarl.algo.aggregation import (LossAgg, StepDenominators, aggregate, step_denominators,
                                     step_token_weights, token_weights)
from megarl.algo.config import AlgoConfig, AlgoSpec
from megarl.algo.correction import (CorrectionOutput, RolloutCorrection, onpolicy_mismatch,
                                    rollout_correction)
from megarl.algo.filters import (dynamic_sampling_indices, dynamic_sampling_keep,
                                 overlong_penalty, response_lengths)
from megarl.algo.kl import KLEstimator, entropy_loss, kl_loss, kl_penalty
from megarl.algo.losses import (CapMode, OldLogp, PolicyLossConfig, PolicyLossKind,
                                PolicyLossOutput, clipped_surrogate, policy_loss)
from megarl.algo.prox import (ProxLogpMode, loglinear_alpha, loglinear_prox_logp,
                              prox_approx_stats)
from megarl.algo.stats import Reduce, Stat, merge_stats, stats_results

__all__ = [
    "AdvantageConfig", "AdvantageEstimator", "AdvantageOutput", "AlgoConfig", "AlgoSpec",
    "CapMode", "CorrectionOutput", "KLEstimator", "LossAgg", "OldLogp", "PolicyLossConfig",
    "PolicyLossKind", "PolicyLossOutput", "ProxLogpMode", "Reduce", "RolloutCorrection", "Stat",
    "StepDenominators", "aggregate", "broadcast_to_tokens", "clipped_surrogate",
    "compute_advantages", "discounted_returns", "dynamic_sampling_indices",
    "dynamic_sampling_keep", "entropy_loss", "gae_advantages", "grpo_advantages", "group_stats",
    "kl_loss", "kl_penalty", "loglinear_alpha", "loglinear_prox_logp", "masked_whiten",
    "merge_stats", "onpolicy_mismatch", "overlong_penalty", "policy_loss", "prox_approx_stats",
    "reinforce_pp_advantages", "response_lengths", "rloo_advantages", "rollout_correction",
    "stats_results", "step_denominators", "step_token_weights", "token_level_rewards",
    "token_weights",
]
