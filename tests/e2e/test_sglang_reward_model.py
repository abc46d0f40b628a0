"""The reward model on real SGLang: the demo's tiny reward model (examples/tiny/reward_model, a
LlamaForSequenceClassification) served by SGLang 0.5.23 started with ``--is-embedding`` (CPU,
fp32) and by megarl-server; the same `megarl.rewards.model:RewardModel` client scores the same
(prompt, completion) pairs through each, and the scores agree. The client sends token ids
(RewardModel's ``tokenizer``): the tokenizer.json made for SGLang (tools/sglang_cpu/hf_tokenizer.py)
adds no BOS to a text, megarl-server's text path does, so texts would be scored as different
sequences (measured: every SGLang text score ~-6.3, the score of the sum without BOS).

Marker ``sglang``: ``python -m pytest -m sglang`` runs the tier alone, MEGARL_SKIP_SGLANG=1 skips it.
"""
import asyncio
import os
import sys

import pytest
from sglang_runs import DEMO, REPO, _hf_tokenizer, require_sglang

pytestmark = pytest.mark.sglang

TOL = 1e-4  # |score SGLang - score megarl-server|, fp32 (two implementations of the same forward)
PAIRS = [(f"{a}+{b}=", c) for a, b, c in [(12, 34, "46"), (12, 34, "47"), (99, 99, "198"), (99, 99, "189"),
                                           (50, 50, "100"), (50, 50, "10"), (23, 45, "68"), (23, 45, "")]]


def _scores(url: str, tokenizer: str) -> list[float]:
    from megarl.rewards.model import RewardModel

    # token ids made here (BOS first): the tokenizer.json SGLang reads adds no BOS to a text, megarl-server does
    fn = RewardModel(urls=[url], tokenizer=tokenizer, max_batch=len(PAIRS), timeout_s=60, retries=0)

    async def run():
        try:
            return await asyncio.gather(*(fn(p, c, {}) for p, c in PAIRS))
        finally:
            await fn.aclose()

    out = asyncio.run(run())
    assert fn.batches_sent == 1  # one POST of every pair: SGLang's batch shape too
    return out


def test_sglang_is_embedding_scores_equal_megarl_server(tmp_path, start_server):
    py = require_sglang()
    sys.path.insert(0, os.path.join(REPO, "tools", "sglang_cpu"))
    from launch import SGLangServer  # tools/sglang_cpu/launch.py

    model = _hf_tokenizer().hf_model_copy(os.path.join(DEMO, "reward_model"), str(tmp_path / "rm"))
    server = SGLangServer(model, python=py, log_path=str(tmp_path / "sglang.log"), extra=["--is-embedding"])
    try:  # SGLang serves LlamaForSequenceClassification from its llama_reward module (MEGARL_ARCHS)
        server.start().wait_ready(timeout=400)
        got = _scores(server.url, model)
    finally:
        server.stop()
    want = _scores(start_server(model).url, model)
    err = max(abs(a - b) for a, b in zip(got, want))
    print(f"\n[sglang-rm] max |SGLang - megarl-server| = {err:.2e} over {len(PAIRS)} pairs")
    assert err <= TOL, (got, want)
    # the scores mean something: each correct sum above its wrong one
    assert all(want[i] > want[i + 1] for i in range(0, len(PAIRS), 2)), want
