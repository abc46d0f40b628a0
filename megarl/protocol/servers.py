"""The server set: the one value the trainer (`megarl.trainer.rollout_link.ManagerCluster`, every
rank's mirror for its update groups) and the rollout manager (`megarl.rollout.cluster.RolloutCluster`,
which sends the work) both keep of the rollout servers, changed the same way on both sides."""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.protocol.errors import ClusterError


@dataclass
class ServerSet:
    """Live servers in order (weights and work go to them) and dropped ones, remembered so that
    they can be re-admitted when they answer again; ``min_live``: rollout.min_live_servers."""

    addresses: list[str]
    min_live: int = 1
    dead: list[str] = field(default_factory=list)

    def drop(self, address: str) -> bool:
        """``address`` leaves the live set (remembered as dead); whether it was live."""
        if address not in self.addresses:
            return False
        self.addresses.remove(address)
        self.dead.append(address)
        return True

    def check_floor(self) -> None:
        """`ClusterError` when fewer than ``min_live`` are live (checked after every drop, also of
        a server already gone: a caller learns the set is below its floor)."""
        if len(self.addresses) < self.min_live:
            raise ClusterError(f"rollout.min_live_servers: {len(self.addresses)} server(s) left "
                               f"(< {self.min_live}); dead: {', '.join(self.dead)}")

    def add(self, address: str) -> None:
        """A (re)joining server takes part in the weight pushes (it gets work once `admitted`)."""
        if address not in self.addresses:
            self.addresses.append(address)

    def admitted(self, address: str) -> None:
        if address in self.dead:
            self.dead.remove(address)


class HoldsServers:
    """A holder of a `ServerSet` in ``self.servers`` (the trainer's `ManagerCluster`, the
    manager's `RolloutCluster`), read as ``addresses`` (live) and ``dead`` (dropped, polled for
    re-admission)."""

    servers: ServerSet

    @property
    def addresses(self) -> list[str]:
        return self.servers.addresses

    @property
    def dead(self) -> list[str]:
        return self.servers.dead
