"""The server's shared state and the request/response helpers every route module uses.

`app` (generation and control endpoints, middleware) and `weight_routes` (weight endpoints) both
import from here and never from each other, so the routes have no import circle. Conventions:
a malformed request raises `BadRequest` (the middleware turns it into a 400 naming the field);
weight/control endpoints answer ``{"success": bool, "message": str, ...}`` through `result`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from aiohttp import web

from megarl.rollout.server.engine import GenerationEngine
from megarl.rollout.server.protocol import BadRequest

__all__ = ["BadRequest", "ServerState", "error", "result", "read_body", "body_field", "on_engine"]


@dataclass
class ServerState:
    engine: GenerationEngine
    model_path: str
    tokenizer: Any = None
    tokenizer_path: Optional[str] = None
    api_key: Optional[str] = None
    groups: dict = field(default_factory=dict)  # group_name -> process group
    started: float = field(default_factory=time.time)


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
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise BadRequest(f"{key} must be {getattr(kind, '__name__', kind)}")
    return v


async def on_engine(state: ServerState, fn):
    """Runs ``fn`` on the engine thread (between two decode steps) and awaits its result."""
    return await asyncio.wrap_future(state.engine.call(fn))
