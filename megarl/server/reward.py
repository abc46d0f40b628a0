"""Reward models on megarl-server: an HF sequence classifier (``LlamaForSequenceClassification``,
``Qwen2ForSequenceClassification``) served on SGLang's ``/classify`` (and ``/encode``).

SGLang 0.5.x (``--is-embedding``) takes an ``EmbeddingReqInput`` and answers as for an
embedding model; this module speaks the same shapes:

    POST /classify  {"input_ids": [int] | [[int]]} or {"text": str | [str]}, optional "rid"
    200  one input:  {"embedding": [float] * num_labels, "meta_info": {"id", "finish_reason",
                      "prompt_tokens", "weight_version"}}
         a batch:    a list of those, in input order

Scores are transformers' ``AutoModelForSequenceClassification`` logits: the decoder's final
hidden state (after the last RMSNorm) times ``score.weight``, read at the last token that is not
``pad_token_id`` (config.json). Causal attention means a forward over the sequence with its
trailing pads removed gives that same row, so trailing pads are dropped before the forward. (SGLang
reads the last token whatever it is; the two agree unless a sequence ends in pad tokens.)

A reward-model server refuses ``/generate`` and a causal-LM server refuses ``/classify``, each with
a 400 naming the model kind. Scoring runs on the engine thread (`on_engine`) in chunks that fit
the engine's KV cache: at most ``max_running`` sequences and ``max_prefill_tokens`` padded tokens.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from aiohttp import web

from megarl.server.requests import BadRequest, parse_inputs
from megarl.server.state import ServerState, on_engine, read_body

# EmbeddingReqInput fields this server reads; the others SGLang accepts as no-ops here
_KNOWN = {"input_ids", "text", "rid"}
_IGNORED = {"sampling_params", "log_metrics", "priority", "routing_key", "lora_path", "background"}


def is_reward_model(state: ServerState) -> bool:
    return bool(state.engine.model.cfg.num_labels)


def parse_classify(body: Any, vocab: int, tokenizer, context_length: int) -> tuple[list[list[int]], list[str], bool]:
    """(token id lists, rids, is_batch) of a /classify body; BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = sorted(k for k in body if k not in _KNOWN and k not in _IGNORED)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown} (known: {', '.join(sorted(_KNOWN))})")
    seqs, is_batch = parse_inputs(body, vocab, tokenizer)
    for i, s in enumerate(seqs):
        if not s:
            raise BadRequest(f"text[{i}]: encodes to no tokens")
        if len(s) > context_length:
            where = f"[{i}]" if is_batch else ""
            raise BadRequest(f"input_ids{where}: {len(s)} tokens > context length {context_length}")
    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in seqs]
    elif isinstance(rids, str):  # SGLang: a string for a batch is a prefix of per-item ids
        rids = [rids] if not is_batch else [f"{rids}_{i}" for i in range(len(seqs))]
    if not isinstance(rids, list) or len(rids) != len(seqs) or not all(isinstance(r, str) for r in rids):
        raise BadRequest("rid must be a string or a list of strings (one per input)")
    return seqs, rids, is_batch


def strip_pads(ids: list[int], pad_token_id: Optional[int]) -> list[int]:
    """``ids`` up to its last non-pad token (transformers' pooled position); all pads: the first."""
    if pad_token_id is None:
        return ids
    end = len(ids)
    while end > 1 and ids[end - 1] == pad_token_id:
        end -= 1
    return ids[:end]


def score(engine, seqs: list[list[int]]) -> list[list[float]]:
    """Score rows [num_labels] of each sequence; call on the engine thread (it owns the cache)."""
    model, out = engine.model, []
    pad = model.cfg.pad_token_id
    seqs = [strip_pads(s, pad) for s in seqs]
    i = 0
    while i < len(seqs):  # chunks the KV cache holds: <= max_running rows, <= max_prefill_tokens padded
        j, longest = i, 0
        while j < len(seqs) and j - i < engine.max_running:
            n = max(longest, len(seqs[j]))
            if j > i and (j - i + 1) * n > engine.max_prefill_tokens:
                break
            longest, j = n, j + 1
        out.extend(model.prefill(seqs[i:j], 0, engine.cache).tolist())
        i = j
    engine.stats["classify_sequences"] += len(seqs)
    return out


async def classify(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    eng = state.engine
    seqs, rids, is_batch = parse_classify(await read_body(request), eng.model.cfg.vocab_size, state.tokenizer,
                                          eng.context_length)
    if eng.released or eng.unloaded:
        raise BadRequest("the server is asleep (/release_memory_occupation): resume it before /classify")
    rows = await on_engine(state, lambda: score(eng, seqs))
    outs = [{"embedding": row,
             "meta_info": {"id": rid, "finish_reason": {"type": "length", "length": 0},
                           "prompt_tokens": len(s), "weight_version": eng.weight_version}}
            for row, rid, s in zip(rows, rids, seqs)]
    return web.json_response(outs if is_batch else outs[0])


async def no_generate(request: web.Request) -> web.Response:
    arch = request.app["state"].engine.model.cfg.architecture
    raise BadRequest(f"/generate: this server serves a reward model ({arch}); use /classify")


async def no_classify(request: web.Request) -> web.Response:
    arch = request.app["state"].engine.model.cfg.architecture
    raise BadRequest(f"/classify: this server serves a causal LM ({arch}), not a reward model "
                     "(a *ForSequenceClassification checkpoint)")


async def health_classify(request: web.Request) -> web.Response:
    """/health_generate of a reward-model server: one tiny forward on the engine thread."""
    state: ServerState = request.app["state"]
    eng = state.engine
    if not eng.alive():
        return web.Response(status=503)
    if eng.paused or eng.updating or eng.released or eng.unloaded:
        return web.Response(status=200)
    t0 = time.monotonic()
    try:
        await on_engine(state, lambda: score(eng, [[0]]))
    except Exception:  # noqa: BLE001 - unhealthy, not a 500
        return web.Response(status=503)
    return web.Response(status=200 if time.monotonic() - t0 < 30 else 503)


def setup(router, state: Optional[ServerState], generate, health_generate) -> None:
    """/generate, /classify, /encode and /health_generate for this server's model kind (without a
    state, e.g. to list the routes: a causal LM's)."""
    rm = state is not None and is_reward_model(state)
    router.add_post("/generate", no_generate if rm else generate)
    router.add_get("/health_generate", health_classify if rm else health_generate)
    for path in ("/classify", "/encode"):
        for method in ("POST", "PUT"):
            router.add_route(method, path, classify if rm else no_classify)
