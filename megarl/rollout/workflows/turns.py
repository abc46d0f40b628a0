"""Tokens between the turns of a multi-turn rollout: close the assistant turn, add the
environment's messages (user feedback, tool results), open the next assistant turn.

With a chat template the text comes from the template itself (`ChatTemplate.turn_suffix` and
`ChatTemplate.continuation`), so the conversation the policy sees is the one it would see from
HF's ``apply_chat_template`` - up to tokenization at the seams, which is per piece:

    ... generated tokens [EOS]  | rest of turn_suffix | continuation(messages)  | generated ...
        loss_mask 1             | loss_mask 0 (context: behave_logp 0, version -1)  | 1

If the last generated token is the first token of the suffix (e.g. ``<|im_end|>`` as EOS), only
the rest of the suffix is added; otherwise (length cut, stop string) the whole suffix closes it.
Without a template (plain-text prompts), messages are rendered with per-role format strings and
nothing closes a turn.
"""
from __future__ import annotations

from typing import Optional

from megarl.data.chat import ChatTemplate
from megarl.common.tokenizer import Tokenizer

__all__ = ["TurnRenderer", "PLAIN_FORMATS"]

PLAIN_FORMATS = {
    "user": "\n{content}\n",
    "tool": "\n<tool_response>\n{content}\n</tool_response>\n",
}


class TurnRenderer:
    def __init__(self, tokenizer: Tokenizer, chat_template: Optional[ChatTemplate] = None,
                 plain_formats: Optional[dict[str, str]] = None, tools: Optional[list[dict]] = None):
        self.tokenizer, self.template, self.tools = tokenizer, chat_template, tools
        self.formats = {**PLAIN_FORMATS, **(plain_formats or {})}
        self._suffix: list[int] = []
        if chat_template is not None:
            # Checked eagerly: a template that cannot be extended turn by turn fails at build time.
            self._suffix = tokenizer.encode(chat_template.turn_suffix)
            chat_template.continuation([{"role": "user", "content": "x"}], tools=tools)

    def close(self, generated: list[int]) -> list[int]:
        """Context tokens that end an assistant turn whose generated tokens are `generated`."""
        if self._suffix and generated and generated[-1] == self._suffix[0]:
            return self._suffix[1:]
        return list(self._suffix)

    def messages(self, messages: list[dict]) -> list[int]:
        """Context tokens adding `messages` and opening the next assistant turn."""
        if self.template is not None:
            return self.tokenizer.encode(self.template.continuation(messages, tools=self.tools))
        parts = []
        for m in messages:
            fmt = self.formats.get(m["role"])
            if fmt is None:
                raise ValueError(f"no plain-text format for role {m['role']!r} (workflow_args.plain_formats)")
            parts.append(fmt.format(content=m["content"]))
        return self.tokenizer.encode("".join(parts))
