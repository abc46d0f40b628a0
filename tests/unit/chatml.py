"""Test helper: a character-level HF `tokenizer.json` with ChatML special tokens and a Qwen-style
chat template (tools in a system turn, tool results as <tool_response> blocks in a user turn).

Ids: 0 <unk>, 1 <s>, 2 <|im_end|> (EOS), 3 <|im_start|>, then "\\n" and printable ASCII in order,
so `vocab_size` is 100 and a tiny random model with 128 rows covers it.
"""
from __future__ import annotations

import json
import os

SPECIALS = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]

CHATML = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user\\n' }}{% endif %}"
    "<tool_response>\n{{ m.content }}\n</tool_response>\n"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_chat_tokenizer(path: str, chat_template: str | None = CHATML) -> None:
    """tokenizer.json + tokenizer_config.json (with `chat_template` unless None) in `path`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)


def ids(text: str) -> list[int]:
    """Expected ids of `text` under this tokenizer (no special tokens inside)."""
    return [len(SPECIALS) + CHARS.index(c) for c in text]
