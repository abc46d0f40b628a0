"""Tokenizers: one small base class over sentencepiece (required) and HF `tokenizer.json` (optional).

Why our own wrapper instead of `transformers.AutoTokenizer`: the trainer, the CPU rollout server and
the tools only need ids <-> text plus the special ids, and `transformers` is a test-only extra.
`load_tokenizer` looks for `tokenizer.model` (sentencepiece) first, then `tokenizer.json` (needs the
`tokenizers` package). `train_sentencepiece` builds the tiny char-level vocabulary of the CPU demo.
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

import sentencepiece as spm

__all__ = [
    "Tokenizer",
    "SentencePieceTokenizer",
    "HFJsonTokenizer",
    "load_tokenizer",
    "train_sentencepiece",
]

# Names HF models commonly give their special tokens, tried when the configs do not say.
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
_EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|im_end|>")


@dataclass
class Tokenizer:
    """What megarl needs from a tokenizer, and the base of both backends: the special ids, the
    vocabulary size and ids <-> text. `pad_id` falls back to `eos_id` when the vocab has none.

    A backend implements ``_encode(text) -> ids`` (no special tokens) and ``_decode(ids) -> text``;
    the base adds the BOS on request and drops ids outside the vocabulary (the padded embedding
    rows of a Megatron model) before decoding, the same for every backend.
    """

    path: str
    bos_id: int | None
    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(self._encode(text))
        return ([self.bos_id] + ids) if add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

    def encode_with_specials(self, text: str, specials: dict[str, int]) -> list[int]:
        """``text`` with each occurrence of a ``specials`` string (a chat template's BOS / EOS
        text) as that id and the text between encoded as usual: what an HF tokenizer does with
        its special tokens, here for every backend (sentencepiece reads "</s>" as characters)."""
        marks = sorted((s for s in specials if s), key=len, reverse=True)
        ids, rest = [], text
        while rest:
            hits = [(rest.find(m), m) for m in marks if m in rest]
            if not hits:
                return ids + self.encode(rest)
            at, mark = min(hits, key=lambda h: (h[0], -len(h[1])))
            ids += (self.encode(rest[:at]) if at else []) + [specials[mark]]
            rest = rest[at + len(mark):]
        return ids

    def token_text(self, token_id: int) -> str:
        """The vocabulary's text of one id (e.g. "</s>" for EOS)."""
        raise NotImplementedError

    def _encode(self, text: str) -> Sequence[int]:
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError


@dataclass
class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model. Ids outside the vocab (padded embedding rows) decode to nothing."""

    processor: spm.SentencePieceProcessor = None

    @classmethod
    def from_file(cls, path: str) -> "SentencePieceTokenizer":
        sp = spm.SentencePieceProcessor(model_file=path)
        eos = sp.eos_id()
        if eos < 0:
            raise ValueError(f"sentencepiece model {path} has no EOS piece (eos_id=-1)")
        bos = sp.bos_id() if sp.bos_id() >= 0 else None
        pad = sp.pad_id() if sp.pad_id() >= 0 else eos
        return cls(path=path, bos_id=bos, eos_id=eos, pad_id=pad, vocab_size=sp.get_piece_size(),
                   processor=sp)

    def _encode(self, text: str) -> Sequence[int]:
        return self.processor.encode(text)

    def token_text(self, token_id: int) -> str:
        return self.processor.id_to_piece(token_id)

    def _decode(self, ids: list[int]) -> str:
        return self.processor.decode(ids)


@dataclass
class HFJsonTokenizer(Tokenizer):
    """An HF fast tokenizer (`tokenizer.json`) through the optional `tokenizers` package."""

    backend: object = None  # tokenizers.Tokenizer

    @classmethod
    def from_file(cls, path: str) -> "HFJsonTokenizer":
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:
            raise ImportError(
                f"{path} is an HF tokenizer.json; reading it needs `pip install tokenizers`"
            ) from e
        tok = _HFTokenizer.from_file(path)
        names = _special_token_names(os.path.dirname(os.path.abspath(path)))

        def lookup(key: str, candidates: Iterable[str]) -> int | None:
            for name in ([names[key]] if names.get(key) else []) + list(candidates):
                tid = tok.token_to_id(name)
                if tid is not None:
                    return tid
            return names.get(key + "_id")

        eos = lookup("eos_token", _EOS_CANDIDATES)
        if eos is None:
            raise ValueError(f"cannot find the EOS token of {path} (no eos_token in the configs)")
        pad = lookup("pad_token", ())
        return cls(path=path, bos_id=lookup("bos_token", _BOS_CANDIDATES), eos_id=eos,
                   pad_id=eos if pad is None else pad,
                   vocab_size=tok.get_vocab_size(with_added_tokens=True), backend=tok)

    def _encode(self, text: str) -> Sequence[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def token_text(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    def _decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)


def _special_token_names(model_dir: str) -> dict:
    """bos/eos/pad token strings from tokenizer_config.json, ids from config.json (either optional)."""
    out: dict = {}
    tc = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(tc):
        with open(tc) as f:
            cfg = json.load(f)
        for key in ("bos_token", "eos_token", "pad_token"):
            val = cfg.get(key)
            out[key] = val.get("content") if isinstance(val, dict) else val
    mc = os.path.join(model_dir, "config.json")
    if os.path.isfile(mc):
        with open(mc) as f:
            cfg = json.load(f)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            val = cfg.get(key)
            out[key] = val[0] if isinstance(val, list) else val
    return out


def load_tokenizer(path: str) -> Tokenizer:
    """Load the tokenizer of an HF-format model dir, or a `.model` / `.json` tokenizer file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for name, cls in (("tokenizer.model", SentencePieceTokenizer),
                          ("tokenizer.json", HFJsonTokenizer)):
            candidate = os.path.join(path, name)
            if os.path.isfile(candidate):
                return cls.from_file(candidate)
        raise FileNotFoundError(f"no tokenizer.model or tokenizer.json in {path}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer path does not exist: {path}")
    if path.endswith(".json"):
        return HFJsonTokenizer.from_file(path)
    return SentencePieceTokenizer.from_file(path)


def train_sentencepiece(
    texts: Iterable[str],
    out_dir: str,
    vocab_size: int = 64,
    model_type: str = "char",
    required_chars: str = "",
    filename: str = "tokenizer.model",
) -> SentencePieceTokenizer:
    """Train a small sentencepiece model and write it to `out_dir/filename`.

    Ids: 0 `<unk>`, 1 `<s>` (BOS), 2 `</s>` (EOS), then each char of `required_chars` in the given
    order (so "0123456789+=" gets ids 3..14 whatever the corpus frequencies), then the rest. There is
    no pad piece (pad falls back to EOS). Text is kept verbatim: no normalization, no dummy prefix.
    With model_type "char" `vocab_size` is an upper bound (the vocab is exactly the chars seen);
    with "bpe"/"unigram" it is the target size.
    """
    os.makedirs(out_dir, exist_ok=True)
    texts = list(texts) + ([required_chars] if required_chars else [])
    required = list(dict.fromkeys(required_chars))  # dedupe, keep order
    if model_type == "char" and required and set("".join(texts)) <= set(required):
        # The char trainer needs >= 1 ordinary piece; the last required char, alone, still lands last.
        required = required[:-1]
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=proto,
        model_type=model_type,
        vocab_size=vocab_size,
        hard_vocab_limit=model_type != "char",
        character_coverage=1.0,
        user_defined_symbols=required,
        add_dummy_prefix=False,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    path = os.path.join(out_dir, filename)
    with open(path, "wb") as f:
        f.write(proto.getvalue())
    return SentencePieceTokenizer.from_file(path)
