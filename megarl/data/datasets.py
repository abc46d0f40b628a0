"""Datasets and token-budget batching (prompt datasets live in `megarl.data.prompts`).

- `SFTDataset`: JSONL/Parquet {"prompt", "response"} -> {"input_ids", "loss_mask"} (loss on the
  response and its EOS only).
- `ChatSFTDataset`: JSONL/Parquet multi-turn chats -> the same, through the chat template, loss on
  the assistant turns only.
- `PromptDataset` / `PromptSample` (re-exported from `prompts`): RL prompts for the workflows.
- `ResumableSampler` (re-exported from `sampler`): an endless, epoch-shuffled index stream whose
  `state_dict()` (seed, epoch, position) resumes exactly where a checkpoint left it.
- `pack_microbatches` / `balance_across_ranks`: split a batch by token counts, deterministically.
"""
from __future__ import annotations

import heapq
from typing import Sequence

from megarl.data.prompts import PromptDataset, PromptSample
from megarl.data.readers import get_field, read_jsonl, read_records, text_field_problem
from megarl.data.sampler import ResumableSampler
from megarl.common.tokenizer import Tokenizer

__all__ = [
    "read_jsonl",
    "SFTDataset",
    "ChatSFTDataset",
    "PromptSample",
    "PromptDataset",
    "ResumableSampler",
    "pack_microbatches",
    "balance_across_ranks",
]


def check_sft_record(where: str, row: dict, prompt_key: str, response_key: str) -> None:
    """A string prompt (may be empty) and a non-empty string response; errors name where and the key."""
    for key, empty_ok in ((prompt_key, True), (response_key, False)):
        problem = text_field_problem(get_field(row, key), empty_ok=empty_ok)
        if problem:
            raise ValueError(f"{where}: {key!r} {problem}")


class _TokenSamples:
    """SFT samples `{"input_ids", "loss_mask"}` in ``self.samples``, indexed."""

    samples: list[dict[str, list[int]]]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.samples[i]

    @property
    def lengths(self) -> list[int]:
        return [len(s["input_ids"]) for s in self.samples]


class SFTDataset(_TokenSamples):
    """Supervised pairs (JSONL or Parquet), tokenized eagerly (the whole file is validated before training starts).

    Sample i is `{"input_ids": [bos?] + prompt + response + [eos], "loss_mask": 0 on bos/prompt,
    1 on response and eos}`. Prompt and response are encoded separately so the boundary is exact.
    Samples longer than `max_seq_len` are cut at the right (the EOS may then be lost).
    """

    def __init__(
        self,
        path: str,
        tokenizer: Tokenizer,
        max_seq_len: int,
        prompt_key: str = "prompt",
        response_key: str = "response",
        add_bos: bool = True,
    ):
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.path = path
        self.samples: list[dict[str, list[int]]] = []
        for where, row in read_records(path, (prompt_key, response_key)):
            check_sft_record(where, row, prompt_key, response_key)
            prompt = tokenizer.encode(get_field(row, prompt_key), add_bos=add_bos)
            response = tokenizer.encode(get_field(row, response_key)) + [tokenizer.eos_id]
            ids = (prompt + response)[:max_seq_len]
            mask = ([0] * len(prompt) + [1] * len(response))[:max_seq_len]
            self.samples.append({"input_ids": ids, "loss_mask": mask})


def chat_messages(where: str, row: dict, messages_key: str) -> list[dict]:
    """A chat SFT record's conversation: a list of {role: str, content: str} with at least one
    assistant message; errors name where and the key."""
    value = get_field(row, messages_key)
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where}: {messages_key!r} must be a non-empty list of {{'role', 'content'}} messages")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: {messages_key!r} message {j} must be {{'role': str, 'content': str}}")
    if not any(m["role"] == "assistant" for m in value):
        raise ValueError(f"{where}: {messages_key!r} has no assistant message (nothing to train)")
    return [dict(m) for m in value]


class ChatSFTDataset(_TokenSamples):
    """Multi-turn chat SFT (JSONL or Parquet): each record's conversation (``messages_key``)
    rendered with the chat template, tokenized span by span (`ChatTemplate.assistant_spans`;
    the template's BOS / EOS text as those ids), loss on the assistant turns only: their content
    and the end-of-turn marker the template writes after it, so the model learns to stop.
    Samples are `{"input_ids", "loss_mask"}` as `SFTDataset`'s, cut at ``max_seq_len``; the
    template writes its own BOS (no id is prepended). A record's ``tools`` (a list of function
    schemas) reaches the template as the rollouts' tools do."""

    def __init__(self, path: str, tokenizer: Tokenizer, max_seq_len: int, messages_key: str, template):
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.path = path
        specials = {text: tid for text, tid in ((template.bos_token, tokenizer.bos_id),
                                                (template.eos_token, tokenizer.eos_id)) if text and tid is not None}
        self.samples: list[dict[str, list[int]]] = []
        for where, row in read_records(path, (messages_key,)):
            messages = chat_messages(where, row, messages_key)
            tools = row.get("tools")  # the schemas the conversation was held with, HF datasets' "tools" column
            if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
                raise ValueError(f"{where}: 'tools' must be a list of function schemas (objects)")
            try:
                spans = template.assistant_spans(messages, tools or None)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            ids, mask = [], []
            for text, trained in spans:
                piece = tokenizer.encode_with_specials(text, specials)
                ids += piece
                mask += [int(trained)] * len(piece)
            self.samples.append({"input_ids": ids[:max_seq_len], "loss_mask": mask[:max_seq_len]})


def _cost(bin_lengths: list[int], padded: bool) -> int:
    return max(bin_lengths) * len(bin_lengths) if padded else sum(bin_lengths)


def pack_microbatches(
    lengths: Sequence[int], max_tokens: int, padded: bool = True, min_microbatches: int = 1
) -> list[list[int]]:
    """Group sample indices into micro-batches of at most `max_tokens` tokens (first-fit decreasing).

    Cost of a micro-batch: `max(len) * count` when `padded` (a [count, max_len] padded tensor), else
    `sum(len)` (packed/THD sequences). Every index appears exactly once; a sample longer than
    `max_tokens` gets a micro-batch of its own (the one case the budget is exceeded). With
    `min_microbatches` = k the costliest micro-batch is split in two until there are k (or one per
    sample), e.g. to give every DP rank the same count. Deterministic: ties break by index.
    Within a micro-batch indices are ascending; micro-batches are ordered by their first index.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []  # indices, longest first
    sums: list[int] = []
    for i in order:
        for k, b in enumerate(bins):
            # Lengths arrive in decreasing order, so a bin's max is its first member's length.
            cost = lengths[b[0]] * (len(b) + 1) if padded else sums[k] + lengths[i]
            if cost <= max_tokens:
                b.append(i)
                sums[k] += lengths[i]
                break
        else:
            bins.append([i])
            sums.append(lengths[i])
    while len(bins) < min(min_microbatches, len(lengths)):
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        k = max(splittable, key=lambda b: (_cost([lengths[j] for j in bins[b]], padded), -b))
        # Alternate the (sorted) members: both halves cost no more than the whole.
        bins[k:k + 1] = [bins[k][0::2], bins[k][1::2]]
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def balance_across_ranks(
    lengths: Sequence[int], n_ranks: int, equal_size: bool = False
) -> list[list[int]]:
    """Split sample indices over `n_ranks` so token sums are near-equal (greedy LPT).

    Longest first, each sample goes to the rank with the least tokens so far (ties: lowest rank).
    LPT's makespan is within 4/3 of optimal. With `equal_size`, rank sample counts differ by at
    most one (ranks r < n % n_ranks take the extra one). Each rank's indices are ascending.
    """
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    n = len(lengths)
    capacity = [n // n_ranks + (r < n % n_ranks) if equal_size else n for r in range(n_ranks)]
    heap = [(0, r) for r in range(n_ranks) if capacity[r] > 0]  # (tokens, rank)
    parts: list[list[int]] = [[] for _ in range(n_ranks)]
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        load, r = heapq.heappop(heap)
        parts[r].append(i)
        if len(parts[r]) < capacity[r]:
            heapq.heappush(heap, (load + lengths[i], r))
    return [sorted(p) for p in parts]
