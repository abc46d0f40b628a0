"""The cores of a node shared by the trainer and its local rollout servers, split per phase
(``train.torch_threads: auto``).

A trainer rank owns its share of the cores the servers leave: ``(cores - server threads) /
ranks on the node``, at least one, at most ``OMP_NUM_THREADS`` when that is set. Its update may borrow the servers' cores when they are idle:
asynchronous generation of short answers finishes early in the step and the server then waits
for the next version (``rollout_idle_ratio``), while the trainer's update is what the step waits
for. `ThreadSplit` decides, before each update, from what the last steps measured: below
``BORROW_AT`` servers' idle share (smoothed) the update runs on its own share (generation is the
bottleneck, or close to it: the servers keep their cores); at or above it, on the thread count
measured cheaper per trained token - both counts alternate in the first ``TRIALS`` steps of
every ``RETRY_EVERY`` and their medians decide, the servers' cores borrowed only when that makes
the update at least 10% cheaper (a small model's operations can be too small to split: the
demo's update is slower on two threads than on one). Every other phase (waiting, pushing,
evaluating) runs on the trainer's own share.

Borrowing applies to a single trainer rank on CPU (it alone reads the servers' idle share, a rank
deciding apart from the others would make the data-parallel ranks unequal, and a GPU's update does
not wait for CPU threads); otherwise the split is fixed. Every step reports ``trainer/update_threads`` and ``trainer/servers_idle`` (the
smoothed share the decision read), and a change of decision is printed with its reason.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Optional

from megarl.common import compat

BORROW_AT = 0.5  # the servers idle at least half of the recent steps: their cores go to the update
SMOOTHING = 0.3  # weight of the newest step in the servers' smoothed idle share
TRIALS, RETRY_EVERY = 8, 100  # the first 8 steps of every 100 (servers idle) alternate the two counts
MARGIN = 0.9  # borrowing must make the update at least 10% cheaper: contention costs the servers too


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


@dataclass
class ThreadSplit:
    own: int  # the trainer rank's share of the cores
    borrow: int  # cores the update may take from idle local servers (0: the split is fixed)
    idle: Optional[float] = None  # the servers' smoothed idle share; None before the first step
    update_threads: int = 0
    reason: str = ""
    steps: int = 0
    choice: int = 0  # the count the last trials chose for idle servers (0: none yet)
    cost: dict = field(default_factory=dict)  # threads -> median update seconds per trained token, last trials
    trials: dict = field(default_factory=dict)  # threads -> this trial window's costs
    _trying: bool = False

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
        # the update runs on the CPU only without CUDA: on GPU its threads are not what it waits for
        return cls(own, servers if world_size == 1 and not compat.HAVE_CUDA else 0)

    def before_update(self) -> int:
        """The update's threads (set here), from what the last steps measured."""
        import torch

        n, why = self._decide()
        if n != self.update_threads:
            print(f"[megarl] update threads {self.update_threads or '-'} -> {n}: {why}", flush=True)
        self.update_threads, self.reason = n, why
        torch.set_num_threads(n)
        return n

    def _decide(self) -> tuple[int, str]:
        self._trying = False
        if not self.borrow:
            return self.own, "a fixed split (no local servers, or more than one trainer rank)"
        if self.idle is None or self.idle < BORROW_AT:
            busy = "(not measured yet)" if self.idle is None else f"{1 - self.idle:.0%}"
            return self.own, f"the local servers were busy {busy} of the recent steps: they keep their core(s)"
        more = self.own + self.borrow
        idle = f"the local servers were idle {self.idle:.0%} of the recent steps"
        if self.steps % RETRY_EVERY < TRIALS:  # (re)measure both counts now and then
            self._trying = True
            n = (self.own, more)[self.steps % 2]
            return n, f"{idle}; measuring the update at {n} thread(s)"
        if not self.cost:
            return self.own, f"{idle}; not measured at both counts yet"
        ms = ", ".join(f"{k}: {1e6 * v:.1f} us" for k, v in sorted(self.cost.items()))
        return self.choice, f"{idle}; the update per trained token (median of the last trials) at {ms}"

    def after_update(self) -> None:
        """The other phases on the trainer's own share."""
        import torch

        torch.set_num_threads(self.own)

    def observe(self, rollout_idle: Optional[float], update_s: Optional[float] = None, tokens: int = 0) -> dict:
        """The step's servers' idle share (rank 0's ``rollout_idle_ratio``; None elsewhere) and
        its update's seconds per trained token at this step's thread count folded in; returns
        the step's metrics."""
        if rollout_idle is not None:
            self.idle = rollout_idle if self.idle is None else (
                SMOOTHING * rollout_idle + (1 - SMOOTHING) * self.idle)
        if self._trying and update_s is not None and tokens > 0:
            self.trials.setdefault(self.update_threads, []).append(update_s / tokens)
            if self.steps % RETRY_EVERY == TRIALS - 1:  # the window's last trial: its medians decide
                self.cost = {k: statistics.median(v) for k, v in self.trials.items()}
                more = self.own + self.borrow
                cheaper = self.cost.get(more, float("inf")) < MARGIN * self.cost.get(self.own, 0.0)
                self.choice, self.trials = (more if cheaper else self.own), {}
        self.steps += 1
        out = {"trainer/update_threads": self.update_threads}
        if self.idle is not None:
            out["trainer/servers_idle"] = self.idle
        return out
