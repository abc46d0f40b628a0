"""`build_controller` wires the data / workflow / reward config into the controller: every new
field (data.answer_key, chat_template, max_prompt_length, truncation, shuffle; rollout.
workflow_args; reward.*) reaches the object that uses it. And the controller counts a workflow's
None (rejected sample) as filtered instead of failing the episode."""
import json
import time

import pytest

from megarl.models.random_hf import tiny_config

from chatml import write_chat_tokenizer
from megarl.config import load_config
from megarl.data import PromptSample
from megarl.rollout.cluster import RolloutCluster
from megarl.rollout.controller import RolloutController
from megarl.rewards import HttpReward
from megarl.protocol.types import Trajectory
from megarl.rollout.workflows import ToolCallingWorkflow
from megarl.rollout.setup import ControllerSpec, EvalSpec, build_controller

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    write_chat_tokenizer(str(path))
    (path / "config.json").write_text(json.dumps(tiny_config("LlamaForCausalLM")))
    return str(path)


def test_config_reaches_dataset_workflow_and_reward(tmp_path, model_dir):
    rows = [{"q": [{"role": "user", "content": "x" * n}], "gt": {"value": str(n)}} for n in (1, 2, 500)]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(data))
    cfg = load_config(None, [
        f"model.hf_path={model_dir}", f"data.train_path={data}", "train.algorithm=grpo",
        "train.global_batch_size=4", "rollout.group_size=2", "train.max_seq_len=1024",
        "data.prompt_key=q", "data.answer_key=gt.value", "data.max_prompt_length=400", "data.truncation=filter",
        "data.shuffle=false", "rollout.workflow=megarl.rollout.workflows:ToolCallingWorkflow",
        "rollout.workflow_args={tools: [calculator], max_turns: 3}",
        "rollout.reward_fn=megarl.rewards:HttpReward",
        "reward.args={url: 'http://127.0.0.1:9/score', max_batch: 8}", "reward.timeout_s=7",
        "reward.on_error_value=-1"])
    c = build_controller(ControllerSpec.from_config(cfg), RolloutCluster([], driver=False))
    ds, wf = c.dataset, c.workflow
    assert ds.stats == {"total": 3, "kept": 2, "filtered": 1, "truncated": 0}
    assert [s.answer for s in ds] == ["1", "2"] and ds[0].messages == rows[0]["q"]
    assert ds[0].prompt.startswith("<|im_start|>system\nTools:\n")  # the workflow's tool schemas
    assert c.sampler.next_batch(4) == [0, 1, 0, 1]  # data.shuffle=false
    assert isinstance(wf, ToolCallingWorkflow) and wf.max_turns == 3 and list(wf.tools) == ["calculator"]
    assert wf.ctx.max_seq_len == 1024 and wf.ctx.group_size == 2 and wf.ctx.chat_template is ds.chat_template
    reward = wf.ctx.reward
    assert isinstance(reward.fn, HttpReward) and reward.fn.max_batch == 8
    assert reward.timeout_s == 7.0 and reward.on_error_value == -1.0


class RejectOdd:
    async def arun_episode(self, client, sample):
        if sample.index % 2:
            return None
        return [Trajectory([1, 5], [0, 1], [0.0, -0.5], [-1, 0], 1.0, sample.index)]


def test_controller_counts_rejected_samples_as_filtered():
    data = [PromptSample(i, f"p{i}", {}, [1]) for i in range(8)]
    cluster = RolloutCluster([], driver=False)
    c = RolloutController(data, RejectOdd(), ["http://127.0.0.1:9"], cluster, batch_groups=2, max_staleness=4,
                          max_concurrent=2, seed=0)
    c.start()
    try:
        batch = c.next_batch(2, timeout_s=10)
        assert len(batch) == 2 and all(t.reward == 1.0 for t in batch)
        deadline = time.monotonic() + 10
        while c.counters["filtered/workflow"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.counters["filtered/workflow"] >= 1 and c.counters["failed"] == 0
    finally:
        c.stop()


def test_eval_is_built_from_the_configured_workflow(tmp_path, model_dir):
    """build_eval: the run's ToolCallingWorkflow twice (greedy group of 1 at temperature 0; k
    sampled at the rollout temperature; workflow_args' group_size is training's), eval prompts
    rendered with its tool schemas, the training reward caller, the dump path when asked."""
    from megarl.rollout.setup import build_eval

    rows = [{"q": [{"role": "user", "content": "What is 2*3?"}], "gt": "6"}] * 3
    data = tmp_path / "eval.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(data))
    cfg = load_config(None, [
        f"model.hf_path={model_dir}", f"data.train_path={data}", f"data.eval_path={data}",
        "train.algorithm=grpo", f"train.run_dir={tmp_path / 'run'}", "train.max_seq_len=1024",
        "data.prompt_key=q", "data.answer_key=gt", "rollout.temperature=0.8", "rollout.eval_k=4",
        "rollout.eval_size=2", "rollout.workflow=megarl.rollout.workflows:ToolCallingWorkflow",
        "rollout.workflow_args={tools: [calculator], max_turns: 3, group_size: 16}",
        "logging.dump_eval_generations=true"])
    c = build_controller(ControllerSpec.from_config(cfg), RolloutCluster([], driver=False))
    ev = build_eval(EvalSpec.from_config(cfg), c.reward)
    greedy, sampled = ev.workflows.greedy, ev.workflows.sampled
    assert isinstance(greedy, ToolCallingWorkflow) and isinstance(sampled, ToolCallingWorkflow)
    assert (greedy.group_size, greedy.ctx.sampling.temperature, greedy.max_turns) == (1, 0.0, 3)
    assert (sampled.group_size, sampled.ctx.sampling.temperature, ev.workflows.k) == (4, 0.8, 4)
    assert c.workflow.group_size == 16  # training keeps its own
    assert greedy.ctx.reward is c.reward and sampled.ctx.reward is c.reward
    assert len(ev.samples) == 2 and all(s.prompt.startswith("<|im_start|>system\nTools:\n") for s in ev.samples)
    assert '"name": "calculator"' in ev.samples[0].prompt
    assert ev.dump_path == str(tmp_path / "run" / "eval_generations.jsonl")
