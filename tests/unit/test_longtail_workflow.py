"""LongTailWorkflow (megarl/rollout/workflows/long_tail.py): per-sample Pareto generation budgets for the
async benchmark - bounded by [min_new_tokens, max_new_tokens], long-tailed, reproducible, and each
request of a group really carries its own budget."""
import asyncio
import statistics

import pytest

from megarl.data.datasets import PromptSample
from megarl.rewards import RewardCaller
from megarl.protocol.types import ModelResponse, SamplingParams
from megarl.rollout.workflows import LongTailWorkflow, WorkflowContext


class CharTok:
    eos_id = 2

    def decode(self, ids):
        return "".join(str(i) for i in ids)


def make(**kw) -> LongTailWorkflow:
    ctx = WorkflowContext(CharTok(), RewardCaller(lambda p, c, m: 1.0),
                          SamplingParams(max_new_tokens=56, ignore_eos=True), 8)
    return LongTailWorkflow(ctx, **kw)


def test_budgets_are_bounded_long_tailed_and_reproducible():
    w = make(min_new_tokens=4, alpha=1.0)
    b = [x for i in range(1000) for x in w.budgets(i, 0, 56)]
    assert min(b) >= 4 and max(b) == 56
    assert 7 <= statistics.median(b) <= 9  # P(L > x) = 4 / x: median 8
    assert 0.04 < sum(x == 56 for x in b) / len(b) < 0.11  # P(L >= 56) = 4/56 = 0.071
    assert make(min_new_tokens=4).budgets(3, 1, 56) == w.budgets(3, 1, 56) != w.budgets(3, 2, 56)


def test_each_request_of_a_group_gets_its_own_budget():
    w = make(min_new_tokens=4, alpha=1.0, seed=7)
    seen = []

    class Client:
        async def agenerate(self, req):
            seen.append(req.sampling.max_new_tokens)
            out = [5] * req.sampling.max_new_tokens
            return ModelResponse(input_tokens=list(req.input_ids), output_tokens=out,
                                 output_logprobs=[-0.1] * len(out), output_versions=[0] * len(out))

    sample = PromptSample(3, "1+2=", {"answer": "3"}, [1, 4, 5])
    trajs = asyncio.run(w.arun_episode(Client(), sample))
    assert seen == w.budgets(3, 0, 56) and len(trajs) == 8
    assert [sum(t.loss_mask) for t in trajs] == seen
    asyncio.run(w.arun_episode(Client(), sample))  # the prompt's second draw: new lengths
    assert seen[8:] == w.budgets(3, 1, 56)


def test_bad_options_fail():
    with pytest.raises(ValueError, match="min_new_tokens"):
        make(min_new_tokens=0)
