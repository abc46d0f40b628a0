"""The server's shared state and the request/response helpers every route module uses.

`app` (generation and control endpoints, middleware) and `weight_routes` (weight endpoints) both
import from here and never from each other, so the routes have no import circle. Conventions:
a malformed request raises `BadRequest` (the middleware turns it into a 400 naming the field);
weight/control endpoints answer ``{"success": bool, "message": str, ...}`` through `result`.

Disk weight loads are confined to ``ServerState.weights_roots`` (`allowed_weights_path`): the
served model dir plus ``--weights-root`` directories, by default the model dir's parent.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from aiohttp import web

from megarl.server.engine import GenerationEngine
from megarl.server.lora import LoRAState
from megarl.server.requests import BadRequest

__all__ = ["BadRequest", "ServerState", "error", "result", "read_body", "body_field", "on_engine",
           "default_weights_roots", "allowed_weights_path"]


@dataclass
class ServerState:
    engine: GenerationEngine
    model_path: str
    tokenizer: Any = None
    tokenizer_path: Optional[str] = None
    api_key: Optional[str] = None
    groups: dict = field(default_factory=dict)  # group_name -> process group
    started: float = field(default_factory=time.time)
    weights_roots: tuple[str, ...] = ()  # real paths /update_weights_from_disk may read under
    return_routed_experts: bool = False  # --enable-return-routed-experts (MoE models only)
    lora: LoRAState = field(default_factory=LoRAState)  # pushed LoRA adapters, merged on load


def default_weights_roots(model_dir: str) -> list[str]:
    """Without ``--weights-root``: the model dir's parent (new versions usually land beside the
    base model). The model dir itself is always allowed."""
    return [os.path.dirname(os.path.realpath(model_dir))]


def allowed_weights_path(state: ServerState, path: str) -> str:
    """The real path of ``path`` if it lies under one of the state's weights roots (symlinks and
    ``..`` resolved first, so neither can lead outside); BadRequest otherwise."""
    real = os.path.realpath(path)
    for root in state.weights_roots:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return real
    raise BadRequest(f"cannot read {path}: outside the allowed weight roots {list(state.weights_roots)} "
                     "(megarl-server --weights-root DIR)")


def error(status: int, message: str) -> web.Response:
    """SGLang's error body: ``{"object": "error", "message", "code"}`` with that HTTP status."""
    return web.json_response({"object": "error", "message": message, "code": status}, status=status)


def result(ok: bool, message: str = "", **extra) -> web.Response:
    """``{"success", "message", **extra}``; HTTP 400 when not ok (SGLang's weight endpoints)."""
    return web.json_response({"success": ok, "message": message, **extra}, status=200 if ok else 400)


async def read_body(request: web.Request) -> dict:
    """The JSON object body ({} without a body); anything else is a BadRequest."""
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not valid JSON: {e}") from e
    except RecursionError:  # absurdly deep nesting: the parser gives up
        raise BadRequest("body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def body_field(body: dict, key: str, kind, default=None, required: bool = False):
    """``body[key]`` checked against ``kind`` (a bool is not an int); null counts as absent."""
    if key not in body or body[key] is None:
        if required:
            raise BadRequest(f"{key} is required")
        return default
    v = body[key]
    if kind is float:  # any JSON number, but finite (json.loads accepts NaN and Infinity)
        try:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        except OverflowError:  # an int beyond float range
            ok = False
        if not ok:
            raise BadRequest(f"{key} must be a finite number, got {str(v)[:40]}")
        return float(v)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise BadRequest(f"{key} must be {getattr(kind, '__name__', kind)}")
    return v


async def on_engine(state: ServerState, fn):
    """Runs ``fn`` on the engine thread (between two decode steps) and awaits its result."""
    return await asyncio.wrap_future(state.engine.call(fn))
