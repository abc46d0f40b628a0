"""Prompt datasets on real files: Parquet chats rendered with the model's chat template, length
limits (filter / error / left / right / middle) with exact ids and counts, dotted field mapping,
template sources, and the sampler's shuffle switch."""
import json
import sys

import pytest

from chatml import CHATML, ids, write_chat_tokenizer
from megarl.data import PromptDataset, SFTDataset, load_chat_template, load_tokenizer, read_records

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

IM_START, IM_END = 3, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_model")
    write_chat_tokenizer(str(path))
    return str(path)


def chat_ids(*turns, generation=True):
    """ids of ChatML turns [(role, content), ...] + the assistant generation prompt."""
    out = []
    for role, content in turns:
        out += [IM_START] + ids(f"{role}\n{content}") + [IM_END] + ids("\n")
    return out + ([IM_START] + ids("assistant\n") if generation else [])


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def test_parquet_chat_dataset_filters_overlong_prompts(tmp_path, model_dir):
    rows = [
        {"messages": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}, "level": 1},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3*3?"}],
         "reward_model": {"ground_truth": "9"}, "level": 2},
        {"messages": [{"role": "user", "content": "x" * 40}], "reward_model": {"ground_truth": "0"}, "level": 3},
    ]
    path = write_parquet(tmp_path / "chat.parquet", rows)
    tok, template = load_tokenizer(model_dir), load_chat_template("", model_dir)
    assert template.source == CHATML and template.eos_token == "<|im_end|>"
    # token counts: row 1 = 12 (user turn) + 11 (generation prompt) = 23; row 2 = 19 + 12 + 11 = 42;
    # row 3 = 48 + 11 = 59
    ds = PromptDataset(path, tok, prompt_key="messages", answer_key="reward_model.ground_truth",
                       chat_template=template, max_prompt_length=42, truncation="filter")
    assert ds.stats == {"total": 3, "kept": 2, "filtered": 1, "truncated": 0}
    assert [s.index for s in ds] == [0, 1]
    assert ds[0].prompt == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert ds[0].prompt_ids == chat_ids(("user", "2+2?"))  # no BOS: the template owns it
    assert len(ds[0].prompt_ids) == 23 and len(ds[1].prompt_ids) == 42
    assert ds[1].prompt_ids == chat_ids(("system", "Be brief."), ("user", "3*3?"))
    assert ds[1].messages == rows[1]["messages"]
    assert ds[1].answer == "9" and ds[1].meta["level"] == 2
    assert ds[1].meta["reward_model"] == {"ground_truth": "9"}
    cut = PromptDataset(path, tok, prompt_key="messages", answer_key="reward_model.ground_truth",
                        chat_template=template, max_prompt_length=42, truncation="left")
    assert cut.stats == {"total": 3, "kept": 3, "filtered": 0, "truncated": 1}
    full = chat_ids(("user", "x" * 40))
    assert len(full) == 59 and cut[2].prompt_ids == full[-42:] and cut[2].index == 2


@pytest.mark.parametrize("policy,expected", [
    ("right", ids("abcdef")),
    ("left", ids("uvwxyz")),
    ("middle", ids("abc") + ids("xyz")),
])
def test_truncation_policies_exact(tmp_path, model_dir, policy, expected):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"q": "abcdefghijklmnopqrstuvwxyz", "a": 1}) + "\n"
                    + json.dumps({"q": "short", "a": 2}) + "\n")
    tok = load_tokenizer(model_dir)
    ds = PromptDataset(str(path), tok, prompt_key="q", answer_key="a", add_bos=False,
                       max_prompt_length=6, truncation=policy)
    assert ds.stats == {"total": 2, "kept": 2, "filtered": 0, "truncated": 1}
    assert ds[0].prompt_ids == expected and ds[0].prompt == "abcdefghijklmnopqrstuvwxyz"
    assert ds[1].prompt_ids == ids("short") and ds[0].answer == 1
    with_bos = PromptDataset(str(path), tok, prompt_key="q", answer_key="a", max_prompt_length=7,
                             truncation=policy)
    assert len(with_bos[0].prompt_ids) == 7 and with_bos[1].prompt_ids == [1] + ids("short")


def test_truncation_error_names_the_record(tmp_path, model_dir):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok", "answer": 1}\n\n{"prompt": "too long", "answer": 2}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3: prompt has 9 tokens > data.max_prompt_length=5"):
        PromptDataset(str(path), load_tokenizer(model_dir), max_prompt_length=5, truncation="error")
    with pytest.raises(ValueError, match="data.truncation: must be one of"):
        PromptDataset(str(path), load_tokenizer(model_dir), truncation="cut")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        PromptDataset(str(path), max_prompt_length=5)


def test_template_sources(tmp_path, model_dir):
    inline = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"
    t = load_chat_template(inline, model_dir)
    assert t.render([{"role": "user", "content": "hi"}]) == "[user]hi<|im_end|>"
    f = tmp_path / "t.jinja"
    f.write_text("{{ bos_token }}{{ messages[0]['content'] }}{% if add_generation_prompt %}>{% endif %}")
    assert load_chat_template(str(f), model_dir).render([{"role": "user", "content": "q"}]) == "<s>q>"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template("no/such/template.jinja", model_dir)
    with pytest.raises(ValueError, match="Jinja syntax error"):
        load_chat_template("{% for %}", model_dir)
    bare = tmp_path / "bare"
    write_chat_tokenizer(str(bare), chat_template=None)
    assert load_chat_template("", str(bare)) is None
    (bare / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_chat_template("", str(bare)).render([{}, {}]) == "J2"
    raising = load_chat_template("{{ raise_exception('no system role') }}", model_dir)
    with pytest.raises(ValueError, match="chat template: no system role"):
        raising.render([])


def test_chat_prompt_without_template_and_bad_messages(tmp_path, model_dir):
    bare = tmp_path / "bare"
    write_chat_tokenizer(str(bare), chat_template=None)
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": 1}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:1: the prompt is a chat but there is no chat template"):
        PromptDataset(str(path), load_tokenizer(str(bare)))
    path.write_text(json.dumps({"prompt": [{"content": "hi"}], "answer": 1}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:1: a chat prompt must be a list of"):
        PromptDataset(str(path), load_tokenizer(model_dir), chat_template=load_chat_template("", model_dir))


def test_tools_are_rendered_into_the_prompt(tmp_path, model_dir):
    path = write_parquet(tmp_path / "t.parquet", [{"prompt": [{"role": "user", "content": "q"}], "answer": "1"}])
    ds = PromptDataset(path, load_tokenizer(model_dir), chat_template=load_chat_template("", model_dir),
                       tools=[{"name": "calc"}])
    assert ds[0].prompt == ('<|im_start|>system\nTools:\n{"name": "calc"}\n<|im_end|>\n'
                            "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")


def test_parquet_row_locations_sft_and_missing_pyarrow(tmp_path, model_dir, monkeypatch):
    path = write_parquet(tmp_path / "s.parquet", [{"prompt": "ab", "response": "c"}, {"prompt": "d", "response": None}])
    assert [w for w, _ in read_records(path)] == [f"{path}:row 1", f"{path}:row 2"]
    with pytest.raises(KeyError, match=r"s.parquet:row 1: missing key\(s\) \['answer'\]"):
        PromptDataset(path)
    with pytest.raises(ValueError, match=r"s.parquet:row 2: 'response' is null"):  # not trained as "None"
        SFTDataset(path, load_tokenizer(model_dir), max_seq_len=16)
    good = write_parquet(tmp_path / "g.parquet", [{"prompt": "ab", "response": "c"}])
    sft = SFTDataset(good, load_tokenizer(model_dir), max_seq_len=16)
    assert sft[0]["input_ids"] == [1] + ids("ab") + ids("c") + [IM_END]
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(ImportError, match=r'reading the Parquet file .*s.parquet needs the optional '
                                          r'package \'pyarrow\': pip install "megarl\[data\]"'):
        read_records(path)


def test_sampler_follows_the_shuffle_switch(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": str(i), "answer": i}) + "\n" for i in range(5)))
    assert PromptDataset(str(path), shuffle=False).make_sampler(seed=3).next_batch(7) == [0, 1, 2, 3, 4, 0, 1]
    shuffled = PromptDataset(str(path)).make_sampler(seed=3).next_batch(5)
    assert sorted(shuffled) == [0, 1, 2, 3, 4] and shuffled != [0, 1, 2, 3, 4]


def test_rendering_matches_transformers_apply_chat_template(model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours = load_chat_template("", model_dir)
    tools = [{"type": "function", "function": {"name": "calc", "description": "d", "parameters": {"type": "object"}}}]
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
              {"role": "tool", "content": "4"}, {"role": "tool", "content": "5"}, {"role": "user", "content": "x"}]]
    for chat in chats:
        for t in (None, tools):
            for gen in (True, False):
                assert ours.render(chat, gen, tools=t) == hf.apply_chat_template(
                    chat, tokenize=False, add_generation_prompt=gen, tools=t)
