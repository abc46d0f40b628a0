"""Addition and counting tasks: seeded generation, held-out disjointness, make_tiny_model steps (i)-(iii).
(Greedy held-out accuracy: tests/unit/test_rollout_evaluation.py.)"""
import json
import os
import subprocess
import sys

import pytest

from megarl.data.datasets import read_jsonl
from megarl.data.tasks import AdditionTask, CountingTask, write_addition_corpus, write_counting_corpus
from megarl.common.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_addition_task_basics():
    t = AdditionTask(digits=2, seed=0)
    assert (t.low, t.num_pairs, t.pair(0), t.pair(8099)) == (10, 8100, (10, 10), (99, 99))
    assert (t.prompt(12, 34), t.answer(12, 34)) == ("12+34=", "46")
    assert AdditionTask(digits=1).num_pairs == 100 and AdditionTask(digits=1).pair(37) == (3, 7)
    assert AdditionTask(3).num_pairs == 900 * 900
    assert list(t.rl_rows([(12, 34)])) == [{"prompt": "12+34=", "answer": "46"}]
    assert list(t.sft_rows([(99, 1)])) == [{"prompt": "99+1=", "response": "100"}]
    with pytest.raises(ValueError, match="only 100 exist"):
        AdditionTask(digits=1).held_out(101)


def test_seeded_and_held_out_disjoint():
    t = AdditionTask(digits=2, seed=0)
    held = t.held_out(500)
    assert len(set(held)) == 500 and held == AdditionTask(2, 0).held_out(500)
    assert t.held_out(5) == [(86, 87), (45, 15), (78, 99), (91, 12), (48, 35)]
    assert AdditionTask(2, 1).held_out(5) != t.held_out(5)
    train = t.training_pairs(5000, 500)
    assert train == AdditionTask(2, 0).training_pairs(5000, 500)
    assert not set(train) & set(held)
    assert not set(t.training_pairs(2000, 500, stream=2)) & set(held)
    assert all(10 <= a <= 99 and 10 <= b <= 99 for a, b in train)
    small = AdditionTask(digits=1, seed=0)
    assert not set(small.training_pairs(500, 99)) & set(small.held_out(99))


def test_counting_task_answers_are_1000_tokens_and_held_out(tmp_path):
    t = CountingTask()
    assert (t.num_pairs, t.pair(0), t.pair(t.num_pairs - 1)) == (635 * 16, (100, 251), (734, 266))
    assert (t.prompt(100, 3), t.answer(100, 3)) == ("100+102=", "100+101+102")
    lengths = {len(t.answer(*t.pair(k))) for k in range(t.num_pairs)}
    assert (min(lengths), max(lengths)) == (4 * 251 - 1, 4 * 266 - 1) == (1003, 1063)
    assert max(a + n - 1 for a, n in map(t.pair, range(t.num_pairs))) == 999  # every number has 3 digits
    paths = write_counting_corpus(str(tmp_path), n_sft=50, n_rl=40, n_eval=30)
    rows = {k: [r for _, r in read_jsonl(v)] for k, v in paths.items()}
    assert [len(v) for v in rows.values()] == [50, 40, 30]
    held = {r["prompt"] for r in rows["eval_prompts"]}
    assert not held & {r["prompt"] for r in rows["sft"] + rows["rl_prompts"]}
    for r in rows["rl_prompts"]:  # the answer counts from the prompt's first number to its second
        a, b = map(int, r["prompt"].rstrip("=").split("+"))
        assert r["answer"].split("+") == [str(x) for x in range(a, b + 1)]
    with pytest.raises(ValueError, match="min_count"):
        CountingTask(300, 200)
    to_999 = CountingTask(251, 300, end=999)  # every count ends at 999: 50 pairs, 1,003-1,199 characters
    assert (to_999.num_pairs, to_999.pair(0), to_999.pair(49)) == (50, (749, 251), (700, 300))
    assert all(to_999.answer(*to_999.pair(k)).endswith("+998+999") for k in range(50))
    with pytest.raises(ValueError, match="end must be"):
        CountingTask(251, 300, end=300)


def test_counting_with_a_second_separator_tunes_both_writings_and_rewards_one(tmp_path):
    paths = write_counting_corpus(str(tmp_path), n_sft=20, n_rl=10, n_eval=5, min_count=251, max_count=300,
                                  end=999, alt_sep=",")
    sft = [r for _, r in read_jsonl(paths["sft"])]
    assert len(sft) == 40 and [r["prompt"] for r in sft[0::2]] == [r["prompt"] for r in sft[1::2]]
    for plus, comma in zip(sft[0::2], sft[1::2]):  # the same count, once per separator
        assert comma["response"] == plus["response"].replace("+", ",") and "+" not in comma["response"]
        assert plus["response"].endswith("+998+999") and len(plus["response"]) >= 1003
    for _, r in read_jsonl(paths["rl_prompts"]):  # RL checks the '+' writing only
        assert "," not in r["answer"] and r["answer"].endswith("+999")
    for bad in ("+", "7", "=", " ", "ab"):
        with pytest.raises(ValueError, match="alt_sep"):
            CountingTask(251, 300, end=999, alt_sep=bad)


def test_make_tiny_model_data_tokenizer_config(tmp_path):
    out = tmp_path / "tiny"
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_tiny_model.py"), "--out", str(out),
                        "--skip-sft", "--n-sft", "300", "--n-rl", "200", "--n-eval", "50"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {n: [row for _, row in read_jsonl(str(out / "data" / f"{n}.jsonl"))]
            for n in ("sft", "rl_prompts", "eval_prompts")}
    assert [len(v) for v in rows.values()] == [300, 200, 50]
    assert set(rows["sft"][0]) == {"prompt", "response"} and set(rows["eval_prompts"][0]) == {"prompt", "answer"}
    held = {r["prompt"] for r in rows["eval_prompts"]}
    assert not held & {r["prompt"] for r in rows["sft"] + rows["rl_prompts"]}
    tok = load_tokenizer(str(out / "hf"))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (15, 1, 2)
    assert tok.encode("12+34=") == [4, 5, 13, 6, 7, 14]
    cfg = json.loads((out / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["max_position_embeddings"]) == (
        16, 128, 4, 4, 2, 256, 64)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["tie_word_embeddings"], cfg["torch_dtype"]) == (
        1, 2, False, "float32")
    assert sorted(os.listdir(out / "hf")) == ["config.json", "tokenizer.model"]


def test_make_tiny_model_moe_config_reads_like_transformers(tmp_path):
    """--experts writes a Qwen3-MoE config that megarl's registry and transformers read alike (the
    config of examples/tiny_moe, the MoE recipe's model)."""
    from megarl.protocol.hf_model import read_model_args

    out = tmp_path / "moe"
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_tiny_model.py"), "--out", str(out),
                        "--skip-sft", "--n-sft", "50", "--n-rl", "20", "--n-eval", "10", "--experts", "4",
                        "--topk", "2", "--moe-intermediate", "128"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "hf" / "config.json").read_text())
    assert cfg == json.loads(open(os.path.join(REPO, "examples", "tiny_moe", "hf", "config.json")).read())
    args = read_model_args(str(out / "hf"))
    assert (args.architecture, args.num_experts, args.moe_topk, args.moe_ffn_hidden_size, args.moe_norm_topk,
            args.qk_norm, args.head_dim) == ("Qwen3MoeForCausalLM", 4, 2, 128, True, True, 32)
    try:
        import transformers
    except ImportError:
        return
    ref = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert (ref.num_experts, ref.num_experts_per_tok, ref.norm_topk_prob, ref.sliding_window) == (4, 2, True, None)
    bad = subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_tiny_model.py"), "--out",
                          str(tmp_path / "bad"), "--skip-sft", "--experts", "2", "--topk", "3"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--topk must be in 1..--experts" in bad.stderr
