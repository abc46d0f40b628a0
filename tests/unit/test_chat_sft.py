"""Chat SFT (`data.messages_key`): conversations rendered with the chat template span by span
(`ChatTemplate.assistant_spans`), the template's BOS / EOS text as those ids
(`Tokenizer.encode_with_specials`), the loss on assistant turns only (`ChatSFTDataset`); checked
against hand-built token sequences, and against plain prompt/response SFT where the template
writes exactly that format."""
import json
import os

import pytest

from megarl.common.errors import ConfigError
from megarl.common.tokenizer import load_tokenizer, train_sentencepiece
from megarl.config.load import load_config
from megarl.data.chat import ChatTemplate, sft_chat_template
from megarl.data.datasets import ChatSFTDataset, SFTDataset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "examples", "tiny")
# role tags around each message, the EOS text after an assistant's, the generation prompt opens one
TAGS = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
        "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+3="},
        {"role": "assistant", "content": "15"}, {"role": "user", "content": "15+1="},
        {"role": "assistant", "content": "16"}, {"role": "user", "content": "thanks"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return train_sentencepiece(["<system>be brief<user>12+3=<assistant>15 thanks"], str(d),
                               required_chars="0123456789+=")


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_assistant_spans_are_the_assistant_turns_and_their_end_markers():
    t = ChatTemplate(TAGS, eos_token="</s>")
    assert t.assistant_spans(CHAT) == [
        ("<system>be brief<user>12+3=<assistant>", False), ("15</s>", True),
        ("<user>15+1=<assistant>", False), ("16</s>", True)]  # the trailing user turn: nothing to train
    # the spans end to end are the whole conversation up to its last assistant turn
    assert "".join(text for text, _ in t.assistant_spans(CHAT)) == t.render(CHAT[:5], add_generation_prompt=False)


def test_specials_are_their_ids_and_the_rest_is_encoded_between_them(tok):
    specials = {"</s>": tok.eos_id, "<s>": tok.bos_id}
    e = tok.encode
    assert tok.encode_with_specials("<s>12</s></s>3", specials) == [1, *e("12"), 2, 2, *e("3")]
    assert tok.encode_with_specials("15", specials) == e("15") and tok.encode_with_specials("", specials) == []
    assert tok.encode_with_specials("1</s>", {"</s>": 2, "": 9}) == [*e("1"), 2]  # an empty marker is none
    assert tok.token_text(tok.eos_id) == "</s>" and tok.token_text(tok.bos_id) == "<s>"


def test_the_loss_is_on_assistant_turns_only(tmp_path, tok):
    path = write(tmp_path / "chat.jsonl", [{"messages": CHAT, "id": 7}])
    ds = ChatSFTDataset(path, tok, 512, "messages", ChatTemplate(TAGS, eos_token="</s>"))
    e = tok.encode
    parts = [(e("<system>be brief<user>12+3=<assistant>"), 0), (e("15") + [tok.eos_id], 1),
             (e("<user>15+1=<assistant>"), 0), (e("16") + [tok.eos_id], 1)]
    assert ds[0]["input_ids"] == [i for ids, _ in parts for i in ids]
    assert ds[0]["loss_mask"] == [m for ids, m in parts for _ in ids]
    trained = [i for i, m in zip(ds[0]["input_ids"], ds[0]["loss_mask"]) if m]
    assert trained == [*e("15"), 2, *e("16"), 2]  # the answers and their EOS, nothing else
    cut = ChatSFTDataset(path, tok, 10, "messages", ChatTemplate(TAGS, eos_token="</s>"))
    assert cut[0]["input_ids"] == ds[0]["input_ids"][:10] and cut[0]["loss_mask"] == ds[0]["loss_mask"][:10]


def test_a_template_that_writes_plain_sft_gives_plain_sfts_tokens(tmp_path):
    """The demo's SFT pairs as one-exchange chats through a template that writes BOS, the prompt,
    the answer and EOS: the tokens and masks of prompt/response SFT, sample by sample. The tiny
    sentencepiece model has no tokenizer_config: BOS / EOS text comes from its own pieces."""
    tok = load_tokenizer(os.path.join(TINY, "model"))
    rows = [json.loads(x) for x in open(os.path.join(TINY, "data", "sft.jsonl")).read().splitlines()[:200]]
    plain = write(tmp_path / "plain.jsonl", rows)
    chats = write(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": r["prompt"]},
                                                           {"role": "assistant", "content": r["response"]}]}
                                             for r in rows])
    template = sft_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% if m['role'] == "
                                 "'assistant' %}{{ eos_token }}{% endif %}{% endfor %}", os.path.join(TINY, "model"), tok)
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>")
    a, b = SFTDataset(plain, tok, 32), ChatSFTDataset(chats, tok, 32, "messages", template)
    assert len(a) == len(b) == 200 and all(a[i] == b[i] for i in range(200))


def test_bad_conversations_are_refused_naming_the_record(tmp_path, tok):
    t = ChatTemplate(TAGS, eos_token="</s>")
    cases = {
        "chat.jsonl:1: 'messages' has no assistant message": [{"role": "user", "content": "1"}],
        "chat.jsonl:1: 'messages' must be a non-empty list": [],
        "chat.jsonl:1: 'messages' message 1 must be {'role': str, 'content': str}":
            [{"role": "user", "content": "1"}, {"role": "assistant", "content": 5}],
    }
    for message, chat in cases.items():
        path = write(tmp_path / "chat.jsonl", [{"messages": chat}])
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("{", r"\{")):
            ChatSFTDataset(path, tok, 64, "messages", t)
    last_only = ChatTemplate("{{ messages[-1]['content'] }}", eos_token="</s>")
    path = write(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(ValueError, match="chat.jsonl:1: chat template from inline: rendering assistant message 2 "
                                         "changes the text before it"):
        ChatSFTDataset(path, tok, 64, "messages", last_only)


def test_config_rules():
    with pytest.raises(ConfigError, match="data.messages_key: conversations for SFT; RL reads chat prompts"):
        load_config(os.path.join(REPO, "configs", "tiny_grpo.yaml"), ["data.messages_key=messages"])
    with pytest.raises(ValueError, match="data.messages_key: chat SFT needs a chat template"):
        sft_chat_template("", os.path.join(TINY, "model"), load_tokenizer(os.path.join(TINY, "model")))


def test_a_records_tools_reach_the_template(tmp_path, tok):
    """A record's "tools" render as the rollouts render them (HF apply_chat_template(tools=...)):
    in the untrained text, never in the loss; malformed tools are refused naming the record."""
    with_tools = ("{% if tools %}<system>{% for t in tools %}{{ t['function']['name'] }}{% endfor %}{% endif %}"
                  + TAGS)
    t = ChatTemplate(with_tools, eos_token="</s>")
    tools = [{"type": "function", "function": {"name": "12", "parameters": {}}}]
    chat = [{"role": "user", "content": "3+3="}, {"role": "assistant", "content": "6"}]
    assert t.assistant_spans(chat, tools) == [("<system>12<user>3+3=<assistant>", False), ("6</s>", True)]
    ds = ChatSFTDataset(write(tmp_path / "chat.jsonl", [{"messages": chat, "tools": tools}]), tok, 64, "messages", t)
    e = tok.encode
    assert ds[0]["input_ids"] == e("<system>12<user>3+3=<assistant>") + e("6") + [tok.eos_id]
    assert ds[0]["loss_mask"] == [0] * len(e("<system>12<user>3+3=<assistant>")) + [1] * (len(e("6")) + 1)
    plain = ChatSFTDataset(write(tmp_path / "plain.jsonl", [{"messages": chat}]), tok, 64, "messages", t)
    assert plain[0]["input_ids"] == e("<user>3+3=<assistant>") + e("6") + [tok.eos_id]
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 'tools' must be a list of function schemas"):
        ChatSFTDataset(write(tmp_path / "bad.jsonl", [{"messages": chat, "tools": "calculator"}]), tok, 64,
                       "messages", t)
