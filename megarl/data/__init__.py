"""Data: tokenizers, record readers (JSONL/Parquet), chat templates, SFT/prompt datasets, a
resumable sampler and token-budget batching.

`megarl.data.tasks` (the synthetic addition task and its corpus) is imported explicitly. Nothing in
this package imports `megarl.rollout`: rollout (workflows, rewards, evaluation) depends on data,
never the other way round.
"""
from megarl.data.chat import ChatTemplate, load_chat_template
from megarl.data.datasets import SFTDataset, balance_across_ranks, pack_microbatches
from megarl.data.prompts import PromptDataset, PromptSample, fit_prompt
from megarl.data.readers import read_jsonl, read_records
from megarl.data.sampler import ResumableSampler
from megarl.common.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece

__all__ = [
    "ChatTemplate",
    "PromptDataset",
    "PromptSample",
    "ResumableSampler",
    "SFTDataset",
    "Tokenizer",
    "balance_across_ranks",
    "fit_prompt",
    "load_chat_template",
    "load_tokenizer",
    "pack_microbatches",
    "read_jsonl",
    "read_records",
    "train_sentencepiece",
]
