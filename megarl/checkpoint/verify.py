"""Is a checkpoint intact? A cheap check before anything loads it, and the choice of what a resume
loads when the newest checkpoint is damaged.

A checkpoint is *committed* when megarl.json says so (``layout.is_complete``); it is *intact*
when every file loading it will read is there and whole. ``verify_checkpoint`` checks, without
reading tensor data:

- megarl.json parses and is marked complete;
- nothing in it would unpickle objects (``safe.check_safe``, first, so that a planted pickle is
  reported as refused);
- per dist-checkpoint directory (the checkpoint, and ``<name>/`` of each extra engine):
  ``metadata.json``, ``.metadata`` (through the allow-list unpickler) and ``common.pt`` exist,
  and every shard file the DCP index points into exists and is at least as long as the index's
  last byte in it (a truncated or deleted ``__R_0.distcp`` is found here);
- a training checkpoint has one RNG file per saving rank;
- the manifest (``files`` in megarl.json, written by every save since it was introduced): every
  file listed exists with its recorded size, and files up to ``CRC_LIMIT`` bytes (indexes,
  ``common.pt``, RNG states, configs, small shards) match their CRC32.

Each problem is a ``CheckpointError`` naming the file. Not detected: same-size corruption inside
a shard larger than ``CRC_LIMIT`` (checksumming every byte would cost as much as loading it);
such a load fails inside Megatron with an error naming the checkpoint directory.

``find_resumable(save_dir)`` returns the checkpoint a resume loads: the one ``latest`` names,
else the newest committed ``step_*``, passing over damaged ones to the newest intact one, with
one note per checkpoint passed over (or ``latest`` ignored) saying why. When checkpoints exist
but none is intact it raises, naming the newest one's damaged file.
"""
from __future__ import annotations

import collections
import os
import zlib
from typing import Optional

from megarl.checkpoint.layout import (
    LATEST, META, STEP_DIR_RE, CheckpointError, read_meta)

MANIFEST = "files"  # key of megarl.json: {relative path: [size, crc32 or None]}
CRC_LIMIT = 4 << 20


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


def file_manifest(ckpt_dir: str) -> dict[str, list]:
    """{relative path: [size, crc32 (files up to CRC_LIMIT) or None]} of every file under
    ``ckpt_dir`` except megarl.json, which carries it. Called by the writer before megarl.json."""
    out = {}
    for root, _, names in os.walk(ckpt_dir):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, ckpt_dir)
            if rel == META:
                continue
            size = os.path.getsize(path)
            out[rel] = [size, _crc32(path) if size <= CRC_LIMIT else None]
    return dict(sorted(out.items()))


def _check_dcp_dir(d: str) -> None:
    """Megatron's markers and every shard file the DCP index points into, whole."""
    from megarl.common.safe_load import read_dcp_metadata

    for name in ("metadata.json", "common.pt"):
        if not os.path.isfile(os.path.join(d, name)):
            raise CheckpointError(f"{os.path.join(d, name)}: missing")
    md = read_dcp_metadata(d)  # names .metadata when missing or unreadable
    need: dict[str, int] = collections.defaultdict(int)
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need[rel], int(info.offset) + int(info.length))
    for rel, end in sorted(need.items()):
        path = os.path.join(d, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (the index {os.path.join(d, '.metadata')} lists it)")
        size = os.path.getsize(path)
        if size < end:
            raise CheckpointError(f"{path}: truncated ({size} bytes, the index needs {end})")


def _check_manifest(path: str, files: dict) -> None:
    for rel, entry in files.items():
        f = os.path.join(path, rel)
        size, crc = (entry + [None])[:2] if isinstance(entry, list) else (entry, None)
        if not os.path.isfile(f):
            raise CheckpointError(f"{f}: missing (listed in {os.path.join(path, META)})")
        got = os.path.getsize(f)
        if got != size:
            raise CheckpointError(f"{f}: {got} bytes, {size} when saved")
        if crc is not None and _crc32(f) != crc:
            raise CheckpointError(f"{f}: contents changed since saved (CRC32 mismatch)")


def verify_checkpoint(path: str) -> dict:
    """Raises ``CheckpointError`` naming the first missing, short or altered file of checkpoint
    ``path``; returns its megarl.json."""
    meta = read_meta(path)
    if meta is None:
        raise CheckpointError(f"{os.path.join(path, META)}: missing or not a JSON object")
    if meta.get("complete") is not True:
        raise CheckpointError(f"{os.path.join(path, META)}: not marked complete")
    from megarl.common.safe_load import check_safe

    engines = meta.get("engines") if isinstance(meta.get("engines"), dict) else {}
    dcp_dirs = [path] + [os.path.join(path, name) for name in engines]
    for d in dcp_dirs:  # first: a planted pickle is refused as such, never reported as "changed"
        check_safe(d)
    files = meta.get(MANIFEST)
    if isinstance(files, dict):
        _check_manifest(path, files)
    for d in dcp_dirs:
        _check_dcp_dir(d)
    layout = meta.get("layout") if isinstance(meta.get("layout"), dict) else {}
    if meta.get("kind") == "training" and isinstance(layout.get("world_size"), int):
        for rank in range(layout["world_size"]):
            rng = os.path.join(path, "rng", f"rank_{rank:05d}.safetensors")
            if not os.path.isfile(rng):
                raise CheckpointError(f"{rng}: missing")
    return meta


def _read_latest(save_dir: str) -> tuple[Optional[str], Optional[str]]:
    """(checkpoint ``latest`` names, or None; a note when ``latest`` exists but is unusable)."""
    try:
        with open(os.path.join(save_dir, LATEST), "rb") as f:
            raw = f.read(256)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{LATEST} ignored (unreadable: {e.strerror or e})"
    name = raw.decode("utf-8", "replace").strip()
    if not STEP_DIR_RE.match(name):
        return None, f"{LATEST} ignored (holds {raw[:24]!r}, not a checkpoint name)"
    path = os.path.join(save_dir, name)
    meta = read_meta(path)
    if not (meta and meta.get("complete") is True):
        return None, f"{LATEST} ignored (names {name}, which is not a committed checkpoint)"
    return path, None


def _committed(save_dir: str) -> list[tuple[int, str]]:
    """``step_*`` directories whose megarl.json says complete, oldest first: every checkpoint a
    save committed, including ones damaged since (``list_checkpoints`` also wants the markers)."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for name in os.listdir(save_dir):
        m = STEP_DIR_RE.match(name)
        meta = read_meta(os.path.join(save_dir, name)) if m else None
        if meta and meta.get("complete") is True:
            found.append((int(m.group(1)), os.path.join(save_dir, name)))
    return sorted(found)


def find_resumable(save_dir: str) -> tuple[Optional[str], list[str]]:
    """(the checkpoint to resume from or None when there is none, notes: one line per checkpoint
    passed over and why). Raises ``CheckpointError`` when checkpoints exist but none is intact."""
    latest, note = _read_latest(save_dir)
    notes = [note] if note else []
    newest_first = [p for _, p in reversed(_committed(save_dir))]
    candidates = ([latest] if latest else []) + [p for p in newest_first if p != latest]
    first_damage = None
    for path in candidates:
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            first_damage = first_damage or e
            notes.append(f"{os.path.basename(path)} is damaged ({e}); passed over")
            continue
        return path, notes
    if first_damage is not None:
        older = f" (and {len(candidates) - 1} older one(s), also damaged)" if len(candidates) > 1 else ""
        raise CheckpointError(f"no intact checkpoint in {save_dir}: {first_damage}{older}")
    return None, notes
