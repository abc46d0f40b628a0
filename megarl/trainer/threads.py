"""The cores of a node shared by the trainer and its local rollout servers, split per phase
(``train.torch_threads: auto``).

A trainer rank owns its share of the cores the servers leave: ``(cores - server threads) /
ranks on the node``, at least one, at most ``OMP_NUM_THREADS`` when that is set. Two phases of a
step may then use the other side's cores, each decided before it from what the last steps
measured (`ThreadSplit`):

- **the update** may borrow the servers' cores while they idle: asynchronous generation of short
  answers finishes early in the step and the servers then wait for the next version
  (``rollout_idle_ratio``), while the trainer's update is what the step waits for. At or above
  ``BORROW_AT`` servers' idle share (smoothed), the update runs on the thread count measured
  cheaper per trained token;
- **the wait** for the next batch may lend the trainer's own cores to the servers (megarl-server's
  ``/set_threads``, `megarl.protocol.wire.EXT_THREADS`): when generation is what the step waits
  for (``trainer_idle_ratio`` at or above ``LEND_AT``), the trainer's cores have nothing to do until
  the batch is complete. The servers go back to their own count when the wait ends, before the
  update starts.

Each choice is a `Trial`: both settings alternate in a window of ``TRIALS`` steps every
``RETRY_EVERY`` (the update's first, then the wait's, so that one never confounds the other), and
their medians of seconds per trained token decide; the larger count only when at least 10%
cheaper (a small model's operations can be too small to split: the demo's update is slower on two
threads than on one, and so is its server's generation). Every other phase (pushing, evaluating)
runs on the trainer's own share and the servers' own count.

The split moves only for a single trainer rank on CPU beside local servers that are not pinned
to cores of their own (`rollout.server_cpus`): that rank alone reads the servers' idle share, a
rank deciding apart from the others would make the data-parallel ranks unequal, and a GPU's
update does not wait for CPU threads. Lending needs megarl-server (SGLang cannot change its
threads while serving). Otherwise the split is fixed. Every step reports
``trainer/update_threads``, ``trainer/servers_idle`` (the smoothed share the update's choice
read), ``trainer/wait_server_threads`` and ``trainer/trainer_idle`` (the wait's), and a change of
either choice is printed with its reason.
"""
from __future__ import annotations

import contextlib
import os
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

from megarl.common import compat
from megarl.config.server_wire import local_extensions
from megarl.protocol.wire import EXT_THREADS

BORROW_AT = 0.5  # the servers idle at least half of the recent steps: their cores may go to the update
LEND_AT = 0.25  # the trainer waits at least a quarter of the recent steps: its cores may go to generation
SMOOTHING = 0.3  # weight of the newest step in a smoothed idle share
TRIALS, RETRY_EVERY = 8, 100  # 8 steps of every 100 alternate a choice's two settings
MARGIN = 0.9  # the larger count must be at least 10% cheaper: contention costs the other side too


def node_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ranks_on_node(world_size: int, env) -> int:
    """Trainer ranks sharing this node, as the launcher says (torchrun, Open MPI, MPICH, SLURM);
    else every rank (a single node)."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if env.get(name, "").isdigit():
            return max(1, int(env[name]))
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # "2(x3)": 2 on each of 3 nodes
    return max(1, int(per_node)) if per_node.isdigit() else max(1, world_size)


def smooth(old: Optional[float], new: Optional[float]) -> Optional[float]:
    if new is None:
        return old
    return new if old is None else SMOOTHING * new + (1 - SMOOTHING) * old


@dataclass
class Trial:
    """One phase's two thread counts (``base``, ``more``), alternated in a window of ``TRIALS``
    steps every ``RETRY_EVERY`` starting at ``offset``; the window's medians of seconds per trained
    token choose."""
    base: int
    more: int
    what: str  # the phase, in its reasons ("the update")
    offset: int = 0
    choice: int = 0  # what the last window chose (0: none yet)
    cost: dict = field(default_factory=dict)  # count -> median seconds per trained token, last window
    samples: dict = field(default_factory=dict)  # count -> this window's seconds per trained token

    def in_window(self, step: int) -> bool:
        return self.offset <= step % RETRY_EVERY < self.offset + TRIALS

    def trial_count(self, step: int) -> int:
        return (self.base, self.more)[step % 2]

    def record(self, step: int, count: int, seconds_per_token: float) -> None:
        self.samples.setdefault(count, []).append(seconds_per_token)
        if step % RETRY_EVERY == self.offset + TRIALS - 1:  # the window's last step: its medians decide
            self.cost = {k: statistics.median(v) for k, v in self.samples.items()}
            cheaper = self.cost.get(self.more, float("inf")) < MARGIN * self.cost.get(self.base, 0.0)
            self.choice, self.samples = (self.more if cheaper else self.base), {}
            print(f"[megarl] trials of {self.what}: {self.costs()} per trained token (medians) -> "
                  f"{self.choice} thread(s)", flush=True)

    def costs(self) -> str:
        return ", ".join(f"{k}: {1e6 * v:.1f} us" for k, v in sorted(self.cost.items()))

    def decide(self, step: int, because: str) -> tuple[int, str, bool]:
        """The count at ``step`` of a phase that may move (``because`` says why), its reason, and
        whether the step is a trial."""
        if self.in_window(step):  # (re)measure both counts now and then
            n = self.trial_count(step)
            return n, f"{because}; measuring {self.what} at {n} thread(s)", True
        if not self.cost:
            return self.base, f"{because}; not measured at both counts yet", False
        return self.choice, (f"{because}; {self.what} per trained token (median of the last trials) at "
                             f"{self.costs()}"), False


@dataclass
class ThreadSplit:
    own: int  # the trainer rank's share of the cores
    borrow: int  # cores the update may take from idle local servers (0: the update's count is fixed)
    lend: int = 0  # cores the servers may take while the trainer waits (0: their count is fixed)
    server_threads: int = 1  # each local server's own count (rollout.server_threads)
    send: Optional[Callable[[int], object]] = None  # sets every local server's count (the manager relays)
    idle: Optional[float] = None  # the servers' smoothed idle share; None before the first step
    waited: Optional[float] = None  # the trainer's smoothed idle (waiting) share
    update_threads: int = 0
    wait_threads: int = 0  # the servers' count during this step's wait
    reason: str = ""
    wait_reason: str = ""
    steps: int = 0
    servers_at: int = 0  # the count the servers were last set to (0: their start count)
    update_trial: Optional[Trial] = None  # the update's two counts
    wait_trial: Optional[Trial] = None  # the servers' two counts while the trainer waits
    _trying: tuple = ()  # the phases whose trial window this step is in

    def __post_init__(self):
        self.update_trial = Trial(self.own, self.own + self.borrow, "the update")
        self.wait_trial = Trial(self.server_threads, self.server_threads + self.lend, "the wait with the servers",
                                offset=TRIALS)

    @classmethod
    def for_run(cls, cfg, rank: int, world_size: int, env=None) -> Optional["ThreadSplit"]:
        """The split of ``train.torch_threads: auto`` for this rank (None: a fixed count or
        torch's default, set once at start). The local servers run on rank 0's node (the
        launcher's first ``ranks_on_node`` ranks)."""
        if cfg.train.torch_threads is not None:
            return None
        r, env = cfg.rollout, os.environ if env is None else env
        local_ranks = ranks_on_node(world_size, env)
        local = cfg.train.is_rl and not r.servers and r.placement == "disaggregated" and rank < local_ranks
        servers = r.local_servers * r.server_threads if local else 0
        own = max(1, (node_cores() - servers) // local_ranks)
        if env.get("OMP_NUM_THREADS", "").isdigit():  # the launcher's (torchrun: 1) or the user's cap
            own = max(1, min(own, int(env["OMP_NUM_THREADS"])))
        # the phases run on the CPU only without CUDA; pinned servers cannot use another core
        moves = servers and world_size == 1 and not compat.HAVE_CUDA and not r.server_cpus
        # the servers a job starts are known by kind: megarl-server can change its threads, SGLang cannot
        lend = own // r.local_servers if moves and EXT_THREADS in local_extensions(r.engine) else 0
        return cls(own, servers if moves else 0, lend, r.server_threads)

    # ------------------------------------------------------------------ the update
    def before_update(self) -> int:
        """The update's threads (set here), from what the last steps measured."""
        import torch

        n, why = self._decide_update()
        if n != self.update_threads:
            print(f"[megarl] update threads {self.update_threads or '-'} -> {n}: {why}", flush=True)
        self.update_threads, self.reason = n, why
        torch.set_num_threads(n)
        return n

    def _decide_update(self) -> tuple[int, str]:
        trial = self.update_trial
        if not self.borrow:
            return self.own, "a fixed split (no local servers, or more than one trainer rank)"
        if self.idle is None or self.idle < BORROW_AT:
            busy = "(not measured yet)" if self.idle is None else f"{1 - self.idle:.0%}"
            return self.own, f"the local servers were busy {busy} of the recent steps: they keep their core(s)"
        n, why, trying = trial.decide(self.steps, f"the local servers were idle {self.idle:.0%} of the recent steps")
        self._trying += ("update",) * trying
        return n, why

    def after_update(self) -> None:
        """The other phases on the trainer's own share."""
        import torch

        torch.set_num_threads(self.own)

    # ------------------------------------------------------------------ the wait
    @contextlib.contextmanager
    def waiting(self):
        """Around the wait for the next batch: the servers' count for it, then their own again."""
        n, why = self._decide_wait()
        if n != self.wait_threads:
            print(f"[megarl] server threads while the trainer waits {self.wait_threads or '-'} -> {n}: {why}",
                  flush=True)
        self.wait_threads, self.wait_reason = n, why
        self._set_servers(n)
        try:
            yield n
        finally:
            self._set_servers(self.server_threads)

    def _decide_wait(self) -> tuple[int, str]:
        trial = self.wait_trial
        if not self.lend or self.send is None:
            return self.server_threads, ("the servers' count is fixed (not megarl-server, not local, pinned, "
                                         "or more than one trainer rank)")
        if self.waited is None or self.waited < LEND_AT:
            share = "(not measured yet)" if self.waited is None else f"{self.waited:.0%}"
            return self.server_threads, f"the trainer waited {share} of the recent steps: it keeps its core(s)"
        n, why, trying = trial.decide(self.steps, f"the trainer waited {self.waited:.0%} of the recent steps")
        self._trying += ("wait",) * trying
        return n, why

    def _set_servers(self, n: int) -> None:
        if self.send is None or n == (self.servers_at or self.server_threads):
            return
        try:
            self.send(n)
            self.servers_at = n
        except Exception as e:  # noqa: BLE001 - a server that refuses keeps its count; the run goes on
            print(f"[megarl] server threads stay {self.server_threads}: setting {n} failed ({e}); "
                  "no more lending this run", flush=True)
            self.lend, self.send = 0, None

    def server_restarted(self) -> None:
        """A local server came back (at its start count)."""
        self.servers_at = 0

    # ------------------------------------------------------------------ the step's measurements
    def observe(self, rollout_idle: Optional[float], update_s: Optional[float] = None, tokens: int = 0,
                trainer_idle: Optional[float] = None, wait_s: Optional[float] = None) -> dict:
        """The step's servers' and trainer's idle shares (rank 0's ``rollout_idle_ratio`` and
        ``trainer_idle_ratio``; None elsewhere) and the seconds per trained token of its update and
        its wait at this step's counts folded in; returns the step's metrics."""
        self.idle, self.waited = smooth(self.idle, rollout_idle), smooth(self.waited, trainer_idle)
        if tokens > 0:
            if "update" in self._trying and update_s is not None:
                self.update_trial.record(self.steps, self.update_threads, update_s / tokens)
            if "wait" in self._trying and wait_s is not None:
                self.wait_trial.record(self.steps, self.wait_threads, wait_s / tokens)
        self._trying = ()
        self.steps += 1
        out = {"trainer/update_threads": self.update_threads}
        if self.idle is not None:
            out["trainer/servers_idle"] = self.idle
        if self.lend:
            out["trainer/wait_server_threads"] = self.wait_threads
            if self.waited is not None:
                out["trainer/trainer_idle"] = self.waited
        return out
