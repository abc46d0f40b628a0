"""Greedy held-out evaluation (megarl.rollout.evaluation) through the async client against a
stand-in /generate server: exact-answer accuracy of the addition task, completions cut at EOS."""
import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.data.datasets import PromptDataset
from megarl.data.tasks import AdditionTask, write_addition_corpus
from megarl.common.tokenizer import train_sentencepiece
from megarl.rollout.client import RolloutClient
from megarl.rollout.evaluation import evaluate_samples
from megarl.rewards import arith_exact_match
from megarl.protocol.types import SamplingParams


class _FakeGenerate(BaseHTTPRequestHandler):
    """Answers "a+b=" correctly when a is even, with "0" otherwise; EOS then junk after it."""

    tok = None
    requests: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(req)
        a, b = map(int, self.tok.decode(req["input_ids"]).rstrip("=").split("+"))
        text = str(a + b) if a % 2 == 0 else "0"
        out_ids = self.tok.encode(text) + [self.tok.eos_id, 4, 4]
        body = json.dumps({"output_ids": out_ids, "text": text, "meta_info": {
            "finish_reason": {"type": "stop"}, "weight_version": "0",
            "output_token_logprobs": [[0.0, t, None] for t in out_ids]}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_greedy_accuracy_through_generate(tmp_path):
    tok = _FakeGenerate.tok = train_sentencepiece(["1+1=2"], str(tmp_path / "model"),
                                                  required_chars="0123456789+=")
    paths = write_addition_corpus(str(tmp_path / "data"), digits=2, n_sft=0, n_rl=0, n_eval=40, seed=0)
    held = AdditionTask(2, 0).held_out(40)
    samples = PromptDataset(paths["eval_prompts"], tok).samples[:30]
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=[tok.eos_id])
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeGenerate)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def run():
        async with RolloutClient([f"http://127.0.0.1:{server.server_address[1]}"]) as client:
            return await evaluate_samples(client, samples, arith_exact_match, sampling, tok)

    try:
        result = asyncio.run(run())
    finally:
        server.shutdown()
    assert sum(a % 2 == 0 for a, _ in held[:30]) == 15
    assert (result.n, result.accuracy, result.mean_reward) == (30, pytest.approx(0.5), pytest.approx(0.5))
    assert len(_FakeGenerate.requests) == 30  # one greedy request per sample
    assert all(r["sampling_params"]["temperature"] == 0.0 and r["sampling_params"]["max_new_tokens"] == 8
               and r["sampling_params"]["stop_token_ids"] == [2] for r in _FakeGenerate.requests)
    assert [1, 11, 9, 13, 11, 10, 14] in [r["input_ids"] for r in _FakeGenerate.requests]  # bos "86+87="


def test_empty_sample_list_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        asyncio.run(evaluate_samples(None, [], arith_exact_match, SamplingParams(), None))


def test_pass_at_k_is_the_unbiased_estimator():
    from megarl.rollout.evaluation import pass_at_k

    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2) / C(5,2)
    assert pass_at_k(10, 1, 1) == pytest.approx(0.1) and pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # 1 wrong cannot fill k=2
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)  # C(6,4) / C(8,4)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


class _CharTok:
    eos_id = 2

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 128 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i - 3) for i in ids if i >= 3)


@pytest.mark.parametrize("answer, correct", [("7", True), ("5", False)])
def test_eval_runs_the_workflows_turns_greedily_and_atomically(answer, correct):
    """MultiTurnWorkflow (answer feedback, 2 turns) as the eval workflow: a right first answer is
    one turn, a wrong one gets the feedback turn; greedy requests at temperature 0, the k sampled
    ones at the rollout temperature, all of them atomic (a push waits for them)."""
    from scripted_client import ScriptedClient

    from megarl.data.datasets import PromptSample
    from megarl.rollout.evaluation import EvalWorkflows, evaluate
    from megarl.rollout.workflows import MultiTurnWorkflow, WorkflowContext

    from megarl.rewards import RewardCaller

    tok = _CharTok()
    caller = RewardCaller(lambda p, c, m: 1.0 if c == "7" else 0.0)
    sampling = SamplingParams(max_new_tokens=4, temperature=0.7, stop_token_ids=[tok.eos_id])

    def wf(params, group):
        return MultiTurnWorkflow(WorkflowContext(tok, caller, params, group, None, 64), max_turns=2)

    wfs = EvalWorkflows(wf(SamplingParams(**{**sampling.__dict__, "temperature": 0.0}), 1), wf(sampling, 3), tok, k=3)
    samples = [PromptSample(i, f"q{i}", {}, tok.encode(f"q{i}")) for i in range(2)]
    client = ScriptedClient(tok, [answer])
    res = asyncio.run(evaluate(client, samples, wfs))
    turns = 1 if correct else 2
    assert len(client.calls) == 2 * (1 + 3) * turns  # per prompt: 1 greedy + k sampled episodes
    assert all(req.metadata.get("atomic") for req, _ in client.calls)
    assert sorted(req.sampling.temperature for req, _ in client.calls) == [0.0] * 2 * turns + [0.7] * 6 * turns
    want = 1.0 if correct else 0.0
    assert (res.n, res.accuracy, res.pass_at_k, res.pass_at_1, res.mean_turns) == (2, want, want, want, turns)
    assert len(res.rows) == 2 * 4 and {r["kind"] for r in res.rows} == {"greedy", "sampled"}
    assert all(r["final"] == answer and r["turns"] == turns for r in res.rows)


def test_an_episode_that_fails_counts_as_wrong_and_does_not_stop_the_evaluation():
    """An episode that raised past its re-runs (an environment server down during the evaluation)
    is a wrong answer, counted in `failed`; the other prompts are scored as usual."""
    from megarl.data.datasets import PromptSample
    from megarl.protocol.types import Trajectory
    from megarl.rollout.evaluation import EvalWorkflows, PeriodicEval, evaluate

    class Flaky:
        async def arun_episode(self, client, sample):
            if sample.index == 1:
                raise RuntimeError("environment http://127.0.0.1:9: /step: connection refused")
            n = len(sample.prompt_ids)
            return [Trajectory(list(sample.prompt_ids) + [5], [0] * n + [1], [0.0] * n + [-0.1], [-1] * n + [0],
                               1.0, sample.index)]

    tok = _CharTok()
    samples = [PromptSample(i, f"q{i}", {}, tok.encode(f"q{i}")) for i in range(4)]
    res = asyncio.run(evaluate(object(), samples, EvalWorkflows(Flaky(), None, tok)))
    assert (res.n, res.accuracy, res.failed) == (4, 0.75, 1)
    assert PeriodicEval.metrics(res, 10, 0)["eval/failed"] == 1
