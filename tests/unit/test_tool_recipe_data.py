"""The tool recipe's data and tokenizer (tools/make_tool_model.py): held-out products appear
nowhere else, the demonstrations call the calculator at the asked share, and a demonstration
renders through the model's template exactly as the tool workflow renders a rollout."""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

import make_tool_model  # noqa: E402
from megarl.data import load_chat_template, load_tokenizer  # noqa: E402
from megarl.envs.examples import ToolEnv  # noqa: E402


def rows(path):
    return [json.loads(line) for line in open(path)]


def test_data_and_template(tmp_path):
    paths = make_tool_model.write_data(str(tmp_path), n_sft=2000, n_rl=500, n_eval=100, tool_share=0.25, seed=0)
    hf = tmp_path / "hf"
    vocab = make_tool_model.write_tokenizer(str(hf))
    sft, rl, ev = rows(paths["sft"]), rows(paths["rl_prompts"]), rows(paths["eval_prompts"])
    held = {r["messages"][0]["content"] for r in ev}
    assert len(held) == 100 and not held & {r["messages"][0]["content"] for r in rl + sft}
    for r in ev:
        a, b = map(int, r["messages"][0]["content"].split("*"))
        assert r["answer"] == str(a * b) and 10 <= a <= 99 and 10 <= b <= 99
    share = sum(len(r["messages"]) == 4 for r in sft) / len(sft)
    assert abs(share - 0.25) < 0.03, share
    tool_demo = next(r for r in sft if len(r["messages"]) == 4)
    assert tool_demo["tools"] == ToolEnv().tools  # the schemas the environment's /info serves
    tok, template = load_tokenizer(str(hf)), load_chat_template("", str(hf))
    assert tok.vocab_size == vocab == 4 + 96 and tok.eos_id == 2  # ChatML specials, newline, printable ASCII
    spans = template.assistant_spans(tool_demo["messages"], tool_demo["tools"])
    a, b = map(int, tool_demo["messages"][0]["content"].split("*"))
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%d*%d"}}</tool_call>' % (a, b)
    prompt = f"<|im_start|>system\ntools: calculator<|im_end|>\n<|im_start|>user\n{a}*{b}<|im_end|>\n" \
             "<|im_start|>assistant\n"
    result = [{"role": "tool", "name": "calculator", "content": str(a * b)}]
    assert spans == [(prompt, False), (call + "<|im_end|>\n", True),
                     (template.continuation(result, tools=tool_demo["tools"]), False),
                     (f"{a * b}<|im_end|>\n", True)]
    # the rollout's prompt is the demonstration's untrained head
    assert template.render(tool_demo["messages"][:1], tools=tool_demo["tools"]) == prompt
