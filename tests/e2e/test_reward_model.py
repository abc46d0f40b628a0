"""Reward models end to end: megarl-server on a tiny random HF sequence classifier (written by
transformers) answers SGLang's /classify with transformers' fp32 logits (<= 1e-5), refuses what
its model kind cannot do, and `megarl.rewards.model:RewardModel` scores (prompt, completion)
pairs through it - or fails with a clear error once its retries are spent."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from e2e_servers import API_KEY, free_port, http, make_model_with_tokenizer

TOL = 1e-5


def _make_rm(path: str, arch: str, num_labels: int, pad: int):
    """A random tiny HF classifier saved by transformers, with the e2e char tokenizer (ids < 64)."""
    import transformers

    from megarl.common.tokenizer import train_sentencepiece
    from e2e_servers import CORPUS

    torch.manual_seed(0)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification)}[arch]
    cfg = cls[0](vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 num_labels=num_labels, pad_token_id=pad, bos_token_id=1, eos_token_id=2)
    model = cls[1](cfg).float().eval()
    with torch.no_grad():  # the init leaves score near zero: make its logits O(1)
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    tok = train_sentencepiece(CORPUS, path, vocab_size=64, model_type="char")
    return model, tok


def _hf_scores(model, seqs):
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].tolist() for s in seqs]


@pytest.fixture(scope="module", params=[("llama", 1, 0), ("qwen2", 2, 3)], ids=["llama-1", "qwen2-2"])
def rm(request, tmp_path_factory, start_server):
    arch, labels, pad = request.param
    path = str(tmp_path_factory.mktemp(f"rm-{arch}"))
    model, tok = _make_rm(path, arch, labels, pad)
    server = start_server(path, api_key=API_KEY)
    return server, model, tok, pad


SEQS = [[1, 5, 9, 33, 12], [1, 7], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [4, 6, 8, 0, 3, 3]]


def test_classify_matches_transformers(rm):
    server, model, tok, pad = rm
    seqs = SEQS + [[1, 9, 9, pad, pad]]  # trailing pads: transformers reads the last non-pad token
    code, out = http("POST", server.url + "/classify", {"input_ids": seqs}, key=API_KEY)
    assert code == 200, out
    assert isinstance(out, list) and len(out) == len(seqs)
    want = _hf_scores(model, seqs)
    err = max(abs(a - b) for o, w in zip(out, want) for a, b in zip(o["embedding"], w))
    assert err <= TOL, (err, out, want)
    assert len(out[0]["embedding"]) == model.config.num_labels
    assert out[0]["meta_info"]["prompt_tokens"] == len(seqs[0]) and out[0]["meta_info"]["weight_version"] == "0"
    # one input: one dict (SGLang's shape); text is tokenized as /generate does (BOS first)
    code, one = http("POST", server.url + "/classify", {"text": "12+34=46", "rid": "r1"}, key=API_KEY)
    assert code == 200 and isinstance(one, dict) and one["meta_info"]["id"] == "r1", one
    want = _hf_scores(model, [tok.encode("12+34=46", add_bos=True)])[0]
    assert max(abs(a - b) for a, b in zip(one["embedding"], want)) <= TOL
    code, info = http("GET", server.url + "/model_info", key=API_KEY)
    assert info["is_generation"] is False and info["architecture"].endswith("ForSequenceClassification")


def test_bad_requests_and_model_kind(rm, tmp_path_factory, start_server):
    server, *_ = rm
    url = server.url
    cases = [({"input_ids": "abc"}, "input_ids"), ({"input_ids": [[1, 999]]}, "input_ids[0]"),
             ({"text": "a", "input_ids": [1]}, "exactly one of input_ids or text"),
             ({"text": [1]}, "text"), ({"input_ids": [1], "temperature": 1}, "temperature"),
             ({"input_ids": [1], "rid": 5}, "rid")]
    for body, field in cases:
        code, out = http("POST", url + "/classify", body, key=API_KEY)
        assert code == 400 and field in out["message"] and "\n" not in out["message"], (body, out)
    assert http("POST", url + "/classify", {"input_ids": [1]})[0] == 401  # API key like every endpoint
    code, out = http("POST", url + "/generate", {"input_ids": [1, 2]}, key=API_KEY)
    assert code == 400 and "reward model" in out["message"], out
    assert http("GET", url + "/health_generate")[0] == 401  # keyed: it runs the model
    assert http("GET", url + "/health_generate", key=API_KEY)[0] == 200


def test_causal_lm_refuses_classify(tmp_path_factory, start_server):
    path = str(tmp_path_factory.mktemp("lm"))
    make_model_with_tokenizer(path)
    lm = start_server(path)
    code, out = http("POST", lm.url + "/classify", {"input_ids": [1, 2]})
    assert code == 400 and "causal LM" in out["message"], out


def test_reward_model_client(rm):
    from megarl.rewards.base import load_reward_fn

    server, model, tok, _ = rm
    pairs = [("12+34=", "46"), ("hello ", "world"), ("the quick ", "brown fox"), ("pack my ", "box")]
    want = [_hf_scores(model, [tok.encode(p + c, add_bos=True)])[0][0] for p, c in pairs]
    for extra in ({}, {"tokenizer": server_model_dir(server)}):  # text, then client-side token ids
        fn = load_reward_fn("megarl.rewards.model:RewardModel",
                            {"urls": [server.url], "api_key": API_KEY, "max_batch": 4, **extra})

        async def run():
            try:
                return await asyncio.gather(*(fn(p, c, {}) for p, c in pairs))
            finally:
                await fn.aclose()

        got = asyncio.run(run())
        assert max(abs(a - b) for a, b in zip(got, want)) <= TOL, (got, want)
        assert fn.batches_sent == 1  # the four calls went out as one POST


def test_reward_model_server_down():
    from megarl.rewards.model import RewardModel, RewardModelError

    dead = f"http://127.0.0.1:{free_port()}"
    fn = RewardModel(urls=[dead], retries=2, retry_backoff_s=0.01, timeout_s=2)

    async def run():
        try:
            return await fn("p", "c", {})
        finally:
            await fn.aclose()

    t0 = time.monotonic()
    with pytest.raises(RewardModelError, match=r"failed after 3 attempt\(s\).*" + dead):
        asyncio.run(run())
    assert time.monotonic() - t0 < 10


def server_model_dir(server) -> str:
    code, info = http("GET", server.url + "/model_info", key=API_KEY)
    return info["model_path"]
