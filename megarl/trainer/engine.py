"""The loss-agnostic Megatron training engine.

    engine = Engine.build(EngineSpec.from_config(cfg), ps)   # GPTModel chunks + DDP + optimizer + LR
    logp = engine.compute_logp(batch).logp          # forward-only, per-token logprobs [B, S]
    metrics = engine.train_batch(batch, loss_fn)    # forward+backward over micro-batches + step

What "per token" means is the engine's one hook, ``_next_token(output, targets, with_entropy)``:
the model's output at position p turned into the quantity about token p + 1 - the policy engine
takes log p(targets) (and entropies) from the LM head's logits; the critic's engine
(`megarl.trainer.critic.CriticEngine`) reads its value head. `_per_token` shifts it by one (entry
t = computed at t - 1, entry 0 = 0); with context parallelism each rank computes its own
positions and the CP group gathers them first (`megarl.trainer.context`).
``forward_per_token`` returns that quantity for a batch; ``compute_logp`` is its name for the
policy, and ``loss_fn`` receives it as its first argument.

Both take a `TensorBatch` (this DP rank's share) and run through Megatron's
``get_forward_backward_func`` (no pipeline, 1F1B or interleaved), one token-budget micro-batch at
a time. Losses are normalised per token at step level:

    loss_fn(logp, entropy, mb) -> (loss, stats)

returns ``loss`` = this micro-batch's contribution to the step loss (its per-token terms already
divided by step-level denominators, e.g. ``mb.step_tokens`` = loss-mask tokens over all micro-
batches and DP ranks). The engine hands Megatron ``loss * step_tokens`` with the micro-batch's
token count; Megatron (``calculate_per_token_loss``) sums gradients over DP and divides by the
step's total token count, so the gradient is exactly d(sum of contributions)/d(theta) however the
step is split. ``stats`` maps name -> `megarl.algo.Stat`, reduced over micro-batches and DP by the
one `megarl.trainer.metrics.StatsTracker`.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megarl.algo.stats import Stat
from megarl.config import (Config, ConfigError, LoRAConfig, ModelConfig, OptimConfig, ParallelConfig,
                           packs_sequences)
from megarl.mcore.optimizer import step_unless_nonfinite
from megarl.trainer.metrics import StatsTracker
from megarl.models import builder, hf_io
from megarl.models.layouts import pad_vocab
from megarl.config.moe import MoEConfig
from megarl.protocol.hf_model import ModelArgs, read_model_args
from megarl.trainer.parallel import ParallelState
from megarl.trainer import moe_losses
from megarl.trainer.batch import MicroBatch, TensorBatch, make_microbatches
from megarl.trainer import context
from megarl.trainer.logits import vocab_parallel_logprobs
from megarl.trainer.packing import pack, packed_length, unpack

LossFn = Callable[[torch.Tensor, Optional[torch.Tensor], MicroBatch],
                  tuple[torch.Tensor, dict[str, Stat]]]


@dataclass(frozen=True)
class EngineSpec:
    """What an `Engine` is built from: its sections and the two training values it reads."""

    model: ModelConfig
    parallel: ParallelConfig
    optim: OptimConfig
    moe: MoEConfig
    steps: int  # train.steps: the LR schedule's decay length when optim.lr_decay_steps is 0
    micro_batch_tokens: int  # train.micro_batch_tokens: the token budget of one micro-batch
    tokenizer_path: str = ""  # data.tokenizer_path: copied next to an HF export (else model.hf_path's)
    lora: Optional[LoRAConfig] = None  # lora section: adapters on a frozen base (trainable engines)
    # train.pack_sequences: micro-batches fed packed (THD), not padded; None = auto (`packs_sequences`)
    pack_sequences: Optional[bool] = None
    # rollout.temperature in RL (1 in SFT): every logprob, entropy and loss is of softmax(logits / T),
    # the distribution the samples were drawn from and the one SGLang and megarl-server report
    temperature: float = 1.0

    @classmethod
    def from_config(cls, cfg: Config) -> "EngineSpec":
        return cls(cfg.model, cfg.parallel, cfg.optim, cfg.moe, cfg.train.steps, cfg.train.micro_batch_tokens,
                   cfg.data.tokenizer_path, cfg.lora if cfg.lora.enabled else None, cfg.train.pack_sequences,
                   cfg.rollout.temperature if cfg.train.is_rl else 1.0)


@dataclass
class PerToken:
    """The engine's per-token output (``_per_token``: logprobs for the policy, values for the
    critic), padded like the batch: [B, S] float32, entry 0 of each row = 0.0, 0.0 past its length."""

    out: torch.Tensor
    entropy: Optional[torch.Tensor] = None


@dataclass
class LogpResult:
    """Padded like the batch: [B, S] float32, entry 0 of each row = 0.0, 0.0 past its length
    (`megarl.trainer.batch.per_sample` gives per-row views)."""

    logp: torch.Tensor
    entropy: Optional[torch.Tensor] = None


class Engine:
    def __init__(self, spec: EngineSpec, ps: ParallelState, args: ModelArgs, chunks, tconfig, use_te: bool,
                 optimizer=None, scheduler=None):
        self.spec, self.ps, self.args = spec, ps, args
        self.chunks, self.tconfig, self.use_te = chunks, tconfig, use_te
        self.optimizer, self.scheduler = optimizer, scheduler
        self.step = 0
        self.replay = None  # MoE routing replay (moe.routing_replay: rollout), trainable engines only
        if optimizer is not None and args.num_experts and spec.moe.routing_replay == "rollout":
            from megarl.mcore.routing_replay import RoutingReplay

            self.replay = RoutingReplay.install(chunks, ps, spec.parallel.sequence_parallel)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, spec: EngineSpec, ps: ParallelState, trainable: bool = True) -> "Engine":
        """Model (HF weights or random init), DDP, Megatron optimizer and LR scheduler.
        Subclasses change the bare model chunks (e.g. a value head) in :meth:`adapt_chunks`."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        if not trainable and spec.lora is not None:  # adapters are for training: a frozen copy is the base
            spec = dataclasses.replace(spec, lora=None)
        args = pad_vocab(read_model_args(spec.model.hf_path), spec.model.make_vocab_size_divisible_by, ps.tp)
        if spec.pack_sequences and args.num_experts:
            raise ConfigError(f"train.pack_sequences: not supported for MoE models ({spec.model.hf_path} has "
                              f"{args.num_experts} experts: the routers' padding mask and routing replay are "
                              "per padded row); set it to auto or false")
        # auto resolved once: self.spec.pack_sequences is what every step does
        spec = dataclasses.replace(spec, pack_sequences=packs_sequences(spec.pack_sequences, spec.model,
                                                                        args.num_experts))
        use_te = builder.resolve_spec(spec.model.spec)
        tconfig = builder.transformer_config(
            args, tp=ps.tp, pp=ps.pp, vpp=ps.vpp, first_stage_layers=spec.parallel.first_stage_layers,
            last_stage_layers=spec.parallel.last_stage_layers, dtype=spec.model.dtype, ep=ps.ep,
            sequence_parallel=spec.parallel.sequence_parallel, recompute=spec.model.recompute,
            use_te=use_te, moe=spec.moe, cp=ps.cp, cp_comm_type=spec.parallel.cp_comm_type)
        chunks = builder.build_model_chunks(args, tconfig, use_te, spec.model.attention)
        if spec.model.init == "hf":
            hf_io.load_hf_weights(chunks, args, spec.model.hf_path, ps.tp, ps.tp_rank, use_te)
        cls.adapt_chunks(chunks, spec, args, tconfig)
        if trainable:  # optim.freeze / lora: before DDP and the optimizer, which then leave them out
            from megarl.models.freeze import apply_freeze

            apply_freeze(chunks, args, spec.optim.freeze, use_te)
            if spec.lora is not None:  # the base freezes; only the adapters train
                from megarl.mcore.lora import apply_lora

                apply_lora(chunks, spec.lora, args, spec.model.seed)
        if not trainable:
            for c in chunks:
                c.requires_grad_(False)
                c.eval()
            return cls(spec, ps, args, chunks, tconfig, use_te)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=spec.parallel.distributed_optimizer)
        chunks = [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=c,
                                          disable_bucketing=i > 0) for i, c in enumerate(chunks)]
        for c in chunks:
            c.broadcast_params()  # DP replicas start identical even from a random init
        optimizer, scheduler = cls._optimizer(spec, chunks)
        tconfig.finalize_model_grads_func = finalize_model_grads
        tconfig.grad_scale_func = optimizer.scale_loss
        tconfig.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        return cls(spec, ps, args, chunks, tconfig, use_te, optimizer, scheduler)

    @classmethod
    def adapt_chunks(cls, chunks, spec: EngineSpec, args: ModelArgs, tconfig) -> None:
        """Hook between weight loading and DDP wrapping; the policy engine changes nothing."""

    @staticmethod
    def _optimizer(spec: EngineSpec, chunks):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = spec.optim
        bf16 = spec.model.dtype == "bfloat16"
        oconf = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
            clip_grad=o.clip_grad, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=spec.parallel.distributed_optimizer)
        optimizer = get_megatron_optimizer(oconf, chunks)
        decay_steps = o.lr_decay_steps or spec.steps
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if o.lr_warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps, lr_decay_steps=max(decay_steps, o.lr_warmup_steps + 1),
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=max(decay_steps, 1), wd_incr_style="constant")
        return optimizer, scheduler

    # ------------------------------------------------------------------ schedules
    def _run(self, mbs: list[MicroBatch], loss_func, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            feed = mb.cp if mb.cp is not None else mb.pack if mb.pack is not None else mb
            if mb.pack is not None:  # one row of the sequences end to end (megarl.trainer.packing)
                out = model(input_ids=feed.tokens, position_ids=feed.position_ids, attention_mask=None,
                            packed_seq_params=mb.pack.params)
                return out, partial(loss_func, mb)
            if self.replay is not None:  # the routers of this stage replay this micro-batch's routes
                self.replay.set(mb.routes)
            # MoE: the router's losses leave padding out (True = padding, megatron-core's sense)
            pad = {"padding_mask": mb.valid == 0} if self.args.num_experts else {}
            out = model(input_ids=feed.tokens, position_ids=feed.position_ids, attention_mask=None, **pad)
            return out, partial(loss_func, mb)

        # Interleaved schedules pull from one iterator per model chunk; all see the same list.
        its = [iter(mbs) for _ in self.chunks] if len(self.chunks) > 1 else iter(mbs)
        if self.spec.pack_sequences:
            seq_length, mb_size = self._pack(mbs), 1
        else:
            seq_length, mb_size = max(m.tokens.shape[1] for m in mbs), mbs[0].tokens.shape[0]
        if self.ps.cp > 1:  # each rank runs its two chunks of every sequence
            for m in mbs:
                m.cp = (context.split_packed(m.pack, self.ps.cp, self.ps.cp_rank) if m.pack is not None
                        else context.split_padded(m.tokens, self.ps.cp, self.ps.cp_rank))
            seq_length = max(m.cp.width for m in mbs)  # the whole rows': the schedule divides by CP
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=its,
                model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                num_microbatches=len(mbs), seq_length=seq_length, micro_batch_size=mb_size,
                forward_only=forward_only)
        finally:
            if self.replay is not None:
                self.replay.set(None)

    def _pack(self, mbs: list[MicroBatch]) -> int:
        """Packs every micro-batch (`megarl.trainer.packing`); returns the pack length the schedule
        announces. Between pipeline stages every micro-batch must have one shape: the packs are
        padded to the longest (a filler sequence); sequence parallelism splits a pack over TP;
        context parallelism pads every sequence to a multiple of 2 x CP."""
        seq_multiple = 2 * self.ps.cp if self.ps.cp > 1 else 1
        multiple = (self.ps.tp if self.spec.parallel.sequence_parallel else 1) * seq_multiple
        total = max(packed_length(m.lengths, multiple, seq_multiple) for m in mbs)
        for m in mbs:
            own = total if self.ps.pp > 1 else packed_length(m.lengths, multiple, seq_multiple)
            m.pack = pack(m.tokens, m.lengths, own, seq_multiple)
        return total

    def _token_outputs(self, out, mb: MicroBatch, with_entropy: bool):
        """`_per_token` in the micro-batch's [b, s] layout, whether the model ran padded or packed,
        whole or split over the CP group."""
        if mb.cp is not None:
            values = self._next_token(out, mb.cp.targets, with_entropy)
            a, e = (context.gather_shifted(v, mb.cp, self.ps.cp_group, self.ps.cp) for v in values)
            if mb.pack is not None:
                return unpack(a, mb.pack), unpack(e, mb.pack)
            s = mb.tokens.shape[1]
            return a[:, :s], None if e is None else e[:, :s]
        if mb.pack is None:
            return self._per_token(out, mb.tokens, with_entropy)
        per_token, entropy = self._per_token(out, mb.pack.tokens, with_entropy)
        return unpack(per_token, mb.pack), unpack(entropy, mb.pack)

    def _per_token(self, out, tokens: torch.Tensor, with_entropy: bool):
        """Token-aligned [b, s]: entry t = `_next_token` at t - 1 (about token t), entry 0 = 0."""
        values = self._next_token(out[:, :-1], tokens[:, 1:], with_entropy)
        return tuple(None if v is None else torch.cat([torch.zeros_like(v[:, :1]), v], dim=1) for v in values)

    def _next_token(self, logits, targets: torch.Tensor, with_entropy: bool):
        """The head's output at each position about the token after it: (log p(targets) [b, n],
        the entropy there or None), p = softmax(logits / spec.temperature)."""
        if self.spec.temperature != 1.0:
            logits = logits / self.spec.temperature
        return vocab_parallel_logprobs(logits, targets, self.ps.tp_group, self.ps.tp, self.ps.tp_rank,
                                       with_entropy, vocab_size=self.args.vocab_size)

    def _microbatches(self, batch: TensorBatch) -> list[MicroBatch]:
        """Token-budget micro-batches of ``batch``. With expert parallelism every MoE layer's
        all-to-all pairs the EP ranks micro-batch by micro-batch, so each rank runs as many as
        the EP rank with the most: the others add filler micro-batches (one token, loss mask 0,
        no row of the batch). The interleaved pipeline adds fillers up to a multiple of PP."""
        # packed, a micro-batch costs its real tokens, not its rows times the longest
        # the budget is per rank: with context parallelism a rank holds 1/cp of every sequence
        mbs = make_microbatches(batch, self.spec.micro_batch_tokens * self.ps.cp, self.ps.device,
                                padded=not self.spec.pack_sequences)
        want = len(mbs)
        if self.ps.ep > 1:
            n = torch.tensor([len(mbs)], dtype=torch.int64, device=self.ps.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.ps.ep_group)
            want = int(n)
        if self.ps.vpp:
            # megatron-core's interleaved schedule runs micro-batches in groups of PP per virtual
            # stage and refuses a last group smaller than PP: round the count up to a multiple
            want = -(-max(want, 1) // self.ps.pp) * self.ps.pp
        if want > len(mbs):
            one = TensorBatch(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                              {k: torch.zeros(1, 1, dtype=v.dtype) for k, v in batch.fields.items()})
            while len(mbs) < want:
                filler = make_microbatches(one, 1, self.ps.device)[0]
                filler.indices = torch.zeros(0, dtype=torch.long)
                mbs.append(filler)
        return mbs

    # ------------------------------------------------------------------ public API
    def compute_logp(self, batch: TensorBatch, with_entropy: bool = False) -> LogpResult:
        """Per-token logprobs (and entropies) of this DP rank's samples, [B, S], on every PP
        stage: the policy engine's :meth:`forward_per_token`."""
        res = self.forward_per_token(batch, with_entropy)
        return LogpResult(res.out, res.entropy)

    @torch.no_grad()
    def forward_per_token(self, batch: TensorBatch, with_entropy: bool = False) -> PerToken:
        """The per-token output (``_per_token``) of this DP rank's samples, [B, S], forward-only,
        on every PP stage."""
        for c in self.chunks:
            c.eval()  # dropout off: a recomputed logprob must be a function of the weights only
        names = ["logp", "entropy"] if with_entropy else ["logp"]
        # Filled in place by the last stage's loss_func; zeros elsewhere until the broadcast.
        out = {n: torch.zeros(len(batch), batch.seq_len, dtype=torch.float32) for n in names}
        if len(batch) == 0 and self.ps.ep == 1:  # TP/PP peers hold the same empty batch
            return PerToken(out["logp"], out.get("entropy"))
        mbs = self._microbatches(batch)

        def loss_func(mb, logits):
            logp, ent = self._token_outputs(logits, mb, with_entropy)
            valid = mb.valid.bool()
            s = mb.tokens.shape[1]  # each row of the batch is written by exactly one micro-batch
            for name, t in (("logp", logp), ("entropy", ent)):
                if t is not None and len(mb.indices):  # padding positions hold garbage: keep zeros
                    out[name][mb.indices, :s] = torch.where(valid, t, 0.0).float().cpu()
            return logits.sum() * 0.0, torch.tensor(0, dtype=torch.int), {}

        self._run(mbs, loss_func, forward_only=True)
        if self.ps.pp > 1:  # only the last stage has logits; every stage returns the result
            for name in names:
                buf = out[name].to(self.ps.device)
                dist.broadcast(buf, src=self.ps.last_stage_rank, group=self.ps.pp_group)
                out[name] = buf.cpu()
        return PerToken(out["logp"], out.get("entropy"))

    def train_batch(self, batch: TensorBatch, loss_fn: LossFn, with_entropy: bool = False) -> dict:
        """One optimizer step over ``batch`` (this DP rank's share). Returns reduced metrics:
        ``loss`` (the step loss = sum of contributions), the loss_fn's stats, grad_norm, lr, ..."""
        t0 = time.perf_counter()
        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()  # DDP accumulates over micro-batches: every step starts at 0
        self.optimizer.zero_grad()
        mbs = self._microbatches(batch)
        step_tokens = batch["loss_mask"].sum(dtype=torch.float64).reshape(1).to(self.ps.device)
        dist.all_reduce(step_tokens, group=self.ps.dp_group)  # one denominator on every DP rank
        for mb in mbs:
            # >= 1 so a step without loss tokens gives zero loss and gradient, not NaN
            mb.step_tokens = max(float(step_tokens.item()), 1.0)
        router_losses = self._router_losses_on()
        if router_losses:
            routed = batch.lengths.sum(dtype=torch.float64).reshape(1).to(self.ps.device)
            dist.all_reduce(routed, group=self.ps.dp_group)
            moe = self.spec.moe
            moe_losses.set_step_coefficients(self.tconfig, moe.aux_loss_coeff, moe.z_loss_coeff,
                                             max(float(step_tokens.item()), 1.0), float(routed.item()))
            moe_losses.clear_tracker()
        tracker = StatsTracker()

        def loss_func(mb, logits):
            logp, ent = self._token_outputs(logits, mb, with_entropy)  # values, for the critic
            loss, stats = loss_fn(logp, ent, mb)
            num = mb["loss_mask"].sum()
            # The contributions are already step-normalised: with count = this micro-batch's
            # token share (summing to 1 over the step), the reduced "loss" is their plain sum.
            share = num.detach().to(torch.float64) / mb.step_tokens
            tracker.add_stats({**stats, "loss": Stat(loss.detach().float(), share)})
            # Megatron divides the summed gradient by the summed `num` (= step_tokens): undo it.
            # Its sum runs over DP x CP ranks; the CP ranks of a DP rank share one micro-batch, so
            # one of them counts its tokens (each rank's gradient holds its own positions' share).
            return loss * mb.step_tokens, (num if self.ps.cp_rank == 0 else num * 0).to(torch.int), {}

        self._run(mbs, loss_func, forward_only=False)
        ok, grad_norm = self._optimizer_step()
        lr = self.optimizer.param_groups[0]["lr"]
        if ok:  # a skipped update does not advance the LR schedule either
            self.scheduler.step(increment=1)
            self.step += 1
        metrics = tracker.reduce(self.ps)
        if router_losses:
            metrics.update(moe_losses.step_metrics(self.ps, len(mbs), self.args.num_layers, self.spec.moe))
        # the positions the model computed that are padding (packed: only the PP filler)
        computed = sum(m.pack.length if m.pack is not None else m.tokens.numel() for m in mbs)
        metrics.update(grad_norm=grad_norm, lr=lr, tokens=float(step_tokens.item()),
                       step_time=time.perf_counter() - t0, update_ok=float(bool(ok)),
                       pad_share=1.0 - float(batch.lengths.sum()) / max(computed, 1))
        return metrics

    def _router_losses_on(self) -> bool:
        """An MoE model with a load-balancing loss or z-loss (`megarl.trainer.moe_losses`)."""
        moe = self.spec.moe
        return bool(self.args.num_experts) and (moe.aux_loss_coeff > 0 or moe.z_loss_coeff > 0)

    def _optimizer_step(self) -> tuple[bool, float]:
        """Megatron's optimizer step, except that a NaN/inf gradient norm skips the update on every
        rank (`megarl.mcore.optimizer`). Returns (updated, grad norm)."""
        return step_unless_nonfinite(self.optimizer, self.spec.optim.clip_grad)

    # ------------------------------------------------------------------ weights
    def export_hf(self, out_dir: str, dtype: Optional[torch.dtype] = None) -> None:
        """The model as an HF checkpoint; with LoRA the merged model (W + s B A), and the adapters
        alone in PEFT's layout under ``<out_dir>/adapter``."""
        tokenizer_dir = self.spec.tokenizer_path or self.spec.model.hf_path
        if self.spec.lora is None:
            hf_io.export_hf(self.chunks, self.args, self.ps, out_dir, src_hf_dir=tokenizer_dir,
                            use_te=self.use_te, dtype=dtype)
            return
        from megarl.models.lora import export_peft, merged_into_base

        with merged_into_base(self.chunks):
            hf_io.export_hf(self.chunks, self.args, self.ps, out_dir, src_hf_dir=tokenizer_dir,
                            use_te=self.use_te, dtype=dtype)
        export_peft(self.chunks, self.args, self.ps, self.spec.lora, os.path.join(out_dir, "adapter"),
                    self.spec.model.hf_path, dtype)

    def named_hf_tensors(self, dtype: Optional[torch.dtype] = None):
        """This stage's (HF name, full tensor) pairs; collective over the TP group of DP rank 0."""
        return hf_io.iter_hf_tensors(self.chunks, self.args, self.ps, self.use_te, dtype)
