"""The critic for GAE: a Megatron GPTModel whose vocab-parallel LM head is replaced by a scalar
value head, trained by the same engine machinery as the actor.

    critic = Critic.build(CriticSpec.from_config(cfg), ps)   # critic.hf_path, else model.hf_path
    warm = critic.warming_up                        # decided before this step's update
    batch, stats = actor.step_fields(batch, version, values=critic.values(batch), update=not warm)
                                                    # V_t at the step start (old values); gae ->
                                                    # advantages + returns (trainer/actor.py)
    metrics = critic.update(batch)                  # clipped value loss, epochs x mini-batches
    if not warm: actor.ppo_update(batch, version, stats)

The value head is a plain replicated Linear(hidden, 1): on the last pipeline stage the hidden
states (after the final norm) are complete and identical on every TP rank (no sequence
parallelism), so every TP rank computes the same values and the same head gradient, and the
backward into the backbone needs no extra communication (like a layer norm's weight). Megatron's
grad-norm counts a replicated parameter once (TP rank 0). Tied embeddings are untied for the
critic: the head has nothing to share with the input embedding.

V_t is aligned like logprobs: entry t is the value of the state that emits token t, i.e. the head
applied to the hidden state at position t - 1; entry 0 = 0.

Value loss per token (old values V_old from the step start, returns R from GAE, c = value_clip):

    L_t = 0.5 max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - R_t)^2)    (c set)
    L_t = 0.5 (V_t - R_t)^2                                                          (c null)

aggregated with the actor's `algo.loss_agg` weights over each whole mini-batch.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from megarl.common import compat
from megarl.algo import Stat, aggregate
from megarl.algo.config import AlgoSpec
from megarl.config import Config, CriticConfig
from megarl.mcore.heads import replace_output_layer
from megarl.trainer.metrics import StatsTracker
from megarl.trainer.actor import (dp_counts, mean_or_zero, minibatch_indices,
                                  minibatch_loss_weights, num_minibatches, shuffle_seed,
                                  step_norm_len)
from megarl.trainer.batch import MicroBatch, TensorBatch
from megarl.trainer.engine import Engine, EngineSpec


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               loss_mask: torch.Tensor,
               clip: Optional[float]) -> tuple[torch.Tensor, dict[str, Stat]]:
    """Per-token clipped value loss (module docstring), 0 off the mask. Stats: value_clip_frac
    (|V - V_old| > c and the clipped branch is the larger), value_mean, return_mean,
    value_abs_err (mean |V - R|)."""
    m = loss_mask.bool()
    ret, old = returns.detach(), old_values.detach()
    err = (values - ret).square()
    stats = {"value_mean": Stat.masked_mean(values, m), "return_mean": Stat.masked_mean(ret, m),
             "value_abs_err": Stat.masked_mean((values - ret).abs(), m)}
    if clip is not None:
        clipped = old + (values - old).clamp(-clip, clip)
        err_c = (clipped - ret).square()
        active = ((values - old).abs() > clip) & (err_c > err)  # the clip changed the loss
        stats["value_clip_frac"] = Stat.masked_mean(active.float(), m)
        err = torch.maximum(err, err_c)
    loss = 0.5 * torch.where(m, err, torch.zeros_like(err))
    return loss, stats


class ValueHead(torch.nn.Module):
    """Linear(hidden, 1) standing in for GPTModel.output_layer (same call signature)."""

    def __init__(self, hidden: int, std: float, dtype: torch.dtype, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)  # same init on every TP/DP rank
        self.weight = torch.nn.Parameter((torch.randn(1, hidden, generator=g) * std).to(dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def attach_value_head(chunks: list, hidden: int, std: float, dtype: torch.dtype, seed: int) -> None:
    """Replaces the LM head of the last-stage chunk by a `ValueHead`; unties embeddings."""
    for model in chunks:
        head = ValueHead(hidden, std, dtype, seed)
        if compat.HAVE_CUDA:
            head.cuda(torch.cuda.current_device())
        replace_output_layer(model, head)


class CriticEngine(Engine):
    """`Engine` whose per-token output is V_t instead of log p(y_t)."""

    @classmethod
    def adapt_chunks(cls, chunks, spec: EngineSpec, args, tconfig) -> None:
        attach_value_head(chunks, args.hidden_size, args.initializer_range, tconfig.params_dtype,
                          spec.model.seed)

    def _next_token(self, values, targets, with_entropy: bool):
        """The value of the state after each position's token [b, n] (`_per_token` aligns it like
        logprobs, module docstring); the critic has no entropy."""
        return values[..., 0].float(), None

    def compute_logp(self, batch, with_entropy=False):
        raise TypeError("the critic's per-token output is values, not logprobs: use forward_per_token")

    def export_hf(self, out_dir, dtype=None):
        raise NotImplementedError("the critic has no HF export (its head is not an LM head)")


@dataclass(frozen=True)
class CriticSpec:
    """What a `Critic` is built from: its own section, its engine's spec (the actor's model and
    optim sections with critic.hf_path / critic.lr over them), the loss weighting of the algorithm
    and the mini-batch plan it shares with the actor."""

    critic: CriticConfig
    engine: EngineSpec
    algo: AlgoSpec  # algo.build(): the loss aggregation the value loss shares with the actor
    ppo_mini_batch_size: int
    ppo_epochs: int
    seed: int  # train.seed: the critic shuffles with seed + 1

    @classmethod
    def from_config(cls, cfg: Config) -> "CriticSpec":
        c = cfg.critic
        model = dataclasses.replace(cfg.model, hf_path=c.hf_path or cfg.model.hf_path)
        optim = dataclasses.replace(cfg.optim, lr=c.lr if c.lr is not None else cfg.optim.lr,
                                    min_lr=min(cfg.optim.min_lr, c.lr or cfg.optim.lr),
                                    freeze=[])  # optim.freeze names the policy's tensors
        engine = dataclasses.replace(EngineSpec.from_config(cfg), model=model, optim=optim, lora=None)
        return cls(c, engine, cfg.algo.build(), cfg.train.ppo_mini_batch_size, cfg.train.ppo_epochs,
                   cfg.train.seed)


class Critic:
    """Value model for GAE: step-start values, and a clipped-value-loss update per RL step."""

    def __init__(self, spec: CriticSpec, ps, engine: CriticEngine):
        self.spec, self.ps, self.engine = spec, ps, engine
        self.updates = 0

    @classmethod
    def build(cls, spec: CriticSpec, ps) -> "Critic":
        return cls(spec, ps, CriticEngine.build(spec.engine, ps))

    @property
    def warming_up(self) -> bool:
        """True for the first critic.warmup_steps updates: the actor should not update yet."""
        return self.updates < self.spec.critic.warmup_steps

    def values(self, batch: TensorBatch) -> torch.Tensor:
        """V_t [B, S] of this rank's samples (forward-only; on every PP stage)."""
        return self.engine.forward_per_token(batch).out

    def update(self, batch: TensorBatch) -> dict[str, float]:
        """Epochs x mini-batches of the value loss (fields loss_mask, values = V_old, returns);
        the same mini-batch plan as the actor. Collective over all ranks."""
        t0 = time.perf_counter()
        missing = [n for n in ("loss_mask", "values", "returns") if n not in batch.fields]
        if missing:
            raise ValueError(f"Critic.update: batch lacks field(s) {missing}")
        spec = self.spec
        n_mini = num_minibatches(dp_counts(len(batch), self.ps), spec.ppo_mini_batch_size)
        norm_len = step_norm_len(batch, spec.algo, self.ps) if n_mini else None
        acc, losses, grad_norms = StatsTracker(), [], []
        for epoch in range(spec.ppo_epochs if n_mini else 0):
            # a different stream from the actor's shuffle (same seed would couple them)
            seed = shuffle_seed(spec.seed + 1, self.updates, epoch)
            for idx in minibatch_indices(len(batch), n_mini, seed):
                mini = batch.select(idx)
                mini = mini.with_fields(
                    loss_weight=minibatch_loss_weights(mini, spec.algo, self.ps, norm_len))
                out = self.engine.train_batch(mini, partial(self._loss_fn, acc))
                losses.append(out["loss"])
                grad_norms.append(out["grad_norm"])
        metrics = acc.reduce(self.ps)
        metrics.update(value_loss=mean_or_zero(losses), grad_norm=mean_or_zero(grad_norms),
                       update_time=time.perf_counter() - t0)
        self.updates += 1
        return metrics

    def _loss_fn(self, acc: StatsTracker, values: torch.Tensor, entropy, mb: MicroBatch):
        m = mb["loss_mask"]
        per_token, stats = value_loss(values, mb["values"], mb["returns"], m,
                                      self.spec.critic.value_clip)
        acc.add_stats(stats)
        return aggregate(per_token, mb["loss_weight"]), {}
