"""Training checkpoints: Megatron dist-checkpointing (sharded ``torch_dist``), atomic and resumable.

Layout of ``checkpoint.save_dir`` (default ``<run_dir>/checkpoints``)::

    latest                        "step_00000300\\n": the newest complete checkpoint, replaced last
    step_00000300/                one complete checkpoint
      metadata.json               Megatron's format marker (torch_dist)
      .metadata, __<rank>_0.distcp  model + optimizer tensors, sharded by the saving layout; they
                                  load into any TP/PP/DP layout
      common.pt                   Megatron's non-sharded optimizer part (param groups: plain types)
      rng/rank_00000.safetensors  per-rank RNG states (restored only when the layout is unchanged)
      config.json, tokenizer.*    the HF config and tokenizer (mcore-to-hf and megarl-logprobs)
      megarl.json                 step, policy version, layout, scheduler, registered state (JSON);
                                  written last: a directory without it is not a checkpoint
    .tmp-step_00000400/           a save in progress, or killed: never resumed from, removed later

Save protocol (collective): every rank writes into ``.tmp-step_N`` -> barrier -> rank 0 writes
megarl.json (fsync) -> renames the directory to ``step_N`` -> replaces ``latest`` -> retires
checkpoints beyond ``keep_last`` (renamed away before deletion). A crash at any point leaves the
previous checkpoints intact and at most a ``.tmp-*`` directory that resume never picks. Resume takes
``latest`` when it names a complete checkpoint, else the newest complete ``step_*``.

Tensors are written synchronously by torch.distributed.checkpoint's own writer (no worker
processes: Megatron's async writer forks, needs psutil and re-imports ``__main__``). Loading is
safe: ``.metadata`` is unpickled with an allow-list of torch checkpoint dataclasses, ``common.pt``
must load with ``weights_only=True``, module ``_extra_state`` (pickled objects) is not saved, and
a checkpoint holding any pickled object is refused; megarl's own state is JSON and safetensors.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
import pickle
import random
import re
import shutil
import time
import warnings
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

META = "megarl.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
FORMAT = "megarl-checkpoint"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_DISTOPT_META = {"distrib_optim_sharding_type": "fully_reshardable"}
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.model", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory or key."""


def step_dir_name(step: int) -> str:
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
        m = _STEP_DIR.match(name)
        path = os.path.join(save_dir, name)
        if m and is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def find_latest(save_dir: str) -> Optional[str]:
    """The checkpoint ``latest`` names if it is complete, else the newest complete one."""
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            name = f.read().strip()
        if _STEP_DIR.match(name) and is_complete(os.path.join(save_dir, name)):
            return os.path.join(save_dir, name)
    except OSError:
        pass
    found = list_checkpoints(save_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory itself, or the latest complete checkpoint of a save directory."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    if is_complete(path):
        return path
    latest = find_latest(path)
    if latest is None:
        raise CheckpointError(f"{path}: not a complete megarl checkpoint (no {META} marking it "
                              f"complete) and holds no complete step_* checkpoint")
    return latest


# ----------------------------------------------------------------------------- safe loading

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_ALLOWED_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                    ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
                    ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                    ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch DCP ``.metadata``: its dataclasses, enums, torch.Size and dtypes only."""

    def find_class(self, module, name):
        known = module in _DCP_MODULES or module == "torch" or (module, name) in _ALLOWED_GLOBALS
        obj = super().find_class(module, name) if known else None
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and isinstance(
                obj, (torch.dtype, torch.layout, torch.memory_format))):
            return obj
        if module in _DCP_MODULES and isinstance(obj, type) and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_dcp_metadata(ckpt_dir: str):
    """The torch DCP ``Metadata`` of a checkpoint, unpickled through the allow-list."""
    path = os.path.join(ckpt_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not a torch_dist checkpoint)") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means "refuse"
        raise CheckpointError(f"{path}: refused or unreadable ({e})") from None


def check_safe(ckpt_dir: str) -> None:
    """Refuses a checkpoint that would make loading unpickle arbitrary objects."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_dcp_metadata(ckpt_dir)
    pickled = sorted(k for k, v in md.state_dict_metadata.items()
                     if not isinstance(v, TensorStorageMetadata))
    if pickled:
        raise CheckpointError(f"{ckpt_dir}: holds pickled objects ({pickled[0]}"
                              f"{f' and {len(pickled) - 1} more' if len(pickled) > 1 else ''}); "
                              "megarl loads tensors only")
    common = os.path.join(ckpt_dir, "common.pt")
    if os.path.exists(common):
        try:
            torch.load(common, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{common}: refused by weights_only loading ({e})") from None


# ----------------------------------------------------------------------------- format: save/load

def sync_save_strategy(resolve: Optional[Callable] = None):
    """Megatron's ``torch_dist`` format written synchronously by torch DCP's FileSystemWriter (one
    file per rank, one tensor in memory at a time, no worker processes).

    ``resolve(key, offsets, sizes) -> tensor`` makes the data lazy: the sharded state dict then only
    needs shapes (meta tensors) and each chunk is produced when it is written.
    """
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
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
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, keep_only_main_replica=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch ShardedTensor deprecation
                dcp_save(mcore_to_pyt_state_dict(flat, False),
                         storage_writer=FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True,
                                                         sync_files=True, thread_count=1),
                         planner=Planner(flatten_state_dict=False))

    return SyncTorchDist()


def _unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def model_sharded_state_dict(chunks) -> dict:
    """{"model": sd} (or "model0", "model1", ... per virtual stage) without ``_extra_state``."""
    out = {}
    for i, chunk in enumerate(chunks):
        sd = _unwrap(chunk).sharded_state_dict()
        out["model" if len(chunks) == 1 else f"model{i}"] = {
            k: v for k, v in sd.items() if not k.endswith("._extra_state")}
    return out


def _load(sharded: dict, ckpt_dir: str) -> dict:
    """dist_checkpointing.load that lists missing keys by name instead of failing inside DCP."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        state, missing, _ = dist_checkpointing.load(sharded, ckpt_dir, strict=StrictHandling.RETURN_ALL)
    if missing:
        names = sorted({m.split("/")[0] for m in missing})
        raise CheckpointError(f"{ckpt_dir}: missing {len(names)} tensor(s): {', '.join(names[:8])}"
                              f"{' ...' if len(names) > 8 else ''}")
    return state


def _load_modules(chunks, state: dict, ckpt_dir: str) -> None:
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
    check_safe(ckpt_dir)
    _load_modules(chunks, _load(model_sharded_state_dict(chunks), ckpt_dir), ckpt_dir)


# ----------------------------------------------------------------------------- optimizer quirks

def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _prime_optimizer_state(optimizer) -> None:
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


def _load_optimizer(optimizer, state: dict) -> None:
    import types

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

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


# ----------------------------------------------------------------------------- RNG

def _save_rng(path: str) -> None:
    from megatron.core import tensor_parallel
    from safetensors.torch import save_file

    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state().cpu()
    for name, st in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        tensors[f"tracker.{name}"] = st.cpu()
    np_state = np.random.get_state()
    meta = {"python": json.dumps(random.getstate()),
            "numpy": json.dumps([np_state[0], np_state[1].tolist(), *np_state[2:]])}
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=meta)


def _load_rng(path: str) -> None:
    from megatron.core import tensor_parallel
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    tracker = {k[len("tracker."):]: v for k, v in tensors.items() if k.startswith("tracker.")}
    if tracker:
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)
    version, internal, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ----------------------------------------------------------------------------- file helpers

def write_synced(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` through a temp file + fsync + rename."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
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
        old = os.path.join(os.path.dirname(final), f"{TMP_PREFIX}old-{os.path.basename(final)}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(os.path.abspath(final)))
    if old:
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- the manager

class CheckpointManager:
    """Saves and resumes everything a run needs to continue bitwise: model, optimizer (incl. the
    distributed optimizer's state), LR scheduler, RNG states, step, policy version and registered
    objects (``state_dict() -> JSON-able dict`` / ``load_state_dict(dict)``; rank 0's state is
    saved, every rank loads it).

        ckpt = CheckpointManager(cfg, ps, engine)
        ckpt.register("data", data)
        start = ckpt.resume()                    # last completed step, 0 when starting fresh
        for step in range(start + 1, n + 1):
            ...
            ckpt.maybe_save(step, last=step == n, policy_version=version)

    ``fault_hook(stage, step)`` (tests) runs on every rank at each save stage: "written" (tensors in
    the temp dir), "committing" (rank 0, before the rename), "committed" (rank 0, before ``latest``).
    """

    def __init__(self, cfg, ps, engine):
        self.cfg, self.ps, self.engine = cfg, ps, engine
        self.save_dir = cfg.checkpoint.save_dir or os.path.join(cfg.train.run_dir, "checkpoints")
        self.state: dict = {}
        self.policy_version = 0
        self.loaded_from: Optional[str] = None
        self.fault_hook: Optional[Callable[[str, int], None]] = None

    def register(self, name: str, obj) -> None:
        if name in self.state:
            raise ValueError(f"checkpoint: state {name!r} is already registered")
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"checkpoint: {name!r} needs state_dict() and load_state_dict()")
        self.state[name] = obj

    # ------------------------------------------------------------------ resume
    def resume(self) -> int:
        """Loads the latest complete checkpoint of save_dir; returns its step (0 if none)."""
        if not self.cfg.checkpoint.resume:
            return 0
        found = [find_latest(self.save_dir) if self.ps.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return 0
        return self.load(found[0])

    def load(self, path: str) -> int:
        """Restores the full training state from checkpoint directory ``path``; returns its step."""
        meta = read_meta(path)
        if not meta or not is_complete(path):
            raise CheckpointError(f"{path}: not a complete checkpoint")
        if meta.get("kind") != "training":
            raise CheckpointError(f"{path}: a {meta.get('kind')} checkpoint holds no optimizer state")
        want = bool(self.cfg.parallel.distributed_optimizer)
        if bool(meta.get("distributed_optimizer")) != want:
            raise CheckpointError(
                f"{path}: saved with parallel.distributed_optimizer={str(not want).lower()}; "
                f"resume with the same setting")
        check_safe(path)
        engine = self.engine
        _prime_optimizer_state(engine.optimizer)
        sharded = self._sharded_state_dict(is_loading=True)
        state = _load(sharded, path)
        _load_modules(engine.chunks, state, path)
        _load_optimizer(engine.optimizer, state["optimizer"])
        self._load_scheduler(meta["scheduler"])
        engine.step = int(meta["engine_step"])
        self.policy_version = int(meta["policy_version"])
        if meta["layout"] == self._layout():
            _load_rng(os.path.join(path, "rng", f"rank_{self.ps.rank:05d}.safetensors"))
        elif self.ps.rank == 0:
            print(f"[checkpoint] layout changed ({meta['layout']} -> {self._layout()}): "
                  "RNG states start fresh", flush=True)
        for name, obj in self.state.items():
            if name in meta["state"]:
                obj.load_state_dict(meta["state"][name])
            elif self.ps.rank == 0:
                print(f"[checkpoint] {path} has no state for {name!r}; it starts fresh", flush=True)
        self.loaded_from = path
        if self.ps.rank == 0:
            print(f"[checkpoint] resumed from {path} (step {meta['step']})", flush=True)
        return int(meta["step"])

    def _load_scheduler(self, saved: dict) -> None:
        """The config's schedule wins (a run may be extended); the position comes from the file."""
        sched = self.engine.scheduler
        changed = sorted(k for k, v in sched.state_dict().items()
                         if k != "num_steps" and saved.get(k) != v)
        if changed and self.ps.rank == 0:
            print(f"[checkpoint] LR schedule differs from the checkpoint in {', '.join(changed)}; "
                  "using the config's", flush=True)
        sched.num_steps = 0
        sched.step(increment=int(saved["num_steps"]))

    # ------------------------------------------------------------------ save
    def maybe_save(self, step: int, last: bool = False, policy_version: Optional[int] = None) -> None:
        c = self.cfg.checkpoint
        if last or (c.save_interval and step % c.save_interval == 0):
            self.save(step, policy_version)
        if c.hf_export_dir and (last or (c.hf_export_interval and step % c.hf_export_interval == 0)):
            self.engine.export_hf(c.hf_export_dir)

    def save(self, step: int, policy_version: Optional[int] = None) -> str:
        """Writes checkpoint ``step_<step>`` atomically (collective); returns its path."""
        from megatron.core import dist_checkpointing

        if policy_version is not None:
            self.policy_version = int(policy_version)
        t0 = time.perf_counter()
        name = step_dir_name(step)
        final, tmp = os.path.join(self.save_dir, name), os.path.join(self.save_dir, TMP_PREFIX + name)
        meta = [self._meta_json(step) if self.ps.rank == 0 else None]
        dist.broadcast_object_list(meta, src=0)  # a bad registered state fails on every rank
        if isinstance(meta[0], Exception):
            raise meta[0]
        if self.ps.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state_dict(is_loading=False), tmp,
                                sharded_strategy=sync_save_strategy())
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        _save_rng(os.path.join(tmp, "rng", f"rank_{self.ps.rank:05d}.safetensors"))
        self._stage("written", step)
        dist.barrier()
        if self.ps.rank == 0:
            self._commit(tmp, final, meta[0], step)
            print(f"[checkpoint] saved {final} in {time.perf_counter() - t0:.2f}s", flush=True)
        dist.barrier()
        return final

    def _commit(self, tmp: str, final: str, meta_text: str, step: int) -> None:
        """Rank 0: side files, megarl.json (last file in), rename, ``latest``, retention."""
        copy_hf_side_files(self.cfg.model.hf_path, tmp)
        tok = self.cfg.data.tokenizer_path
        if tok and os.path.isdir(tok):  # a separate tokenizer dir wins over the model's
            copy_hf_side_files(tok, tmp, [n for n in HF_SIDE_FILES if n.startswith("tokenizer")])
        write_synced(os.path.join(tmp, META), meta_text)
        self._stage("committing", step)
        commit_dir(tmp, final)
        self._stage("committed", step)
        write_synced(os.path.join(self.save_dir, LATEST), os.path.basename(final) + "\n")
        self._retire(keep=final)

    def _retire(self, keep: str) -> None:
        """Keeps the newest keep_last complete checkpoints (and ``keep``); removes stale temp
        directories. Each victim is renamed into a temp name first, so a crash mid-delete never
        leaves a damaged directory under a checkpoint name."""
        found = list_checkpoints(self.save_dir)
        victims = [p for _, p in found[:-self.cfg.checkpoint.keep_last] if p != keep]
        victims += [os.path.join(self.save_dir, n) for n in os.listdir(self.save_dir)
                    if n.startswith(TMP_PREFIX)]
        for path in victims:
            base = os.path.basename(path)
            trash = path if base.startswith(TMP_PREFIX) else os.path.join(
                self.save_dir, f"{TMP_PREFIX}trash-{base}")
            if trash != path:
                os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def _stage(self, stage: str, step: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(stage, step)

    # ------------------------------------------------------------------ contents
    def _sharded_state_dict(self, is_loading: bool) -> dict:
        sd = model_sharded_state_dict(self.engine.chunks)
        sd["optimizer"] = self.engine.optimizer.sharded_state_dict(
            dict(sd), is_loading=is_loading, metadata=_DISTOPT_META)
        return sd

    def _layout(self) -> dict:
        ps = self.ps
        return {"tp": ps.tp, "pp": ps.pp, "dp": ps.dp, "vpp": ps.vpp, "world_size": ps.world_size}

    def _meta_json(self, step: int):
        """megarl.json text (rank 0), or the exception to raise on every rank."""
        try:
            meta = {
                "format": FORMAT, "version": 1, "kind": "training", "complete": True,
                "step": step, "engine_step": self.engine.step, "policy_version": self.policy_version,
                "layout": self._layout(),
                "distributed_optimizer": bool(self.cfg.parallel.distributed_optimizer),
                "dtype": self.cfg.model.dtype, "scheduler": self.engine.scheduler.state_dict(),
                "state": {name: obj.state_dict() for name, obj in self.state.items()},
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
            return json.dumps(meta, indent=1)
        except (TypeError, ValueError) as e:
            return CheckpointError(f"checkpoint: registered state is not JSON-serialisable ({e})")
