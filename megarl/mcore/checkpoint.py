"""Megatron-core glue for checkpoints: the synchronous ``torch_dist`` save strategy, sharded state
dicts, loading with one-line errors, and the optimizer fixes a load needs.

Everything here works around or extends megatron-core 0.16.1; the private and deep names it uses are
pinned in `megarl.mcore.pins.CHECKPOINT_PINS` (and the optimizer ones in ``OPTIMIZER_PINS``), with
why each is used.

Behaviours of 0.16.1 this module corrects (no name to check; the dist tests catch them):
a fresh torch Adam has empty state, so the load template would hold no optimizer tensors
(``prime_optimizer_state``); ``DistributedOptimizer.load_state_dict`` gives every parameter the
SAME ``step`` tensor, which torch Adam then advances once per parameter per step
(``load_optimizer``); its ``_set_main_param_and_optimizer_states`` copies every key of the torch
state, 'step' included, which the fully_reshardable format keeps per group (``load_optimizer``
replaces it per instance for the load); the default distributed-optimizer format fails with
"flattened_range is not supported", so ``fully_reshardable`` is used; Megatron's async writer forks a
Manager that re-imports ``__main__`` and needs psutil (``sync_save_strategy`` writes synchronously
instead, or stages a copy that a thread of megarl's writes: ``checkpoint.async_save``).

Megatron is imported inside functions so that ``import megarl.checkpoint`` stays cheap for tools
that only look at files; so are megarl.checkpoint's own modules (that package imports this one).
"""
from __future__ import annotations

import types
import warnings
from typing import Callable, Optional

import torch

# the distributed optimizer's only format that saves and loads here (see the module docstring)
_DISTOPT_META = {"distrib_optim_sharding_type": "fully_reshardable"}


# ----------------------------------------------------------------------------- format: save

def sync_save_strategy(resolve: Optional[Callable] = None, stage_into: Optional[list] = None):
    """Megatron's ``torch_dist`` format written synchronously by torch DCP's FileSystemWriter (one
    file per rank, one tensor in memory at a time, no worker processes).

    ``resolve(key, offsets, sizes) -> tensor`` makes the data lazy: the sharded state dict then only
    needs shapes (meta tensors) and each chunk is produced when it is written.

    ``stage_into`` (a list): nothing is written; a `StagedWrite` holding a copy of this rank's
    shards (tensors copied to CPU memory, objects serialised) is appended, for `write_staged` to
    write later, from another thread, while training changes the originals.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint.planner import WriteItemType

    class Planner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            if resolve is None or write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            chunk = write_item.tensor_data.chunk
            return resolve(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))

    class SyncTorchDist(SaveShardedStrategy):
        def __init__(self):
            super().__init__("torch_dist", 1)

        @property
        def can_handle_sharded_objects(self):
            return True

        def save(self, sharded_state_dict, checkpoint_dir):
            # keep_only_main_replica: each replicated shard (e.g. over DP) is written by one rank
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, keep_only_main_replica=True)
            if stage_into is not None:
                for shards in flat.values():  # the copy the background write reads
                    for sh in shards:
                        if isinstance(sh, ShardedTensor):
                            sh.data = sh.data.detach().to("cpu", copy=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch ShardedTensor deprecation
                # objects are serialised here, tensors wrapped (the copies, when staged)
                staged = StagedWrite(mcore_to_pyt_state_dict(flat, False), str(checkpoint_dir), Planner)
            if stage_into is not None:
                stage_into.append(staged)
            else:
                write_staged(staged)

    return SyncTorchDist()


class StagedWrite:
    """One rank's shards of one dist-checkpoint, ready for torch DCP's writer."""

    def __init__(self, state_dict: dict, checkpoint_dir: str, planner_cls):
        self.state_dict, self.checkpoint_dir, self.planner_cls = state_dict, checkpoint_dir, planner_cls


def write_staged(staged: StagedWrite, group=None) -> None:
    """Writes a `StagedWrite` (collective over ``group``, default: the world): DCP plans over the
    group, then each rank writes its file."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dcp_save(staged.state_dict,
                 storage_writer=FileSystemWriter(staged.checkpoint_dir, single_file_per_rank=True,
                                                 sync_files=True, thread_count=1),
                 planner=staged.planner_cls(flatten_state_dict=False), process_group=group)


def _unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def model_sharded_state_dict(chunks) -> dict:
    """{"model": sd} (or "model0", "model1", ... per virtual stage) without ``_extra_state``."""
    # _extra_state holds pickled objects (TE fp8 metadata): saving it would make every
    # checkpoint fail check_safe, and the local spec has nothing in it worth keeping
    out = {}
    for i, chunk in enumerate(chunks):
        sd = _unwrap(chunk).sharded_state_dict()
        out["model" if len(chunks) == 1 else f"model{i}"] = {
            k: v for k, v in sd.items() if not k.endswith("._extra_state")}
    return out


def training_sharded_state_dict(chunks, optimizer, is_loading: bool) -> dict:
    """Model chunks plus the optimizer (the distributed optimizer in its fully_reshardable format,
    so a checkpoint loads into any TP/PP/DP layout)."""
    sd = model_sharded_state_dict(chunks)
    sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), is_loading=is_loading,
                                                   metadata=_DISTOPT_META)
    return sd


def stacked_piece(key: str, shape: tuple, dtype: torch.dtype, layer: Optional[int],
                  expert: Optional[int]):
    """A load request for one layer (and expert) of the stacked checkpoint key ``key`` of global
    ``shape``: a ``[1, (1,) ...]`` piece at offset ``layer`` of axis 0 (and ``expert`` of axis 1).
    Not ``prepend_axis_num``, whose legacy path needs every layer local in a 1-rank world."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    offsets = [] if layer is None else [(0, layer, shape[0])]
    if expert is not None:
        offsets.append((1, expert, shape[1]))
    piece = (1,) * len(offsets) + tuple(shape[len(offsets):])
    return ShardedTensor.from_rank_offsets(key, torch.empty(piece, dtype=dtype), *offsets)


def save_sharded(sharded: dict, ckpt_dir: str, stage_into: Optional[list] = None) -> None:
    """Writes a sharded state dict into ``ckpt_dir`` (collective; the directory must exist). With
    ``stage_into`` only Megatron's small files are written; the shards are copied and staged there
    (`sync_save_strategy`)."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded, ckpt_dir, sharded_strategy=sync_save_strategy(stage_into=stage_into))


# ----------------------------------------------------------------------------- format: load

def check_shapes(sharded: dict, ckpt_dir: str) -> None:
    """Every tensor of ``sharded`` that the checkpoint holds has the same global shape there
    (a checkpoint of another model size fails here, naming the tensor and both shapes, instead
    of deep inside DCP). Tensors Megatron allows to differ (the padded vocabulary) are skipped."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megarl.common.errors import CheckpointError
    from megarl.common.safe_load import read_dcp_metadata

    stored = read_dcp_metadata(ckpt_dir).state_dict_metadata
    tensors = sorted((sh for sh in nested_values(sharded) if isinstance(sh, ShardedTensor)),
                     key=lambda sh: sh.key)  # the first mismatch by name: a stable message
    for sh in tensors:
        if sh.allow_shape_mismatch:
            continue
        have = stored.get(sh.key)
        if isinstance(have, TensorStorageMetadata) and tuple(have.size) != tuple(sh.global_shape):
            raise CheckpointError(f"{ckpt_dir}: tensor {sh.key} has shape {tuple(have.size)} in the "
                                  f"checkpoint but {tuple(sh.global_shape)} in this model "
                                  "(a checkpoint of another model size?)")


def load_sharded(sharded: dict, ckpt_dir: str) -> dict:
    """dist_checkpointing.load that checks shapes first and lists missing keys by name instead of
    failing inside DCP; any other failure of the load is one line naming the checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megarl.common.errors import CheckpointError

    check_shapes(sharded, ckpt_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            state, missing, _ = dist_checkpointing.load(sharded, ckpt_dir, strict=StrictHandling.RETURN_ALL)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - damage verify_checkpoint cannot see (same-size junk)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"{ckpt_dir}: cannot load ({type(e).__name__}: {first[:300]})") from e
    if not any(k.startswith("optimizer") for k in sharded):  # a model-only load of a training checkpoint
        missing = [m for m in missing if not m.startswith("optimizer.")]
    if missing:
        names = sorted({m.split("/")[0] for m in missing})
        raise CheckpointError(f"{ckpt_dir}: missing {len(names)} tensor(s): {', '.join(names[:8])}"
                              f"{' ...' if len(names) > 8 else ''}")
    return state


def load_modules(chunks, state: dict, ckpt_dir: str) -> None:
    """Copies the loaded model state into ``chunks``; every parameter must be restored."""
    from megarl.common.errors import CheckpointError

    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        result = _unwrap(chunk).load_state_dict(state[key], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        if missing or result.unexpected_keys:
            raise CheckpointError(f"{ckpt_dir}: parameters not restored: "
                                  f"{', '.join((missing + list(result.unexpected_keys))[:8])}")


def load_model_weights(chunks, ckpt_dir: str) -> None:
    """Loads only the model weights of a checkpoint (any saving layout) into ``chunks``.
    Collective over all ranks."""
    from megarl.common.safe_load import check_safe

    check_safe(ckpt_dir)
    load_modules(chunks, load_sharded(model_sharded_state_dict(chunks), ckpt_dir), ckpt_dir)


# ----------------------------------------------------------------------------- optimizer quirks

def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def prime_optimizer_state(optimizer) -> None:
    """A fresh torch Adam has no state, so the load template would hold no optimizer tensors:
    give every parameter zero moments and step 0 (overwritten by the load)."""
    for opt in _inner_optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                          step=torch.zeros((), dtype=torch.float32))


def _copy_loaded_states_only(self, model_param, tensors: dict) -> None:
    """DistributedOptimizer._set_main_param_and_optimizer_states copies every key of the torch
    state, 'step' included, which the fully_reshardable format keeps per group: KeyError."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    dst = {"param": main_param, **self.optimizer.state[main_param]}
    for key, value in tensors.items():
        dst[key].copy_(value)


def load_optimizer(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)`` with the 0.16.1 fixes described in the module docstring."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    # the patch is an instance attribute for the duration of the load only: the class (and any
    # other optimizer in the process) is never modified
    for opt in _inner_optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer) and not opt.config.use_precision_aware_optimizer:
            opt._set_main_param_and_optimizer_states = types.MethodType(_copy_loaded_states_only, opt)
    try:
        optimizer.load_state_dict(state)
    finally:
        for opt in _inner_optimizers(optimizer):
            opt.__dict__.pop("_set_main_param_and_optimizer_states", None)
    # DistributedOptimizer.load_state_dict hands every parameter the SAME step tensor, which torch
    # Adam increments in place once per parameter: give each its own copy.
    for opt in _inner_optimizers(optimizer):
        for st in opt.optimizer.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()
