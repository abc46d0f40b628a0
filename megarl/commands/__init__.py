"""The checkpoint commands: ``megarl-convert`` (HF <-> Megatron dist checkpoints) and ``megarl-logprobs``.
(Not to be confused with `megarl.tools`, the tools a tool-calling workflow lets the model call, nor
with the repository's tools/, developer scripts and benchmarks.)

Shared conventions: inputs are validated in the launching process before any rank starts, bad
input ends in one line ``<prog>: <message>`` on stderr and a non-zero exit (no traceback), outputs
appear atomically (temp path + rename), and a command whose ``--tp/--pp`` needs several ranks
re-executes itself under torchrun unless it already runs under torchrun/srun/mpirun.
"""
from __future__ import annotations

import os
import shutil
import warnings
from typing import Callable

from megarl.common.errors import ToolError  # noqa: F401 - the tools' error type, shared with the library


def run_tool(prog: str, fn: Callable[[], int], debug: bool = False) -> int:
    """Runs ``fn``; known errors (bad input) become ``prog: message`` on stderr and exit status 1,
    unexpected ones one line too (exit status 1); ``debug`` shows the traceback instead."""
    from megarl.checkpoint import CheckpointError
    from megarl.common.cli import run_main

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch ShardedTensor deprecation
    warnings.filterwarnings("ignore", message=".*(cuda_graph_scope|Transformer Engine|Apex).*")
    return run_main(prog, fn, debug, expected=(ToolError, CheckpointError, FileNotFoundError, ValueError,
                                               KeyError), code=1)


def needs_launch(nproc: int) -> bool:
    from megarl.trainer import parallel

    return nproc > 1 and not parallel.under_launcher()


def init_ranks(tp: int, pp: int, ep: int = 1):
    """torch.distributed (a private loopback port when not under a launcher) + model parallel.
    Returns (ParallelState, created) where ``created`` says this call made the process group."""
    import torch.distributed as dist

    from megarl.common import compat
    from megarl.trainer import parallel
    from megarl.common.net import LOOPBACK, free_port

    compat.quiet_megatron_warnings()
    created = not dist.is_initialized()
    if created and not parallel.under_launcher():
        os.environ.setdefault("MASTER_ADDR", LOOPBACK)
        os.environ["MASTER_PORT"] = str(free_port())
    info = parallel.init_distributed()
    if info.world_size % (tp * pp):
        raise ToolError(f"world size {info.world_size} is not divisible by tp*pp={tp * pp}")
    if (info.world_size // (tp * pp)) % ep:
        raise ToolError(f"--ep {ep} does not divide the data-parallel size {info.world_size // (tp * pp)}")
    return parallel.init_model_parallel(tp, pp, ep=ep), created


def finish_ranks(created: bool) -> None:
    import torch.distributed as dist

    from megarl.trainer import parallel

    parallel.destroy_model_parallel_only()
    if created and dist.is_initialized():
        dist.destroy_process_group()


def temp_output_dir(out: str) -> str:
    """The temp directory an output is written into before the final rename."""
    out = os.path.abspath(out)
    return os.path.join(os.path.dirname(out), f".tmp-{os.path.basename(out)}")


def check_output_dir(out: str, force: bool, inputs: dict[str, str] = {}) -> None:
    """``out`` can be written (atomically: ``.tmp-<out>`` then a rename) without touching an input:
    it may not be, contain or lie inside any of ``inputs`` ({flag: path}), --force or not."""
    real = os.path.realpath(out)
    for flag, path in inputs.items():
        src = os.path.realpath(path)
        if real == src:
            raise ToolError(f"--out {out}: is the input ({flag} {path}); write somewhere else")
        if _inside(real, src):
            raise ToolError(f"--out {out}: lies inside the input ({flag} {path}); write somewhere else")
        if _inside(src, real):
            raise ToolError(f"--out {out}: contains the input ({flag} {path}), which replacing it would delete")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ToolError(f"--out {out}: exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ToolError(f"--out {out}: exists and is not empty (pass --force to replace it)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ToolError(f"--out {out}: parent directory {parent} does not exist")
    check_writable("--out", out, parent)


def check_output_file(flag: str, path: str, inputs: dict[str, str] = {}) -> None:
    """``path`` can be written (atomically: ``<path>.tmp`` then a rename): not a directory, not
    one of ``inputs`` ({flag: path}), in a directory that exists and takes new files."""
    for in_flag, src in inputs.items():
        if os.path.realpath(path) == os.path.realpath(src):
            raise ToolError(f"{flag} {path}: is the {in_flag} file; write somewhere else")
    if os.path.isdir(path):
        raise ToolError(f"{flag} {path}: is a directory (expected a file path)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ToolError(f"{flag} {path}: directory {parent} does not exist")
    check_writable(flag, path, parent)


def check_writable(flag: str, out: str, parent: str) -> None:
    """Creates and removes a file in ``parent``: the only test that holds for root, read-only
    mounts and ACLs alike (os.access does not), done before any rank starts or any work."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(prefix=".megarl-probe-", dir=parent)
    except OSError as e:
        raise ToolError(f"{flag} {out}: cannot write in {parent} ({e.strerror or e})") from None
    os.close(fd)
    os.remove(probe)


def _inside(path: str, parent: str) -> bool:
    return path.startswith(parent.rstrip(os.sep) + os.sep)


def discard(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
