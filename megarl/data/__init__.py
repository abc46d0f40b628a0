"""Data: tokenizers, record readers (JSONL/Parquet), chat templates, SFT/prompt datasets, a
resumable sampler and token-budget batching.

`megarl.data.tasks` (synthetic tasks + evaluation) is imported explicitly; it pulls in the rollout
reward functions and is kept out of this package's import.
"""
from megarl.data.chat import ChatTemplate, load_chat_template
from megarl.data.datasets import SFTDataset, balance_across_ranks, pack_microbatches
from megarl.data.prompts import PromptDataset, PromptSample, fit_prompt
from megarl.data.readers import read_jsonl, read_records
from megarl.data.sampler import ResumableSampler
from megarl.data.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece

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
