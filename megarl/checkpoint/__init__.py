"""Training checkpoints: Megatron dist-checkpointing (sharded ``torch_dist``), atomic, resumable
in any TP/PP/DP layout, and safe to load.

    layout.py   step directory naming, megarl.json, is_complete / find_latest / resolve_checkpoint,
                atomic commit helpers (write_synced, commit_dir, copy_hf_side_files)
    safe.py     allow-list unpickler for DCP metadata; check_safe refuses pickled content
    verify.py   verify_checkpoint (every file there and whole, cheaply, before a load; the manifest
                in megarl.json), find_resumable (the newest intact checkpoint, saying what it passed over)
    (megarl/mcore/checkpoint.py: the megatron-core side - the sync torch_dist save strategy,
                sharded state dicts, loading, optimizer fixes - with the other pinned internals)
    rng.py      per-rank RNG states as safetensors
    manager.py  CheckpointManager: register / resume / load / maybe_save / save / retention
    export.py   the HF export schedule the training loops call (maybe_export_hf)

The names below are the package's public surface; ``from megarl.checkpoint import X`` is the way
to import them.
"""
from megarl.checkpoint.export import hf_export_due, maybe_export_hf
from megarl.checkpoint.layout import (
    FORMAT, HF_SIDE_FILES, LATEST, META, TMP_PREFIX, CheckpointError, commit_dir, copy_hf_side_files,
    find_latest, is_complete, list_checkpoints, read_meta, resolve_checkpoint, step_dir_name,
    write_synced)
from megarl.checkpoint.manager import CheckpointManager
from megarl.common.safe_load import check_safe, read_dcp_metadata
from megarl.checkpoint.verify import file_manifest, find_resumable, verify_checkpoint
from megarl.mcore.checkpoint import load_model_weights, model_sharded_state_dict, sync_save_strategy

__all__ = [
    "FORMAT", "HF_SIDE_FILES", "LATEST", "META", "TMP_PREFIX", "CheckpointError", "CheckpointManager",
    "check_safe", "commit_dir", "copy_hf_side_files", "file_manifest", "find_latest", "find_resumable",
    "hf_export_due", "is_complete",
    "list_checkpoints", "load_model_weights", "maybe_export_hf", "model_sharded_state_dict",
    "read_dcp_metadata", "read_meta", "resolve_checkpoint", "step_dir_name", "sync_save_strategy",
    "verify_checkpoint", "write_synced",
]
