"""Loss aggregation with step-level denominators (`algo.loss_agg`).

With L_it the per-token loss of sequence i, token t, m_it the loss mask, n_i = sum_t m_it,
N_tok = sum_i n_i and N_seq = #{i : n_i > 0}, counted over the WHOLE step (every micro-batch of
every data-parallel rank):

    token_mean               sum_it m_it L_it / N_tok
    seq_mean_token_mean      (1 / N_seq) sum_i (1 / n_i) sum_t m_it L_it
    seq_mean_token_sum       (1 / N_seq) sum_i sum_t m_it L_it
    seq_mean_token_sum_norm  (1 / N_seq) sum_i sum_t m_it L_it / C      (Dr.GRPO, C constant,
                                                                          e.g. max response length)

Rows with no loss token do not count in N_seq. Every mode is sum_it W_it L_it with a per-token
weight W. So the protocol is:

    1. once per step, on each DP rank: d = step_denominators(loss_mask of the rank's whole step)
    2. all-reduce d.as_tensor() with SUM over the DP group (skip with one rank), d = from_tensor
    3. W = token_weights(loss_mask, mode, d, norm_len)   -> [B, S], split into micro-batches with
       the other per-token tensors
    4. per micro-batch: loss = aggregate(per_token_loss, W_mb); backward; the sum over micro-batches
       and DP ranks is the step loss.

Because W already holds the global denominator, the engine must not divide by the number of
micro-batches or tokens again, and data-parallel gradients must be SUMMED (multiply by the DP size
when the DDP wrapper averages). A sequence is one row, so per-sequence n_i is always local.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algo.choices import LossAgg


@dataclass
class StepDenominators:
    """N_tok and N_seq of a step (fp64 0-dim tensors). Local until all-reduced by the caller."""

    num_tokens: torch.Tensor
    num_seqs: torch.Tensor

    def as_tensor(self) -> torch.Tensor:
        """[2] tensor for a single SUM all-reduce."""
        return torch.stack([self.num_tokens, self.num_seqs])

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "StepDenominators":
        return cls(t[0], t[1])

    def __add__(self, other: "StepDenominators") -> "StepDenominators":
        return StepDenominators(self.num_tokens + other.num_tokens, self.num_seqs + other.num_seqs)


def step_denominators(loss_mask: torch.Tensor) -> StepDenominators:
    """N_tok = sum_it m_it and N_seq = #{i : n_i > 0} of the rows given (a rank's whole step)."""
    n_i = loss_mask.to(torch.float64).sum(dim=-1)
    return StepDenominators(n_i.sum(), (n_i > 0).to(torch.float64).sum())


def token_weights(loss_mask: torch.Tensor, mode: LossAgg, denominators: StepDenominators,
                  norm_len: int | None = None) -> torch.Tensor:
    """Per-token weights W [B, S] such that sum_it W_it L_it is the aggregated loss (module
    docstring) given the step-level `denominators`. `norm_len` is C for seq_mean_token_sum_norm.
    All-zero when the step has no loss token."""
    m = loss_mask.to(torch.float64)
    if mode == LossAgg.TOKEN_MEAN:
        den = denominators.num_tokens.to(torch.float64).expand(m.shape[0], 1)
    else:
        n_seq = denominators.num_seqs.to(torch.float64)
        if mode == LossAgg.SEQ_MEAN_TOKEN_MEAN:
            den = n_seq * m.sum(dim=-1, keepdim=True)
        elif mode == LossAgg.SEQ_MEAN_TOKEN_SUM:
            den = n_seq.expand(m.shape[0], 1)
        elif mode == LossAgg.SEQ_MEAN_TOKEN_SUM_NORM:
            if norm_len is None or norm_len <= 0:
                raise ValueError("loss_agg=seq_mean_token_sum_norm needs a positive norm_len")
            den = (n_seq * norm_len).expand(m.shape[0], 1)
        else:
            raise ValueError(f"unknown loss aggregation {mode!r}")
    safe = torch.where(den > 0, den, torch.ones_like(den))
    w = torch.where(den > 0, m / safe, torch.zeros_like(m))
    # fp32 at least: bf16 weights of 1/N_tok would lose the denominator's precision.
    return w.to(torch.float64 if loss_mask.dtype == torch.float64 else torch.float32)


def step_token_weights(loss_mask: torch.Tensor, mode: LossAgg,
                       norm_len: int | None = None) -> torch.Tensor:
    """`token_weights` when `loss_mask` already is the whole step (one process, no DP)."""
    return token_weights(loss_mask, mode, step_denominators(loss_mask), norm_len)


def aggregate(per_token_loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_it W_it L_it for one micro-batch (0-dim, differentiable). Tokens with W = 0 never
    propagate a non-finite L into the sum."""
    w = weights.to(per_token_loss.dtype)
    return torch.where(w != 0, per_token_loss * w, torch.zeros_like(per_token_loss)).sum()
