"""GenerationEngine (no HTTP): continuous batching gives the same tokens as running alone; pause
modes, aborts and a failing step behave as documented."""

from __future__ import annotations

import threading

import pytest
import torch
from test_server_reference import make_tiny_model, reference_logprobs

from megarl.server import build_state
from megarl.server.engine import Sequence
from megarl.server.sampling import SamplingConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("eng"))
    return path, make_tiny_model(path, max_pos=96)


@pytest.fixture
def engine(model_dir):
    eng = build_state(model_dir[0], max_running_requests=3, max_prefill_tokens=24).engine
    yield eng
    eng.shutdown()


class Waiter:
    def __init__(self):
        self.done: list[Sequence] = []
        self.cv = threading.Condition()

    def __call__(self, seq):
        with self.cv:
            self.done.append(seq)
            self.cv.notify_all()

    def wait(self, n, timeout=30):
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.done) >= n, timeout), f"{len(self.done)}/{n} done"
        return self.done


def _seq(rid, prompt, w, **kw):
    return Sequence(rid, prompt, SamplingConfig(**{"temperature": 0.0, "ignore_eos": True, **kw}), w)


def test_continuous_batching_equals_running_alone(engine, model_dir):
    path, sd = model_dir
    g = torch.Generator().manual_seed(0)
    jobs = [(torch.randint(3, 128, (int(n),), generator=g).tolist(), int(m))
            for n, m in zip(torch.randint(1, 12, (8,), generator=g), torch.randint(1, 20, (8,), generator=g))]
    w = Waiter()
    for i, (prompt, m) in enumerate(jobs):  # 8 requests, 3 slots: queueing, joins and leaves
        engine.submit(_seq(f"r{i}", prompt, w, max_new_tokens=m))
    done = {s.rid: s for s in w.wait(len(jobs))}
    for i, (prompt, m) in enumerate(jobs):
        s = done[f"r{i}"]
        assert len(s.out_ids) == m and s.finish == {"type": "length", "length": m}
        solo = Waiter()
        engine.submit(_seq("solo", prompt, solo, max_new_tokens=m))
        assert solo.wait(1)[0].out_ids == s.out_ids
        want = reference_logprobs(path, sd, prompt + s.out_ids)[len(prompt):]
        assert max(abs(a - b) for a, b in zip(s.out_logprobs, want)) <= 1e-5


def test_context_length_and_stop_ids(engine):
    w = Waiter()
    engine.submit(_seq("ctx", list(range(3, 90)), w, max_new_tokens=50))
    s = w.wait(1)[0]
    assert len(s.prompt) + len(s.out_ids) == 96 and s.finish["type"] == "length"
    w2 = Waiter()
    engine.submit(_seq("ids", [5, 6], w2, max_new_tokens=30))
    ids = w2.wait(1)[0].out_ids
    w3 = Waiter()
    engine.submit(_seq("stop", [5, 6], w3, max_new_tokens=30, stop_token_ids=(ids[3],)))
    s = w3.wait(1)[0]
    assert s.out_ids == ids[: ids.index(ids[3]) + 1] and s.finish == {"type": "stop", "matched": ids[3]}


def test_pause_modes_and_abort(engine):
    engine.call(lambda: engine.pause("in_place")).result(5)
    w = Waiter()
    for i in range(4):
        engine.submit(_seq(f"p{i}", [1, 2, 3], w, max_new_tokens=40))
    assert engine.call(lambda: len(engine.waiting)).result(5) == 4  # held while paused
    engine.call(engine.resume).result(5)
    engine.call(lambda: engine.pause("retract")).result(5)
    state = engine.call(lambda: (len(engine.running), [len(s.out_ids) for s in engine.waiting])).result(5)
    assert state[0] == 0 and len(state[1]) == 4
    assert engine.call(lambda: engine.abort("p3")).result(5) == 1
    engine.call(engine.resume).result(5)
    engine.call(lambda: engine.pause("abort")).result(5)
    done = w.wait(4)
    assert all(s.finish["type"] == "abort" for s in done)
    engine.call(engine.resume).result(5)


def test_a_failing_step_aborts_the_batch_and_the_engine_lives_on(engine):
    real = engine.model.decode
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(*a, **k)

    engine.model.decode = flaky
    w = Waiter()
    engine.submit(_seq("x", [1, 2], w, max_new_tokens=10))
    s = w.wait(1)[0]
    assert s.finish["type"] == "abort" and "boom" in s.finish["message"]
    w2 = Waiter()
    engine.submit(_seq("y", [1, 2], w2, max_new_tokens=10))
    assert len(w2.wait(1)[0].out_ids) == 10


def test_prompt_logprobs_score_the_prompt_against_the_reference_forward(engine, model_dir):
    """logprob_start_len (SGLang's input_token_logprobs): every prompt token from the start index
    scored by the model (what a teacher does with a student's sample), with max_new_tokens 0 only
    the scoring, batched beside ordinary requests; the first prompt token has no logprob (None)."""
    path, sd = model_dir
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (9, 5, 14, 1)]
    w = Waiter()
    engine.submit(_seq("gen", prompts[0], w, max_new_tokens=6))  # an ordinary request alongside
    for i, (prompt, start) in enumerate(zip(prompts, (0, 2, 13, 0))):
        s = _seq(f"s{i}", prompt, w, max_new_tokens=0)
        s.input_logprob_start = start
        engine.submit(s)
    tail = _seq("both", prompts[2], w, max_new_tokens=4)
    tail.input_logprob_start = 5
    engine.submit(tail)
    done = {s.rid: s for s in w.wait(6)}
    for i, (prompt, start) in enumerate(zip(prompts, (0, 2, 13, 0))):
        s = done[f"s{i}"]
        ref = reference_logprobs(path, sd, prompt)
        assert s.out_ids == [] and s.finish == {"type": "length", "length": 0}
        assert len(s.in_logprobs) == len(prompt) - start and (start > 0 or s.in_logprobs[0] is None)
        got = [x for x in s.in_logprobs if x is not None]
        want = ref[max(start, 1):]
        assert len(got) == len(want) and all(abs(a - b) < 1e-5 for a, b in zip(got, want)), (got, want)
    both = done["both"]
    assert len(both.out_ids) == 4 and len(both.in_logprobs) == len(prompts[2]) - 5
    assert all(abs(a - b) < 1e-5 for a, b in zip(both.in_logprobs, reference_logprobs(path, sd, prompts[2])[5:]))
    # the generated tokens' own logprobs are those of the sequence the model saw
    ref = reference_logprobs(path, sd, prompts[2] + both.out_ids)
    assert all(abs(a - b) < 1e-5 for a, b in zip(both.out_logprobs, ref[len(prompts[2]):]))
    assert done["gen"].in_logprobs is None and len(done["gen"].out_ids) == 6


def test_prompt_logprob_requests_are_parsed_as_sglang_does():
    from megarl.server.requests import BadRequest, build_response, parse_generate

    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 1}
    (one,), logprob, _ = parse_generate(body, 128, None, 64)
    assert logprob and one.logprob_start == 1 and one.params.max_new_tokens == 0
    assert parse_generate({**body, "logprob_start_len": 9}, 128, None, 64)[0][0].logprob_start == 4  # capped
    assert parse_generate({**body, "logprob_start_len": -1}, 128, None, 64)[0][0].logprob_start is None
    for bad, message in (({"logprob_start_len": -2}, "logprob_start_len must be -1 or an int >= 0"),
                         ({"logprob_start_len": 1.5}, "logprob_start_len must be -1 or an int >= 0"),
                         ({"return_logprob": False}, "logprob_start_len: prompt logprobs need return_logprob")):
        with pytest.raises(BadRequest, match=message):
            parse_generate({**body, **bad}, 128, None, 64)
    seq = Sequence("r", [5, 6, 7, 8], SamplingConfig(max_new_tokens=0), lambda s: None, input_logprob_start=1)
    seq.in_logprobs, seq.finish = [-1.5, -0.25, -3.0], {"type": "length", "length": 0}
    meta = build_response(seq, True, None, "3", 0.0)["meta_info"]
    assert meta["input_token_logprobs"] == [[-1.5, 6, None], [-0.25, 7, None], [-3.0, 8, None]]
    assert meta["output_token_logprobs"] == [] and meta["completion_tokens"] == 0


def test_set_threads_takes_effect_between_steps_with_the_same_tokens(engine):
    """/set_threads' engine side: the count changes on the engine thread before its next step,
    and generation gives the same greedy tokens at either."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        outs = {}
        for n in (1, 2):
            engine.set_threads(n)
            w = Waiter()
            engine.submit(_seq(f"t{n}", [1, 4, 9, 16], w, max_new_tokens=12))
            outs[n] = w.wait(1)[0].out_ids
            assert engine.applied_threads == n and engine.call(torch.get_num_threads).result(5) == n
        assert outs[1] == outs[2] and len(outs[1]) == 12
        engine.set_threads(0)  # at least one
        engine.call(lambda: None).result(5)
        assert engine.applied_threads == 1
    finally:
        torch.set_num_threads(before)
