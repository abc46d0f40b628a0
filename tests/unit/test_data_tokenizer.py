"""Tokenizer: train a char-level sentencepiece model, load it back, round-trip text and ids."""
import json

import pytest

from megarl.common.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece

CHARS = "0123456789+="


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_sentencepiece(["12+34=46", "99+1=100", "5+5=10"], str(d), required_chars=CHARS)
    return d


def test_ids_follow_required_chars(tok_dir):
    tok = load_tokenizer(str(tok_dir))
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (15, 1, 2, 2)  # pad falls back to eos
    assert tok.encode("12+34=") == [4, 5, 13, 6, 7, 14]
    assert tok.encode("12+34=", add_bos=True) == [1, 4, 5, 13, 6, 7, 14]
    assert tok.encode("0123456789") == list(range(3, 13))


def test_round_trip_and_specials(tok_dir):
    tok = load_tokenizer(str(tok_dir / "tokenizer.model"))  # a file works as well as the dir
    for text in ["12+34=46", "999+1=1000", "0=0"]:
        assert tok.decode(tok.encode(text)) == text
    # BOS/EOS are control pieces and ids beyond the vocab (padded embedding rows) are dropped.
    assert tok.decode([1, 4, 5, 2, 15, 63]) == "12"


def test_extra_chars_get_ids_after_required(tmp_path):
    tok = train_sentencepiece(["ab 12"], str(tmp_path), required_chars=CHARS)
    assert tok.vocab_size == 18
    assert tok.encode("1 a") == [4, 17, 15]
    assert tok.decode(tok.encode("1 ab 2")) == "1 ab 2"


def test_missing_tokenizer_names_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 16}))
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(str(tmp_path / "nope"))


def test_tokenizer_json_needs_tokenizers_package(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install tokenizers"):
            load_tokenizer(str(tmp_path))
    else:
        pytest.skip("tokenizers is installed; the missing-package error cannot be shown")
