"""The one metrics path: merge `Stat`s (masked sums with explicit counts), reduce once, log.

    tracker.add_stats(out.stats)                 # dict[str, megarl.algo.Stat] from a loss function
    tracker.add("loss", loss_sum, n_tokens)      # a masked mean with its explicit denominator
    tracker.add_scalar("grad_norm", gn)          # a plain value: sum = value, count = 1
    stats = tracker.reduce(ps)                   # over DP on the last PP stage, then to every rank
    logger.log(stats, step)                      # jsonl (always), tensorboard, wandb, console

Means are global: sums over all DP ranks and calls divided by the summed count, so ranks with more
tokens weigh more (never a mean of per-rank means); `Reduce.MAX` stats take the max. The engine,
the actor and the critic all reduce through `StatsTracker`. Also `print0` and a dependency-free
`progress`.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megarl.algo.stats import Reduce, Stat, merge_stats

__all__ = ["StatsTracker", "reduce_stats", "MetricsLogger", "print0", "get_rank", "progress"]


def _to_float(x: Any) -> float:
    return float(x.detach().item()) if isinstance(x, torch.Tensor) else float(x)


def _scalar(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(())
    return torch.tensor(float(x), dtype=torch.float64)


def get_rank() -> int:
    """Global rank: torch.distributed's if initialized, else $RANK, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def print0(*args: Any, **kwargs: Any) -> None:
    """print() on global rank 0 only (flushed)."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def reduce_stats(stats: dict[str, Stat], group=None, device="cpu") -> dict[str, float]:
    """name -> `Stat.result()` after summing (SUM values, all counts) and max-ing (MAX values) over
    `group`: ONE packed all-reduce per reduction kind present, none for a group of one.

    Invariant: every rank of `group` holds the same names with the same reduction kinds (any
    values, count 0 allowed), since the packed tensors are laid out by sorted name.
    """
    names = sorted(stats)
    by_kind = {kind: [n for n in names if stats[n].reduce == kind] for kind in Reduce}
    values = {n: stats[n].value for n in names}
    counts = {n: stats[n].count for n in names}
    if group is not None and dist.get_world_size(group) > 1:
        def packed(xs):
            return torch.stack([x.to(device=device, dtype=torch.float64) for x in xs])

        sums = by_kind[Reduce.SUM]
        # Layout [SUM values by name..., counts of all names by name...]: identical on every
        # rank only because the names are (the invariant above); float64 keeps sums of
        # float32 token stats exact enough over many ranks.
        if names:  # SUM values and every count travel together
            t = packed([values[n] for n in sums] + [counts[n] for n in names])
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
            values.update(zip(sums, t[: len(sums)].cpu()))
            counts.update(zip(names, t[len(sums):].cpu()))
        if by_kind[Reduce.MAX]:
            t = packed([values[n] for n in by_kind[Reduce.MAX]])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            values.update(zip(by_kind[Reduce.MAX], t.cpu()))
    return {n: Stat(values[n], counts[n], stats[n].reduce).result() for n in names}


class StatsTracker:
    """Thread-safe accumulator of named `Stat`s (merged over micro-batches, mini-batches, calls),
    reduced by `reduce` once per step; then it is empty.

    Invariant for `reduce` over DP: every DP rank of the last pipeline stage has added the same
    names with the same reduction kinds (in any order, any number of times, count 0 allowed).
    """

    def __init__(self) -> None:
        self._stats: dict[str, Stat] = {}
        self._prefix: list[str] = []
        self._lock = threading.Lock()

    def _name(self, name: str) -> str:
        return "/".join(self._prefix + [name])

    @property
    def stats(self) -> dict[str, Stat]:
        """The merged, not yet reduced stats (a copy)."""
        with self._lock:
            return dict(self._stats)

    @contextlib.contextmanager
    def scope(self, prefix: str) -> Iterator["StatsTracker"]:
        """Names added inside get "prefix/" prepended (scopes nest). Not per-thread."""
        self._prefix.append(prefix)
        try:
            yield self
        finally:
            self._prefix.pop()

    def add_stats(self, stats: dict[str, Stat]) -> None:
        """Merge a loss function's stats (SUM stats add, MAX stats max)."""
        named = {self._name(k): v for k, v in stats.items()}
        with self._lock:
            self._stats = merge_stats(self._stats, named)

    def add(self, name: str, value_sum: Any, count: Any) -> None:
        """Add a sum and the number of items it sums (e.g. masked token sum and mask.sum())."""
        self.add_stats({name: Stat(_scalar(value_sum), _scalar(count).to(torch.float64))})

    def add_scalar(self, name: str, value: Any) -> None:
        """A single observation (count 1); its reduced value is the mean over calls and ranks."""
        self.add(name, value, 1.0)

    def add_masked(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """sum(values * mask) over sum(mask)."""
        self.add_stats({name: Stat.masked_mean(values, mask)})

    def reduce(self, ps: Optional[Any] = None) -> dict[str, float]:
        """name -> reduced result on EVERY rank; the tracker is emptied.

        `ps` (a `megarl.trainer.parallel.ParallelState`; None: this process alone) says where: only the
        last pipeline stage runs loss functions, so it reduces over its DP group (`reduce_stats`)
        and broadcasts the dict over the pipeline group.
        """
        with self._lock:
            stats, self._stats = self._stats, {}
        if ps is None:
            return reduce_stats(stats)
        box: list = [None]
        if ps.is_last_stage:
            box = [reduce_stats(stats, ps.dp_group if ps.dp > 1 else None, ps.device)]
        if ps.pp > 1:
            dist.broadcast_object_list(box, src=ps.last_stage_rank, group=ps.pp_group)
        return box[0]


class _JsonlSink:
    """One row per step, in step order, across restarts: a run that resumes from a checkpoint
    older than its last logged step (after a crash or a hard kill) logs those steps again, and
    the first such write drops the old rows from that step on, so no step appears twice."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        rows = self._rows()
        self._last = rows[-1][0] if rows else None
        self._f = open(path, "a", encoding="utf-8")
        if self._f.tell() != sum(len(line.encode()) for _, line in rows):
            self._rewind((self._last or 0) + 1)  # drop a torn line before appending after it

    def _rows(self) -> list[tuple[int, str]]:
        """(step, line) of every complete row; a torn last line (killed mid-write) is skipped."""
        if not os.path.exists(self.path):
            return []
        rows = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append((int(json.loads(line)["step"]), line if line.endswith("\n") else line + "\n"))
                except (ValueError, KeyError, TypeError):
                    continue
        return rows

    def _rewind(self, step: int) -> None:
        self._f.close()
        keep = [line for s, line in self._rows() if s < step]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(tmp, self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, metrics: dict[str, float], step: int) -> None:
        if self._last is not None and step <= self._last:
            self._rewind(step)
        row = {"step": step, "time": round(time.time(), 3)}
        row.update({k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()})
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        self._last = step

    def close(self) -> None:
        self._f.close()


class _TensorboardSink:
    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self._w = SummaryWriter(log_dir=log_dir)

    def write(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class _WandbSink:
    def __init__(self, project: str, run_name: str | None, config: dict | None, run_dir: str):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=project, name=run_name, config=config, dir=run_dir)

    def write(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class _ConsoleSink:
    def __init__(self, keys: list[str] | None, max_keys: int = 8, interval: int = 1):
        self._keys, self._max_keys, self._interval = keys, max_keys, interval

    def write(self, metrics: dict[str, float], step: int) -> None:
        if step % self._interval and step != 1:
            return  # logging.log_interval: the console line every N steps (files get every step)
        keys = self._keys if self._keys is not None else list(metrics)[: self._max_keys]
        parts = [f"{k} {metrics[k]:.4g}" for k in keys if k in metrics]
        print(" | ".join([f"step {step}"] + parts), flush=True)

    def close(self) -> None:
        pass


class MetricsLogger:
    """Rank-0 sinks behind one `log(metrics, step)`; on other ranks every call is a no-op.

    Always `RUN_DIR/metrics.jsonl` (one flushed line per step: step, time, metrics); tensorboard
    under RUN_DIR/tensorboard when `tensorboard=True` and it imports; wandb when `wandb_project` is
    set and wandb imports; a console line with `console_keys` (default: the first 8 metrics) every
    `console_interval` steps (and at step 1).
    A sink that cannot start is reported once and skipped; the run never fails for a logger.
    """

    def __init__(
        self,
        run_dir: str,
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        wandb_run_name: str | None = None,
        config: dict | None = None,
        console: bool = True,
        console_keys: list[str] | None = None,
        console_interval: int = 1,
        enabled: bool | None = None,
    ):
        self.run_dir = run_dir
        self.enabled = get_rank() == 0 if enabled is None else enabled
        self.sinks: list[Any] = []
        if not self.enabled:
            return
        self.sinks.append(_JsonlSink(os.path.join(run_dir, "metrics.jsonl")))
        optional = []
        if tensorboard:
            optional.append(("tensorboard", lambda: _TensorboardSink(os.path.join(run_dir, "tensorboard"))))
        if wandb_project:
            optional.append(("wandb", lambda: _WandbSink(wandb_project, wandb_run_name, config, run_dir)))
        for name, make in optional:
            try:
                self.sinks.append(make())
            except ImportError as e:
                print(f"[metrics] {name} logging off: {e}", file=sys.stderr, flush=True)
        if console:
            self.sinks.append(_ConsoleSink(console_keys, interval=console_interval))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        clean = {k: _to_float(v) for k, v in metrics.items()}
        for sink in self.sinks:
            sink.write(clean, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def progress(
    iterable: Iterable | int, desc: str = "", total: int | None = None, enabled: bool | None = None
) -> Iterator:
    """Yield from `iterable` (or range(n) for an int) while drawing a one-line bar on stderr.

    On a terminal the line is redrawn at most 10x/s; otherwise (log files) a line is printed at
    most every 10 s. Only rank 0 draws unless `enabled` says otherwise.
    """
    if isinstance(iterable, int):
        iterable, total = range(iterable), iterable
    elif total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    show = (get_rank() == 0) if enabled is None else enabled
    tty = sys.stderr.isatty()
    interval = 0.1 if tty else 10.0
    start = last = time.monotonic()
    done = 0

    def draw(final: bool = False) -> None:
        elapsed = time.monotonic() - start
        rate = done / elapsed if elapsed > 0 else 0.0
        if total:
            frac = min(done / total, 1.0)
            bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
            eta = (total - done) / rate if rate > 0 else 0.0
            text = f"{desc} [{bar}] {done}/{total} {_fmt_time(elapsed)}<{_fmt_time(eta)} {rate:.2f}it/s"
        else:
            text = f"{desc} {done} {_fmt_time(elapsed)} {rate:.2f}it/s"
        end = "\n" if final or not tty else ""
        print(("\r" if tty else "") + text, end=end, file=sys.stderr, flush=True)

    for item in iterable:
        yield item
        done += 1
        now = time.monotonic()
        if show and now - last >= interval:
            last = now
            draw()
    if show:
        draw(final=True)
