"""aiohttp application of the CPU rollout server: SGLang 0.5.x endpoints over one
`GenerationEngine`.

Auth: with an API key, every endpoint except ``/health`` (`OPEN_PATHS`)
needs ``Authorization: Bearer KEY`` (401 otherwise) - like SGLang, generation is protected too;
a route added to `setup_routes` is protected unless it is listed in `OPEN_PATHS`.
Errors: a malformed request is a 400 ``{"object": "error", "message": ..., "code": 400}`` naming the
field; an unexpected failure is a 500 with the message; neither stops the server.
Weight updates run on the engine thread (`GenerationEngine.call`), so they land between decode
steps.
Weight-update endpoints answer ``{"success": bool, "message": str}`` (HTTP 400 when false).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time

from aiohttp import web

from megarl.server import memory, reward, weight_routes
from megarl.server.engine import PAUSE_MODES, Sequence
from megarl.server.requests import build_response, parse_generate
from megarl.server.sampling import SamplingConfig
from megarl.server.state import (BadRequest, ServerState, body_field, error, on_engine, read_body,
                                         result)
from megarl.protocol.wire import MEGARL_EXTENSIONS

log = logging.getLogger("megarl.server")

OPEN_PATHS = frozenset({"/health"})  # liveness only: /health_generate runs the model


@web.middleware
async def _guard(request: web.Request, handler):
    state: ServerState = request.app["state"]
    if state.api_key and request.path not in OPEN_PATHS:
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, f"Bearer {state.api_key}".encode()):  # constant time
            return error(401, "missing or invalid API key (Authorization: Bearer KEY)")
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except BadRequest as e:
        return error(400, str(e))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - keep serving
        log.exception("%s failed", request.path)
        return error(500, f"{type(e).__name__}: {e}")


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, seq: Sequence) -> None:
    def done():
        if not fut.done():
            fut.set_result(seq)

    loop.call_soon_threadsafe(done)


# ---- generation ---------------------------------------------------------------------------------
async def generate(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    eng = state.engine
    body = await read_body(request)
    samples, return_logprob, is_batch = parse_generate(
        body, eng.model.cfg.vocab_size, state.tokenizer, eng.context_length, state.return_routed_experts
    )
    loop = asyncio.get_running_loop()
    futs, seqs = [], []
    for spec in samples:
        fut = loop.create_future()
        seq = Sequence(spec.rid, spec.input_ids, spec.params, functools.partial(_resolve, loop, fut), group=spec.group,
                       want_routes=spec.return_routed_experts, input_logprob_start=spec.logprob_start)
        if spec.params.max_new_tokens == 0 and spec.logprob_start is None:  # nothing to compute
            seq.finish = {"type": "length", "length": 0}
            fut.set_result(seq)
        else:
            eng.submit(seq)
        futs.append(fut)
        seqs.append(seq)
    try:
        done = await asyncio.gather(*futs)
    except asyncio.CancelledError:  # client went away: free the slots
        rids = {s.rid for s in seqs}
        eng.call(lambda: sum(eng.abort(r) for r in rids))
        raise
    now = time.perf_counter()
    outs = [build_response(s, return_logprob, state.tokenizer, eng.weight_version, now) for s in done]
    return web.json_response(outs if is_batch else outs[0])


async def health(request: web.Request) -> web.Response:
    ok = request.app["state"].engine.alive()
    return web.Response(status=200 if ok else 503)


async def health_generate(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    eng = state.engine
    if not eng.alive():
        return web.Response(status=503)
    if eng.paused or eng.updating:  # generation is held on purpose; the engine thread is alive
        return web.Response(status=200)
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    cfg = SamplingConfig(max_new_tokens=1, temperature=0.0)
    eng.submit(Sequence("health-" + str(id(fut)), [0], cfg, functools.partial(_resolve, loop, fut)))
    try:
        await asyncio.wait_for(fut, timeout=30)
    except asyncio.TimeoutError:
        return web.Response(status=503)
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    eng, cfg = state.engine, state.engine.model.cfg
    return web.json_response({
        "model_path": state.model_path,
        "tokenizer_path": state.tokenizer_path,
        "is_generation": not cfg.num_labels,  # False for a reward model, as SGLang --is-embedding
        "preferred_sampling_params": None,
        "weight_version": eng.weight_version,
        "architecture": cfg.architecture,
        "dtype": str(eng.model.dtype).removeprefix("torch."),
        "vocab_size": cfg.vocab_size,
        "context_length": eng.context_length,
        "max_running_requests": eng.max_running,
        "paused": eng.paused,
        "updating_weights": eng.updating,
        "enable_return_routed_experts": state.return_routed_experts,
        # what this server adds to SGLang's protocol: the rollout side chooses the wire from it
        "megarl_extensions": list(MEGARL_EXTENSIONS),
    })


async def server_info(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    eng = state.engine
    return web.json_response({
        "weight_version": eng.weight_version,
        "tp_size": eng.model.tp_size,
        "num_running": len(eng.running),
        "num_waiting": len(eng.waiting),
        "memory_released": sorted(eng.released),  # asleep: megarl.server.memory
        "awaiting_weights": len(eng.unloaded),
        "uptime_s": time.time() - state.started,
        "threads": eng.applied_threads,  # generation's torch threads now (/set_threads)
        **dict(eng.stats),
    })


# ---- control ------------------------------------------------------------------------------------
async def flush_cache(request: web.Request) -> web.Response:
    await on_engine(request.app["state"], request.app["state"].engine.flush_cache)
    return web.Response(text="Cache flushed.\n")


async def pause_generation(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    mode = body_field(await read_body(request), "mode", str, "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    n = await on_engine(state, lambda: state.engine.pause(mode))
    return result(True, f"paused ({mode})", num_affected_requests=n)


async def continue_generation(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    await on_engine(state, state.engine.resume)
    return result(True, "continued")


async def release_memory(request: web.Request) -> web.Response:
    """Sleep (`megarl.server.memory`): the tagged memory is freed; generation waits for a wake."""
    return await _memory_call(request, memory.release)


async def resume_memory(request: web.Request) -> web.Response:
    return await _memory_call(request, memory.resume)


async def _memory_call(request: web.Request, fn) -> web.Response:
    state: ServerState = request.app["state"]
    body = await read_body(request)
    try:
        tags = memory.parse_tags(body.get("tags"))
        out = await on_engine(state, lambda: fn(state.engine, tags))
    except memory.MemoryError_ as e:
        raise BadRequest(str(e)) from e
    # the server's own record of its sleeps (a colocated run's log), and where weights came through
    st = state.engine.stats
    log.info("%s %s at %.6f; weight bytes so far: socket %d, shared memory %d", request.path.strip("/"),
             ",".join(tags), time.time(), st["weight_bytes_socket"], st["weight_bytes_shared_memory"])
    return result(True, f"{request.path.strip('/')}: {', '.join(tags)}", **out)


async def abort_request(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = await read_body(request)
    rid = body_field(body, "rid", str, "")
    abort_all = body_field(body, "abort_all", bool, False)
    if not rid and not abort_all:
        raise BadRequest("rid (or abort_all: true) is required")
    n = await on_engine(state, lambda: state.engine.abort(rid, abort_all))
    return result(True, f"aborted {n}", num_aborted=n)


async def set_threads(request: web.Request) -> web.Response:
    """megarl extension (`EXT_THREADS`): ``{"threads": N}`` - generation's torch threads from the
    next engine step on (a trainer lends its core while it waits, `megarl.trainer.threads`).
    Answers at once, without waiting for the step in progress."""
    state: ServerState = request.app["state"]
    n = body_field(await read_body(request), "threads", int, required=True)
    if not 1 <= n <= 1024:
        raise BadRequest(f"threads must be an integer in [1, 1024], got {n!r}")
    if state.engine.model.tp_size > 1:  # its followers' threads are their own processes'
        return result(False, f"a --tp {state.engine.model.tp_size} server keeps its --threads")
    state.engine.set_threads(n)
    return result(True, f"threads {n} from the next step", threads=n)


def _set_updating(engine, value: bool) -> bool:
    """Opens (True) or closes (False) the weight-update session; False when it already was."""
    if engine.updating == value:
        return False
    engine.updating = value
    return True


async def begin_weight_update(request: web.Request) -> web.Response:
    """SGLang's session contract: one session at a time, so a caller that lost track of one (a
    push that failed after its begin) learns it here instead of loading into it unnoticed."""
    state: ServerState = request.app["state"]
    if not await on_engine(state, lambda: _set_updating(state.engine, True)):
        return result(False, "a weight-update session is already open; call /end_weight_update first")
    return result(True, "weight update begun")


async def end_weight_update(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    if not await on_engine(state, lambda: _set_updating(state.engine, False)):
        return result(False, "no weight-update session is open; call /begin_weight_update first")
    return result(True, "weight update ended")


def setup_routes(app: web.Application) -> None:
    r = app.router
    reward.setup(r, app.get("state"), generate, health_generate)  # by model kind: LM or reward model
    r.add_get("/health", health)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    r.add_get("/get_server_info", server_info)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/abort_request", abort_request)
    r.add_post("/release_memory_occupation", release_memory)
    r.add_post("/resume_memory_occupation", resume_memory)
    r.add_post("/begin_weight_update", begin_weight_update)
    r.add_post("/end_weight_update", end_weight_update)
    r.add_post("/set_threads", set_threads)
    weight_routes.setup(r)


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_guard], client_max_size=1 << 31)
    app["state"] = state
    setup_routes(app)
    app.on_shutdown.append(lambda _app: asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown))
    return app

