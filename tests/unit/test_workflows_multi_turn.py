"""Multi-turn and tool-calling workflows token by token: exact ids, masks, logprobs, versions and
per-turn rewards of each turn, with the `ScriptedClient` test double standing in for the server."""
import asyncio

import pytest

from chatml import CHATML, ids, write_chat_tokenizer
from megarl.data import PromptSample, load_chat_template, load_tokenizer
from megarl.data.chat import ChatTemplate
from megarl.rewards import RewardCaller, math_reward
from megarl.protocol.types import SamplingParams
from megarl.rollout.workflows import (MultiTurnWorkflow, ToolCallingWorkflow, TurnRenderer, WorkflowContext,
                                      parse_tool_calls)
from scripted_client import ScriptedClient
from test_sandbox_boundary import require_sandbox

IM_END, IM_START = 2, 3
NL = ids("\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("chat_tok"))
    write_chat_tokenizer(path)
    return path


def ctx_for(model_dir, chat=True, max_seq_len=None):
    tok = load_tokenizer(model_dir)
    return WorkflowContext(tok, RewardCaller(math_reward), SamplingParams(max_new_tokens=400, stop_token_ids=[2]),
                           1, load_chat_template("", model_dir) if chat else None, max_seq_len)


def chat_sample(ctx, tools=None):
    messages = [{"role": "user", "content": "12*7?"}]
    text = ctx.chat_template.render(messages, tools=tools)
    return PromptSample(0, text, {"answer": "84"}, ctx.tokenizer.encode(text), messages)


def gen(text, call):
    """(ids, logprobs, versions) the ScriptedClient returns for call number `call`."""
    out = ids(text) + [IM_END]
    half = len(out) // 2
    return out, [-(j + 1) / 100 for j in range(len(out))], [2 * call] * half + [2 * call + 1] * (len(out) - half)


def turn_header(role, content):
    return [IM_START] + ids(f"{role}\n{content}") + [IM_END] + NL + [IM_START] + ids("assistant\n")


def test_answer_feedback_turns_exact(model_dir):
    ctx = ctx_for(model_dir)
    wf = MultiTurnWorkflow(ctx, max_turns=3, turn_discount=0.5, feedback="Wrong, retry.")
    sample = chat_sample(ctx)
    client = ScriptedClient(ctx.tokenizer, ["80", "so \\boxed{84}"])
    (t,) = asyncio.run(wf.arun_episode(client, sample))
    p = sample.prompt_ids
    g0, lp0, v0 = gen("80", 0)
    between = NL + turn_header("user", "Wrong, retry.")  # rest of "<|im_end|>\n" after the EOS, then the turn
    g1, lp1, v1 = gen("so \\boxed{84}", 1)
    assert t.input_ids == p + g0 + between + g1
    assert t.loss_mask == [0] * len(p) + [1] * len(g0) + [0] * len(between) + [1] * len(g1)
    assert t.behave_logp == [0.0] * len(p) + lp0 + [0.0] * len(between) + lp1
    assert t.versions == [-1] * len(p) + v0 + [-1] * len(between) + v1
    assert v0 == [0, 1, 1] and v1[0] == 2 and v1[-1] == 3  # versions differ inside and across turns
    assert t.info["turn_rewards"] == [0.0, 1.0] and t.reward == 0.5  # 0 + 0.5 ** 1 * 1
    start1 = len(p) + len(g0) + len(between)
    assert [(x["start"], x["end"]) for x in t.info["turns"]] == [(len(p), len(p) + len(g0)), (start1, start1 + len(g1))]
    assert t.info["completion"] == "so \\boxed{84}" and t.info["num_turns"] == 2
    assert client.calls[1][0].input_ids == p + g0 + between  # turn 2 was generated from exactly this


def test_plain_prompts_use_role_formats(model_dir):
    ctx = ctx_for(model_dir, chat=False)
    wf = MultiTurnWorkflow(ctx, max_turns=2, feedback="no", plain_formats={"user": " [{content}] "})
    sample = PromptSample(3, "12*7=", {"answer": 84}, ids("12*7="))
    (t,) = asyncio.run(wf.arun_episode(ScriptedClient(ctx.tokenizer, ["85", "84"]), sample))
    g0, g1 = gen("85", 0)[0], gen("84", 1)[0]
    assert t.input_ids == ids("12*7=") + g0 + ids(" [no] ") + g1  # nothing closes a plain turn
    assert t.info["turn_rewards"] == [0.0, 1.0] and t.reward == 1.0 and t.group_id == 3


def test_tool_calls_and_results_exact(model_dir):
    ctx = ctx_for(model_dir)
    require_sandbox()  # the python tool runs in bubblewrap by default
    wf = ToolCallingWorkflow(ctx, tools=["calculator", "python"], max_turns=3)
    assert [s["function"]["name"] for s in wf.tool_schemas] == ["calculator", "python"]
    sample = chat_sample(ctx, tools=wf.tool_schemas)
    assert sample.prompt.startswith('<|im_start|>system\nTools:\n{"type": "function", "function": {"name": "calculator"')
    calls = ('<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
             '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(2**10)\\"}"}</tool_call>'
             '<tool_call>{"name": "shell", "arguments": {}}</tool_call><tool_call>{"name": oops}</tool_call>')
    client = ScriptedClient(ctx.tokenizer, [calls, "It is \\boxed{84}"])
    (t,) = asyncio.run(wf.arun_episode(client, sample))
    results = ["84", "1024", "error: unknown tool 'shell'; available: calculator, python",
               "error: invalid JSON in <tool_call>: Expecting value"]
    tool_turn = ctx.tokenizer.encode(ctx.chat_template.continuation(
        [{"role": "tool", "content": r} for r in results], tools=wf.tool_schemas))
    assert tool_turn == [IM_START] + ids("user\n" + "".join(f"<tool_response>\n{r}\n</tool_response>\n" for r in results)) \
        + [IM_END] + NL + [IM_START] + ids("assistant\n")
    p, (g0, lp0, v0), (g1, lp1, v1) = sample.prompt_ids, gen(calls, 0), gen("It is \\boxed{84}", 1)
    assert t.input_ids == p + g0 + NL + tool_turn + g1
    n_ctx = len(NL + tool_turn)
    assert t.loss_mask == [0] * len(p) + [1] * len(g0) + [0] * n_ctx + [1] * len(g1)
    assert t.behave_logp == [0.0] * len(p) + lp0 + [0.0] * n_ctx + lp1
    assert t.versions == [-1] * len(p) + v0 + [-1] * n_ctx + v1
    turn0, turn1 = t.info["turns"]
    assert turn0["tool_results"] == results and turn0["tool_calls"] == 4 and turn0["tool_errors"] == 2
    assert t.info["turn_rewards"] == [0.0, 1.0] and t.reward == 1.0


def test_last_turn_is_scored_and_room_runs_out(model_dir):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "80+4"}}</tool_call>'
    ctx = ctx_for(model_dir)
    wf = ToolCallingWorkflow(ctx, max_turns=2, tool_timeout_s=5)
    client = ScriptedClient(ctx.tokenizer, [call, call + " 84"])
    (t,) = asyncio.run(wf.arun_episode(client, chat_sample(ctx, wf.tool_schemas)))
    # turn 2 still calls a tool, but it is the last turn: scored as an answer (last number 84)
    assert t.info["num_turns"] == 2 and t.info["turn_rewards"] == [0.0, 1.0]
    # with room for the first answer but not for the tool turn, the episode ends after turn 1
    sample = chat_sample(ctx, wf.tool_schemas)
    tight = ctx_for(model_dir, max_seq_len=len(sample.prompt_ids) + len(gen(call, 0)[0]) + 5)
    wf2 = ToolCallingWorkflow(tight, max_turns=2)
    (t2,) = asyncio.run(wf2.arun_episode(ScriptedClient(tight.tokenizer, [call]), sample))
    assert t2.info["num_turns"] == 1 and t2.reward == 0.0 and len(t2.input_ids) <= tight.max_seq_len


def test_forced_prefix_is_context_but_part_of_the_turn_text(model_dir):
    ctx = ctx_for(model_dir)
    forced = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*42"}}</tool_call>'
    wf = ToolCallingWorkflow(ctx, max_turns=2, forced_prefix=forced, stop_at_tool_call=True)
    client = ScriptedClient(ctx.tokenizer, ["", "\\boxed{84}"])
    sample = chat_sample(ctx, wf.tool_schemas)
    (t,) = asyncio.run(wf.arun_episode(client, sample))
    p, f = sample.prompt_ids, ids(forced)
    assert t.input_ids[:len(p) + len(f)] == p + f and t.loss_mask[len(p):len(p) + len(f)] == [0] * len(f)
    assert t.info["turns"][0]["tool_results"] == ["84"] and t.reward == 1.0
    assert client.calls[0][0].sampling.stop == ["</tool_call>"]


@pytest.mark.parametrize("text,expected", [
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', [("f", {"x": 1}, None)]),
    ('a<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 2}"}\n</tool_call>b', [("f", {"x": 2}, None)]),
    ('<tool_call>{"name": "f"}</tool_call>', [("f", {}, None)]),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [("f", {}, "tool call arguments must be a JSON object")]),
    ('<tool_call>["f"]</tool_call>', [("", {}, 'a tool call needs {"name": str, "arguments": {...}}')]),
    ('<tool_call>{"name": "f", "arguments": {}}', []),  # unterminated: not a call
    ("no calls", []),
])
def test_parse_tool_calls(text, expected):
    assert [(c.name, c.arguments, c.error) for c in parse_tool_calls(text)] == expected


def test_templates_that_cannot_be_extended_are_refused(model_dir):
    tok = load_tokenizer(model_dir)
    last_only = ChatTemplate("{{ messages[-1]['content'] }}", origin="test")
    with pytest.raises(ValueError, match="changes the text before it"):
        TurnRenderer(tok, last_only)
    TurnRenderer(tok, ChatTemplate(CHATML))  # the ChatML template can
