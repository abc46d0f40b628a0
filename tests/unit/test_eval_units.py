"""megarl-eval's pieces without a server: pass@k from n > k samples per prompt against a hand
computation, the eval.* section's rules, the sampled workflow's group of n, the results file and
its summary line. The command itself, end to end: tests/e2e/test_eval_command.py."""
import asyncio
import json
import math

import pytest

from megarl.config import ConfigError, load_config
from megarl.data.datasets import PromptSample
from megarl.rollout.evaluation import EvalWorkflows, evaluate
from megarl.rollout.types import Trajectory


class Scripted:
    """A workflow whose episode for prompt i has the rewards ``rewards[i]`` (a group of len())."""

    def __init__(self, rewards):
        self.rewards = rewards

    async def arun_episode(self, client, sample):
        return [Trajectory([1, 5], [0, 1], [0.0, -0.5], [-1, 0], r, sample.index) for r in self.rewards[sample.index]]


class Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


def test_pass_at_k_from_n_samples_per_prompt_by_hand():
    """n = 5 samples, k = 2; c = 0, 2, 5 correct: pass@2 per prompt = 1 - C(n-c, 2) / C(n, 2) =
    0, 1 - 3/10, 1 (the Codex paper's 1 - prod_{i=n-c+1}^{n} (1 - k/i): (1 - 2/4)(1 - 2/5) = 0.3)."""
    samples = [PromptSample(i, f"p{i}", {}, [1]) for i in range(3)]
    greedy = Scripted([[1.0], [0.0], [1.0]])
    sampled = Scripted([[0.0] * 5, [1.0, 0.0, 1.0, 0.0, 0.0], [1.0] * 5])
    res = asyncio.run(evaluate(None, samples, EvalWorkflows(greedy, sampled, Tok(), k=2)))
    assert res.accuracy == pytest.approx(2 / 3) and res.k == 2
    assert 1 - (1 - 2 / 4) * (1 - 2 / 5) == pytest.approx(0.7) == 1 - math.comb(3, 2) / math.comb(5, 2)
    assert res.pass_at_k == pytest.approx((0.0 + 0.7 + 1.0) / 3)
    assert res.pass_at_1 == pytest.approx((0.0 + 0.4 + 1.0) / 3)  # the mean fraction correct
    assert res.mean_reward_at_k == pytest.approx(7 / 15)
    assert sum(r["kind"] == "sampled" for r in res.rows) == 15 and sum(r["kind"] == "greedy" for r in res.rows) == 3


def test_eval_section_rules():
    cfg = load_config(None, ["model.hf_path=/m", "data.train_path=/d", "train.run_dir=/r", "eval.out_dir=ev", "eval.n=8",
                             "rollout.eval_k=4"])
    assert (cfg.eval.out_dir, cfg.eval.n, cfg.eval.checkpoint) == ("/r/ev", 8, "")  # relative: in the run
    for bad, match in ((["eval.n=2", "rollout.eval_k=4"], "eval.n: 2 samples per prompt need"),
                       (["eval.n=3"], "rollout.eval_k=0"), (["eval.n=-1"], "eval.n"),
                       (["eval.k=3"], "eval.k: unknown key")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, ["model.hf_path=/m", "data.train_path=/d", *bad])


def test_the_sampled_workflow_draws_n_per_prompt(tmp_path):
    from megarl.config import DataConfig, RewardConfig, RolloutConfig
    from megarl.common.tokenizer import train_sentencepiece
    from megarl.rollout.setup import EvalSpec, TaskSpec, build_eval, task_parts

    train_sentencepiece(["1+1=2"], str(tmp_path), required_chars="0123456789+=")
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3)))
    task = TaskSpec(RolloutConfig(eval_k=2), DataConfig(eval_path=str(data)), RewardConfig(),
                    str(tmp_path), 32)
    reward = task_parts(task)[2]
    assert build_eval(EvalSpec(task, n=6), reward).workflows.sampled.group_size == 6
    assert build_eval(EvalSpec(task), reward).workflows.sampled.group_size == 2  # 0: n = k
    asyncio.run(reward.aclose())


def test_results_and_summary_line(tmp_path):
    from megarl.eval import summary_line, write_outputs

    results = {"source": "hf", "model": "/m", "eval_path": "/e.jsonl", "prompts": 3, "greedy_accuracy": 2 / 3,
               "mean_reward": 2 / 3, "k": 2, "n": 5, "pass@2": 0.5666, "pass@1": 0.4666, "wall_s": 1.5}
    write_outputs(str(tmp_path / "out"), results, [{"index": 0, "reward": 1.0}])
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == results
    assert (tmp_path / "out" / "samples.jsonl").read_text() == '{"index": 0, "reward": 1.0}\n'
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["results.json", "samples.jsonl"]  # no .tmp left
    line = summary_line(results, str(tmp_path / "out"))
    assert "\n" not in line and line.startswith("megarl-eval: hf /m on /e.jsonl (3 prompts): greedy accuracy 0.6667")
    assert "pass@1 0.4666, pass@2 0.5666 (n=5)" in line
