"""megarl-server /generate over HTTP: logprobs, n, stop conditions, abort, auth and bad input."""

from __future__ import annotations

import threading
import time

import pytest
from e2e_servers import API_KEY as KEY
from e2e_servers import http
from test_server_reference import reference_logprobs


@pytest.fixture
def srv(cluster):
    return cluster[0]


def gen(srv, body, key=KEY, status=200):
    code, out = http("POST", srv.url + "/generate", body, key=key)
    assert code == status, out
    return out


def test_logprobs_match_independent_forward(srv, tiny_model):
    path, sd = tiny_model
    prompts = [[1, 5, 9, 14], [1, 30, 31, 32, 33, 34, 35, 36, 37], [1, 7]]
    cases = [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 3},
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "seed": 4},
    ]
    for sp in cases:
        outs = gen(srv, {"input_ids": prompts, "return_logprob": True,
                         "sampling_params": {**sp, "max_new_tokens": 24, "ignore_eos": True}})
        assert len(outs) == len(prompts)
        for prompt, out in zip(prompts, outs):
            ids = out["output_ids"]
            meta = out["meta_info"]
            assert len(ids) == 24 and meta["finish_reason"] == {"type": "length", "length": 24}
            assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 24
            assert meta["weight_version"] == "0" and meta["weight_versions"] == ["0"] * 24
            got = [e[0] for e in meta["output_token_logprobs"]]
            assert [e[1] for e in meta["output_token_logprobs"]] == ids
            # the server reports log_softmax(logits / temperature) (SGLang's default), greedy at 1
            want = reference_logprobs(path, sd, prompt + ids, sp["temperature"] or 1.0)[len(prompt):]
            assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, sp


def test_a_sample_scored_by_prompt_logprobs_gets_its_own_logprobs(srv):
    """What a teacher does with a student's sample (SGLang's request shape): prompt + completion
    sent back with max_new_tokens 0 and logprob_start_len = the prompt's length scores the
    completion; with the same weights, the logprobs it was sampled with."""
    prompts = [[1, 5, 9, 14], [1, 30, 31, 32, 33, 34, 35, 36, 37]]
    outs = gen(srv, {"input_ids": prompts, "return_logprob": True,
                     "sampling_params": {"temperature": 1.0, "seed": 5, "max_new_tokens": 12, "ignore_eos": True}})
    scored = gen(srv, {"input_ids": [p + o["output_ids"] for p, o in zip(prompts, outs)], "return_logprob": True,
                       "logprob_start_len": len(prompts[0]),  # one start for the batch, as in SGLang
                       "sampling_params": {"max_new_tokens": 0}})
    for prompt, out, score in zip(prompts, outs, scored):
        meta = score["meta_info"]
        assert score["output_ids"] == [] and meta["completion_tokens"] == 0
        entries = meta["input_token_logprobs"]
        full = prompt + out["output_ids"]
        assert [e[1] for e in entries] == full[len(prompts[0]):]
        mine = [e[0] for e in entries][len(prompt) - len(prompts[0]):]  # the completion's entries
        sampled = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        assert len(mine) == 12 and max(abs(a - b) for a, b in zip(mine, sampled)) <= 1e-5


def test_n_samples_and_seed_determinism(srv):
    body = {"input_ids": [1, 5, 6], "sampling_params": {"n": 4, "seed": 11, "max_new_tokens": 16,
                                                        "ignore_eos": True}}
    a, b = gen(srv, body), gen(srv, body)
    assert isinstance(a, list) and len(a) == 4
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]  # reproducible
    assert len({tuple(o["output_ids"]) for o in a}) > 1  # distinct samples
    assert "output_token_logprobs" not in a[0]["meta_info"]


def test_stop_token_ids_and_stop_strings(srv):
    base = {"input_ids": [1, 10, 11, 12], "sampling_params": {"temperature": 0, "max_new_tokens": 40,
                                                             "ignore_eos": True}}
    full = gen(srv, base)
    ids, text = full["output_ids"], full["text"]
    assert isinstance(text, str)
    stop_tok = ids[5]
    first = ids.index(stop_tok)
    out = gen(srv, {**base, "sampling_params": {**base["sampling_params"], "stop_token_ids": [stop_tok]}})
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    stop_str = text[len(text) // 2: len(text) // 2 + 2]
    out = gen(srv, {**base, "sampling_params": {**base["sampling_params"], "stop": [stop_str]}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert out["text"] == text[: text.index(stop_str)]
    assert ids[: len(out["output_ids"])] == out["output_ids"]


def test_text_prompt_and_eos(srv):
    out = gen(srv, {"text": "hello", "sampling_params": {"max_new_tokens": 64, "temperature": 1.0, "seed": 1}})
    assert isinstance(out["text"], str)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] in ("stop", "length")
    if reason["type"] == "stop":
        assert reason["matched"] == 2 and out["output_ids"][-1] == 2


def test_abort_request_returns_partial_output(srv):
    body = {"input_ids": [1, 3, 4], "rid": "long-one", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 450, "ignore_eos": True}}
    box = {}
    t = threading.Thread(target=lambda: box.update(out=gen(srv, body)))
    t.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        _, info = http("GET", srv.url + "/get_server_info", key=KEY)
        if info["num_running"] and info.get("tokens", 0) > 20:
            break
        time.sleep(0.01)
    code, res = http("POST", srv.url + "/abort_request", {"rid": "long-one"}, key=KEY)
    assert code == 200 and res["num_aborted"] == 1
    t.join(timeout=30)
    out = box["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 450
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def test_api_key_required(srv):
    code, _ = http("POST", srv.url + "/generate", {"input_ids": [1, 2]}, key=None)
    assert code == 401
    code, _ = http("POST", srv.url + "/pause_generation", {"mode": "abort"}, key="wrong")
    assert code == 401
    assert http("GET", srv.url + "/model_info")[0] == 401
    assert http("GET", srv.url + "/health")[0] == 200  # open, like SGLang
    code, info = http("GET", srv.url + "/model_info", key=KEY)
    assert code == 200 and info["weight_version"] == "0" and info["model_path"]


@pytest.mark.parametrize("body,field", [
    (b"{not json", "JSON"),
    ({"sampling_params": {}}, "input_ids"),
    ({"input_ids": [1, "x"]}, "input_ids"),
    ({"input_ids": [1, 100000]}, "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, "bogus"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": [3]}}, "stop"),
    ({"input_ids": [1, 2], "stream": True}, "stream"),
    ({"input_ids": [1] * 600}, "context length"),
    ([1, 2, 3], "object"),
])
def test_malformed_requests_are_400_and_server_survives(srv, body, field):
    code, out = http("POST", srv.url + "/generate", body, key=KEY)
    assert code == 400 and field in out["message"], out
    assert http("GET", srv.url + "/health_generate", key=KEY)[0] == 200  # keyed: it runs the model


def test_admin_endpoint_validation(srv):
    assert http("POST", srv.url + "/pause_generation", {"mode": "nap"}, key=KEY)[0] == 400
    assert http("POST", srv.url + "/abort_request", {}, key=KEY)[0] == 400
    code, out = http("POST", srv.url + "/update_weights_from_tensor",
                     {"serialized_named_tensors": ["!!notbase64"]}, key=KEY)
    assert code == 400 and "serialized_named_tensors[0]" in out["message"]
    code, out = http("POST", srv.url + "/get_weights_by_name", {"name": "nope"}, key=KEY)
    assert code == 400 and "nope" in out["message"]
    assert http("POST", srv.url + "/flush_cache", key=KEY)[0] == 200
    assert gen(srv, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})["output_ids"]


def test_set_threads_changes_generation_threads_and_refuses_bad_counts(srv):
    """megarl's /set_threads extension (advertised in /model_info): generation's torch threads
    from the next engine step on, shown in /get_server_info; a bad count is a 400 naming the field."""
    assert "set_threads" in http("GET", srv.url + "/model_info", key=KEY)[1]["megarl_extensions"]
    assert http("POST", srv.url + "/set_threads", {"threads": 2}, key=None)[0] == 401
    for bad in ({}, {"threads": 0}, {"threads": "2"}, {"threads": True}, {"threads": 2000}):
        code, out = http("POST", srv.url + "/set_threads", bad, key=KEY)
        assert code == 400 and "threads" in out["message"], (bad, out)
    try:
        for n in (2, 1):
            code, out = http("POST", srv.url + "/set_threads", {"threads": n}, key=KEY)
            assert code == 200 and out["success"] and out["threads"] == n
            gen(srv, {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}})
            assert http("GET", srv.url + "/get_server_info", key=KEY)[1]["threads"] == n
    finally:
        http("POST", srv.url + "/set_threads", {"threads": 1}, key=KEY)
