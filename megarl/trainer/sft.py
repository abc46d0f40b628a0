"""Supervised fine-tuning: token-mean NLL over response tokens, driven by the same engine as RL."""
from __future__ import annotations

import torch

from megarl.algo.stats import Stat
from megarl.data.chat import sft_chat_template
from megarl.data.datasets import ChatSFTDataset, ResumableSampler, SFTDataset, balance_across_ranks
from megarl.common.tokenizer import load_tokenizer
from megarl.trainer.batch import MicroBatch, TensorBatch


def sft_loss(logp: torch.Tensor, entropy, mb: MicroBatch):
    """loss = sum_{tokens in step} -log pi_theta(y_t) * mask_t / (mask tokens in the whole step)."""
    mask = mb["loss_mask"]
    nll = -(logp * mask).sum()
    return nll / mb.step_tokens, {"nll": Stat(nll.detach(), mask.sum().detach())}


class SFTData:
    """The step's samples for this DP rank: every rank draws the same global batch from a
    resumable sampler and keeps its token-balanced share."""

    def __init__(self, cfg, ps):
        path = cfg.data.tokenizer_path or cfg.model.hf_path
        tok = load_tokenizer(path)
        if cfg.data.messages_key:  # conversations through the chat template, loss on assistant turns
            self.dataset = ChatSFTDataset(cfg.data.train_path, tok, cfg.train.max_seq_len, cfg.data.messages_key,
                                          sft_chat_template(cfg.data.chat_template, path, tok))
        else:
            self.dataset = SFTDataset(cfg.data.train_path, tok, cfg.train.max_seq_len,
                                      cfg.data.prompt_key, cfg.data.response_key)
        self.sampler = ResumableSampler(len(self.dataset), seed=cfg.train.seed)
        self.batch_size, self.ps = cfg.train.global_batch_size, ps

    def next_batch(self) -> TensorBatch:
        samples = [self.dataset[i] for i in self.sampler.next_batch(self.batch_size)]
        share = balance_across_ranks([len(s["input_ids"]) for s in samples], self.ps.dp)[self.ps.dp_rank]
        return TensorBatch.from_lists([samples[i]["input_ids"] for i in share],
                                      {"loss_mask": [samples[i]["loss_mask"] for i in share]})

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
