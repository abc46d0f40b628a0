"""CheckpointManager: saves and resumes the whole training state of a run, atomically.

Save protocol (collective): every rank writes into ``.tmp-step_N`` -> barrier -> rank 0 writes
megarl.json (fsync) -> renames the directory to ``step_N`` -> replaces ``latest`` -> retires
checkpoints beyond ``keep_last`` (renamed away before deletion). A crash at any point leaves the
previous checkpoints intact and at most a ``.tmp-*`` directory that resume never picks. The
directory layout and the completion rule are in ``layout.py``; what makes loading safe in
``safe.py``; everything that knows Megatron's sharded formats in ``megarl/mcore/checkpoint.py``.

Tensors are written by torch.distributed.checkpoint's own writer (no worker processes: Megatron's
async writer forks, needs psutil and re-imports ``__main__``) - synchronously, or with
``checkpoint.async_save`` from a writer thread: the save copies this rank's shards to host memory
(the only part on the step's critical path), and the thread writes them, agrees with the other
ranks over a process group of its own (collectives of two threads never share a group) and
commits, while training goes on. One save is in flight at most: the next save waits for it, and
so do the last step's save and ``close()``; an error of the thread is raised there.

The manager owns resumable state only. The HF export is the run's deliverable, not state it
resumes from, so its schedule lives with the loops (``export.maybe_export_hf``).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import time
from typing import Callable, Optional

import torch.distributed as dist

from megarl.common import runlogs
from megarl.checkpoint.layout import (
    FORMAT, HF_SIDE_FILES, LATEST, META, TMP_PREFIX, CheckpointError, commit_dir, copy_hf_side_files,
    find_latest, is_complete, list_checkpoints, read_meta, step_dir_name, write_synced)
from megarl.checkpoint.rng import load_rng, save_rng
from megarl.common.safe_load import check_safe
from megarl.checkpoint.verify import MANIFEST, file_manifest, find_resumable, verify_checkpoint
from megarl.mcore import checkpoint as mcore


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
            maybe_export_hf(cfg, engine, step, last=step == n)   # the HF export: export.py

    ``fault_hook(stage, step)`` (tests) runs on every rank at each save stage: "written" (tensors in
    the temp dir), "committing" (rank 0, before the rename), "committed" (rank 0, before ``latest``).
    """

    def __init__(self, cfg, ps, engine):
        self.cfg, self.ps, self.engine = cfg, ps, engine
        self.save_dir = cfg.checkpoint.save_dir or os.path.join(cfg.train.run_dir, "checkpoints")
        self.state: dict = {}
        self.extra_engines: dict = {}  # name -> engine saved in <checkpoint>/<name>/ (the critic)
        self.policy_version = 0
        self.loaded_from: Optional[str] = None
        self.fault_hook: Optional[Callable[[str, int], None]] = None
        self.async_save = bool(getattr(cfg.checkpoint, "async_save", False))
        self._writer = None  # the background save in flight: (thread, step, error box)
        # the writer thread's own group: DCP's planning collectives run beside the trainer's
        self._group = dist.new_group(backend="gloo") if self.async_save else None
        self.last_save_s = 0.0  # the save's time on the step's critical path (async: the copy)

    def register(self, name: str, obj) -> None:
        if name in self.state:
            raise ValueError(f"checkpoint: state {name!r} is already registered")
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"checkpoint: {name!r} needs state_dict() and load_state_dict()")
        self.state[name] = obj

    def add_engine(self, name: str, engine) -> None:
        """A second trained model (the GAE critic): its weights, optimizer and LR schedule go to
        the sub-directory ``name`` of every checkpoint, a dist-checkpoint of its own (so its
        tensor keys never collide with the policy's)."""
        if name in self.extra_engines or name in ("rng",):
            raise ValueError(f"checkpoint: engine {name!r} is already registered")
        self.extra_engines[name] = engine

    # ------------------------------------------------------------------ resume
    def resume(self) -> int:
        """Loads the newest intact checkpoint of save_dir (``verify.find_resumable``: a damaged
        newer one is passed over with one line saying why); returns its step (0 if none). The
        run's per-step logs are cut back to what they held when that checkpoint was saved
        (``megarl.common.runlogs``), emptied when there is none."""
        if not self.cfg.checkpoint.resume:
            return 0
        found: list = [None]
        if self.ps.rank == 0:
            try:
                found = [find_resumable(self.save_dir)]
            except CheckpointError as e:  # raised on every rank, not only here
                found = [e]
        dist.broadcast_object_list(found, src=0)
        if isinstance(found[0], Exception):
            raise found[0]
        path, notes = found[0]
        for note in notes if self.ps.rank == 0 else ():
            print(f"[checkpoint] {note}", flush=True)
        step = self.load(path) if path is not None else 0
        if self.ps.rank == 0:
            self._rollback_logs(read_meta(path) if path is not None else {})
        return step

    def _rollback_logs(self, meta: dict) -> None:
        """Rank 0: per-step logs back to their sizes at the save (only for the run that saved)."""
        run_dir = os.path.abspath(self.cfg.train.run_dir)
        saved = meta.get("run_logs")
        if saved is None and meta:  # saved before sizes were recorded: leave the logs alone
            return
        if saved is not None and saved.get("run_dir") != run_dir:
            return  # another run's checkpoint: its sizes say nothing about this run's logs
        cut = runlogs.rollback(run_dir, (saved or {}).get("sizes", {}))
        if cut:
            print(f"[checkpoint] per-step logs rolled back to the checkpoint: {'; '.join(cut)}", flush=True)

    def load(self, path: str) -> int:
        """Restores the full training state from checkpoint directory ``path``; returns its step."""
        meta = read_meta(path)
        if not meta or not is_complete(path):
            raise CheckpointError(f"{path}: not a complete checkpoint")
        verify_checkpoint(path)
        if meta.get("kind") != "training":
            raise CheckpointError(f"{path}: a {meta.get('kind')} checkpoint holds no optimizer state")
        want = bool(self.cfg.parallel.distributed_optimizer)
        if bool(meta.get("distributed_optimizer")) != want:
            raise CheckpointError(
                f"{path}: saved with parallel.distributed_optimizer={str(not want).lower()}; "
                f"resume with the same setting")
        check_safe(path)
        self._load_engine(self.engine, path, meta["scheduler"], meta["engine_step"])
        for name, extra in self.extra_engines.items():
            saved = meta.get("engines", {}).get(name)
            if saved is None:
                raise CheckpointError(f"{path}: holds no {name!r} model; resume with the same algorithm")
            check_safe(os.path.join(path, name))
            self._load_engine(extra, os.path.join(path, name), saved["scheduler"], saved["engine_step"])
        self.policy_version = int(meta["policy_version"])
        if meta["layout"] == self._layout():
            load_rng(os.path.join(path, "rng", f"rank_{self.ps.rank:05d}.safetensors"))
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

    def _load_engine(self, engine, path: str, scheduler: dict, engine_step: int) -> None:
        mcore.prime_optimizer_state(engine.optimizer)  # before the template: it needs the tensors
        sharded = mcore.training_sharded_state_dict(engine.chunks, engine.optimizer, is_loading=True)
        state = mcore.load_sharded(sharded, path)
        mcore.load_modules(engine.chunks, state, path)
        mcore.load_optimizer(engine.optimizer, state["optimizer"])
        self._load_scheduler(engine.scheduler, scheduler)
        engine.step = int(engine_step)

    def _load_scheduler(self, sched, saved: dict) -> None:
        """The config's schedule wins (a run may be extended); the position comes from the file."""
        changed = sorted(k for k, v in sched.state_dict().items()
                         if k != "num_steps" and saved.get(k) != v)
        if changed and self.ps.rank == 0:
            print(f"[checkpoint] LR schedule differs from the checkpoint in {', '.join(changed)}; "
                  "using the config's", flush=True)
        sched.num_steps = 0
        sched.step(increment=int(saved["num_steps"]))

    # ------------------------------------------------------------------ save
    def maybe_save(self, step: int, last: bool = False, policy_version: Optional[int] = None) -> None:
        """Saves every ``checkpoint.save_interval`` steps when set, and always at the last step
        (which, saved in the background, is waited for)."""
        c = self.cfg.checkpoint
        if last or (c.save_interval and step % c.save_interval == 0):
            self.save(step, policy_version)
            if last:
                self.wait()

    def wait(self) -> None:
        """Waits for a background save to be committed (collective); raises its error."""
        if self._writer is None:
            return
        thread, step, box = self._writer
        thread.join()
        self._writer = None
        if box:
            raise box[0]

    close = wait

    def save(self, step: int, policy_version: Optional[int] = None) -> str:
        """Writes checkpoint ``step_<step>`` atomically (collective); returns its path. With
        ``checkpoint.async_save`` it returns once the shards are copied; the directory appears
        when the writer thread has committed it."""
        self.wait()  # one background save at a time
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
            for name in self.extra_engines:
                os.makedirs(os.path.join(tmp, name))
        dist.barrier()  # the temp dir exists (and is empty) before any rank writes into it
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        error, staged = None, [] if self.async_save else None
        try:
            self._write(tmp, staged)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - decided together below: all raise, none hangs
            error = e
        if staged is None:
            self._finish(error, tmp, final, meta[0], step, t0)
            self.last_save_s = time.perf_counter() - t0
            return final
        # the logs' sizes now: a resume from this checkpoint rolls back to them, not to the commit's
        sizes = runlogs.sizes(os.path.abspath(self.cfg.train.run_dir)) if self.ps.rank == 0 else None
        self._agree_written(error, tmp, final, group=None)  # a failed copy: raised here, on every rank
        self.last_save_s = time.perf_counter() - t0
        box: list = []

        def write():
            err = None
            try:
                for job in staged:
                    mcore.write_staged(job, self._group)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed in _finish
                err = e
            try:
                self._finish(err, tmp, final, meta[0], step, t0, background=True, sizes=sizes)
            except BaseException as e:  # noqa: BLE001 - raised on the trainer's thread by wait()
                box.append(e)

        import threading

        thread = threading.Thread(target=write, name=f"checkpoint-{step}", daemon=True)
        thread.start()
        self._writer = (thread, step, box)
        return final

    def _finish(self, error, tmp: str, final: str, meta_text: str, step: int, t0: float,
                background: bool = False, sizes: Optional[dict] = None) -> None:
        """After the writes: agree, then rank 0 commits (on the writer's group when in the background;
        ``sizes``: rank 0's per-step log sizes at the save)."""
        group = self._group if background else None
        self._agree_written(error, tmp, final, group=group)
        self._stage("written", step)
        dist.barrier(group=group)  # every rank's tensors are on disk before rank 0 marks the checkpoint complete
        if self.ps.rank == 0:
            self._commit(tmp, final, meta_text, step, sizes)
            how = " in the background" if background else ""
            print(f"[checkpoint] saved {final}{how} in {time.perf_counter() - t0:.2f}s", flush=True)
        dist.barrier(group=group)  # no rank goes on (or exits) before the checkpoint is committed

    def _write(self, tmp: str, staged: Optional[list] = None) -> None:
        """This rank's shards of every engine, and its RNG states, into ``tmp`` (``staged``: the
        shards copied and appended there instead, `megarl.mcore.checkpoint.save_sharded`)."""
        for directory, engine in [(tmp, self.engine)] + [
                (os.path.join(tmp, n), e) for n, e in self.extra_engines.items()]:
            mcore.save_sharded(mcore.training_sharded_state_dict(
                engine.chunks, engine.optimizer, is_loading=False), directory, stage_into=staged)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        save_rng(os.path.join(tmp, "rng", f"rank_{self.ps.rank:05d}.safetensors"))

    def _agree_written(self, error: Optional[BaseException], tmp: str, final: str, group=None) -> None:
        """Every rank learns whether any rank failed to write; then all raise one line (the
        partial directory removed, ``latest`` still naming the previous checkpoint) or go on."""
        import torch

        free = shutil.disk_usage(self.save_dir).free  # read before the partial directory is removed
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
        if not failed.item():
            return
        if self.ps.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier(group=group)
        raise save_error(error, final, self.save_dir, free, self._bytes_needed())

    def _bytes_needed(self) -> int:
        """What a checkpoint of this run takes: the newest complete one's size, else the engines'
        parameters with their fp32 Adam state (weights, two moments, main params: 16 bytes each)."""
        done = list_checkpoints(self.save_dir)
        if done:
            path = done[-1][1]
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
        engines = [self.engine, *self.extra_engines.values()]
        return sum(16 * p.numel() for e in engines for c in e.chunks for p in c.parameters())

    def _commit(self, tmp: str, final: str, meta_text: str, step: int, sizes: Optional[dict] = None) -> None:
        """Rank 0: side files, megarl.json (last file in), rename, ``latest``, retention."""
        copy_hf_side_files(self.cfg.model.hf_path, tmp)
        tok = self.cfg.data.tokenizer_path
        if tok and os.path.isdir(tok):  # a separate tokenizer dir wins over the model's
            copy_hf_side_files(tok, tmp, [n for n in HF_SIDE_FILES if n.startswith("tokenizer")])
        meta = json.loads(meta_text)
        # last, so that they describe the directory as committed: what verify_checkpoint checks,
        # and how far the per-step logs had got (what a resume from here rolls them back to)
        meta[MANIFEST] = file_manifest(tmp)
        run_dir = os.path.abspath(self.cfg.train.run_dir)
        meta["run_logs"] = {"run_dir": run_dir, "sizes": runlogs.sizes(run_dir) if sizes is None else sizes}
        write_synced(os.path.join(tmp, META), json.dumps(meta, indent=1))
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
    def _layout(self) -> dict:
        ps = self.ps
        layout = {"tp": ps.tp, "pp": ps.pp, "dp": ps.dp, "vpp": ps.vpp, "world_size": ps.world_size}
        if ps.ep > 1:  # only MoE runs have it: dense layouts compare equal to older checkpoints'
            layout["ep"] = ps.ep
        if ps.cp > 1:  # likewise
            layout["cp"] = ps.cp
        return layout

    def _meta_json(self, step: int):
        """megarl.json text (rank 0), or the exception to raise on every rank."""
        try:
            meta = {
                "format": FORMAT, "version": 1, "kind": "training", "complete": True,
                "step": step, "engine_step": self.engine.step, "policy_version": self.policy_version,
                "layout": self._layout(),
                # the original vocabulary (exports strip Megatron's padding back to it)
                "vocab_size": self.engine.args.vocab_size,
                "padded_vocab_size": self.engine.args.mcore_vocab_size,
                "distributed_optimizer": bool(self.cfg.parallel.distributed_optimizer),
                "dtype": self.cfg.model.dtype, "scheduler": self.engine.scheduler.state_dict(),
                "state": {name: obj.state_dict() for name, obj in self.state.items()},
                "engines": {name: {"engine_step": e.step, "scheduler": e.scheduler.state_dict()}
                            for name, e in self.extra_engines.items()},
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
            lora = getattr(self.engine.spec, "lora", None)
            if lora is not None:  # megarl-convert merges the adapters (megarl.commands.conversion)
                meta["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                                "target_modules": list(lora.target_modules)}
            return json.dumps(meta, indent=1)
        except (TypeError, ValueError) as e:
            return CheckpointError(f"checkpoint: registered state is not JSON-serialisable ({e})")


def save_error(error: Optional[BaseException], final: str, save_dir: str, free: int, needed: int) -> CheckpointError:
    """One line for a save that failed on some rank: a full disk says so (torch's writer reports it
    as "enforce fail at inline_container.cc" with a C++ trace, errno lost), anything else is named.
    ``error`` is None on the ranks that wrote their part."""
    mib = 1 << 20
    chain, todo = [], [error]
    while todo and len(chain) < 16:
        e = todo.pop()
        if e is None:
            continue
        chain.append(e)
        # torch.distributed.checkpoint's CheckpointException: {rank: (exception, traceback)}
        todo += [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
        todo += [e.__cause__, e.__context__]
    full = (any(getattr(x, "errno", None) == errno.ENOSPC for x in chain) or free < max(needed // 100, mib)
            or any("No space left" in str(x) for x in chain))
    latest = find_latest(save_dir)
    kept = f"the previous checkpoint {latest} is intact and stays latest" if latest else "no checkpoint was kept"
    if full:
        return CheckpointError(f"checkpoint.save_dir: no space left on {save_dir} to write {os.path.basename(final)}: "
                               f"it needs ~{needed / mib:.1f} MiB, {free / mib:.1f} MiB free; {kept}")
    first = chain[-1] if chain else None  # the innermost failure: what a user can act on
    what = "another rank failed" if first is None else f"{type(first).__name__}: {str(first).strip().splitlines()[0][:300]}"
    return CheckpointError(f"checkpoint.save_dir: writing {final} failed ({what}); {kept}")
