"""A mixture of RL prompt sources (`data.sources`): the draw order (`MixtureSampler`), its exact
resume, the mixture's index space (`SourceMixture`), the config's refusals, each source's task
(`source_tasks`), the dispatch to each source's workflow and the per-source step metrics."""
import asyncio
import collections
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from megarl.common.errors import ConfigError
from megarl.config.load import load_config
from megarl.data.mixture import MixtureSampler, SourceMixture
from megarl.data.prompts import PromptDataset
from megarl.rollout.setup import TaskSpec, training_task
from megarl.rollout.sources import SourceWorkflows, source_tasks
from megarl.trainer.rollout_stats import source_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = os.path.join(REPO, "examples", "tiny", "data", "rl_prompts.jsonl")
EVAL = os.path.join(REPO, "examples", "tiny", "data", "eval_prompts.jsonl")
RECIPE = os.path.join(REPO, "configs", "tiny_grpo.yaml")


def sources(*entries: str) -> list[str]:
    return ["data.train_path=", f"data.sources=[{', '.join(entries)}]"]


@pytest.mark.parametrize("weights", [(3, 1), (0.5, 0.3, 0.2), (1, 1, 1, 7)])
def test_every_prefix_of_the_draws_is_within_one_draw_of_the_weights(weights):
    s = MixtureSampler([50] * len(weights), weights, seed=3)
    shares = np.array(weights, float) / sum(weights)
    for t in range(1, 1001):
        i = s.next_source()
        assert s.next_source() == i  # reads, never moves
        s.next_index()
        counts = np.array(s.draws)
        assert counts.sum() == t and np.abs(counts - shares * t).max() < 1.0, (t, counts)


def test_each_source_is_walked_once_per_epoch_in_its_own_order():
    sizes = [7, 5, 3]
    s = MixtureSampler(sizes, [7, 5, 3], seed=11)
    got = s.next_batch(15 * 4)  # shares equal to the sizes: four epochs of every source
    offsets = [0, 7, 12]
    for i, (off, n) in enumerate(zip(offsets, sizes)):
        mine = [g - off for g in got if off <= g < off + n]
        assert len(mine) == 4 * n
        for e in range(4):
            assert sorted(mine[e * n:(e + 1) * n]) == list(range(n))
        # the per-source order is reshuffled each epoch and seeded apart from the other sources
        assert mine[:n] != mine[n:2 * n] or n < 3
    again = MixtureSampler(sizes, [7, 5, 3], seed=11).next_batch(60)
    other = MixtureSampler(sizes, [7, 5, 3], seed=12).next_batch(60)
    assert again == got and other != got


def test_a_restored_sampler_draws_exactly_what_the_original_would():
    a = MixtureSampler([13, 4], [2, 1], seed=5, names=["x", "y"])
    a.next_batch(37)  # past an epoch boundary of both sources
    state = json.loads(json.dumps(a.state_dict()))  # what a checkpoint holds
    b = MixtureSampler([13, 4], [2, 1], seed=5, names=["x", "y"])
    b.load_state_dict(state)
    assert b.next_batch(100) == a.next_batch(100)
    assert b.draws == a.draws == [91, 46]


def test_a_changed_mixture_is_refused_at_resume():
    a = MixtureSampler([13, 4], [2, 1], seed=5, names=["x", "y"])
    with pytest.raises(ValueError, match=r"sources \['x', 'y'\], not \['x', 'z'\]"):
        MixtureSampler([13, 4], [2, 1], names=["x", "z"]).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="source 'y': sampler state is for a dataset of 4 samples, not 5"):
        MixtureSampler([13, 5], [2, 1], names=["x", "y"]).load_state_dict(a.state_dict())


def test_the_mixture_indexes_every_source_end_to_end():
    a, b = PromptDataset(PROMPTS), PromptDataset(EVAL)
    mix = SourceMixture({"train": a, "held": b}, [1, 1])
    assert len(mix) == len(a) + len(b) == 5500
    assert mix[0].prompt == a[0].prompt and mix[0].source == "train" and mix[0].index == 0
    assert mix[5000].prompt == b[0].prompt and mix[5000].source == "held" and mix[5000].index == 5000
    assert mix.source_of(5499) == "held" and mix[5499].meta == b[499].meta
    assert mix.stats["total"] == 5500 and mix.stats["held/kept"] == 500


def test_config_refusals_name_the_field():
    ok = "{name: a, path: x.jsonl}"
    cases = {
        "data.sources: set either data.train_path": [f"data.sources=[{ok}]"],
        r"data.sources\[1\].name: 'a' names two sources": sources(ok, ok),
        r"data.sources\[0\].name: required": sources("{path: x.jsonl}"),
        r"data.sources\[0\].name: required, letters, digits and _ . - \(a metrics key\); got 'a/b'":
            sources("{name: a/b, path: x.jsonl}"),
        r"data.sources\[0\].path: required": sources("{name: a}"),
        r"data.sources\[1\].weight: must be > 0, got 0.0": sources(ok, "{name: b, path: y.jsonl, weight: 0}"),
        r"data.sources\[0\].truncation: must be one of": sources("{name: a, path: x.jsonl, truncation: cut}"),
        r"data.sources\[0\].colour: unknown key": sources("{name: a, path: x.jsonl, colour: red}"),
        r"data.sources\[0\].workflow_args: expected a mapping": sources("{name: a, path: x.jsonl, workflow_args: [1]}"),
        "data.sources: RL prompt files \\(a mixture, held-out sets\\); SFT reads data.train_path":
            ["train.algorithm=sft", *sources(ok)],
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(RECIPE, overrides)


def test_each_source_task_is_the_runs_with_its_own_fields():
    cfg = load_config(RECIPE, ["rollout.workflow_args={max_turns: 2}", "data.max_prompt_length=20", *sources(
        f"{{name: a, path: {PROMPTS}}}",
        f"{{name: b, path: {EVAL}, weight: 3, reward_fn: 'megarl.rewards:math_reward', workflow_args: {{}}, "
        "reward_args: {k: 1}, prompt_key: q, answer_key: '', max_prompt_length: 0, truncation: left}")])
    tasks = source_tasks(TaskSpec.from_config(cfg))
    a, b = tasks["a"], tasks["b"]
    assert list(tasks) == ["a", "b"]
    assert (a.data.train_path, b.data.train_path) == (PROMPTS, EVAL) and a.data.sources == [] == b.data.sources
    assert a.rollout.reward_fn == cfg.rollout.reward_fn and b.rollout.reward_fn == "megarl.rewards:math_reward"
    assert a.rollout.workflow_args == {"max_turns": 2} and b.rollout.workflow_args == {}
    assert a.reward.args == cfg.reward.args and b.reward.args == {"k": 1}
    assert (a.data.prompt_key, a.data.answer_key, a.data.max_prompt_length, a.data.truncation) == \
        ("prompt", "answer", 20, "filter")
    assert (b.data.prompt_key, b.data.answer_key, b.data.max_prompt_length, b.data.truncation) == ("q", "", 0, "left")
    assert cfg.rollout.workflow_args == {"max_turns": 2} and cfg.data.sources[1].name == "b"  # untouched


def test_a_prompt_runs_its_own_sources_workflow_and_reward():
    cfg = load_config(RECIPE, sources(f"{{name: exact, path: {PROMPTS}, weight: 3}}",
                                      f"{{name: last, path: {EVAL}, reward_fn: 'megarl.rewards:math_reward'}}"))
    workflow, dataset = training_task(TaskSpec.from_config(cfg), 8)
    assert isinstance(workflow, SourceWorkflows) and isinstance(dataset, SourceMixture)
    assert [w.ctx.reward.fn.__name__ for w in workflow.workflows.values()] == ["arith_exact_match", "math_reward"]
    assert len(workflow.rewards) == 2
    draws = collections.Counter(dataset.source_of(i) for i in dataset.make_sampler(cfg.train.seed).next_batch(400))
    assert draws == {"exact": 300, "last": 100}

    seen = []

    class Recorder:  # stands in for a workflow: records which one ran (the dispatch is under test)
        def __init__(self, name):
            self.name = name

        async def arun_episode(self, client, sample):
            seen.append((self.name, sample.index))
            return []

    wfs = SourceWorkflows({"exact": Recorder("exact"), "last": Recorder("last")})
    for i in (0, 4999, 5000, 5499):
        asyncio.run(wfs.arun_episode(None, dataset[i]))
    assert seen == [("exact", 0), ("exact", 4999), ("last", 5000), ("last", 5499)]
    with pytest.raises(ValueError, match="names the source 'gone', which is not one of data.sources"):
        asyncio.run(wfs.arun_episode(None, SimpleNamespace(index=3, source="gone")))


def test_per_source_step_metrics_against_a_hand_count():
    infos = [{"source": s} for s in ("a", "a", "b", "a", "b", "b", "b", "b")]
    rewards = np.array([1.0, 0.0, 0.5, 1.0, 0.0, 0.5, 0.5, 0.5])
    response = np.array([3, 5, 2, 4, 6, 2, 2, 2])
    got = source_metrics(SimpleNamespace(infos=infos, arrays={"rewards": rewards}), response)
    assert got == {
        "source/a/trained_share": 3 / 8, "source/a/reward": 2 / 3, "source/a/response_len": 4.0,
        "source/a/accuracy": 2 / 3,
        "source/b/trained_share": 5 / 8, "source/b/reward": 2.0 / 5, "source/b/response_len": 14 / 5,
        "source/b/accuracy": 0.0}
    # one file (no source in the infos) or a rank without infos: nothing
    assert source_metrics(SimpleNamespace(infos=[{}] * 8, arrays={"rewards": rewards}), response) == {}
    assert source_metrics(SimpleNamespace(infos=[], arrays={"rewards": rewards}), response) == {}


def test_eval_set_refusals_and_each_sets_task():
    with pytest.raises(ConfigError, match="data.eval_sets: set either data.eval_path"):
        load_config(RECIPE, [f"data.eval_path={EVAL}", f"data.eval_sets=[{{name: a, path: {EVAL}}}]"])
    with pytest.raises(ConfigError, match=r"data.eval_sets\[1\].name: 'a' names two eval sets"):
        load_config(RECIPE, ["data.eval_path=", f"data.eval_sets=[{{name: a, path: {EVAL}}}, {{name: a, path: {EVAL}}}]"])
    with pytest.raises(ConfigError, match=r"data.eval_sets\[0\].size: must be >= 1, got 0"):
        load_config(RECIPE, ["data.eval_path=", f"data.eval_sets=[{{name: a, path: {EVAL}, size: 0}}]"])
    cfg = load_config(RECIPE, ["data.eval_path=", "rollout.eval_k=2", "rollout.eval_reward_fn=megarl.rewards:math_reward",
                               f"data.eval_sets=[{{name: a, path: {EVAL}}}, {{name: b, path: {PROMPTS}, size: 7, "
                               "interval: 3, k: 0, reward_fn: 'megarl.rewards:arith_exact_match', prompt_key: q}]"])
    from megarl.rollout.sources import eval_set_tasks

    a, b = eval_set_tasks(TaskSpec.from_config(cfg)).values()
    r = cfg.rollout
    assert (a.data.eval_path, a.rollout.eval_size, a.rollout.eval_interval, a.rollout.eval_k) == \
        (EVAL, r.eval_size, r.eval_interval, 2)
    assert a.rollout.eval_reward_fn == "megarl.rewards:math_reward" and a.data.prompt_key == "prompt"
    assert (b.data.eval_path, b.rollout.eval_size, b.rollout.eval_interval, b.rollout.eval_k) == (PROMPTS, 7, 3, 0)
    assert b.rollout.eval_reward_fn == "megarl.rewards:arith_exact_match" and b.data.prompt_key == "q"


def test_each_eval_set_runs_at_its_own_steps_and_reports_under_its_name():
    from megarl.common.plotting import eval_set_names
    from megarl.rollout.evaluation import EvalSuite

    class Recorder:  # stands in for a PeriodicEval (the suite's scheduling and naming are under test)
        def __init__(self, acc):
            self.acc, self.submitted, self.name, self.waited = acc, [], "", []

        def submit(self, controller, step, version):
            self.submitted.append(step)

        @property
        def running(self):
            return len(self.submitted)

        def poll(self, wait=False, timeout_s=600.0, diagnose=None):
            self.waited.append((wait, timeout_s))
            if not self.submitted:
                return {}
            step = self.submitted.pop()
            return {"eval_accuracy": self.acc, "eval/greedy_pass@1": self.acc, "eval/mean_reward": self.acc / 2,
                    "eval/step": step, "eval/version": step + 1, "eval/pass@4": 0.9}

    first, second = Recorder(0.25), Recorder(0.5)
    suite = EvalSuite([("math", first, 3), ("code", second, 0)], last_step=10)
    assert (first.name, second.name) == ("math", "code")
    suite.submit(None, 0, 1)  # step 0 (rollout.eval_at_start): every set
    assert (first.submitted, second.submitted, suite.running) == ([0], [0], 2)
    suite.poll(wait=True, timeout_s=5.0)
    for step in range(1, 7):
        suite.submit(None, step, step + 1)
    assert (first.submitted, second.submitted) == ([3, 6], [])  # interval 3; interval 0: never in between
    got = suite.poll(wait=True, timeout_s=5.0)  # the newest of the first set's, none of the second's
    assert got == {"eval/math/accuracy": 0.25, "eval/math/mean_reward": 0.125, "eval/math/step": 6,
                   "eval/math/version": 7, "eval/math/pass@4": 0.9,
                   "eval_accuracy": 0.25, "eval/step": 6, "eval/version": 7}
    for step in range(7, 11):
        suite.submit(None, step, step + 1)
    assert first.submitted == [3, 9, 10] and second.submitted == [10]  # and every set at the last step
    last = suite.poll(wait=True, timeout_s=5.0)
    assert last["eval/code/step"] == 10 and last["eval/code/accuracy"] == 0.5 and last["eval_accuracy"] == 0.25
    assert all(w and t <= 5.0 for w, t in first.waited + second.waited)  # one deadline for every set
    assert eval_set_names([{"step": 0, **got}, {"step": 10, **last}]) == ["math", "code"]


def test_an_entry_with_its_own_reward_args_keeps_the_jobs_reward_model_servers():
    from megarl.rollout.reward_servers import task_with_reward_urls
    from megarl.rollout.sources import eval_set_tasks

    rm = "megarl.rewards.model:RewardModel"
    cfg = load_config(RECIPE, ["data.eval_path=", *sources(
        f"{{name: rm, path: {PROMPTS}, reward_fn: '{rm}', reward_args: {{batch_size: 4}}}}",
        f"{{name: fn, path: {PROMPTS}, reward_fn: 'megarl.rewards:math_reward', reward_args: {{k: 1}}}}"),
        f"data.eval_sets=[{{name: e, path: {EVAL}, reward_fn: '{rm}', reward_args: {{batch_size: 2}}}}]"])
    task = task_with_reward_urls(TaskSpec.from_config(cfg), ["http://127.0.0.1:9"], "KEY")  # what the manager does
    srcs = source_tasks(task)
    assert srcs["rm"].reward.args == {"batch_size": 4, "urls": ["http://127.0.0.1:9"], "api_key": "KEY"}
    assert srcs["fn"].reward.args == {"k": 1}  # not the reward model's: its own arguments only
    assert eval_set_tasks(task)["e"].reward.args == {"batch_size": 2, "urls": ["http://127.0.0.1:9"], "api_key": "KEY"}
