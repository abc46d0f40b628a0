"""The rollout manager's owner of the server set: the live and dead servers, the admin connection,
the version the servers hold, and the HTTP half of the weight-update protocol.

    trainer ranks                       rollout manager                        rollout servers
    ManagerCluster ── channel ──▶ RolloutCluster ──── AdminRunner ────────▶ /pause_generation, ...
      version (the policy version:    version (what the servers hold: follows
      advanced by commit in the       the trainer's, set when a push's tail
      collective push)                flipped the servers)
                                      listeners: the RolloutController (hold / release / on_version)

The trainer's `megarl.trainer.rollout_link.ManagerCluster` holds the policy-version counter and
forwards each protocol step of a push (`PauseForUpdate`, `FinishPush`, ...) to this one; the
manager's controller reads the version here for its staleness clock and its clients' version
stamps. Tests and tools that push without a manager build one directly as a
`megarl.weights.target.PushTarget` (``driver=True`` on the rank that talks to the servers).

A push runs the protocol exactly once: the listeners' gates close first (so requests the servers
abort wait instead of racing the update), then one ``/pause_generation`` and one
``/continue_generation`` per server.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Protocol

from megarl.protocol.servers import HoldsServers, ServerSet
from megarl.rollout.admin import AdminRunner
from megarl.rollout.http import AdminError, normalize_address
from megarl.protocol.types import PauseMode

log = logging.getLogger("megarl.cluster")


class ClusterListener(Protocol):
    """Who generates against the servers (the rollout controller)."""

    def hold(self) -> None: ...  # stop sending new segments (blocks until the gate is closed)

    def release(self) -> None: ...  # send again

    def on_version(self, version: int) -> None: ...  # the servers now hold this version

    def on_server_removed(self, address: str) -> None: ...  # resubmit its requests elsewhere

    def on_server_added(self, address: str) -> None: ...  # it holds the current weights


class RolloutCluster(HoldsServers):
    def __init__(self, addresses: list[str], *, driver: bool, api_key: Optional[str] = None,
                 timeout_s: float = 60.0, pause_mode: PauseMode = "abort", version: int = 0,
                 min_live_servers: int = 1, health_timeout_s: float = 3.0, required: frozenset = frozenset()):
        self.servers = ServerSet([normalize_address(a) for a in addresses], min_live_servers)
        # extensions the resolved weight wire needs (megarl.config.server_wire.required_extensions):
        # a server that comes back without them is not re-admitted
        self.required = frozenset(required)
        # a health check never waits longer than a push step would
        # a health probe never outlasts the push deadline it runs inside
        self.health_timeout_s = min(health_timeout_s, timeout_s)
        # restart(address) -> bool: relaunch a server this job started (LocalServers); None:
        # servers are external and come back on their own
        self.restart: Optional[Callable[[str], bool]] = None
        self.poll_interval_s = 1.0
        self._lock = threading.Lock()
        self._ready: set[str] = set()
        self._poller: Optional[threading.Thread] = None
        self._closed = False
        self.driver, self.api_key, self.timeout_s, self.pause_mode = driver, api_key, timeout_s, pause_mode
        self.version = int(version)
        self.listeners: list[ClusterListener] = []
        self.admin: Optional[AdminRunner] = None
        if driver and self.addresses:
            # only the driver (the manager) talks admin to the servers; other ranks keep the list in step
            self.admin = AdminRunner(self.addresses, api_key, timeout_s)
        self.counters = {"pauses": 0, "continues": 0, "sleeps": 0}
        self.unresponsive: set[str] = set()  # failed the last pause: not waited on again
        self.session_open = False  # a /begin_weight_update was sent and no /end_weight_update yet

    @classmethod
    def from_config(cls, cfg, addresses: list[str], driver: bool) -> "RolloutCluster":
        return cls.from_sections(cfg.rollout, cfg.weights, addresses, driver)

    @classmethod
    def from_sections(cls, rollout, weights, addresses: list[str], driver: bool,
                      pause_mode: Optional[str] = None) -> "RolloutCluster":
        """From ``rollout.api_key``, ``rollout.min_live_servers``, ``weights.timeout_s`` and
        ``pause_mode`` (the run's wire plan's; default ``weights.pause_mode``)."""
        from megarl.config.server_wire import required_extensions

        pause_mode = pause_mode or weights.pause_mode
        if pause_mode == "auto":  # guessing is how a wire fit for one server reaches another
            raise ValueError("weights.pause_mode: auto was not resolved against the servers "
                             "(megarl.config.server_wire.resolve_wire, run by megarl-train's preflight)")
        return cls(addresses, driver=driver, api_key=rollout.api_key or None, timeout_s=weights.timeout_s,
                   pause_mode=pause_mode, min_live_servers=rollout.min_live_servers,
                   required=required_extensions(weights))

    # ------------------------------------------------------------------ the version
    def get_version(self) -> int:
        """`VersionProvider` for the staleness manager and the client's version stamps."""
        return self.version

    def commit(self, version: int) -> None:
        """The servers hold ``version`` (called on every rank once the push succeeded)."""
        self.version = int(version)
        for listener in self.listeners:
            listener.on_version(self.version)

    def subscribe(self, listener: ClusterListener) -> None:
        self.listeners.append(listener)

    def stage_admin(self, rank: int) -> AdminRunner:
        """A pipeline-stage source's own admin connection to the servers (it announces its stage's
        buckets itself, beside the driver's connection)."""
        return AdminRunner(self.addresses, self.api_key, self.timeout_s)

    # ------------------------------------------------------------------ the server set
    def add_server(self, address: str) -> None:
        """A (re)joining server enters the weight-update set; the caller pushes the current
        weights to it, then calls `admitted` so it gets work (see `WeightPusher.add_server`)."""
        address = normalize_address(address)
        if address not in self.addresses:
            self.servers.add(address)
            self._reconnect()

    def remove_server(self, address: str) -> None:
        """Drops a dead or hung server (every rank, in the same order): no more work, no more
        weights; the driver polls it (and restarts it when it is ours) for re-admission."""
        address = normalize_address(address)
        # remembered as dead (not forgotten): the driver polls it and re-admits it once it answers
        if self.servers.drop(address):
            self._reconnect()
            for listener in self.listeners:
                listener.on_server_removed(address)
            log.warning("rollout server %s dropped (%d left)", address, len(self.addresses))
            if self.driver and self.restart is not None:
                self.restart(address)
        self.servers.check_floor()

    def admitted(self, address: str) -> None:
        """After the pusher gave a (re)joining server the current weights: it gets work."""
        address = normalize_address(address)
        self.servers.admitted(address)
        for listener in self.listeners:
            listener.on_server_added(address)

    # ------------------------------------------------------------------ health (driver)
    def unhealthy(self) -> list[str]:
        """Servers whose /health does not answer 200 within health_timeout_s (dead or hung)."""
        return [a for a, ok in self._health(self.addresses).items() if not ok]

    def ready_to_rejoin(self) -> list[str]:
        """Dropped servers that answered /health since the last call (restarted by us or by their
        owner). Never blocks: a background thread polls the dead servers (a hung one would
        otherwise stall every step for its health timeout)."""
        with self._lock:
            # only still-dead ones: a server re-admitted meanwhile must not be pushed twice
            ready, self._ready = [a for a in self._ready if a in self.dead], set()
        if self.dead and (self._poller is None or not self._poller.is_alive()):
            self._poller = threading.Thread(target=self._poll_dead, name="megarl-health", daemon=True)
            self._poller.start()
        return ready

    def _poll_dead(self) -> None:
        refused: set[str] = set()
        while self.dead and not self._closed:
            for address, ok in self._health(list(self.dead)).items():
                if ok and self._speaks_wire(address, refused):
                    with self._lock:
                        self._ready.add(address)
            time.sleep(self.poll_interval_s)

    def _speaks_wire(self, address: str, refused: set[str]) -> bool:
        """A server that answers again still advertises what the weight wire needs (one at the
        same address may be another kind of server now: SGLang where a megarl-server was)."""
        if not self.required:
            return True
        from megarl.protocol.wire import server_extensions

        probe = AdminRunner([address], self.api_key, self.health_timeout_s)
        try:
            missing = self.required - server_extensions(probe.call(lambda c: c.get_model_info())[address])
        except Exception as e:  # noqa: BLE001 - not answering yet: polled again
            log.debug("rollout server %s: /model_info: %s", address, e)
            return False
        finally:
            probe.close()
        if missing and address not in refused:
            refused.add(address)
            log.warning("rollout server %s is back without %s, which the weight wire needs "
                        "(weights.tensor_format / verify_interval / refit / disk_delta as resolved at start); "
                        "not re-admitted", address, ", ".join(sorted(missing)))
        return not missing

    def _health(self, addresses: list[str]) -> dict[str, bool]:
        if not addresses:
            return {}
        probe = AdminRunner(addresses, self.api_key, self.health_timeout_s)
        try:
            return probe.call(lambda c: c.health())
        finally:
            probe.close()

    def _reconnect(self) -> None:
        if self.driver:
            if self.admin is not None:
                self.admin.close()
            self.admin = AdminRunner(self.addresses, self.api_key, self.timeout_s) if self.addresses else None

    # ------------------------------------------------------------------ push protocol (driver)
    def pause_for_update(self) -> None:
        """Steps 1-3 of a push: gates closed, ``/pause_generation`` {mode}, ``/flush_cache``
        (cached prefixes were computed by the old weights; not for mode in_place),
        ``/begin_weight_update``."""
        for listener in self.listeners:
            listener.hold()
        # listeners first (no new segments), then the servers: nothing is sent into a paused server
        self.counters["pauses"] += 1
        self.unresponsive = set()
        try:
            self.admin.call(lambda c: c.pause(self.pause_mode))
        except AdminError as e:
            self.unresponsive = set(e.failures)  # a hung server would stall resume() as well
            raise
        # set before the call: a begin that landed on some servers and failed on others still
        # opened sessions, and a server refuses the next begin while one is open
        self.session_open = True
        try:
            if self.pause_mode == "in_place":
                # paused requests keep their KV cache and resume on it (what in_place is for); SGLang
                # refuses /flush_cache while they hold it
                self.admin.call(lambda c: c.begin_weight_update())
            else:
                self.admin.call(lambda c: c.flush_and_begin())  # one round trip: the two are independent
        except AdminError as e:
            self._take_over_sessions(e)

    def _take_over_sessions(self, e: AdminError) -> None:
        """A begin refused because a session is open: this run always ends its own (publish,
        abandon_update), so one open at a push's begin was left by another run, killed mid-push,
        on a server that outlived it. It is ended, and this push begins its own there; any other
        failure is raised."""
        left = sorted(a for a, why in e.failures.items() if "already open" in why)
        if not left or len(left) != len(e.failures):
            raise e
        log.warning("weight-update session left open on %s (a run killed mid-push?): ended; this push "
                    "begins its own", ", ".join(left))
        others = [a for a in self.addresses if a not in left]
        self.admin.call(lambda c: c.end_weight_update(skip=others))
        self.admin.call(lambda c: c.begin_weight_update(skip=others))

    def publish(self, version: int) -> None:
        """After every bucket landed: servers flip to ``version`` at once, then close the update."""
        # version first, then end: requests that resume right after end_weight_update report the new version
        self.admin.call(lambda c: c.update_weight_version(str(version)))
        self.session_open = False
        self.admin.call(lambda c: c.end_weight_update())

    def abandon_update(self) -> None:
        """A push that failed after its begin closes the session it opened before generation
        resumes (the retry, or the next push, begins a new one; SGLang and megarl-server refuse
        a second begin while one is open). Best effort: a server that died or never began says
        so, and is dealt with by the health check that follows a failed push."""
        if not self.session_open or self.admin is None:
            return
        self.session_open = False
        try:
            self.admin.call(lambda c: c.end_weight_update(skip=self.unresponsive))
        except Exception as e:  # noqa: BLE001 - the push's own error is the one raised
            log.warning("end_weight_update after a failed push: %s", e)

    def settle(self) -> None:
        """Nothing is left running between pushes here (the manager's link defers `end_push`)."""

    def end_push(self, version: Optional[int]) -> None:
        """The tail of a push: with ``version`` (every bucket landed) the servers flip to it and the
        version is committed; in any case generation resumes."""
        try:
            if version is not None:
                self.publish(version)
                # commit after publish: the staleness window moves only once the servers hold the version
                self.commit(version)
        finally:
            try:
                self.abandon_update()  # nothing to do after a publish, which ended the session
            finally:
                self.resume()

    def resume(self) -> None:
        """``/continue_generation`` and open the gates; runs even after a failed push so that one
        dead server never keeps the others paused."""
        try:
            if self.admin is not None:
                self.counters["continues"] += 1
                self.admin.call(lambda c: c.continue_generation(skip=self.unresponsive))
        except Exception as e:  # noqa: BLE001 - reported; the push's own error is the one raised
            log.warning("continue_generation: %s", e)
        finally:
            for listener in self.listeners:
                listener.release()

    # ------------------------------------------------------------------ colocated placement
    def sleep(self, tags: list[str]) -> None:
        """The trainer trains on the servers' devices: they release ``tags`` (idle by then: an
        on-policy batch is complete and nothing else is generating)."""
        self.counters["sleeps"] += 1
        self.admin.call(lambda c: c.release_memory_occupation(tags))

    def wake(self, tags: list[str]) -> None:
        """Before the push: the servers take ``tags`` back (weights zero-filled until it lands)."""
        self.admin.call(lambda c: c.resume_memory_occupation(tags))

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        return {"version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.version = int(state["version"])

    def close(self) -> None:
        self._closed = True
        if self.admin is not None:
            self.admin.close()
            self.admin = None
