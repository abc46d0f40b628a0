"""The PPO actor: one RL step's policy update on top of the loss-agnostic engine.

    actor = Actor.build(cfg, ps, engine)            # + a frozen reference when algo.kl_coef > 0
    batch = step.share(ps.dp_rank)                  # this DP rank's whole groups (trainer/handoff.py)
    batch, stats = actor.step_fields(batch, version, values=V)   # ref, prox, advantages: one place
    metrics = actor.ppo_update(batch, version, stats)            # epochs x mini-batches

`step_fields` is the one place a step's computed fields join its batch, each computed once on
the step-start weights and added by one `with_fields`:

    values     <- the critic's V_t (given: gae)
    ref_logp   <- ref.compute_logp(batch)          (algo.kl_loss_coef > 0, or algo.kl_in_reward)
    prox_logp  <- engine.compute_logp(batch)       (algo.prox_logp_mode: recompute | metrics;
                                                    loglinear interpolates inside the loss)
    advantages, returns <- compute_advantages on this rank's share: the manager gives each DP rank
                           whole groups, so group baselines need nothing of another rank; the
                           step-wide whitening of reinforce_pp / gae sums a few scalars over DP
                           (megarl/algo/advantages.py) - no gather of the step

`ppo_update` then runs on this DP rank's share (fields loss_mask, behave_logp, advantages,
versions; prox_logp / ref_logp when the loss needs them):

    for epoch in range(train.ppo_epochs):
        for mini-batch in shuffled split:           (train.ppo_mini_batch_size is GLOBAL over DP)
            W <- token_weights(mini-batch, all_reduce_DP(step_denominators(mini-batch)))
            engine.train_batch(mini-batch, loss)    (one optimizer step)

    loss = sum_it W_it [ L^policy_it - entropy_coef H_it + kl_coef k_it ]

so every aggregation denominator is a statistic of the whole mini-batch (all micro-batches, all DP
ranks): the loss and its gradient do not depend on how the mini-batch is cut into micro-batches.
Every DP rank of a step draws the same number of mini-batches (from the all-gathered sample
counts); TP/PP peers hold the same samples and use the same shuffle seed, so they agree.

Under loglinear prox the clock of mini-batch k of K optimizer steps is v_theta = v_prox + k / K
(the update as a whole moves the policy from version v_prox to v_prox + 1), so the first
mini-batch sees pi_prox = pi_theta exactly, like a recompute would.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megarl.algo import (AdvantageConfig, AlgoSpec, ProxLogpMode, Stat, aggregate,
                         compute_advantages, entropy_loss, kl_loss, kl_penalty,
                         loglinear_prox_logp, onpolicy_mismatch, policy_loss, prox_approx_stats,
                         step_denominators, token_weights)
from megarl.algo.advantages import AdvantageOutput, Reduce
from megarl.algo.aggregation import StepDenominators
from megarl.algo.choices import LossAgg
from megarl.trainer.metrics import StatsTracker
from megarl.trainer import moe_losses
from megarl.trainer.batch import MicroBatch, TensorBatch

# ----------------------------------------------------------------------------- pure helpers


def num_minibatches(local_counts: Sequence[int], mini_batch_size: int) -> int:
    """Optimizer steps per epoch for a step whose DP ranks hold `local_counts` sequences.

    n = ceil(sum(local_counts) / mini_batch_size) (mini_batch_size <= 0: the whole step, n = 1),
    capped at min(local_counts) so that every rank has at least one sequence in every mini-batch
    (all DP ranks must take part in every optimizer step). 0 when some rank holds nothing.
    """
    total, fewest = sum(local_counts), min(local_counts, default=0)
    if fewest <= 0:
        return 0
    n = 1 if mini_batch_size <= 0 else math.ceil(total / mini_batch_size)
    return max(1, min(n, fewest))


def minibatch_indices(n: int, n_mini: int, seed: int) -> list[list[int]]:
    """Splits range(n) into `n_mini` nearly equal parts (sizes differ by at most one, larger
    first) of a seeded random permutation; each part is sorted. Same seed, same split on every
    process (torch CPU generator)."""
    if n_mini < 1 or n < n_mini:
        raise ValueError(f"cannot split {n} sequences into {n_mini} mini-batches")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    base, extra = divmod(n, n_mini)
    out, start = [], 0
    for j in range(n_mini):
        size = base + (1 if j < extra else 0)
        out.append(sorted(perm[start:start + size]))
        start += size
    return out


def shuffle_seed(seed: int, update: int, epoch: int) -> int:
    """The mini-batch shuffle seed of (config seed, update index, epoch)."""
    return (seed * 1_000_003 + update * 1_009 + epoch) % (2 ** 63)


def distill_advantages(task_adv: torch.Tensor, batch: TensorBatch, coef: float, reward_coef: float,
                       acc: Optional[StatsTracker] = None) -> torch.Tensor:
    """On-policy distillation's advantages [B, S]: with r_t = log pi_T(y_t) - log pi_behave(y_t)
    (the negative per-token reverse KL of the sampling policy from the teacher, estimated on the
    sampled token),

        A_t = reward_coef * A_task_t + coef * r_t      on generated tokens (0 elsewhere)

    r_t is not discounted or summed over later tokens (each token's own term, as in on-policy
    distillation). ``acc`` gets distill/reverse_kl (the mean of -r_t over generated tokens) and
    distill/teacher_logp."""
    if "teacher_logp" not in batch:
        raise ValueError("algo.distill_coef > 0 but the batch has no teacher_logp (no teacher scored it)")
    dt = task_adv.dtype
    mask, teacher = batch["loss_mask"].to(dt), batch["teacher_logp"].to(dt)
    r = (teacher - batch["behave_logp"].to(dt)) * mask
    if acc is not None:
        acc.add_stats({"distill/reverse_kl": Stat.masked_mean(-r, mask.bool()),
                       "distill/teacher_logp": Stat.masked_mean(teacher, mask.bool())})
    return (reward_coef * task_adv + coef * r) * mask


def step_advantages(cfg: AdvantageConfig, batch: TensorBatch, values: Optional[torch.Tensor] = None,
                    kl: Optional[torch.Tensor] = None, reduce: Reduce = None) -> AdvantageOutput:
    """`megarl.algo.compute_advantages` on a batch of whole groups (a DP rank's share, or a whole
    step): reads loss_mask and the sample fields rewards and group_ids; ``values`` (the critic's
    V_t) for gae; ``kl`` [B, S], the per-token KL estimate to fold into the reward
    (algo.kl_in_reward); ``reduce`` sums the step-wide whitening statistics over the DP shares."""
    return compute_advantages(cfg, batch["rewards"], batch["loss_mask"], batch["group_ids"],
                              values=values, kl=kl, reduce=reduce)


# ----------------------------------------------------------------------------- DP collectives


def dp_counts(n_local: int, ps) -> list[int]:
    """Every DP rank's local sequence count (all-gather over the DP group)."""
    # On ps.device because NCCL cannot gather CPU tensors; float64 holds any count exactly.
    mine = torch.tensor([n_local], dtype=torch.float64, device=ps.device)
    if ps.dp == 1:
        return [n_local]
    parts = [torch.zeros_like(mine) for _ in range(ps.dp)]
    dist.all_gather(parts, mine, group=ps.dp_group)
    return [int(p.item()) for p in parts]


def dp_sum(ps):
    """A `Reduce` over the DP group (None with one DP rank: the share is the step)."""
    if ps.dp == 1:
        return None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.to(ps.device)  # NCCL reduces device tensors only
        dist.all_reduce(t, group=ps.dp_group)
        return t.cpu()
    return reduce


def minibatch_loss_weights(mini: TensorBatch, spec: AlgoSpec, ps,
                           norm_len: Optional[int]) -> torch.Tensor:
    """Aggregation weights W [B, S] (`algo.loss_agg`) whose denominators are those of the whole
    mini-batch: one SUM all-reduce of (N_tok, N_seq) over the DP group."""
    mask = mini["loss_mask"]
    den = step_denominators(mask).as_tensor().to(ps.device)
    if ps.dp > 1:
        dist.all_reduce(den, group=ps.dp_group)
    # W stays on the CPU with the batch; make_microbatches moves it with the other fields.
    return token_weights(mask, spec.loss_agg, StepDenominators.from_tensor(den.cpu()), norm_len)


def step_norm_len(full: TensorBatch, spec: AlgoSpec, ps) -> Optional[int]:
    """C of seq_mean_token_sum_norm: algo.loss_agg_norm_len, else the longest response of the
    step (max loss tokens of one sequence over all DP ranks); None for other modes."""
    if spec.loss_agg != LossAgg.SEQ_MEAN_TOKEN_SUM_NORM:
        return None
    if spec.loss_agg_norm_len is not None:
        return spec.loss_agg_norm_len
    per_row = full["loss_mask"].to(torch.float64).sum(dim=-1)
    # The appended 0 keeps max() defined on a rank without samples (it still joins the MAX).
    t = torch.cat([per_row, per_row.new_zeros(1)]).max().reshape(1).to(ps.device)
    if ps.dp > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.dp_group)
    return max(1, int(t.item()))


# ----------------------------------------------------------------------------- the actor


@dataclass
class _Clock:
    """Where the update is: optimizer step k of K, policy version at the step start."""

    k: int = 0
    total: int = 1
    prox_version: float = 0.0

    @property
    def theta_version(self) -> float:
        return self.prox_version + self.k / self.total


class Actor:
    """Policy update of one RL step (module docstring). Holds the trainable engine and an optional
    frozen reference engine. The policy version is not kept here: the caller passes the one the
    trainer's `ManagerCluster` holds (the loglinear prox clock starts from it)."""

    def __init__(self, cfg, ps, engine, ref=None, spec: Optional[AlgoSpec] = None):
        self.cfg, self.ps, self.engine, self.ref = cfg, ps, engine, ref
        self.spec = spec or cfg.algo.build()
        self.updates = 0  # PPO updates so far: seeds the mini-batch shuffle (restored on resume)

    @classmethod
    def build(cls, cfg, ps, engine=None) -> "Actor":
        """Engine (unless given) + the frozen reference when the algorithm needs one."""
        from megarl.trainer.engine import Engine, EngineSpec

        engine = engine or Engine.build(EngineSpec.from_config(cfg), ps)
        spec = cfg.algo.build()
        ref = build_reference(cfg, ps, engine) if spec.uses_ref_model else None
        return cls(cfg, ps, engine, ref, spec)

    # ------------------------------------------------------------------ per-step inputs
    def ref_logp(self, batch: TensorBatch) -> torch.Tensor:
        """log pi_ref [B, S] of this rank's samples (forward-only on the frozen reference)."""
        if self.ref is None:
            raise ValueError("Actor.ref_logp: no reference model (algo.kl_coef is 0)")
        return self.ref.compute_logp(batch).logp

    def step_fields(self, batch: TensorBatch, version: int, values: Optional[torch.Tensor] = None,
                    update: bool = True) -> tuple[TensorBatch, StatsTracker]:
        """This DP rank's share (whole groups) plus every field the step computes (module
        docstring), added in one `with_fields`; and the stats measured on the way (train-rollout
        mismatch, entropy, MoE replay deltas) for `ppo_update`. ``update=False``: only what the
        advantages need (the critic's warm-up steps). Collective over the DP group when the
        estimator whitens over the step."""
        missing = [n for n in ("loss_mask", "rewards", "group_ids") if n not in batch]
        if missing:
            raise ValueError(f"Actor.step_fields: batch lacks field(s) {missing}")
        spec, acc, new = self.spec, StatsTracker(), {}
        if values is not None:
            new["values"] = values
        kl_reward = spec.kl_in_reward and spec.kl_coef > 0
        kl_loss = update and self.ref is not None and spec.kl_loss_coef > 0
        if (kl_reward or kl_loss) and "ref_logp" not in batch.fields:
            new["ref_logp"] = self.ref_logp(batch)
        if update and spec.prox_logp_mode != ProxLogpMode.LOGLINEAR and spec.policy_loss.needs_prox_logp:
            new["prox_logp"] = self._prox_logp(batch, acc, version)
        ref = new.get("ref_logp", batch.fields.get("ref_logp"))
        # k_t of the sampling policy vs pi_ref: the shaped reward is fixed for the whole update
        kl = kl_penalty(batch["behave_logp"], ref, batch["loss_mask"], spec.kl_estimator) if kl_reward else None
        out = step_advantages(spec.advantage, batch, values if values is not None else batch.fields.get("values"),
                              kl, dp_sum(self.ps))
        advantages = out.advantages
        if spec.distill_coef > 0:  # on-policy distillation: the teacher's per-token signal
            advantages = distill_advantages(advantages, batch, spec.distill_coef, spec.distill_reward_coef, acc)
        return batch.with_fields(**new, advantages=advantages, returns=out.returns), acc

    # ------------------------------------------------------------------ the update
    def ppo_update(self, batch: TensorBatch, version: int,
                   stats: Optional[StatsTracker] = None) -> dict[str, float]:
        """One RL step on this DP rank's share, its fields from `step_fields` (module docstring),
        ``stats`` the ones measured there. `version` = the policy version of the current weights
        (the cluster's). Collective over all ranks."""
        t0 = time.perf_counter()
        spec, cfg = self.spec, self.cfg
        mode = spec.prox_logp_mode
        need = ["loss_mask", "behave_logp", "advantages"]
        need += ["versions"] if mode != ProxLogpMode.RECOMPUTE else []
        need += ["prox_logp"] if mode != ProxLogpMode.LOGLINEAR and spec.policy_loss.needs_prox_logp else []
        need += ["ref_logp"] if self.ref is not None and spec.kl_loss_coef > 0 else []
        missing = [n for n in need if n not in batch.fields]
        if missing:
            raise ValueError(f"Actor.ppo_update: batch lacks field(s) {missing} (Actor.step_fields adds them)")
        acc = stats if stats is not None else StatsTracker()
        if getattr(self.engine, "replay", None) is not None:  # MoE routing replay: did the routes arrive?
            none = torch.zeros((), dtype=torch.int64)
            covered, fed = batch.routes.coverage(batch.lengths) if batch.routes is not None else (none, none)
            acc.add_stats({"moe/routes_frac": Stat(covered.double().to(self.ps.device),
                                                   fed.double().to(self.ps.device))})
        full = batch
        # Same on every DP rank (from the gathered counts): all ranks step the optimizer together.
        n_mini = num_minibatches(dp_counts(len(batch), self.ps), cfg.train.ppo_mini_batch_size)
        clock = _Clock(0, max(1, n_mini * cfg.train.ppo_epochs), float(version))
        # Collective (MAX over DP): every rank must call it, hence before the loop.
        norm_len = step_norm_len(full, spec, self.ps) if n_mini else None
        losses, grad_norms, lr, skipped, pad_shares = [], [], 0.0, 0, []
        router: dict[str, list[float]] = {}  # MoE router losses of each optimizer step
        for epoch in range(cfg.train.ppo_epochs if n_mini else 0):
            seed = shuffle_seed(cfg.train.seed, self.updates, epoch)
            for idx in minibatch_indices(len(full), n_mini, seed):
                mini = full.select(idx)
                # W before the micro-batch split: the gradient must not depend on the budget.
                mini = mini.with_fields(
                    loss_weight=minibatch_loss_weights(mini, spec, self.ps, norm_len))
                out = self.engine.train_batch(mini, partial(self._loss_fn, clock, acc),
                                              with_entropy=spec.entropy_coef > 0)
                losses.append(out["loss"])
                grad_norms.append(out["grad_norm"])
                skipped += 1 - int(out["update_ok"])  # NaN/inf gradient: the engine skipped it
                pad_shares.append(out["pad_share"])
                lr = out["lr"]
                for name in moe_losses.METRICS:
                    if name in out:
                        router.setdefault(name, []).append(out[name])
                clock.k += 1
        if getattr(self.engine, "replay", None) is not None:  # what the replay changed, over all of the step's forwards
            acc.add_stats(self.engine.replay.take_stats(self.ps.device))
        metrics = acc.reduce(self.ps)
        metrics.update(
            loss=mean_or_zero(losses), grad_norm=mean_or_zero(grad_norms),
            grad_norm_max=max(grad_norms, default=0.0), lr=lr, n_minibatches=float(n_mini),
            optimizer_steps=float(clock.k), skipped_updates=float(skipped), pad_share=mean_or_zero(pad_shares),
            update_time=time.perf_counter() - t0, **{k: mean_or_zero(v) for k, v in router.items()})
        # K optimizer steps together move the policy by exactly one version (loglinear clock).
        self.updates += 1
        return metrics

    def _prox_logp(self, batch: TensorBatch, acc: StatsTracker, version: int) -> torch.Tensor:
        """log pi_prox [B, S] on the step-start weights; the entropy metric comes free with it, and
        so does the train-rollout mismatch over the whole step (without prox: `_loss_fn`)."""
        res = self.engine.compute_logp(batch, with_entropy=not self.spec.entropy_coef > 0)
        if self.cfg.moe.replay_check:  # the same recompute with the trainer's own routing
            own = self.engine.compute_logp(dataclasses.replace(batch, routes=None)).logp
            delta = (res.logp - own).abs()
            acc.add_stats({"moe/replay_logp_delta_mean": Stat.masked_mean(delta, batch["loss_mask"]),
                           "moe/replay_logp_delta_max": Stat.masked_max(delta, batch["loss_mask"])})
        acc.add_stats(onpolicy_mismatch(res.logp, batch["behave_logp"], batch["versions"],
                                        batch["loss_mask"], version))
        if res.entropy is not None:  # the entropy metric without paying for it in backward
            acc.add_stats({"entropy": Stat.masked_mean(res.entropy, batch["loss_mask"])})
        return res.logp

    def _loss_fn(self, clock: _Clock, acc: StatsTracker, logp: torch.Tensor,
                 entropy: Optional[torch.Tensor], mb: MicroBatch):
        """Per micro-batch: sum_it W_it (policy + entropy + KL terms); stats go to `acc`."""
        spec = self.spec
        m, behave, w = mb["loss_mask"], mb["behave_logp"], mb["loss_weight"]
        stats: dict[str, Stat] = {}
        prox = mb.fields.get("prox_logp")  # absent under loglinear or for a prox-free loss
        if spec.prox_logp_mode != ProxLogpMode.RECOMPUTE:
            approx = loglinear_prox_logp(logp, behave, mb["versions"], clock.prox_version,
                                         clock.theta_version, m)
            if spec.prox_logp_mode == ProxLogpMode.LOGLINEAR:
                prox = approx
            elif prox is not None:
                stats.update(prox_approx_stats(approx, prox, m, behave))
        out = policy_loss(logp, prox, behave, mb["advantages"], m, spec.policy_loss)
        stats.update(out.stats)
        per_token = out.loss
        if entropy is not None:
            ent, s = entropy_loss(entropy, m, spec.entropy_coef)
            per_token, stats = per_token + ent, {**stats, **s}
        if "ref_logp" in mb.fields:
            kl, s = kl_loss(logp, mb["ref_logp"], m, spec.kl_estimator, spec.kl_loss_coef)
            per_token, stats = per_token + kl, {**stats, **s}
        loss = aggregate(per_token, w)
        # Sums of step-normalised contributions: count = this micro-batch's share of the
        # mini-batch's tokens, so the reduced result is the mean over optimizer steps.
        share = m.sum() / mb.step_tokens
        stats["pg_loss"] = Stat(aggregate(out.loss, w).detach(), share.detach())
        if clock.k == 0:  # the step-start weights: pi_theta = pi_prox
            gap = (logp.detach() - behave).abs()
            stats["logp_gap"] = Stat.masked_mean(gap, m)
            stats["logp_gap_max"] = Stat.masked_max(gap, m)
            if "prox_logp" not in mb.fields:  # else measured on the whole step by _prox_logp
                stats.update(onpolicy_mismatch(logp, behave, mb["versions"], m, clock.prox_version))
        acc.add_stats(stats)
        return loss, {}


def mean_or_zero(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def build_reference(cfg, ps, engine):
    """The frozen reference policy, same parallel layout as `engine`: model.ref_hf_path, else
    model.hf_path; with model.init=random and no ref path, a copy of the actor's initial weights."""
    from megarl.trainer.engine import Engine, EngineSpec

    path = cfg.model.ref_hf_path or cfg.model.hf_path
    copy_actor = cfg.model.init == "random" and not cfg.model.ref_hf_path
    model = dataclasses.replace(cfg.model, hf_path=path, init="random" if copy_actor else "hf")
    ref = Engine.build(dataclasses.replace(EngineSpec.from_config(cfg), model=model), ps, trainable=False)
    if copy_actor:
        with torch.no_grad():
            for src, dst in zip(engine.chunks, ref.chunks):
                src = getattr(src, "module", src)
                for (name, p), (name2, q) in zip(src.named_parameters(), dst.named_parameters()):
                    assert name == name2, (name, name2)
                    q.copy_(p)
    return ref
