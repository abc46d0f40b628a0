"""Multi-turn tool calling end to end on CPU: a real megarl-server serving a tiny random Llama with
a ChatML tokenizer and chat template, the real RolloutClient, the calculator tool, and a weight
update between the turns. A random model does not write tool calls, so the first turn starts
with the workflow's documented `forced_prefix` (a tool call, context tokens); every generated
token comes from the server. Checked token by token: ids, loss mask, behave_logp, versions and
each turn's reward. Then two GRPO steps of `megarl-train` on the same model with a Parquet chat
dataset show the loop trains on these trajectories.
"""
from __future__ import annotations

import asyncio
import json

import pytest

import harness
from chatml import write_chat_tokenizer
from e2e_servers import http
from test_server_reference import make_tiny_model

from megarl.data import PromptSample, load_chat_template, load_tokenizer
from megarl.rollout.client import RolloutClient
from megarl.rewards import RewardCaller
from megarl.protocol.types import SamplingParams
from megarl.rollout.workflows import ToolCallingWorkflow, WorkflowContext, check_episode

FORCED = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
EOS = 2  # <|im_end|>


async def length_reward(prompt, completion, meta):
    """An async reward whose value is checkable from the recorded tokens."""
    return float(len(completion))


class RecordingClient(RolloutClient):
    """The real client; records each (request, response) and, after the first response, loads new
    weights on the server as version 1 - a weight update between the two turns."""

    def __init__(self, *args, new_weights: str, **kw):
        super().__init__(*args, **kw)
        self.calls, self.new_weights = [], new_weights

    async def agenerate(self, req):
        resp = await super().agenerate(req)
        self.calls.append((req, resp))
        if len(self.calls) == 1:
            code, out = await asyncio.to_thread(http, "POST", self.servers[0].address + "/update_weights_from_disk",
                                                {"model_path": self.new_weights, "weight_version": "1"})
            assert code == 200, out
        return resp


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory):
    out = []
    for seed in (0, 1):
        path = str(tmp_path_factory.mktemp(f"chat-llama-{seed}"))
        make_tiny_model(path, seed=seed, vocab=128, eos=EOS, max_pos=2048)
        write_chat_tokenizer(path)
        out.append(path)
    return out


def test_tool_turns_token_by_token(chat_models, start_server):
    old, new = chat_models
    server = start_server(old)
    tok, template = load_tokenizer(old), load_chat_template("", old)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=[tok.eos_id], seed=7)
    ctx = WorkflowContext(tok, RewardCaller(length_reward, timeout_s=30), sampling, 1, template, 2048)
    wf = ToolCallingWorkflow(ctx, tools=["calculator"], max_turns=2, forced_prefix=FORCED)
    messages = [{"role": "user", "content": "What is 12*7?"}]
    text = template.render(messages, tools=wf.tool_schemas)
    sample = PromptSample(11, text, {"answer": "84"}, tok.encode(text), messages)

    async def episode():
        client = RecordingClient([server.url], new_weights=new)
        try:
            return await wf.arun_episode(client, sample), client.calls
        finally:
            await client.close()

    (traj,), calls = asyncio.run(episode())
    assert check_episode(sample, [traj], vocab_size=128) == []  # the model's (padded) vocab
    (req0, r0), (req1, r1) = calls
    p, forced = sample.prompt_ids, tok.encode(FORCED)
    g0, g1 = r0.output_tokens, r1.output_tokens
    assert 1 <= len(g0) <= 8 and 1 <= len(g1) <= 8
    close = tok.encode("\n") if g0[-1] == EOS else tok.encode("<|im_end|>\n")  # rest of the turn suffix
    tool_turn = tok.encode("<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<|im_end|>\n"
                           "<|im_start|>assistant\n")
    ctx0, ctx1 = p + forced, close + tool_turn
    assert req0.input_ids == ctx0 and req1.input_ids == ctx0 + g0 + ctx1  # what each turn was generated from
    assert traj.input_ids == ctx0 + g0 + ctx1 + g1
    assert traj.loss_mask == [0] * len(ctx0) + [1] * len(g0) + [0] * len(ctx1) + [1] * len(g1)
    assert traj.behave_logp == [0.0] * len(ctx0) + r0.output_logprobs + [0.0] * len(ctx1) + r1.output_logprobs
    assert all(lp < 0.0 for lp in r0.output_logprobs + r1.output_logprobs)
    # turn 1 under the old weights (version 0), turn 2 under the new ones (version 1)
    assert traj.versions == [-1] * len(ctx0) + [0] * len(g0) + [-1] * len(ctx1) + [1] * len(g1)
    final_text = tok.decode(g1[:-1] if g1[-1] == EOS else g1)
    t0, t1 = traj.info["turns"]
    assert (t0["start"], t0["end"], t1["start"], t1["end"]) == (
        len(ctx0), len(ctx0) + len(g0), len(ctx0) + len(g0) + len(ctx1), len(traj.input_ids))
    assert t0["tool_results"] == ["84"] and t0["tool_calls"] == 1 and t0["tool_errors"] == 0
    assert traj.info["turn_rewards"] == [0.0, float(len(final_text))]
    assert traj.reward == float(len(final_text)) and traj.info["completion"] == final_text
    assert traj.group_id == 11


def test_grpo_trains_on_tool_trajectories(chat_models, tmp_path):
    """Two steps of the real loop: Parquet chat prompts (one over-long, filtered), ToolCallingWorkflow
    with a forced tool call, the calculator, rewards by length; trainer, server and pushes real."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"messages": [{"role": "user", "content": f"What is {a}*{b}?"}], "answer": str(a * b)}
            for a, b in ((2, 3), (4, 5), (6, 7), (8, 9))]
    rows.append({"messages": [{"role": "user", "content": "x" * 2000}], "answer": "0"})
    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(data))
    args = json.dumps({"tools": ["calculator"], "max_turns": 2, "forced_prefix": FORCED})
    run = harness.train(tmp_path / "run", "data.prompt_key=messages", "data.max_prompt_length=600",
                        "data.truncation=filter", "train.steps=2", "train.global_batch_size=4",
                        "train.max_seq_len=1024", "train.micro_batch_tokens=8192", "rollout.group_size=2",
                        "rollout.max_concurrent=4", "rollout.workflow=megarl.rollout.workflows:ToolCallingWorkflow",
                        f"rollout.workflow_args={args}", "rollout.reward_fn=reward_plugins:length_reward",
                        "reward.timeout_s=30", model=chat_models[0], data=data, env=harness.plugin_env(), check=True)
    rows_out = run.rows
    assert [r["step"] for r in rows_out] == [1, 2]
    for r in rows_out:
        assert r["reward"] >= 0.0 and 2 <= r["response_len"] <= 16  # two turns of at most 8 tokens
        assert r["optimizer_steps"] == 1


def test_eval_runs_the_tool_workflow_greedily_with_pass_at_k_and_dumps(chat_models, tmp_path):
    """Evaluation through the configured ToolCallingWorkflow: eval prompts rendered with the tool
    schemas, the forced tool call answered by the calculator, a second (final) turn scored; greedy
    pass@1 and pass@2 over two sampled episodes per prompt, every episode in eval_generations.jsonl."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    def write(name, pairs):
        rows = [{"messages": [{"role": "user", "content": f"What is {a}*{b}?"}], "answer": str(a * b)}
                for a, b in pairs]
        pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / name))
        return tmp_path / name

    train_data = write("train.parquet", ((2, 3), (4, 5), (6, 7), (8, 9)))
    eval_data = write("eval.parquet", ((2, 3), (3, 4), (2, 3)))  # a repeated prompt: greedy twice
    args = json.dumps({"tools": ["calculator"], "max_turns": 2, "forced_prefix": FORCED, "group_size": 2})
    run = harness.train(tmp_path / "run", "data.prompt_key=messages", "train.steps=1",
                        "train.global_batch_size=4", "train.max_seq_len=1024", "train.micro_batch_tokens=8192",
                        "rollout.group_size=2", "rollout.max_concurrent=2", "rollout.max_new_tokens=6",
                        "rollout.workflow=megarl.rollout.workflows:ToolCallingWorkflow",
                        f"rollout.workflow_args={args}", "rollout.reward_fn=reward_plugins:even_length",
                        "rollout.eval_at_start=true", "rollout.eval_k=2",
                        "logging.dump_eval_generations=true", model=chat_models[0], data=train_data,
                        eval_data=eval_data, env=harness.plugin_env(), check=True)
    metrics = {r["step"]: r for r in run.rows}
    dumps = run.jsonl("eval_generations.jsonl")
    assert sorted({d["step"] for d in dumps}) == [0, 1]
    for step in (0, 1):
        m, rows = metrics[step], [d for d in dumps if d["step"] == step]
        greedy = sorted((d for d in rows if d["kind"] == "greedy"), key=lambda d: d["index"])
        sampled = [d for d in rows if d["kind"] == "sampled"]
        assert len(greedy) == 3 and len(sampled) == 6 and m["eval/n"] == 3
        for d in rows:
            assert {"prompt", "completion", "reward", "version", "step"} <= set(d)
            assert '"name": "calculator"' in d["prompt"]  # the tool schemas, as training renders them
            assert "<tool_response>\n84\n</tool_response>" in d["completion"]  # the calculator answered
            assert d["turns"] == 2 and d["tool_calls"] == 1 and d["version"] == m["eval/version"]
            assert d["reward"] == (1.0 if len(d["final"]) % 2 == 0 else 0.0)  # the final turn, scored
        assert m["eval/mean_turns"] == 2.0 and m["eval/tool_calls"] == 1.0
        assert m["eval_accuracy"] == pytest.approx(sum(d["reward"] for d in greedy) / 3)
        assert greedy[0]["completion"] == greedy[2]["completion"]  # temperature 0: the same answer
        per_prompt = [[d["reward"] for d in sampled if d["index"] == i] for i in range(3)]
        assert all(len(r) == 2 for r in per_prompt)
        assert m["eval/pass@2"] == pytest.approx(sum(max(r) for r in per_prompt) / 3)  # n = k: any correct
        assert m["eval/pass@1"] == pytest.approx(sum(sum(r) / 2 for r in per_prompt) / 3)
    assert metrics[0]["eval/version"] == 0 and metrics[1]["eval/version"] == 1
