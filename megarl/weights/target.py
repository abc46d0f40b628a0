"""What the weight pusher and its transports need of the rollout side, as protocols: a push target
(the server set, the policy version, the protocol's HTTP steps) and an admin connection to the
servers. Declared here, on the trainer side, so that `megarl.weights` imports nothing of the
rollout manager's package: the trainer's `ManagerCluster` / `RemoteAdmin` implement them over the
manager channel, the manager's `RolloutCluster` / `AdminRunner` implement them directly."""
from __future__ import annotations

import concurrent.futures
from typing import Any, Optional, Protocol


class StageAdmin(Protocol):
    """A synchronous admin connection to the servers (`megarl.rollout.admin.AdminRunner`, or the
    trainer's `megarl.trainer.rollout_link.RemoteAdmin`) that takes the admin messages of
    `megarl.protocol.messages` (``ADMIN_MESSAGES``), e.g. ``request(UpdateFromDisk(update))``."""

    addresses: list[str]

    def request(self, msg: Any, timeout: Optional[float] = None) -> Any: ...  # sent and waited for

    def send(self, msg: Any) -> concurrent.futures.Future: ...  # sent; the caller waits later


class PushTarget(Protocol):
    """The cluster `megarl.weights.push.WeightPusher` talks to: the trainer's
    `megarl.trainer.rollout_link.ManagerCluster` (the manager runs the HTTP steps), or, in tests
    and tools that push without a manager, the manager's own `megarl.rollout.cluster.RolloutCluster`."""

    addresses: list[str]  # the servers that receive weights, the same on every rank
    driver: bool  # this rank runs the protocol's HTTP steps (global rank 0)
    admin: Optional[StageAdmin]  # the driver's admin connection (None on other ranks)
    version: int  # the policy version the servers hold

    def stage_admin(self, rank: int) -> StageAdmin: ...  # a pipeline-stage source's own connection

    def pause_for_update(self) -> None: ...  # protocol step 1 (settles the previous push first)

    def end_push(self, version: Optional[int]) -> None: ...  # step 3: publish (or not), resume

    def commit(self, version: int) -> None: ...  # step 4, every rank

    def unhealthy(self) -> list[str]: ...  # driver: servers that do not answer /health

    def add_server(self, address: str) -> None: ...

    def admitted(self, address: str) -> None: ...

    def remove_server(self, address: str) -> None: ...
