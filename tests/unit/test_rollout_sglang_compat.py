"""Client-side pieces that real SGLang needs (no server): its ``weight_versions`` spans, and the
``/update_weights_from_tensor`` payload in its format - checked by reading the pickle's opcodes,
never by unpickling it."""
from __future__ import annotations

import base64
import pickletools

import torch

from megarl.rollout.client import RolloutClient
from megarl.protocol.tensor_wire import _owned, encode_megarl, tensor_update

# What SGLang 0.5's restricted unpickler admits among the globals a by-value tensor pickle uses
# (torch.storage._load_from_bytes is mapped there to a weights_only torch.load).
SGLANG_ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes"),
                  ("collections", "OrderedDict"), ("torch", "Size")}


def _globals(payload: bytes) -> set[tuple[str, str]]:
    """Module/name pairs a pickle would import (GLOBAL and STACK_GLOBAL after string pushes)."""
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(payload):
        if op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
    return found


def test_token_versions_from_sglang_spans_and_megarl_lists():
    c = RolloutClient(["127.0.0.1:1"], version_fn=lambda: 5)
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert c._token_versions({"weight_versions": spans, "weight_version": "4"}, 5) == [3, 3, 4, 4, 4]
    one = [{"version": "default", "start": 0, "end": 1}]  # a single span the size of the output
    assert c._token_versions({"weight_versions": one, "weight_version": "default"}, 1) == [5]
    assert c._token_versions({"weight_versions": ["1", "2"], "weight_version": "2"}, 2) == [1, 2]
    assert c._token_versions({"weight_version": "7"}, 3) == [7, 7, 7]


def test_sglang_tensor_payload_is_by_value_and_uses_only_allowed_globals():
    base = torch.arange(12, dtype=torch.float32).view(3, 4)
    named = {"a.weight": base[1:], "b.bias": torch.ones(2, dtype=torch.bfloat16)}
    upd = tensor_update(named, "sglang", weight_version="2")
    body = upd.to_json()
    assert body["load_format"] is None and body["weight_version"] == "2" and len(body["serialized_named_tensors"]) == 1
    raw = base64.b64decode(body["serialized_named_tensors"][0])
    found = _globals(raw)
    assert ("torch._utils", "_rebuild_tensor_v2") in found and ("torch.storage", "_load_from_bytes") in found
    assert found <= SGLANG_ALLOWED, found - SGLANG_ALLOWED  # no shared-memory handles either
    # by value: a view travels as its own bytes, not its base's
    assert _owned(base[1:]).untyped_storage().nbytes() == 8 * 4


def test_megarl_tensor_payload_is_safetensors():
    from safetensors.torch import load

    named = {"x": torch.randn(3, 2)}
    upd = tensor_update(named, "megarl")
    assert upd.load_format == "safetensors_b64" and upd.serialized_named_tensors[0] == encode_megarl(named)
    assert torch.equal(load(base64.b64decode(upd.serialized_named_tensors[0]))["x"], named["x"])


def test_version_flip_keeps_the_requests_the_pause_kept():
    """SGLang's /update_weight_version defaults to abort_all_requests: true, which ended every
    request ``pause_mode: retract`` had kept (returned as aborts without their tokens: no sample
    spanned two versions, tests/e2e/test_sglang_async.py[retract]); the flip must say false."""
    import asyncio

    from megarl.rollout.admin import AdminClient

    sent = []

    class Recording(AdminClient):
        async def _call(self, srv, method, path, body, timeout):
            sent.append((path, body))
            return {"success": True}

    async def flip():
        c = Recording(["127.0.0.1:1"])
        try:
            await c.update_weight_version("3")
        finally:
            await c.close()

    asyncio.run(flip())
    assert sent == [("/update_weight_version", {"new_version": "3", "abort_all_requests": False})]
