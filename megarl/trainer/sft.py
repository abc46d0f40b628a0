"""Supervised fine-tuning loss: token-mean negative log-likelihood over response tokens."""
from __future__ import annotations

import torch

from megarl.trainer.batch import MicroBatch


def sft_loss(logp: torch.Tensor, entropy, mb: MicroBatch):
    """loss = sum_{tokens in step} -log pi_theta(y_t) * mask_t / (mask tokens in the whole step)."""
    mask = mb["loss_mask"]
    nll = -(logp * mask).sum()
    return nll / mb.step_tokens, {"nll": (nll, mask.sum())}
