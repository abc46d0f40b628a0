"""The disk transport's delta format (``weights.disk_delta`` with ``weights.transport=disk`` and
megarl-server): each push writes, per pipeline stage, one file of per-tensor records plus a
manifest, instead of a whole HF checkpoint.

A record is ``raw`` (the tensor's bytes; every tensor of the first push and of the push after a
failed one, and with ``raw`` every changed tensor), ``same`` (equal to the last push: no payload;
frozen rows) or, with ``weights.disk_delta=xor``, ``xor`` (zlib-compressed XOR of the tensor's bytes
with the ones pushed last: unchanged bytes become zeros). Every record carries the
CRC-32 of the tensor it reconstructs; the server rebuilds each tensor from its own current
weights (which are the last pushed version: the manifest names it, and a server at another
version refuses) and loads nothing unless every checksum matches. The trainer keeps a CPU copy of
the last pushed bytes on each stage's writer rank (the model's size in the serving dtype).

``megarl_delta.json``: {"base": version or null, "version": str, "tensors": {name: [file, offset,
length, codec, dtype, shape, crc32]}}."""
from __future__ import annotations

import json
import os
import zlib
from typing import Optional

import numpy as np
import torch


MANIFEST = "megarl_delta.json"
LEVEL = 1  # zlib: the fastest level; XOR of an updated float tensor barely compresses at any level


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def encode(tensors, base: Optional[dict], out, xor: bool = True) -> tuple[dict, dict]:
    """Writes records of ``(name, tensor)`` pairs to the open file ``out``; returns (manifest
    entries, the new base {name: bytes}). ``base`` None: raw records. A tensor equal to its base
    is a ``same`` record (no payload); a changed one is ``xor`` (``xor`` True) or ``raw``."""
    entries, new = {}, {}
    for name, t in tensors:
        b = _bytes(t).copy()  # a copy: the base must not follow the parameter as training updates it
        prev = None if base is None else base.get(name)
        if prev is not None and prev.shape == b.shape and np.array_equal(b, prev):
            payload, codec = b"", "same"
        elif xor and prev is not None and prev.shape == b.shape:
            payload, codec = zlib.compress(np.bitwise_xor(b, prev).tobytes(), LEVEL), "xor"
        else:
            payload, codec = b.tobytes(), "raw"
        offset = out.tell()  # records are appended back to back; the manifest says where each starts
        out.write(payload)
        entries[name] = [os.path.basename(out.name), offset, len(payload), codec,
                         # the CRC is of the reconstructed bytes, not the payload: it checks the base too
                         str(t.dtype).removeprefix("torch."), list(t.shape), zlib.crc32(b)]
        new[name] = b
    return entries, new


def decode(path: str, current: dict[str, torch.Tensor], version: Optional[str]) -> dict[str, torch.Tensor]:
    """The tensors of delta directory ``path`` rebuilt against ``current`` (the server's weights,
    at ``version``). Any mismatch (base version, dtype, shape, length, checksum) is a ValueError
    naming the tensor; nothing is returned partially."""
    with open(os.path.join(path, MANIFEST)) as f:
        man = json.load(f)
    if man["base"] is not None and man["base"] != version:
        raise ValueError(f"delta against version {man['base']}, the server holds {version}")
    out, files = {}, {}
    try:
        for name, (fname, offset, length, codec, dtype, shape, crc) in man["tensors"].items():
            if fname not in files:  # basename only: a manifest cannot point outside its directory
                files[fname] = open(os.path.join(path, os.path.basename(fname)), "rb")
            fh = files[fname]
            fh.seek(offset)
            payload = fh.read(length)
            if len(payload) != length:
                raise ValueError(f"{name}: record truncated ({len(payload)} of {length} bytes)")
            dt = getattr(torch, dtype)
            if codec == "raw":
                b = np.frombuffer(payload, dtype=np.uint8)
            else:
                cur = current.get(name)
                if cur is None or cur.dtype != dt or list(cur.shape) != shape:
                    raise ValueError(f"{name}: no {dtype} {shape} base tensor on the server")
                base = _bytes(cur)
                if codec == "same":
                    b = base.copy()
                else:
                    try:
                        x = np.frombuffer(zlib.decompress(payload), dtype=np.uint8)
                    except zlib.error as e:
                        raise ValueError(f"{name}: corrupt delta record ({e})") from None
                    if x.shape != base.shape:
                        raise ValueError(f"{name}: delta of {x.size} bytes for a {base.size}-byte tensor")
                    b = np.bitwise_xor(x, base)
            if zlib.crc32(b) != crc:
                raise ValueError(f"{name}: checksum mismatch after reconstruction")
            # a copy: frombuffer memory is read-only, and `base` may view the live parameter
            out[name] = torch.from_numpy(b.copy()).view(dt).reshape(shape)
    finally:
        for fh in files.values():
            fh.close()
    return out
