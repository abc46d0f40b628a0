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

Names load on first use (PEP 562 ``__getattr__``): ``megarl.config`` imports ``megarl.algo.config``,
which needs only the torch-free enums of ``megarl.algo.choices``, and an eager import of the math
here would make every config load (and every command line rejecting a bad config) import torch.
"""
import importlib

_EXPORTS = {
    "advantages": ["AdvantageOutput", "broadcast_to_tokens", "compute_advantages", "discounted_returns",
                   "gae_advantages", "grpo_advantages", "group_stats", "masked_whiten",
                   "reinforce_pp_advantages", "rloo_advantages", "token_level_rewards"],
    "aggregation": ["StepDenominators", "aggregate", "step_denominators", "step_token_weights",
                    "token_weights"],
    "choices": ["AdvantageConfig", "AdvantageEstimator", "CapMode", "KLEstimator", "LossAgg", "OldLogp",
                "PolicyLossConfig", "PolicyLossKind", "ProxLogpMode", "RolloutCorrection"],
    "config": ["AlgoConfig", "AlgoSpec"],
    "correction": ["CorrectionOutput", "onpolicy_mismatch", "rollout_correction"],
    "filters": ["dynamic_sampling_indices", "dynamic_sampling_keep", "overlong_penalty", "response_lengths",
                "shape_and_filter"],
    "kl": ["entropy_loss", "kl_loss", "kl_penalty"],
    "losses": ["PolicyLossOutput", "clipped_surrogate", "policy_loss"],
    "prox": ["loglinear_alpha", "loglinear_prox_logp", "prox_approx_stats"],
    "stats": ["Reduce", "Stat", "merge_stats", "stats_results"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
