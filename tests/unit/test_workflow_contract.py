"""The workflow contract, run over every shipped workflow (chat-template and plain prompts).

The server is replaced by `ScriptedClient`, a test double that answers from a script and fakes
mid-response weight updates, so every generated token's logprob and version is known. Each
episode must pass `check_episode` (alignment, mask/version/logprob consistency, group ids) and
every loss_mask=1 run must be exactly one response, generated from exactly the tokens before it.
"""
import asyncio

import pytest

from chatml import write_chat_tokenizer
from megarl.data import PromptSample, load_chat_template, load_tokenizer
from megarl.rewards import RewardCaller, math_reward
from megarl.protocol.types import SamplingParams, Trajectory
from megarl.rollout.workflows import WorkflowContext, check_episode, load_workflow
from scripted_client import ScriptedClient

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
SCRIPT = [CALL, "The answer is \\boxed{84}", "maybe 80", CALL + CALL]
WORKFLOWS = {
    "single_turn": ("megarl.rollout.workflows:SingleTurnWorkflow", {}),
    "compat_path": ("megarl.rollout.workflow:SingleTurnWorkflow", {}),
    "multi_turn": ("megarl.rollout.workflows:MultiTurnWorkflow", {"max_turns": 3, "turn_discount": 0.5}),
    "tool_calling": ("megarl.rollout.workflows:ToolCallingWorkflow", {"tools": ["calculator"], "max_turns": 3}),
    "tool_forced": ("megarl.rollout.workflows:ToolCallingWorkflow",
                    {"tools": ["calculator"], "max_turns": 2, "forced_prefix": "<think>"}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("chat_tok"))
    write_chat_tokenizer(path)
    return path


def make_ctx(model_dir, chat: bool, max_seq_len=400, group_size=3):
    tok = load_tokenizer(model_dir)
    return WorkflowContext(tok, RewardCaller(math_reward), SamplingParams(max_new_tokens=120, stop_token_ids=[tok.eos_id]),
                           group_size, load_chat_template("", model_dir) if chat else None, max_seq_len)


def make_sample(ctx, index=5, question="What is 12*7?"):
    if ctx.chat_template is not None:
        messages = [{"role": "user", "content": question}]
        text = ctx.chat_template.render(messages)
        return PromptSample(index, text, {"answer": "84"}, ctx.tokenizer.encode(text), messages)
    return PromptSample(index, question, {"answer": "84"}, [ctx.tokenizer.bos_id] + ctx.tokenizer.encode(question))


def generated_runs(t: Trajectory) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate(t.loss_mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def assert_runs_are_responses(t: Trajectory, client: ScriptedClient):
    for start, end in generated_runs(t):
        matches = [(q, r) for q, r in client.calls
                   if q.input_ids == t.input_ids[:start] and r.output_tokens == t.input_ids[start:end]]
        assert matches, f"generated tokens [{start}:{end}] match no (request, response) pair"
        _, r = matches[0]
        assert t.behave_logp[start:end] == r.output_logprobs and t.versions[start:end] == r.output_versions


@pytest.mark.parametrize("chat", [True, False], ids=["chat_template", "plain"])
@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_shipped_workflows_meet_the_contract(model_dir, name, chat):
    path, args = WORKFLOWS[name]
    ctx = make_ctx(model_dir, chat)
    workflow = load_workflow(path, ctx, args)
    client = ScriptedClient(ctx.tokenizer, SCRIPT)
    sample = make_sample(ctx)
    result = asyncio.run(workflow.arun_episode(client, sample))
    assert check_episode(sample, result, ctx.tokenizer.vocab_size) == []
    assert len(result) == ctx.group_size and {t.group_id for t in result} == {sample.index}
    for t in result:
        assert_runs_are_responses(t, client)
        assert t.info["segments"] >= 2  # the double reports 2 segments per response
    n_turns = sum(len(generated_runs(t)) for t in result)
    assert n_turns == len(client.calls)  # every response landed in exactly one trajectory
    # a prompt that leaves no room to generate is rejected, which the contract allows
    tight = make_ctx(model_dir, chat, max_seq_len=len(sample.prompt_ids))
    assert asyncio.run(load_workflow(path, tight, args).arun_episode(client, sample)) is None


def test_checker_reports_violations(model_dir):
    ctx = make_ctx(model_dir, chat=False)
    sample = make_sample(ctx)
    p = list(sample.prompt_ids)
    good = Trajectory(p + [7], [0] * len(p) + [1], [0.0] * len(p) + [-0.5], [-1] * len(p) + [3], 1.0, sample.index)
    assert check_episode(sample, [good]) == [] and check_episode(sample, None) == []
    bad_mask = Trajectory(p + [7], [1] * len(p) + [1], [0.0] * len(p) + [-0.5], [-1] * len(p) + [3], 1.0, sample.index)
    assert "loss_mask is 1 on a prompt token" in check_episode(sample, [bad_mask])[0]
    bad_ctx = Trajectory(p + [7, 8], [0] * len(p) + [1, 0], [0.0] * len(p) + [-0.5, -0.1], [-1] * len(p) + [3, -1],
                         1.0, sample.index)
    assert "context token needs behave_logp 0.0 and version -1" in check_episode(sample, [bad_ctx])[0]
    unversioned = Trajectory(p + [7], [0] * len(p) + [1], [0.0] * len(p) + [-0.5], [-1] * len(p) + [-1], 1.0, 99)
    problems = check_episode(sample, [unversioned])
    assert any("group_id 99" in x for x in problems) and any("version >= 0" in x for x in problems)
    good.loss_mask.append(1)  # mutated after construction: no longer aligned
    assert "not token-aligned" in check_episode(sample, [good])[0]
    assert "non-empty list" in check_episode(sample, [])[0]


def test_load_workflow_errors(model_dir):
    ctx = make_ctx(model_dir, chat=True)
    with pytest.raises(ValueError, match="expected 'module:Class'"):
        load_workflow("megarl.rollout.workflows.SingleTurnWorkflow", ctx)
    with pytest.raises(ValueError, match="cannot load 'megarl.rollout.workflows:Nope'"):
        load_workflow("megarl.rollout.workflows:Nope", ctx)
    with pytest.raises(ValueError, match=r"rollout.workflow_args: .* cannot be built with \{'turns': 2\}"):
        load_workflow("megarl.rollout.workflows:MultiTurnWorkflow", ctx, {"turns": 2})
    with pytest.raises(ValueError, match="unknown tool 'shell'"):
        load_workflow("megarl.rollout.workflows:ToolCallingWorkflow", ctx, {"tools": ["shell"]})
