"""Weight endpoints of the CPU rollout server (SGLang 0.5.x request shapes).

- ``/init_weights_update_group`` {master_address, master_port, rank_offset, world_size,
  group_name="weight_update_group", backend="gloo"}: this server joins as rank ``rank_offset``.
- ``/update_weights_from_distributed`` {names, dtypes, shapes, group_name, flush_cache,
  abort_all_requests, weight_version, load_format}: receive ``broadcast(src=0)`` per announced
  tensor, in order (or, with load_format "flattened_bucket", the whole bucket in one broadcast;
  "direct_bucket": large tensors straight into their parameters, the small ones packed; see
  `weights.receive_broadcast`), then load them all, in the same engine job (every announced tensor
  is received even when a name is bad, so the trainer's broadcasts never hang; the bad name is
  reported afterwards, and a bad announce writes no parameter in place).
- megarl extensions for shard-to-shard refit (`megarl.weights.shard_push`): ``server_tp_ranks:
  true`` in ``/init_weights_update_group`` makes every TP rank of a ``--tp N`` server join, as
  ``rank_offset + tp_rank``; ``load_format: "shard_refit"`` with ``refit_units`` and
  ``refit_src_tp`` receives the units' slices point to point on every TP rank
  (`weights.receive_shards`). A TP server's other loads take full tensors on rank 0, which hands
  each follower its slices.
- ``/update_weights_from_disk`` {model_path, weight_version}: a full HF safetensors dir, only under
  the server's weights roots (``--weights-root``; default the model dir's parent).
- ``/update_weights_from_tensor`` {serialized_named_tensors: [base64 safetensors], load_format,
  weight_version}: see `weights.decode_named_tensors`; never unpickles.
- ``/destroy_weights_update_group`` {group_name}; ``/get_weights_by_name`` {name, truncate_size};
  ``/update_weight_version`` {new_version}.
- ``/weights_checksum`` {names, dtypes} (a megarl extension, not in SGLang): ``{"success": true,
  "checksums": {name: sha256 hex}}`` of each named tensor as this server holds it, cast to
  ``dtypes[i]`` (`megarl.protocol.wire.tensor_digest`), so the trainer checks a push without reading any
  tensor back (``weights.verify_interval``); computed on the engine thread, between batches.
A given ``weight_version`` becomes the server's version once the tensors are loaded; without one
the version is unchanged (SGLang semantics).
"""

from __future__ import annotations

import asyncio
import os

import torch

from aiohttp import web

from megarl.common.net import new_process_group
from megarl.server import weights as W
from megarl.protocol.lora_names import is_lora_name
from megarl.protocol import delta_format as disk_delta
from megarl.protocol.wire import DIRECT_BUCKET, FLATTENED_BUCKET, SHARED_MEMORY, tensor_digest
from megarl.server.state import (BadRequest, ServerState, allowed_weights_path, body_field, on_engine,
                                         read_body, result)


def _version(body: dict):
    v = body.get("weight_version")
    if v is not None and not isinstance(v, (str, int)):
        raise BadRequest("weight_version must be a string")
    return None if v is None else str(v)


def _apply(state: ServerState, tensors: dict, version, abort_all: bool):
    """Engine-thread body of every update: optional abort, validate-then-load, version."""

    def run():
        eng = state.engine
        if abort_all:
            eng.abort(None, abort_all=True)
        to_load, commit = state.lora.prepare(eng.model, tensors)  # LoRA adapters: merged (server/lora.py)
        eng.model.load(to_load)
        commit()
        eng.loaded(to_load)
        if version is not None:
            eng.weight_version = version
        return len(tensors)

    return run


async def _update(state: ServerState, tensors: dict, body: dict) -> web.Response:
    version = _version(body)
    abort_all = bool(body.get("abort_all_requests", False))
    try:
        n = await on_engine(state, _apply(state, tensors, version, abort_all))
    except (KeyError, ValueError) as e:
        return result(False, f"weights not loaded: {e}")
    return result(True, f"loaded {n} tensors", weight_version=state.engine.weight_version)


async def init_group(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = await read_body(request)
    addr = body_field(body, "master_address", str, required=True)
    port = body_field(body, "master_port", int, required=True)
    rank = body_field(body, "rank_offset", int, 1)
    world = body_field(body, "world_size", int, required=True)
    name = body_field(body, "group_name", str, "weight_update_group")
    backend = body_field(body, "backend", str, "gloo")
    timeout = body_field(body, "timeout", float, 300.0)
    if not 0 < timeout <= 3600:
        raise BadRequest(f"timeout={timeout} must be in (0, 3600] seconds")
    if not 0 < port < 65536:
        raise BadRequest(f"master_port={port} must be in [1, 65535]")
    if not 0 < rank < world:
        raise BadRequest(f"rank_offset={rank} must be in [1, world_size={world})")
    if name in state.groups:
        return result(False, f"group {name!r} already exists; destroy it first")
    # shard refit: every server TP rank joins, as rank_offset + its TP rank (megarl extension)
    tp_ranks = bool(body.get("server_tp_ranks", False)) and state.engine.model.tp is not None
    if tp_ranks:
        if rank + state.engine.model.tp_size > world:
            raise BadRequest(f"rank_offset={rank} + tp_size={state.engine.model.tp_size} exceeds world_size={world}")
        await on_engine(state, lambda: state.engine.model.tp.command("join", addr, port, rank, world, name,
                                                                     backend, timeout))
    try:
        pg = await asyncio.to_thread(new_process_group, addr, port, rank, world, name, backend, timeout)
    except Exception as e:  # noqa: BLE001 - rendezvous failures are the caller's to see
        return result(False, f"init_weights_update_group failed: {type(e).__name__}: {e}")
    state.groups[name] = W.WeightGroup(pg)
    state.groups[name].tp_ranks = tp_ranks
    return result(True, f"joined {name!r} as rank {rank}/{world} ({backend})")


async def destroy_group(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    name = body_field(await read_body(request), "group_name", str, "weight_update_group")
    group = state.groups.pop(name, None)
    if group is None:
        return result(False, f"no group {name!r}")
    def destroy():
        if getattr(group, "tp_ranks", False):
            state.engine.model.tp.command("destroy", name)
        W.destroy_weight_update_group(group.pg)

    await on_engine(state, destroy)
    return result(True, f"destroyed {name!r}")


async def from_distributed(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = await read_body(request)
    names = body_field(body, "names", list, required=True)
    dtypes = body.get("dtypes", body.get("dtype_names"))
    shapes = body_field(body, "shapes", list, required=True)
    if not isinstance(dtypes, list) or not (len(names) == len(dtypes) == len(shapes)):
        raise BadRequest("names, dtypes and shapes must be lists of equal length")
    try:
        for d in dtypes:
            W.parse_dtype(d)
    except ValueError as e:
        raise BadRequest(f"dtypes: {e}") from e
    if not all(isinstance(n, str) for n in names):
        raise BadRequest("names must be a list of strings")
    for i, shape in enumerate(shapes):
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise BadRequest(f"shapes[{i}] must be a list of non-negative ints, got {shape!r}")
    name = body_field(body, "group_name", str, "weight_update_group")
    load_format = body_field(body, "load_format", str, None)
    if load_format == SHARD_REFIT:
        return await _from_shards(state, body, names)
    if load_format not in (None, FLATTENED_BUCKET, DIRECT_BUCKET):
        raise BadRequest(f"load_format: {load_format!r} is not supported "
                         f"(None, {FLATTENED_BUCKET!r} or {DIRECT_BUCKET!r})")
    group = state.groups.get(name)
    if group is None:
        return result(False, f"no weight update group {name!r}; call /init_weights_update_group")
    version, abort_all = _version(body), bool(body.get("abort_all_requests", False))
    model = state.engine.model

    def receive_and_load():
        # one engine job: the group's buffer is reused by the next bucket, and the in-place
        # receive writes parameters, so no batch may run (nor another receive) in between
        targets = {n: t for n, t in _in_place_targets(model, names, dtypes, shapes).items()
                   if not state.lora.tracks(n)}  # an adapted base goes through the LoRA merge
        try:
            tensors, in_place = W.receive_broadcast(group, names, dtypes, shapes, load_format, model.device,
                                                    targets)
        except Exception as e:  # noqa: BLE001 - reported, not raised: the trainer names the server
            raise _ReceiveError(f"{type(e).__name__}: {e}") from e
        n = _apply(state, tensors, version, abort_all)() + in_place
        state.engine.loaded(names)  # the ones written in place too
        state.engine.stats["weight_bytes_socket"] += sum(
            int(torch.Size(sh).numel()) * W.parse_dtype(d).itemsize for sh, d in zip(shapes, dtypes))
        return n

    try:
        n = await on_engine(state, receive_and_load)
    except _ReceiveError as e:
        return result(False, f"broadcast receive failed: {e}")
    except (KeyError, ValueError) as e:
        return result(False, f"weights not loaded: {e}")
    return result(True, f"loaded {n} tensors", weight_version=state.engine.weight_version)


class _ReceiveError(RuntimeError):
    pass


SHARD_REFIT = "shard_refit"


async def _from_shards(state: ServerState, body: dict, names: list) -> web.Response:
    """load_format "shard_refit" (megarl extension, `megarl.protocol.refit`): ``refit_units`` (one
    ``[key, kind, dim, length, padded, dtype]`` per name) arrive point to point from the
    ``refit_src_tp`` trainer TP ranks, each server TP rank receiving its own slices."""
    from megarl.server.weights import storage
    from megarl.protocol.refit import UNIT_KINDS

    units = body_field(body, "refit_units", list, required=True)
    src_tp = body_field(body, "refit_src_tp", int, required=True)
    name = body_field(body, "group_name", str, "weight_update_group")
    model = state.engine.model
    try:
        if len(units) != len(names) or src_tp < 1:
            raise ValueError(f"{len(units)} units for {len(names)} names, refit_src_tp={src_tp}")
        for u in units:
            if not (isinstance(u, list) and len(u) == 6 and u[1] in UNIT_KINDS):
                raise ValueError(f"bad unit {str(u)[:80]}")
            storage(model, u[0])
            W.parse_dtype(u[5])
    except (KeyError, ValueError, TypeError) as e:
        raise BadRequest(f"refit_units: {e}") from e
    group = state.groups.get(name)
    if group is None:
        return result(False, f"no weight update group {name!r}; call /init_weights_update_group")
    if model.tp is not None and not getattr(group, "tp_ranks", False):
        return result(False, f"group {name!r} was joined without server_tp_ranks; shard refit needs every TP rank")
    version, abort_all = _version(body), bool(body.get("abort_all_requests", False))

    def receive():
        if abort_all:
            state.engine.abort(None, abort_all=True)
        if model.tp is not None:
            model.tp.command("receive_shards", name, units, src_tp)
        try:
            n = W.receive_shards(model, group, units, src_tp)
        except Exception as e:  # noqa: BLE001
            raise _ReceiveError(f"{type(e).__name__}: {e}") from e
        state.engine.loaded(names)
        if version is not None:
            state.engine.weight_version = version
        return n

    try:
        n = await on_engine(state, receive)
    except _ReceiveError as e:
        return result(False, f"shard receive failed: {e}")
    return result(True, f"received {n} slices of {len(units)} units", weight_version=state.engine.weight_version)


def _in_place_targets(model, names, dtypes, shapes) -> dict:
    """{name: parameter} for the announced tensors a broadcast may write straight into (same
    dtype, contiguous); empty when any name or shape is bad, so a bad announce writes nothing
    and its error comes from the load, after every byte was received (the trainer never hangs)."""
    if model.tp is not None:  # a TP rank holds slices: full tensors land in `model.load`
        return {}
    try:
        canon = [model.check_update(n, s) for n, s in zip(names, shapes)]
    except (KeyError, ValueError):
        return {}
    return {n: model.params[c] for n, c, d in zip(names, canon, dtypes)
            if model.params[c].dtype == W.parse_dtype(d) and model.params[c].is_contiguous()}


async def from_disk(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = await read_body(request)
    path = body_field(body, "model_path", str, required=True)
    try:
        real = allowed_weights_path(state, path)
    except BadRequest as e:
        return result(False, str(e))
    try:
        if os.path.exists(os.path.join(real, disk_delta.MANIFEST)):  # weights.delta's format
            tensors = await asyncio.to_thread(disk_delta.decode, real, state.engine.model.params,
                                              state.engine.weight_version)
        else:
            tensors = await asyncio.to_thread(W.read_hf_dir, real)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return result(False, f"cannot read {path}: {e}")
    missing = state.engine.model.missing(tensors)
    if missing:
        return result(False, f"{path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    resp = await _update(state, tensors, body)
    if resp.status == 200:
        state.model_path = path
    return resp


async def from_tensor(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = await read_body(request)
    entries = body_field(body, "serialized_named_tensors", list, required=True)
    try:
        tensors = await asyncio.to_thread(W.decode_named_tensors, entries, body.get("load_format"))
    except ValueError as e:
        raise BadRequest(str(e)) from e
    # where the weight bytes came through (/get_server_info): a socket, or this host's memory
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    state.engine.stats["weight_bytes_shared_memory" if body.get("load_format") == SHARED_MEMORY
                       else "weight_bytes_socket"] += nbytes
    return await _update(state, tensors, body)


def _param(model, name: str, field: str) -> str:
    """The key of HF tensor ``name`` in the model's params (a tied lm_head is the embedding)."""
    canon = "model.embed_tokens.weight" if name == "lm_head.weight" and model.cfg.tie_word_embeddings else name
    if canon not in model.params:
        raise BadRequest(f"{field}: unknown parameter {name!r}")
    return canon


async def get_weights_by_name(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = await read_body(request)
    name = body_field(body, "name", str, required=True)
    k = body_field(body, "truncate_size", int, 100)
    model = state.engine.model
    canon = _param(model, name, "name")
    t = await on_engine(state, lambda: model.full_param(canon)[:k].float().clone())
    return web.json_response(t.tolist())


async def weights_checksum(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = await read_body(request)
    names = body_field(body, "names", list, required=True)
    dtypes = body_field(body, "dtypes", list, None)
    if not all(isinstance(n, str) for n in names):
        raise BadRequest("names must be a list of strings")
    if dtypes is not None and len(dtypes) != len(names):
        raise BadRequest(f"dtypes: {len(dtypes)} given for {len(names)} names")
    try:
        casts = [None if d is None else W.parse_dtype(d) for d in (dtypes or [None] * len(names))]
    except ValueError as e:
        raise BadRequest(f"dtypes: {e}") from e
    model = state.engine.model
    lora = {n for n in names if is_lora_name(n)}  # pushed adapters: the ones the server holds
    canon = {n: _param(model, n, "names") for n in names if n not in lora}

    def held(n):
        try:
            return state.lora.held(n)
        except KeyError:
            raise BadRequest(f"names: no LoRA adapter {n!r} was pushed") from None

    def digests():  # on the engine thread: never between the tensors of a load
        return {n: tensor_digest(held(n) if n in lora else model.full_param(canon[n]), d)
                for n, d in zip(names, casts)}

    return result(True, f"{len(names)} checksums", checksums=await on_engine(state, digests))


async def update_weight_version(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = await read_body(request)
    v = body.get("new_version")
    if not isinstance(v, (str, int)):
        raise BadRequest("new_version must be a string")
    abort_all = bool(body.get("abort_all_requests", False))
    await on_engine(state, _apply(state, {}, str(v), abort_all))
    return result(True, f"weight_version={v}")


def setup(r: web.UrlDispatcher) -> None:
    r.add_post("/init_weights_update_group", init_group)
    r.add_post("/destroy_weights_update_group", destroy_group)
    r.add_post("/update_weights_from_distributed", from_distributed)
    r.add_post("/update_weights_from_disk", from_disk)
    r.add_post("/update_weights_from_tensor", from_tensor)
    r.add_post("/get_weights_by_name", get_weights_by_name)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_post("/weights_checksum", weights_checksum)
    from megarl.server import lora_routes

    lora_routes.setup(r)  # /load_lora_adapter, /unload_lora_adapter
