"""SGLang's LoRA adapter endpoints on megarl-server, backed by the merge of `megarl.server.lora`:

- ``/load_lora_adapter`` {lora_name, lora_path}: a PEFT adapter directory (``adapter_config.json``
  with ``r`` and ``lora_alpha``; ``adapter_model.safetensors`` with
  ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), under the server's weight roots,
  is merged into the weights: W = W0 + (lora_alpha / r) B A. One adapter at a time: loading another
  replaces it (the merge always starts from W0).
- ``/unload_lora_adapter`` {lora_name}: the base weights W0 come back.
"""
from __future__ import annotations

import asyncio
import json
import os

import torch
from aiohttp import web
from safetensors.torch import load_file

from megarl.server.lora import SCALING
from megarl.server.state import BadRequest, allowed_weights_path, body_field, on_engine, read_body, result

PREFIX = "base_model.model."


def read_peft(path: str) -> dict[str, torch.Tensor]:
    """{HF adapter name or lora.scaling: tensor} of a PEFT LoRA directory; ValueError naming the file."""
    cfg_path, st_path = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
        r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{cfg_path}: not a PEFT LoRA config with r and lora_alpha ({type(e).__name__}: {e})") from None
    if r < 1:
        raise ValueError(f"{cfg_path}: r must be >= 1, got {r}")
    scaling = alpha / (r ** 0.5 if cfg.get("use_rslora") else r)
    try:
        raw = load_file(st_path)
    except Exception as e:  # noqa: BLE001 - SafetensorError is not an OSError
        raise ValueError(f"{st_path}: cannot read safetensors ({e})") from None
    out = {SCALING: torch.tensor([scaling], dtype=torch.float32)}
    for name, t in raw.items():
        key = name.removeprefix(PREFIX)
        if not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ValueError(f"{st_path}: {name!r} is not a LoRA A/B tensor")
        out[key] = t
    return out


async def load_adapter(request: web.Request) -> web.Response:
    state = request.app["state"]
    body = await read_body(request)
    name = body_field(body, "lora_name", str, required=True)
    path = body_field(body, "lora_path", str, required=True)
    try:
        real = allowed_weights_path(state, path)
        tensors = await asyncio.to_thread(read_peft, real)
    except (BadRequest, ValueError) as e:
        return result(False, f"lora_path: {e}")

    def run():
        model = state.engine.model
        to_load, commit = state.lora.prepare(model, tensors)
        model.load(to_load)
        commit()
        state.lora.name = name
        return len(to_load)

    try:
        n = await on_engine(state, run)
    except (KeyError, ValueError) as e:
        return result(False, f"adapter not loaded: {e}")
    return result(True, f"merged LoRA adapter {name!r} into {n} weights")


async def unload_adapter(request: web.Request) -> web.Response:
    state = request.app["state"]
    body = await read_body(request)
    name = body_field(body, "lora_name", str, required=True)
    if getattr(state.lora, "name", None) != name:
        return result(False, f"lora_name: adapter {name!r} is not loaded")

    def run():
        state.engine.model.load(state.lora.unload())
        return len(state.lora.bases)

    n = await on_engine(state, run)
    return result(True, f"unloaded LoRA adapter {name!r}: {n} base weights back")


def setup(r: web.UrlDispatcher) -> None:
    r.add_post("/load_lora_adapter", load_adapter)
    r.add_post("/unload_lora_adapter", unload_adapter)
