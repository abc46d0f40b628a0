"""Small network helpers shared by the trainer, the rollout server, the tools and the tests.

- :func:`free_port`: a TCP port nobody listens on right now (torchrun masters, local servers,
  weight-update rendezvous).
- :func:`reachable_host` / :func:`http_url`: where a client connects to reach a server bound on
  a given address (a wildcard bind is reached over loopback on the same machine).
- :func:`new_process_group`: the custom weight-update group, built exactly like SGLang's
  ``init_custom_process_group`` so the trainer side (rank 0, ``weights/transports.py``) and the
  CPU server side (ranks >= 1, ``rollout/server/weight_routes.py``) rendezvous with each other and
  with a real SGLang server alike.

Importing this module is cheap: torch.distributed is imported by :func:`new_process_group` only.
"""
from __future__ import annotations

import socket
from datetime import timedelta

LOOPBACK = "127.0.0.1"
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def free_port(host: str = LOOPBACK) -> int:
    """A port free on ``host`` at the time of the call. The socket is closed before returning,
    so another process may take it first: callers that bind later retry or fail loudly."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reachable_host(bind_host: str) -> str:
    """The address a client on this machine uses for a server bound on ``bind_host``."""
    return LOOPBACK if bind_host in _WILDCARDS else bind_host


def http_url(host: str, port: int) -> str:
    """``http://host:port`` for a server bound on ``host`` (IPv6 literals bracketed)."""
    host = reachable_host(host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def new_process_group(addr: str, port: int, rank: int, world: int, name: str, backend: str,
                      timeout_s: float):
    """Hosts (rank 0) or joins (rank > 0) a process group outside the default one.

    TCP-store rendezvous at ``addr:port`` (rank 0 serves the store), ``PrefixStore(name)`` so
    several groups can share a store, and a group built by torch's ``_new_process_group_helper``
    and registered in torch's group table with an identity rank map: collectives then accept it
    and ``group_src``/``src`` rank numbers are the group's own. Blocks until all ``world`` ranks
    joined or ``timeout_s`` passed.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, int(port), world, is_master=rank == 0, timeout=timeout)
    pg, _ = _new_process_group_helper(world, rank, [], backend, dist.PrefixStore(name, store),
                                      group_name=name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg
