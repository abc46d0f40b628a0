"""SGLang 0.5.x JSON shapes for /generate: request validation and response building.

Request: ``{"input_ids": [int] | [[int]], "text": str | [str], "sampling_params": {..} | [{..}],
"return_logprob": bool, "rid": str | [str], "stream": false}``; exactly one of input_ids / text.
Any other top-level field is a 400 naming it, except SGLang fields this server does not implement
sent at their no-op value (`_NOOP_TOP`, e.g. ``"logprob_start_len": -1``); an explicit
``max_new_tokens`` that, with the prompt, exceeds the context length is a 400 with the numbers (as
SGLang refuses it; without one the default is capped by the context).
``sampling_params.n`` > 1 expands each prompt into n samples; the response is then a list,
prompt-major (prompt 0 samples 0..n-1, prompt 1 ...). A single prompt with n == 1 returns one
object, a batch returns a list.

Response object: ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", "e2e_latency", "weight_version", "weight_versions",
"output_token_logprobs"?, "input_token_logprobs"?}}``. ``output_token_logprobs`` is
``[[logprob, token_id, null], ...]`` with logprob = log_softmax of the raw fp32 logits
(temperature 1, before top-k/top-p/min-p). With ``"logprob_start_len": k`` (>= 0, and
return_logprob) ``input_token_logprobs`` scores the prompt the same way from position k on, the
first prompt token's entry null (nothing precedes it), as SGLang does; with ``max_new_tokens`` 0
that is all the request does (a teacher scoring a student's tokens).
``weight_versions`` (megarl extension) lists, per output token, the weight version that produced
it; ``weight_version`` is the server's version when the response was built. Tokens that stopped
generation (EOS, stop_token_ids, the token completing a stop string) stay in output_ids; ``text``
is cut before a matched stop string.

MoE routing (server started with ``--enable-return-routed-experts``, request
``"return_routed_experts": true``; a 400 otherwise): ``meta_info["routed_experts"]`` is base64 of
the int32 array [rows, num_hidden_layers, num_experts_per_tok] (C order, little-endian) - the
expert ids each position was routed to, SGLang's field and layout - and, a megarl extension,
``meta_info["routed_expert_weights"]`` the float32 routing weights in the same layout (the
weights the MoE layer multiplied the experts' outputs by). rows = prompt_tokens +
completion_tokens - 1: row j is the routing of the forward that fed token j (and sampled token
j + 1); the last output token is never fed. Layers without experts have ids -1 and weights 0.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from megarl.server.moe import b64_array
from megarl.server.sampling import SamplingConfig

_KNOWN_SAMPLING = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "ignore_eos", "n", "seed", "sampling_seed", "skip_special_tokens", "no_stop_trim",
    "spaces_between_special_tokens", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "min_new_tokens",
}


_KNOWN_TOP = {"input_ids", "text", "sampling_params", "return_logprob", "rid", "stream", "return_routed_experts",
              "logprob_start_len"}
# SGLang GenerateReqInput fields the CPU server does not implement, accepted at these values only
_NOOP_TOP = {
    "top_logprobs_num": (0, None), "return_text_in_logprobs": (False, None),
    "log_metrics": (True, False, None), "return_hidden_states": (False, None), "lora_path": (None,),
    "image_data": (None,), "custom_logit_processor": (None,), "data_parallel_rank": (None,),
}


class BadRequest(ValueError):
    """A malformed request; the message names the offending field."""


@dataclass
class SampleRequest:
    rid: str
    group: str
    input_ids: list[int]
    params: SamplingConfig
    return_routed_experts: bool = False
    logprob_start: Optional[int] = None  # logprob_start_len >= 0 with return_logprob: the prompt's logprobs from there


def _num(d: dict, key: str, kind, default, lo=None, hi=None, where="sampling_params"):
    v = d.get(key, default)
    if v is None:
        return default
    # json.loads accepts NaN/Infinity, and NaN passes every range check: refuse non-finite values
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            isinstance(v, float) and (not math.isfinite(v) or (kind is int and not v.is_integer()))):
        raise BadRequest(f"{where}.{key} must be a finite {kind.__name__}, got {repr(v)[:40]}")
    try:
        v = kind(v)
    except OverflowError:  # an int beyond float range
        raise BadRequest(f"{where}.{key} is out of range") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"{where}.{key}={v} out of range [{lo}, {'inf' if hi is None else hi}]")
    return v


def parse_sampling(d: Any, vocab: int, has_tokenizer: bool) -> tuple[SamplingConfig, int]:
    """(config, n) from one sampling_params dict."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise BadRequest("sampling_params must be an object")
    unknown = set(d) - _KNOWN_SAMPLING
    if unknown:
        raise BadRequest(f"sampling_params: unknown field(s) {sorted(unknown)}")
    for key in ("frequency_penalty", "presence_penalty"):
        if d.get(key) not in (None, 0, 0.0):
            raise BadRequest(f"sampling_params.{key} is not supported by the CPU server")
    if d.get("repetition_penalty") not in (None, 1, 1.0):
        raise BadRequest("sampling_params.repetition_penalty is not supported by the CPU server")
    stop = d.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("sampling_params.stop must be a string or a list of non-empty strings")
    if stop and not has_tokenizer:
        raise BadRequest("sampling_params.stop needs a tokenizer (the model dir has none)")
    stop_ids = d.get("stop_token_ids") or ()
    if not isinstance(stop_ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
    ):
        raise BadRequest("sampling_params.stop_token_ids must be a list of ints")
    ignore_eos = d.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("sampling_params.ignore_eos must be a bool")
    seed = d.get("sampling_seed", d.get("seed"))
    if seed is not None:
        seed = _num({"seed": seed}, "seed", int, None)
    cfg = SamplingConfig(
        max_new_tokens=_num(d, "max_new_tokens", int, 128, lo=0),
        temperature=_num(d, "temperature", float, 1.0, lo=0.0),
        top_p=_num(d, "top_p", float, 1.0, lo=1e-9, hi=1.0),
        top_k=_num(d, "top_k", int, -1, lo=-1, hi=vocab),
        min_p=_num(d, "min_p", float, 0.0, lo=0.0, hi=1.0),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=ignore_eos,
        seed=seed,
    )
    return cfg, _num(d, "n", int, 1, lo=1, hi=1024)


def _token_list(v: Any, where: str, vocab: int) -> list[int]:
    if not isinstance(v, list) or not v:
        raise BadRequest(f"{where} must be a non-empty list of token ids")
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise BadRequest(f"{where} has an invalid token id {t!r} (vocab size {vocab})")
    return v


def parse_inputs(body: dict, vocab: int, tokenizer) -> tuple[list[list[int]], bool]:
    """(token id lists, is_batch) of a body's ``input_ids`` or ``text`` (one of them; a single
    input or a batch), as /generate and /classify take them. BadRequest naming the field."""
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise BadRequest("exactly one of input_ids or text is required")
    if has_ids:
        ids = body["input_ids"]
        is_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        seqs = ([_token_list(s, f"input_ids[{i}]", vocab) for i, s in enumerate(ids)] if is_batch
                else [_token_list(ids, "input_ids", vocab)])
        return seqs, is_batch
    if tokenizer is None:
        raise BadRequest("text: the model dir has no tokenizer; send input_ids")
    text = body["text"]
    is_batch = isinstance(text, list)
    texts = text if is_batch else [text]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequest("text must be a string or a non-empty list of strings")
    return [tokenizer.encode(t, add_bos=True) for t in texts], is_batch


def parse_generate(body: Any, vocab: int, tokenizer, context_length: int,
                   routes_enabled: bool = False) -> tuple[list[SampleRequest], bool, bool]:
    """Returns (samples, return_logprob, is_batch). Raises BadRequest naming the field.
    ``routes_enabled``: the server was started with --enable-return-routed-experts."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    _check_top_level(body)
    if body.get("stream"):
        raise BadRequest("stream: streaming is not supported by the CPU server")
    prompts, is_batch = parse_inputs(body, vocab, tokenizer)
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != len(prompts):
            raise BadRequest(f"sampling_params: {len(sp)} entries for {len(prompts)} prompts")
    else:
        sp = [sp] * len(prompts)
    parsed = [parse_sampling(s, vocab, tokenizer is not None) for s in sp]
    for i, (prompt, s, (cfg, _)) in enumerate(zip(prompts, sp, parsed)):
        if isinstance(s, dict) and s.get("max_new_tokens") is not None:
            _check_room(len(prompt), cfg.max_new_tokens, context_length, f"[{i}]" if is_batch else "")
    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in prompts]
    elif isinstance(rids, str) and not is_batch:
        rids = [rids]
    if not isinstance(rids, list) or len(rids) != len(prompts) or not all(isinstance(r, str) for r in rids):
        raise BadRequest("rid must be a string (one prompt) or a list of strings (one per prompt)")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise BadRequest("return_logprob must be a bool")
    want_routes = _routes_flag(body, routes_enabled)
    start = _logprob_start(body, return_logprob)
    samples = []
    for rid, prompt, (cfg, n) in zip(rids, prompts, parsed):
        if len(prompt) >= context_length:
            raise BadRequest(f"input_ids: prompt of {len(prompt)} tokens >= context length {context_length}")
        for j in range(n):
            seed = cfg.seed
            if n > 1 and seed is not None:
                seed = seed * 1_000_003 + j  # distinct, reproducible streams per sample
            c = cfg if seed == cfg.seed else SamplingConfig(**{**cfg.__dict__, "seed": seed})
            samples.append(SampleRequest(rid if n == 1 else f"{rid}-{j}", rid, list(prompt), c, want_routes,
                                         None if start is None else min(start, len(prompt))))
    return samples, return_logprob, is_batch or any(n > 1 for _, n in parsed)


def _logprob_start(body: dict, return_logprob: bool) -> Optional[int]:
    """``logprob_start_len``: -1 / absent = no prompt logprobs; k >= 0 with return_logprob = the
    logprob of every prompt token from position k on (SGLang's input_token_logprobs)."""
    start = body.get("logprob_start_len", -1)
    if start is None or start == -1:
        return None
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise BadRequest(f"logprob_start_len must be -1 or an int >= 0, got {start!r}")
    if not return_logprob:
        raise BadRequest("logprob_start_len: prompt logprobs need return_logprob: true")
    return start


def _routes_flag(body: dict, routes_enabled: bool) -> bool:
    want = body.get("return_routed_experts", False)
    if not isinstance(want, bool):
        raise BadRequest("return_routed_experts must be a bool")
    if want and not routes_enabled:
        raise BadRequest("return_routed_experts: the server was started without --enable-return-routed-experts")
    return want


def _check_top_level(body: dict) -> None:
    unknown = sorted(k for k in body if k not in _KNOWN_TOP and k not in _NOOP_TOP)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown} (known: {', '.join(sorted(_KNOWN_TOP))})")
    for key in sorted(set(body) & set(_NOOP_TOP)):
        if not any(body[key] is a or (type(body[key]) is type(a) and body[key] == a) for a in _NOOP_TOP[key]):
            raise BadRequest(f"{key}={body[key]!r} is not supported by the CPU server "
                             f"(accepted: {', '.join(map(repr, _NOOP_TOP[key]))})")


def _check_room(prompt_len: int, max_new: int, context_length: int, where: str) -> None:
    if prompt_len + max_new > context_length:
        raise BadRequest(f"input_ids{where}: prompt of {prompt_len} tokens + sampling_params.max_new_tokens="
                         f"{max_new} = {prompt_len + max_new} tokens exceeds the context length {context_length}")


def build_response(seq, return_logprob: bool, tokenizer, weight_version: str, now: float) -> dict:
    text: Optional[str] = None
    if tokenizer is not None:
        text = tokenizer.decode(seq.out_ids)
        matched = (seq.finish or {}).get("matched")
        if isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
    meta = {
        "id": seq.rid,
        "finish_reason": seq.finish,
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": len(seq.out_ids),
        "cached_tokens": 0,
        "e2e_latency": now - seq.created,
        "weight_version": weight_version,
        "weight_versions": list(seq.out_versions),
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(seq.out_logprobs, seq.out_ids)]
        if seq.input_logprob_start is not None:  # the prompt's from logprob_start_len (the first token: None)
            start = seq.input_logprob_start
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(seq.in_logprobs, seq.prompt[start:])]
    if seq.want_routes:
        ids, weights = seq.routes()
        meta["routed_experts"] = b64_array(ids, "int32")
        meta["routed_expert_weights"] = b64_array(weights, "float32")
    return {"text": text, "output_ids": list(seq.out_ids), "meta_info": meta}
