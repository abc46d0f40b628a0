"""The `launch.*` section: how megarl-launch places trainer, servers and router on a cluster."""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.common import _check, _choice
from megarl.common.errors import ConfigError
from megarl.common.fields import bounded


@dataclass
class LaunchConfig:
    server: str = "auto"
    """Server program the launcher (megarl-launch, launch/slurm.sbatch) starts on rollout nodes:
    auto (sglang on GPU nodes, megarl on CPU nodes), sglang (python -m sglang.launch_server) or
    megarl (megarl-server)."""
    server_tp: int = bounded(1, ge=1)
    """GPUs per rollout server for tensor parallelism (SGLang --tp-size)."""
    server_dp: int = bounded(1, ge=1)
    """Data-parallel replicas inside one SGLang server (--dp-size); GPUs per server = tp * dp."""
    servers_per_node: int = bounded(0, ge=0)
    """Servers per rollout node; 0 = the node's GPUs // (server_tp * server_dp), 1 on CPU nodes."""
    server_port: int = bounded(30000, ge=1, le=65535)
    """Port of a node's first server; the node's further servers take the next ports."""
    server_args: list[str] = field(default_factory=list)
    """Extra flags appended to every server command (e.g. ["--mem-fraction-static", "0.8"])."""
    health_timeout_s: float = bounded(900.0, gt=0, le=86400)
    """How long the launcher waits for every server's /health before it gives up."""
    router: bool = False
    """Also start SGLang's router (sglang-router) in front of the servers on the first rollout
    node, for generation clients; weight pushes still go to every server directly."""
    router_port: int = bounded(30100, ge=1, le=65535)
    """Port of the router."""
    router_policy: str = "cache_aware"
    """Router load-balancing policy: cache_aware, round_robin, random or power_of_two."""

    def validate(self) -> None:
        _check(self, "launch")
        _choice("launch.server", self.server, ("auto", "sglang", "megarl"))
        _choice("launch.router_policy", self.router_policy,
                ("cache_aware", "round_robin", "random", "power_of_two"))
        if self.router and self.server == "megarl":
            raise ConfigError("launch.router: SGLang's router fronts SGLang servers; "
                              "set launch.server to sglang (or auto on GPU nodes)")
