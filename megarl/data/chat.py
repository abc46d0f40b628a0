"""Chat templates: render `[{"role", "content"}, ...]` conversations the way the model was tuned.

The template is the model's own Jinja template (``chat_template`` in ``tokenizer_config.json``, or
the ``chat_template.jinja`` file newer HF exports write next to it) unless ``data.chat_template``
names a file or holds an inline template. Rendering follows HF's ``apply_chat_template``
conventions so a prompt here tokenizes like it would there: a sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, ``bos_token``/``eos_token`` strings, ``raise_exception``,
``tojson``, ``strftime_now`` and an optional ``tools`` list; rendered text is tokenized without
adding BOS (a template that wants BOS writes it).

Multi-turn rollouts append turns token by token, so they need two strings the template implies:
`turn_suffix` (what the template writes after an assistant message's content, e.g.
``<|im_end|>\\n``) and `continuation(messages)` (the text that appends `messages` to a
conversation and opens the next assistant turn). Both come from rendering a fixed conversation
with and without the new messages; a template whose renders are not prefixes of each other
cannot be extended this way and is refused when first asked.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Optional

from megarl.common.compat import require

__all__ = ["ChatTemplate", "load_chat_template", "sft_chat_template"]

# Stand-in content for the fixed conversation `turn_suffix` / `continuation` render around.
_SENTINEL = "MEGARL-ASSISTANT-CONTENT-7f3a"
_BASE = [{"role": "user", "content": "MEGARL-USER-CONTENT-7f3a"}]


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message):
    raise ValueError(f"chat template: {message}")


def _token_text(value) -> str:
    """tokenizer_config.json stores special tokens as strings or {"content": ...} objects."""
    if isinstance(value, dict):
        return str(value.get("content") or "")
    return "" if value is None else str(value)


class ChatTemplate:
    """A compiled Jinja chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "inline"):
        jinja2 = require("jinja2", "rendering chat templates")
        sandbox = require("jinja2.sandbox", "rendering chat templates")
        env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template from {origin}: Jinja syntax error line {e.lineno}: {e.message}") from e
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token, eos_token
        self._suffix: Optional[str] = None

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: Optional[list[dict]] = None, **extra: Any) -> str:
        """The conversation as text (HF ``apply_chat_template(..., tokenize=False)``)."""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, bos_token=self.bos_token, eos_token=self.eos_token,
                                     **extra)

    # ---- incremental rendering for multi-turn rollouts -------------------------------------------
    def _prefix_of(self, short: str, long: str, what: str) -> str:
        if not long.startswith(short):
            raise ValueError(f"chat template from {self.origin}: rendering {what} changes the text "
                             "before it, so turns cannot be appended token by token")
        return long[len(short):]

    @property
    def turn_suffix(self) -> str:
        """Text the template writes after an assistant message's content (often the end-of-turn
        token and a newline)."""
        if self._suffix is None:
            text = self.render(_BASE + [{"role": "assistant", "content": _SENTINEL}], False)
            if text.count(_SENTINEL) != 1:
                raise ValueError(f"chat template from {self.origin}: assistant content is not "
                                 "rendered verbatim once; cannot find the end of an assistant turn")
            self._suffix = text.split(_SENTINEL, 1)[1]
        return self._suffix

    def assistant_spans(self, messages: list[dict], tools: Optional[list[dict]] = None) -> list[tuple[str, bool]]:
        """The conversation as consecutive texts, each flagged True when it is an assistant turn
        (its content and what the template writes after it, the end-of-turn marker): what chat
        SFT trains on. Built from renders of growing prefixes (before each assistant message
        with the generation prompt, after it without), so the untrained text in front of a turn
        is exactly the prompt generation would start from; turns after the last assistant message
        are left out (nothing to train). A template whose renders are not prefixes of each other
        is refused. ``tools``: the function schemas the conversation was held with (rendered as
        the rollouts render them, HF's ``apply_chat_template(tools=...)``)."""
        out, done = [], ""
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            head = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            full = self.render(messages[:i + 1], add_generation_prompt=False, tools=tools)
            out.append((self._prefix_of(done, head, f"the turns before assistant message {i}"), False))
            out.append((self._prefix_of(head, full, f"assistant message {i}"), True))
            done = full
        return [(text, trained) for text, trained in out if text]

    def continuation(self, messages: list[dict], tools: Optional[list[dict]] = None) -> str:
        """Text appending `messages` (user/tool turns) after a closed assistant turn and opening
        the next assistant turn (generation prompt)."""
        base = _BASE + [{"role": "assistant", "content": _SENTINEL}]
        before = self.render(base, False, tools=tools)
        after = self.render(base + list(messages), True, tools=tools)
        return self._prefix_of(before, after, f"{[m.get('role') for m in messages]} messages")


def _model_template(model_dir: str) -> tuple[Optional[str], dict]:
    """(template source or None, tokenizer_config) of an HF model/tokenizer directory."""
    cfg: dict = {}
    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    source = cfg.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    jinja_file = os.path.join(model_dir, "chat_template.jinja")
    if not source and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            source = f.read()
    return source or None, cfg


def load_chat_template(setting: str, model_dir: str) -> Optional[ChatTemplate]:
    """``data.chat_template``: "" = the model's own (None when it has none), a path to a Jinja
    file, or an inline template; BOS/EOS strings always come from the model's tokenizer_config."""
    model_dir = model_dir if os.path.isdir(model_dir) else os.path.dirname(os.path.abspath(model_dir))
    own, cfg = _model_template(model_dir)
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    if not setting:
        return ChatTemplate(own, bos, eos, f"{model_dir}/tokenizer_config.json") if own else None
    if os.path.isfile(setting):
        with open(setting, encoding="utf-8") as f:
            return ChatTemplate(f.read(), bos, eos, setting)
    if "{{" in setting or "{%" in setting:
        return ChatTemplate(setting, bos, eos, "data.chat_template (inline)")
    raise ValueError(f"data.chat_template: {setting!r} is neither a file nor a Jinja template")


def sft_chat_template(setting: str, tokenizer_path: str, tok) -> ChatTemplate:
    """data.chat_template (else the model's) for chat SFT; its BOS / EOS text from
    tokenizer_config.json, else the tokenizer's own pieces (a sentencepiece model has no config)."""
    template = load_chat_template(setting, tokenizer_path)
    if template is None:
        raise ValueError("data.messages_key: chat SFT needs a chat template (none in the model's "
                         "tokenizer_config.json or chat_template.jinja; set data.chat_template)")
    if not template.bos_token and tok.bos_id is not None:
        template.bos_token = tok.token_text(tok.bos_id)
    if not template.eos_token:
        template.eos_token = tok.token_text(tok.eos_id)
    return template
