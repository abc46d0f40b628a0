"""Bad-input corpus, class "input checked too late": data records whose fields the datasets read
only once the ranks run (a missing answer, a null / empty / non-string prompt, a chat that is no
list of messages, Parquet columns of the wrong type, a bad record deep in a long file, a bad eval
file). Preflight streams every record of the train and eval files before any rank starts, so each
case is one line naming the file, line (or Parquet row) and key, exit status 2, and no run
directory left behind. Also: checking the 5000-prompt demo file stays well under a second.
"""
from __future__ import annotations

import json
import os
import time

import pytest
from badinput_support import REPO, TINY, CliCase, corpus_tests

GRPO = ("{grpo_yaml}", "model.hf_path={model}", "data.eval_path=", "train.run_dir={root}/runs/{id}",
        "rollout.health_timeout_s=3")
SFT = ("{sft_yaml}", "model.hf_path={hf}", "train.run_dir={root}/runs/{id}")


def D(id, extra, *needles, base=GRPO):  # noqa: N802 - a table row
    return CliCase(id, "megarl-train", base + tuple(extra), 2, needles, ("{root}/runs/{id}",))


CASES = {f"megarl-train:{c.id}": c for c in [
    D("rl_answer_missing", ["data.train_path={root}/no_answer.jsonl"], "data.train_path: {root}/no_answer.jsonl:2:",
      "missing key(s) ['answer']", "data.answer_key"),
    D("rl_nested_answer_missing", ["data.train_path={root}/no_answer.jsonl",
                                   "data.answer_key=reward_model.ground_truth"],
      "no_answer.jsonl:1:", "['reward_model.ground_truth']"),
    D("rl_prompt_null", ["data.train_path={root}/null_prompt.jsonl"], "data.train_path: {root}/null_prompt.jsonl:3:",
      "'prompt' is null; expected a non-empty string or a list of chat messages"),
    D("rl_prompt_empty", ["data.train_path={root}/empty_prompt.jsonl"], "empty_prompt.jsonl:1:", "'prompt' is empty"),
    D("rl_prompt_number", ["data.train_path={root}/int_prompt.jsonl"], "int_prompt.jsonl:1:", "'prompt' is int"),
    D("rl_prompt_bad_chat", ["data.train_path={root}/bad_chat.jsonl"], "bad_chat.jsonl:1:",
      "'prompt' must be a list of {{'role': str, 'content': ...}} messages"),
    D("rl_bad_record_deep_in_file", ["data.train_path={root}/late.jsonl"], "late.jsonl:4999:",
      "missing key(s) ['answer']"),
    D("rl_eval_prompt_null", ["data.train_path={rl}", "data.eval_path={root}/null_prompt.jsonl"],
      "data.eval_path: {root}/null_prompt.jsonl:3:", "'prompt' is null"),
    D("parquet_prompt_column_int", ["data.train_path={root}/int_prompt.parquet"],
      "data.train_path: {root}/int_prompt.parquet:row 1:", "'prompt' is int"),
    D("parquet_prompt_null_row", ["data.train_path={root}/null_prompt.parquet"], "null_prompt.parquet:row 2:",
      "'prompt' is null"),
    D("parquet_answer_column_missing", ["data.train_path={root}/no_answer.parquet"], "no_answer.parquet:row 1:",
      "missing key(s) ['answer']"),
    D("parquet_not_parquet", ["data.train_path={root}/junk.parquet"], "data.train_path: {root}/junk.parquet:",
      "cannot read"),
    D("sft_response_null", ["data.train_path={root}/sft_null.jsonl"], "data.train_path: {root}/sft_null.jsonl:2:",
      "'response' is null", base=SFT),
    D("sft_response_empty", ["data.train_path={root}/sft_empty.jsonl"], "sft_empty.jsonl:1:", "'response' is empty",
      base=SFT),
    D("sft_prompt_number", ["data.train_path={root}/sft_int.jsonl"], "sft_int.jsonl:1:", "'prompt' is int", base=SFT),
]}


def _jsonl(path: str, rows: list) -> None:
    with open(path, "w") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def _parquet(path: str, columns: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("baddata"))
    j = lambda name: os.path.join(root, name)  # noqa: E731
    ok = {"prompt": "1+1=", "answer": "2"}
    _jsonl(j("no_answer.jsonl"), [ok, {"prompt": "1+2="}])
    _jsonl(j("null_prompt.jsonl"), [ok, ok, {"prompt": None, "answer": "2"}])
    _jsonl(j("empty_prompt.jsonl"), [{"prompt": "  ", "answer": "1"}])
    _jsonl(j("int_prompt.jsonl"), [{"prompt": 12, "answer": "1"}])
    _jsonl(j("bad_chat.jsonl"), [{"prompt": [{"content": "hi"}], "answer": "1"}])
    lines = open(os.path.join(TINY, "data", "rl_prompts.jsonl")).read().splitlines()
    lines[4998] = json.dumps({"prompt": json.loads(lines[4998])["prompt"]})
    _jsonl(j("late.jsonl"), lines)
    _parquet(j("int_prompt.parquet"), {"prompt": [1, 2], "answer": ["1", "2"]})
    _parquet(j("null_prompt.parquet"), {"prompt": ["1+1=", None], "answer": ["2", "2"]})
    _parquet(j("no_answer.parquet"), {"prompt": ["1+1="]})
    open(j("junk.parquet"), "w").write("not parquet\n")
    _jsonl(j("sft_null.jsonl"), [{"prompt": "1+1=", "response": "2"}, {"prompt": "1+2=", "response": None}])
    _jsonl(j("sft_empty.jsonl"), [{"prompt": "1+1=", "response": ""}])
    _jsonl(j("sft_int.jsonl"), [{"prompt": 5, "response": "2"}])
    os.makedirs(j("runs"))
    paths = {"root": root, "grpo_yaml": f"{REPO}/configs/tiny_grpo.yaml", "sft_yaml": f"{REPO}/configs/tiny_sft.yaml",
             "model": f"{TINY}/model", "hf": f"{TINY}/hf", "rl": f"{TINY}/data/rl_prompts.jsonl"}
    return root, lambda text: text.format(**paths)


results, test_data_case, test_docs_list_every_case = corpus_tests(CASES)


def test_every_record_of_the_demo_file_checked_quickly():
    """Preflight reads all 5000 demo prompts (and tokenizes them for the length check)."""
    from megarl.launch import preflight as pf
    from megarl.config import load_config

    cfg = load_config(os.path.join(REPO, "configs", "tiny_grpo.yaml"), [f"model.hf_path={TINY}/model"])
    args = pf.check_model(cfg)
    tok = pf.check_tokenizer(cfg, args.vocab_size)
    path = os.path.join(TINY, "data", "rl_prompts.jsonl")
    t0 = time.perf_counter()
    assert pf.check_dataset("data.train_path", path, cfg, tok, args.max_position_embeddings) == 5000
    assert time.perf_counter() - t0 < 0.5  # ~0.1 s on one core
