"""Trainer ranks' side of the rollout manager (megarl.rollout.manager).

    rank 0                       every rank                          rollout manager
    ManagerCluster ──Link──────────────────────────────────────────▶ RolloutCluster + controller
      version (the trainer's count of pushes; the manager publishes it to the servers)
      pause_for_update()   request: waits (the servers must be paused before bytes arrive)
      end_push(v)          submitted, not awaited: load-wait, version flip, commit, resume run
                           on the manager while the next update starts; errors surface at the
                           next push's settle()
    next_batch()           rank 0 reads one `Batch`; one byte broadcast gives every rank the
                           step's flat arrays (megarl.trainer.handoff), each pads its DP rank's
                           contiguous share into its `TensorBatch`

`RemoteAdmin` has `AdminRunner`'s `request` / `send` of admin messages (the closed set
`megarl.protocol.messages.ADMIN_MESSAGES`), so the weight transports are the same code whether the
admin connection is local or the manager's.

The channel's secret: rank 0 makes one per run and hands it to the manager it spawns through an
inherited pipe, or reads ``rollout.manager_secret_file`` for a manager started apart; the other
ranks get it with the server list (a pipeline stage's weight source opens its own link).
No thread and no event loop of the trainer serves rollout traffic: a link is a blocking socket.
"""
from __future__ import annotations

import logging
import os
import subprocess
from typing import Optional

import torch.distributed as dist

from megarl.protocol.channel import ChannelError, Link, ManagerStalled, RemoteError
from megarl.protocol.servers import HoldsServers, ServerSet
from megarl.protocol.messages import (AddServer, Admitted, BatchRequest, EvalPoll, EvalSubmit, FinishPush, Init,
                                      PauseForUpdate, PushFailed, RemoveServer, Resume, SetThreads, Sleep, Start,
                                      StateRequest, Unhealthy, Wake)
from megarl.trainer.handoff import ReceivedStep, receive_step

log = logging.getLogger("megarl.link")


class ManagerDied(ChannelError):
    """The rollout manager process is gone: the run stops; a resume trains every pending prompt once."""


class RemoteAdmin:
    """A `megarl.weights.target.StageAdmin` over a link to the manager, which runs each admin
    message against its own admin connection (megarl.rollout.admin.ADMIN_CALLS)."""

    def __init__(self, link: Link, cluster: "ManagerCluster", timeout_s: float, owns_link: bool = False):
        self.link, self.cluster, self.timeout_s, self.owns_link = link, cluster, timeout_s, owns_link

    def request(self, msg, timeout: Optional[float] = None):
        msg.timeout_s = timeout or msg.timeout_s or self.timeout_s
        # +5 s over the manager's own deadline: its error (naming the servers) arrives before ours fires
        return self.link.request(msg, msg.timeout_s + 5.0, what=msg.endpoint)

    def send(self, msg):
        msg.timeout_s = msg.timeout_s or self.timeout_s
        return self.link.submit(msg, what=msg.endpoint)

    @property
    def addresses(self) -> list[str]:
        return list(self.cluster.addresses)

    def close(self) -> None:
        if self.owns_link:  # a stage source's own link (the driver's belongs to RolloutSide)
            self.link.close()


class PushLane:
    """A push's protocol steps over one link: pause, publish (submitted, not awaited), settle
    (the replies of what was submitted). The driver link's own for synchronous pushes; an
    overlapped push's flight gets a link of its own (`ManagerCluster.push_lane`), so that its
    steps run while the trainer's thread waits for its next batch on the driver link."""

    def __init__(self, link: Link, cluster: "ManagerCluster", timeout_s: float, side=None, owns_link: bool = False):
        self.link, self.timeout_s, self.side = link, timeout_s, side
        self.admin = RemoteAdmin(link, cluster, timeout_s, owns_link=owns_link)

    def _request(self, msg):
        # +10 s: the manager's cluster steps run under weights.timeout_s; its error must arrive first
        try:
            return self.link.request(msg, self.timeout_s + 10.0, what=type(msg).__name__)
        except RemoteError:
            raise
        except Exception as e:  # noqa: BLE001 - the channel failed: a dead manager is named as such
            raise (self.side._died(e) if self.side is not None else e) from None

    def settle(self) -> None:
        """Before a push: the tail of the previous one must have succeeded."""
        try:
            errors = self.link.settle(self.timeout_s + 10.0)
        except Exception as e:  # noqa: BLE001 - the channel itself failed
            raise (self.side._died(e) if self.side is not None else e) from None
        if errors:
            raise RemoteError("; ".join(errors))

    def pause_for_update(self) -> None:
        self.settle()
        self._request(PauseForUpdate())

    def end_push(self, version: Optional[int]) -> None:
        """Not awaited: the manager waits for the loads, flips the version, resumes."""
        if version is None:
            # deferred: its reply is read at the next settle(), so a failure surfaces at the next push
            self.link.submit(Resume(), what="continue_generation", deferred=True)
        else:
            self.link.submit(FinishPush(int(version)), what="update_weight_version", deferred=True)

    def unhealthy(self) -> list[str]:
        return self._request(Unhealthy())

    def fail(self, error: str) -> None:
        """The flight could not recover: the step the trainer waits for fails with ``error``."""
        self._request(PushFailed(error))


class ManagerCluster(HoldsServers):
    """The trainer's view of the server set and the one policy-version counter; the driver
    (global rank 0) forwards the protocol steps to the manager's `RolloutCluster`. A
    `megarl.weights.target.PushTarget` for `WeightPusher`, as `RolloutCluster` is."""

    def __init__(self, addresses: list[str], *, link: Optional[Link], manager_address: str,
                 version: int = 0, min_live_servers: int = 1, timeout_s: float = 60.0, side=None,
                 secret: bytes = b"", silence_s: float = 600.0):
        self.servers = ServerSet(list(addresses), min_live_servers)
        self.silence_s = silence_s  # train.stall_timeout_s: a link's liveness window
        self.link, self.manager_address, self.side = link, manager_address, side
        self._secret = secret
        self.driver = link is not None
        self.version, self.timeout_s = int(version), timeout_s
        self.lane = PushLane(link, self, timeout_s, side) if link is not None else None
        self.admin = self.lane.admin if link is not None else None

    def get_version(self) -> int:
        return self.version

    def stage_admin(self, rank: int) -> RemoteAdmin:
        """A pipeline-stage source's own link (its announces run beside the driver's)."""
        link = Link(self.manager_address, "stage", self._secret, rank, silence_s=self.silence_s)
        return RemoteAdmin(link, self, self.timeout_s, owns_link=True)

    def _call(self, msg, timeout_s: Optional[float] = None):
        # +10 s: the manager's cluster steps run under weights.timeout_s; its error must arrive first
        timeout_s = timeout_s or self.timeout_s + 10.0
        if self.side is not None:  # a dead manager is named as such
            return self.side._request(msg, timeout_s)
        return self.link.request(msg, timeout_s, what=type(msg).__name__)

    def set_server_threads(self, threads: int) -> None:
        """Every local megarl-server's generation threads from its next step on (driver only;
        `megarl.trainer.threads` lends the trainer's cores while it waits)."""
        self.admin.request(SetThreads(int(threads)), timeout=10.0)

    # ------------------------------------------------------------------ push protocol (driver)
    def push_lane(self) -> PushLane:
        """A link of its own for an overlapped push's flight (weights.overlap; driver only)."""
        link = Link(self.manager_address, "push", self._secret, 0, silence_s=self.silence_s)
        return PushLane(link, self, self.timeout_s, self.side, owns_link=True)

    def settle(self) -> None:
        self.lane.settle()

    def pause_for_update(self) -> None:
        self.lane.pause_for_update()

    def end_push(self, version: Optional[int]) -> None:
        self.lane.end_push(version)

    def commit(self, version: int) -> None:
        self.version = int(version)

    # ------------------------------------------------------------------ colocated placement
    def sleep(self, tags: list[str]) -> None:
        self._call(Sleep(list(tags)))

    def wake(self, tags: list[str]) -> None:
        self._call(Wake(list(tags)))

    # ------------------------------------------------------------------ the server set
    def unhealthy(self) -> list[str]:
        return self._call(Unhealthy())

    def remove_server(self, address: str, lane: Optional[PushLane] = None) -> None:
        """``lane``: an overlapped push's recovery tells the manager over its own link."""
        if self.servers.drop(address) and self.driver:
            (lane or self.lane)._request(RemoveServer(address))
        # every rank checks the floor itself: all raise at the same step without asking the manager
        self.servers.check_floor()

    def add_server(self, address: str) -> None:
        self.servers.add(address)
        if self.driver:
            self._call(AddServer(address))

    def admitted(self, address: str) -> None:
        self.servers.admitted(address)
        if self.driver:
            self._call(Admitted(address))

    def close(self) -> None:
        pass


class RolloutSide:
    """Rank 0's handle on the manager process (spawned here unless ``rollout.manager_address``
    names one already running) and the step hand-off on every rank."""

    def __init__(self, cfg, ps=None):
        self.cfg, self.ps = cfg, ps  # ps: given here or to `start` (`launch` runs before it exists)
        self.proc: Optional[subprocess.Popen] = None
        self.link: Optional[Link] = None
        self.address = ""
        self._secret = b""  # the channel's, this run's (never logged, never in argv)
        self._log_from = 0  # manager.log's size at launch: a failed start quotes its own lines only
        self.evals_pending = 0  # submitted evaluations not reported yet (rank 0)
        self.stalled = False  # a link of this run (the driver's, or a push lane) found the manager stopped

    def launch(self) -> None:
        """Rank 0: start the manager process without waiting for it, so that it imports and
        starts the local servers while this process imports megatron-core and builds the engine
        (train.py calls this first thing); `start` then waits for its address. Nothing to start
        when ``rollout.manager_address`` names one already running."""
        from megarl.common.net import serving_host
        from megarl.protocol.handshake import new_secret
        from megarl.common.procs import log_size, split_cpus
        from megarl.trainer.manager_process import start_process

        r, t = self.cfg.rollout, self.cfg.train
        if self.proc is not None or r.manager_address:
            return
        server_cpus, trainer_cpus = split_cpus(r.server_cpus) if r.server_cpus else (None, None)
        self._secret = new_secret()
        log = os.path.join(t.run_dir, "manager.log")
        self._log_from = log_size(log)  # appended across resumes
        self.proc = start_process(os.path.join(t.run_dir, "config.yaml"), serving_host(), log, self._secret,
                                  cpus=server_cpus)
        if trainer_cpus:  # generation and training on their own cores (docs/demo.md)
            # after the spawn: the manager (and the servers it starts) keep the server CPUs
            os.sched_setaffinity(0, trainer_cpus)

    def start(self, ps=None) -> None:
        """Rank 0: the link to the manager (launched here unless `launch` already did)."""
        from megarl.trainer.manager_process import wait_listening

        if ps is not None:
            self.ps = ps
        if self.ps.rank != 0:
            return
        if self.cfg.rollout.manager_address:
            from megarl.protocol.handshake import read_secret_file

            self.address = self.cfg.rollout.manager_address
            self._secret = read_secret_file(self.cfg.rollout.manager_secret_file)
        else:
            self.launch()
            self.address = wait_listening(self.proc, os.path.join(self.cfg.train.run_dir, "manager.log"),
                                          self._log_from)
        # every read of the link is bounded: a manager silent (no reply, no beat) for
        # train.stall_timeout_s is stopped or hung (channel.py, "Liveness")
        self.link = Link(self.address, "driver", self._secret, silence_s=self.cfg.train.stall_timeout_s)

    def connect(self, version: int, state: Optional[dict]) -> ManagerCluster:
        """Every rank: the server set (the manager starts them on Init) and the trainer's cluster."""
        servers = [None, None, None]
        if self.ps.rank == 0:
            servers = [self._request(Init(self.ps.dp, version, state), 600.0), self.address, self._secret]
        # the secret too: a pipeline stage's weight source opens its own link (inside the job's group)
        dist.broadcast_object_list(servers, src=0)
        return ManagerCluster(servers[0], link=self.link, manager_address=servers[1], version=version,
                              min_live_servers=self.cfg.rollout.min_live_servers,
                              timeout_s=self.cfg.weights.timeout_s, side=self if self.ps.rank == 0 else None,
                              secret=servers[2], silence_s=self.cfg.train.stall_timeout_s)

    def _request(self, msg, timeout_s: Optional[float] = None):
        try:
            return self.link.request(msg, timeout_s)
        except RemoteError:
            raise
        except Exception as e:  # noqa: BLE001 - the channel failed: say whether the process died
            raise self._died(e) from None

    def _died(self, error: BaseException) -> Exception:
        if isinstance(error, ManagerStalled):  # alive but not running: waiting on its exit says nothing
            self.stalled = True
            return ManagerDied(f"{error} (log {self.cfg.train.run_dir}/manager.log); rerun to resume from the "
                               f"last checkpoint")
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                return ManagerDied(f"rollout manager (pid {self.proc.pid}) exited with status {code} "
                                   f"(log {self.cfg.train.run_dir}/manager.log); rerun to resume from the "
                                   f"last checkpoint")
        return ManagerDied(f"rollout manager at {self.address}: {error}")

    def start_rollouts(self) -> None:
        if self.ps.rank == 0:
            self._request(Start())

    # ------------------------------------------------------------------ the step hand-off
    def next_batch(self, n_groups: int, timeout_s: float = 600.0, version: Optional[int] = None) -> ReceivedStep:
        """The step on every rank (its arrays; infos and the manager's stats on rank 0; servers to
        re-admit). ``version``: the policy version that trains it (the staleness hard cap's clock)."""
        batch = (self._request(BatchRequest(n_groups, timeout_s, version), timeout_s + 30.0)
                 if self.ps.rank == 0 else None)
        return receive_step(batch, self.ps)

    def submit_eval(self, step: int, version: int) -> None:
        if self.ps.rank == 0:
            self._request(EvalSubmit(step, version))
            self.evals_pending += 1

    def poll_eval(self, wait: bool, timeout_s: float = 600.0) -> dict:
        """Finished evaluations' metrics, a round trip only while one is running; ``wait``: all of
        them, within ``timeout_s`` (the manager raises past it, naming what the evaluation waits on)."""
        if self.ps.rank != 0 or not self.evals_pending:
            return {}
        report = self._request(EvalPoll(wait, timeout_s), timeout_s + 30.0 if wait else 60.0)
        self.evals_pending = report.running
        return report.metrics

    def state_dict(self) -> dict:
        return self._request(StateRequest(), 120.0) if self.ps.rank == 0 else {}

    def kill_if_stalled(self) -> None:
        """A stopped manager ends neither on the closed link nor on SIGTERM: SIGKILL (its servers
        die with it, PR_SET_PDEATHSIG) - the ledger in the checkpoint is what resumes. Run before
        the weight groups close: a broadcast the stalled manager never relayed to the servers is
        still waiting on them, and gloo would hold the exit for weights.timeout_s; with the
        servers gone it fails at once."""
        if self.proc is not None and (self.stalled or (self.link is not None and self.link.broken is not None)):
            self.proc.kill()

    def close(self) -> None:
        """The manager stops its rollouts and the servers it started when the link closes."""
        self.kill_if_stalled()
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


class ManagerState:
    """The manager's exactly-once ledger inside the trainer's checkpoint: rank 0 asks the manager
    at save time; a resume hands the saved state to the manager at Init."""

    def __init__(self, side: RolloutSide):
        self.side = side
        self.loaded: Optional[dict] = None

    def state_dict(self) -> dict:
        return self.side.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state
