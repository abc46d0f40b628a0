"""RL prompt datasets: JSONL or Parquet records -> `PromptSample`s the rollout workflows consume.

A record's prompt field (``data.prompt_key``, dotted for nested fields) is either
- a string, used verbatim (BOS prepended when the tokenizer has one), or
- a chat: ``[{"role": ..., "content": ...}, ...]``, rendered with the chat template
  (``add_generation_prompt=True``, plus the workflow's tool schemas) and tokenized without BOS.
Every other field lands in ``meta`` (what reward functions receive); ``data.answer_key`` (dotted,
e.g. verl's ``reward_model.ground_truth``) is copied to ``meta["answer"]``.

Prompts longer than ``max_prompt_length`` tokens follow ``truncation``:
    filter  drop the sample              error   raise, naming file:line
    left    keep the last N tokens       right   keep the first N tokens
    middle  keep the first N//2 and the last N - N//2 tokens
``dataset.stats`` counts them ({total, kept, filtered, truncated}) for the run's metrics. A
truncated sample keeps its full text in ``prompt``; ``prompt_ids`` is what is generated from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megarl.data.chat import ChatTemplate
from megarl.data.readers import get_field, read_records
from megarl.data.sampler import ResumableSampler
from megarl.common.tokenizer import Tokenizer

__all__ = ["PromptSample", "PromptDataset", "TRUNCATION_POLICIES", "fit_prompt"]

TRUNCATION_POLICIES = ("filter", "error", "left", "right", "middle")


@dataclass
class PromptSample:
    """One RL prompt. `meta` holds every record field except the prompt (so `meta["answer"]`);
    `messages` is the chat when the prompt was one (workflows continue it), else None."""

    index: int
    prompt: str
    meta: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] | None = None
    messages: list[dict] | None = None
    seed: int | None = None  # this draw's sampling seed (rollout.seed set; the controller fills it)
    source: str = ""  # the data.sources entry it came from (`megarl.data.mixture`); "" with one file

    @property
    def answer(self) -> Any:
        return self.meta.get("answer")


def fit_prompt(ids: list[int], max_len: int, policy: str) -> Optional[list[int]]:
    """`ids` cut to `max_len` tokens by `policy`; None = filter it out. `max_len` 0 = no limit;
    "error" raises ValueError (the caller adds where)."""
    if max_len <= 0 or len(ids) <= max_len:
        return ids
    if policy == "filter":
        return None
    if policy == "left":
        return ids[len(ids) - max_len:]
    if policy == "right":
        return ids[:max_len]
    if policy == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head):]
    if policy == "error":
        raise ValueError(f"prompt has {len(ids)} tokens > data.max_prompt_length={max_len}")
    raise ValueError(f"data.truncation: unknown policy {policy!r} (one of {', '.join(TRUNCATION_POLICIES)})")


def _as_messages(value: Any, where: str) -> list[dict]:
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value):
        raise ValueError(f"{where}: a chat prompt must be a list of {{'role': str, 'content': ...}}")
    return [dict(m) for m in value]


class PromptDataset:
    """RL prompts from JSONL/Parquet (see module docstring). Without a tokenizer `prompt_ids` stays
    None (and no length limit applies)."""

    def __init__(
        self,
        path: str,
        tokenizer: Tokenizer | None = None,
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        add_bos: bool = True,
        *,
        chat_template: ChatTemplate | None = None,
        max_prompt_length: int = 0,
        truncation: str = "filter",
        tools: Optional[list[dict]] = None,
        shuffle: bool = True,
    ):
        if truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"data.truncation: must be one of {', '.join(TRUNCATION_POLICIES)}; got {truncation!r}")
        if max_prompt_length > 0 and tokenizer is None:
            raise ValueError("data.max_prompt_length needs a tokenizer to count tokens")
        self.path, self.shuffle = path, shuffle
        self.tokenizer, self.chat_template, self.tools = tokenizer, chat_template, tools
        self.max_prompt_length, self.truncation = max_prompt_length, truncation
        self.add_bos = add_bos
        self.samples: list[PromptSample] = []
        self.stats = {"total": 0, "kept": 0, "filtered": 0, "truncated": 0}
        required = (prompt_key,) + ((answer_key,) if answer_key else ())
        for where, row in read_records(path, required):
            self.stats["total"] += 1
            sample = self._sample(where, row, prompt_key, answer_key)
            if sample is not None:
                self.samples.append(sample)
        self.stats["kept"] = len(self.samples)

    def _render(self, where: str, value: Any) -> tuple[str, Optional[list[dict]]]:
        if isinstance(value, str) and value.strip():
            return value, None
        if isinstance(value, str):
            raise ValueError(f"{where}: the prompt is empty")
        if isinstance(value, (list, tuple)):
            messages = _as_messages(value, where)
            if self.chat_template is None:
                raise ValueError(f"{where}: the prompt is a chat but there is no chat template (none in "
                                 "the model's tokenizer_config.json; set data.chat_template)")
            return self.chat_template.render(messages, add_generation_prompt=True, tools=self.tools), messages
        raise ValueError(f"{where}: prompt must be a string or a list of messages, got {type(value).__name__}")

    def _sample(self, where: str, row: dict, prompt_key: str, answer_key: str | None) -> Optional[PromptSample]:
        text, messages = self._render(where, get_field(row, prompt_key))
        meta = {k: v for k, v in row.items() if k != prompt_key}
        if answer_key and answer_key != "answer":
            meta["answer"] = get_field(row, answer_key)
        ids = None
        if self.tokenizer is not None:
            # A chat template writes its own BOS text; plain prompts get the BOS id.
            ids = self.tokenizer.encode(text, add_bos=self.add_bos and messages is None)
            try:
                fitted = fit_prompt(ids, self.max_prompt_length, self.truncation)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            if fitted is None:
                self.stats["filtered"] += 1
                return None
            self.stats["truncated"] += len(fitted) < len(ids)
            ids = fitted
        return PromptSample(len(self.samples), text, meta, ids, messages)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> PromptSample:
        return self.samples[i]

    def make_sampler(self, seed: int) -> ResumableSampler:
        """The prompt order for training: shuffled by (seed, epoch) unless `shuffle` is off."""
        if not self.samples:
            raise ValueError(f"{self.path}: no prompts left ({self.stats})")
        return ResumableSampler(len(self.samples), seed=seed, shuffle=self.shuffle)
