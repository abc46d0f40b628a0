"""Data: tokenizers, SFT/prompt datasets, a resumable sampler and token-budget batching.

`megarl.data.tasks` (the synthetic addition task and its corpus) is imported explicitly. Nothing in
this package imports `megarl.rollout`: rollout (workflows, rewards, evaluation) depends on data,
never the other way round.
"""
from megarl.data.datasets import (
    PromptDataset,
    PromptSample,
    ResumableSampler,
    SFTDataset,
    balance_across_ranks,
    pack_microbatches,
    read_jsonl,
)
from megarl.data.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece

__all__ = [
    "PromptDataset",
    "PromptSample",
    "ResumableSampler",
    "SFTDataset",
    "Tokenizer",
    "balance_across_ranks",
    "load_tokenizer",
    "pack_microbatches",
    "read_jsonl",
    "train_sentencepiece",
]
