"""On-disk layout of megarl checkpoints: naming, the completion marker, discovery, atomic commits.

Layout of ``checkpoint.save_dir`` (default ``<run_dir>/checkpoints``)::

    latest                        "step_00000300\\n": the newest complete checkpoint, replaced last
    step_00000300/                one complete checkpoint
      metadata.json               Megatron's format marker (torch_dist)
      .metadata, __<rank>_0.distcp  model + optimizer tensors, sharded by the saving layout; they
                                  load into any TP/PP/DP layout
      common.pt                   Megatron's non-sharded optimizer part (param groups: plain types)
      rng/rank_00000.safetensors  per-rank RNG states (restored only when the layout is unchanged)
      config.json, tokenizer.*    the HF config and tokenizer (mcore-to-hf and megarl-logprobs)
      megarl.json                 step, policy version, layout, vocab_size (the original one; the
                                  tensors hold padded_vocab_size rows), scheduler, registered state (JSON),
                                  the manifest (every file's size, CRC32 of small ones: verify.py)
                                  and the run's per-step log sizes (megarl/common/runlogs.py);
                                  written last: a directory without it is not a checkpoint
    .tmp-step_00000400/           a save in progress, or killed: never resumed from, removed later

Everything here is plain file-system work (no torch, no Megatron) so that tools can find and
validate checkpoints cheaply, and so that the one invariant every reader relies on lives in one
place: a directory counts as a checkpoint only when ``megarl.json`` says ``complete`` and
Megatron's own markers are present. ``find_latest`` takes ``latest`` when it names a complete
checkpoint, else the newest complete ``step_*``; whether its files are intact is ``verify.py``'s
question (resume passes over damaged ones).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

from megarl.common.errors import CheckpointError  # noqa: F401 - raised here, and by megarl.mcore below this package

META = "megarl.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
FORMAT = "megarl-checkpoint"
STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.model", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json")


def step_dir_name(step: int) -> str:
    # zero-padded so that lexical order is step order for people listing the directory
    return f"step_{step:08d}"


# ----------------------------------------------------------------------------- finding checkpoints

def read_meta(path: str) -> Optional[dict]:
    """megarl.json of a checkpoint directory, or None when absent or unreadable."""
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def is_complete(path: str) -> bool:
    """True when ``path`` is a committed checkpoint. megarl.json is written last (after every
    rank's tensors and Megatron's markers), so its ``complete`` flag plus the markers it follows
    is the whole test; a killed save never has it."""
    meta = read_meta(path)
    return bool(meta and meta.get("complete") is True
                and os.path.isfile(os.path.join(path, "metadata.json"))
                and os.path.isfile(os.path.join(path, ".metadata")))


def list_checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """Complete ``step_*`` checkpoints in ``save_dir``, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for name in os.listdir(save_dir):
        m = STEP_DIR_RE.match(name)
        path = os.path.join(save_dir, name)
        if m and is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def find_latest(save_dir: str) -> Optional[str]:
    """The checkpoint ``latest`` names if it is complete, else the newest complete one."""
    # ``latest`` is only a hint: it is replaced after the commit, so a crash in between leaves it
    # one checkpoint behind, and a hand-edited or damaged one must not block resuming.
    try:
        with open(os.path.join(save_dir, LATEST), "rb") as f:  # bytes: it may hold garbage
            name = f.read(256).decode("utf-8", "replace").strip()
        if STEP_DIR_RE.match(name) and is_complete(os.path.join(save_dir, name)):
            return os.path.join(save_dir, name)
    except OSError:
        pass
    found = list_checkpoints(save_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory itself, or the latest complete checkpoint of a save directory."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    if is_complete(path) or (read_meta(path) or {}).get("complete") is True:
        return path  # committed; whether it is still intact is verify_checkpoint's to say
    latest = find_latest(path)
    if latest is None:
        raise CheckpointError(f"{path}: not a complete megarl checkpoint (no {META} marking it "
                              f"complete) and holds no complete step_* checkpoint")
    return latest


# ----------------------------------------------------------------------------- atomic commits

def write_synced(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` through a temp file + fsync + rename."""
    # readers see either the old file or the whole new one, never a torn write
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    # a rename is durable only once its directory entry is flushed
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_hf_side_files(src_dir: str, dst_dir: str, names=HF_SIDE_FILES) -> None:
    """config.json, tokenizer and generation config, where ``src_dir`` has them."""
    for name in names:
        if src_dir and os.path.isfile(os.path.join(src_dir, name)):
            shutil.copy(os.path.join(src_dir, name), os.path.join(dst_dir, name))


def commit_dir(tmp: str, final: str) -> None:
    """Atomically puts ``tmp`` at ``final`` (an existing ``final`` is moved aside, then removed)."""
    _fsync_dir(tmp)
    old = None
    if os.path.exists(final):
        # moved under a temp name, not deleted in place: a crash mid-delete must never leave a
        # half-removed directory under a checkpoint name (temp names are never resumed from)
        old = os.path.join(os.path.dirname(final), f"{TMP_PREFIX}old-{os.path.basename(final)}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(os.path.abspath(final)))
    if old:
        shutil.rmtree(old, ignore_errors=True)
