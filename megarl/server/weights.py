"""Weight sources for the CPU rollout server: HF safetensors dirs, tensor payloads, a gloo group.

- `read_hf_dir(path)`: ``model.safetensors`` or the shards listed in
  ``model.safetensors.index.json``; HF tensor names, no conversion.
- `decode_named_tensors`: the payload of ``/update_weights_from_tensor`` (the trainer encodes it
  with ``megarl.protocol.tensor_wire``). Each entry of ``serialized_named_tensors`` is base64 text
  of a safetensors file (``load_format="safetensors_b64"``). Safetensors is a pure data format,
  so a payload can never execute code; pickled payloads (SGLang's default) are rejected rather
  than deserialized.
- `receive_broadcast`: one bucket of ``/update_weights_from_distributed`` over the group that
  ``/init_weights_update_group`` joined with `megarl.common.net.new_process_group` (built like SGLang's
  ``init_custom_process_group``, the same function the trainer hosts it with). The trainer is
  rank 0 and broadcasts each announced tensor, in announced order, with ``src=0``.
"""

from __future__ import annotations

import base64
import glob
import json
import os
from typing import Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file

from megarl.protocol.wire import (DIRECT_BUCKET, FLAT_ALIGN, FLATTENED_BUCKET, SAFETENSORS_B64, SHARED_MEMORY, SHM_DIR,
                                  SHM_PREFIX, direct_split, flat_layout)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "float64": torch.float64,
}


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16', 'torch.bfloat16', 'bf16' -> torch.bfloat16."""
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}")
    return _DTYPES[key]


def read_hf_dir(path: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint dir, by HF name. Only safetensors files are read (never a
    pickle such as pytorch_model.bin); any unreadable file is a ValueError naming it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such directory")
    if os.path.exists(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = os.path.join(path, str(name))
        if os.path.dirname(os.path.normpath(file)) != os.path.normpath(path):
            raise ValueError(f"{index}: {name!r} is not a file of {path}")  # no ../ in an index
        try:
            tensors.update(load_file(file))
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - SafetensorError is not an OSError/ValueError
            raise ValueError(f"{file}: cannot read safetensors ({e})") from None
    # Buffers some exporters write; never parameters.
    return {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}


def decode_named_tensors(entries: list, load_format: str | None) -> dict[str, torch.Tensor]:
    if load_format == SHARED_MEMORY:
        out = {}
        for i, entry in enumerate(entries):
            out.update(map_shared(entry, f"serialized_named_tensors[{i}]"))
        return out
    if load_format not in (None, SAFETENSORS_B64):
        raise ValueError(f"load_format {load_format!r} not supported; use {SAFETENSORS_B64!r} "
                         f"or {SHARED_MEMORY!r}")
    out: dict[str, torch.Tensor] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, str):
            raise ValueError(f"serialized_named_tensors[{i}] must be a base64 string")
        try:
            out.update(st_load(base64.b64decode(entry, validate=True)))
        except Exception as e:  # noqa: BLE001 - report any decode failure as a bad payload
            raise ValueError(f"serialized_named_tensors[{i}] is not base64 safetensors: {e}") from e
    return out


def map_shared(entry, field: str) -> dict[str, torch.Tensor]:
    """The tensors of one shared-memory manifest (`megarl.protocol.wire.SHARED_MEMORY`), as views of the
    file mapped private and read-only in effect (nothing writes them; the load copies them into the
    parameters). Only a regular file named SHM_PREFIX* directly in SHM_DIR and owned by this
    server's user is opened; every tensor must lie inside it."""
    try:
        spec = json.loads(entry)
        path, items = spec["path"], spec["tensors"]
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{field}: not a shared-memory manifest ({e})") from None
    if not (isinstance(path, str) and os.path.dirname(path) == SHM_DIR
            and os.path.basename(path).startswith(SHM_PREFIX)):
        raise ValueError(f"{field}: path must be {SHM_DIR}/{SHM_PREFIX}*, got {path!r}")
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as e:
        raise ValueError(f"{field}: {path}: {e.strerror}") from None
    import stat

    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise ValueError(f"{field}: {path} is not a regular file of this user")
    buf = torch.from_file(path, shared=False, size=st.st_size, dtype=torch.uint8)
    out = {}
    for item in items:
        try:
            name, dtype, shape, offset = item
            dt = parse_dtype(dtype)
            n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dt).element_size()
            if not (isinstance(offset, int) and 0 <= offset and offset + n <= st.st_size):
                raise ValueError(f"bytes {offset}..+{n} outside the file's {st.st_size}")
            out[name] = buf[offset:offset + n].view(dt).view(shape)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{field}: tensor {str(item)[:80]}: {e}") from None
    return out


def destroy_weight_update_group(pg) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(pg)


class WeightGroup:
    """A joined weight-update group and its packing buffer, reused by every bucket: a fresh
    128 MiB buffer costs its page faults on first touch (0.1-0.5 s on a loaded host) each time."""

    def __init__(self, pg):
        self.pg = pg
        self.scratch = torch.empty(0, dtype=torch.uint8)
        self.tp_ranks = False  # every server TP rank joined (shard refit), not only the leader

    def buffer(self, nbytes: int, device) -> torch.Tensor:
        if self.scratch.numel() < nbytes or self.scratch.device != torch.device(device):
            self.scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.scratch[:nbytes]


def receive_broadcast(group: WeightGroup, names, dtypes, shapes, load_format=None, device="cpu",
                      targets: Optional[dict] = None) -> tuple[dict[str, torch.Tensor], int]:
    """Receive one announced bucket; returns (tensors still to load, how many were received in
    place). Per ``load_format``: None = broadcast(src=0) per tensor, in announced order;
    "flattened_bucket" = the whole bucket in one broadcast, laid out as SGLang lays it out
    (views into the group's buffer, valid until its next receive); "direct_bucket" = `megarl.protocol.wire.direct_split`: a large tensor whose
    name is in ``targets`` ({name: the parameter itself, same dtype/shape, contiguous}) is
    received straight into it (no copy; the caller holds the engine, so nothing reads it
    meanwhile), any other into a new tensor, then the small ones in one packed broadcast.
    Buffers live on ``device`` (the model's: an NCCL group needs CUDA tensors)."""
    import torch.distributed as dist

    pg, targets = group.pg, targets or {}
    out: dict[str, torch.Tensor] = {}
    # queued without waiting, one wait at the end: the group's worker thread receives them back
    # to back instead of handing each one to and from this thread
    works: list = []

    def unpack(idx: list[int], align: int = FLAT_ALIGN) -> None:
        layout, total = flat_layout([dtypes[i] for i in idx], [shapes[i] for i in idx], align)
        buf = group.buffer(total, device)
        works.append(dist.broadcast(buf, src=0, group=pg, async_op=True))
        for w in works:
            w.wait()
        works.clear()
        for i, (off, n) in zip(idx, layout):
            out[names[i]] = buf[off:off + n].view(parse_dtype(dtypes[i])).reshape([int(s) for s in shapes[i]])

    if load_format == FLATTENED_BUCKET:  # SGLang's layout: back to back, no padding
        unpack(list(range(len(names))), align=1)
        return out, 0
    direct = range(len(names))
    if load_format == DIRECT_BUCKET:
        direct, packed = direct_split(dtypes, shapes)
    in_place = 0
    for i in direct:
        t = targets.get(names[i])
        if t is None:
            t = out[names[i]] = torch.empty([int(s) for s in shapes[i]], dtype=parse_dtype(dtypes[i]),
                                            device=device)
        else:
            in_place += 1
        works.append(dist.broadcast(t, src=0, group=pg, async_op=True))
    if load_format == DIRECT_BUCKET and packed:
        unpack(packed)
    for w in works:
        w.wait()
    return out, in_place


def receive_shards(model, group: WeightGroup, units: list, src_tp: int) -> int:
    """Shard-to-shard refit (`megarl.protocol.refit`), this server TP rank's part: for every
    announced unit ``[key, kind, dim, length, padded, dtype]``, receive the slices whose
    destination is this rank from trainer TP rank ``src_rank`` (group rank ``src_rank``) straight
    into this rank's storage (a non-contiguous or other-dtype slice through a temporary). Trainer
    TP rank i is group rank i; the sender tags each slice with its position in
    the whole plan, so both sides agree without another message. Returns the slices received."""
    import torch.distributed as dist

    from megarl.protocol.refit import unit_slices

    full = model.full_cfg
    me, s = model.tp_rank, model.tp_size
    works, copies, tag, n = [], [], 0, 0
    for key, kind, dim, length, padded, dtype in units:
        dst = storage(model, key)
        want = parse_dtype(dtype)
        for sl in unit_slices(kind, dim, length, padded, src_tp, s, full.num_heads, full.num_kv_heads,
                              full.head_dim):
            tag += 1
            if sl.dst_rank != me:
                continue
            view = dst.narrow(dim, sl.dst_row, sl.rows)
            buf = view if view.is_contiguous() and view.dtype == want else torch.empty(
                view.shape, dtype=want, device=view.device)
            works.append(dist.irecv(buf, src=sl.src_rank, group=group.pg, tag=tag))
            if buf is not view:
                copies.append((view, buf))
            n += 1
    for w in works:
        w.wait()
    for view, buf in copies:
        view.copy_(buf)
    return n


_FUSED = {"qkv": "qkv", "qkv_bias": "qkv_b", "gate_up": "gate_up", "gate_up_bias": "gate_up_b"}


def storage(model, key: str) -> torch.Tensor:
    """``model``'s local tensor for a shard-refit unit key: an HF name whose parameter is a whole
    storage, or a fused one, ``model.layers.N.self_attn.qkv[_bias]`` /
    ``model.layers.N.mlp.gate_up[_bias]`` (KeyError otherwise)."""
    if key == "lm_head.weight" and model.cfg.tie_word_embeddings:
        key = "model.embed_tokens.weight"
    if key in model.params:
        return model.params[key]
    head, _, leaf = key.rpartition(".")
    parts = head.split(".")
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and leaf in _FUSED:
        layer = int(parts[2])
        t = model.layers[layer].get(_FUSED[leaf]) if layer < len(model.layers) else None
        if t is not None:
            return t
    raise KeyError(f"unknown shard-refit unit {key!r}")
