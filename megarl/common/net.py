"""Small network helpers shared by the trainer, the rollout server, the tools and the tests.

- :func:`free_port`: a TCP port nobody listens on right now (torchrun masters, local servers,
  weight-update rendezvous).
- :func:`reachable_host` / :func:`http_url`: where a client connects to reach a server bound on
  a given address (a wildcard bind is reached over loopback on the same machine);
  :func:`normalize_address`: the one spelling of a rollout server's address.
- :func:`listening_socket` / :func:`serve_store`: torch's TCP store served on a socket we bound
  ourselves, so it listens on the address it was given (torch's own listener binds every
  interface whatever it is told; docs/reliability.md, Security).
- :func:`new_process_group`: the custom weight-update group, built exactly like SGLang's
  ``init_custom_process_group`` so the trainer side (rank 0, ``weights/transports.py``) and the
  CPU server side (ranks >= 1, ``rollout/server/weight_routes.py``) rendezvous with each other and
  with a real SGLang server alike.

Which address other nodes reach this process by (a job that spans nodes must never hand out
127.0.0.1: on another node it names that node's own loopback):

- :func:`advertised_address` (a weight-update group's rendezvous, one per pipeline-stage source
  rank): the configured address, or for "auto" the local address the kernel picks to reach the
  peer that will connect back (a UDP ``connect`` sends no packet). Whoever we reach over a route
  can reach us back at that route's source address on ordinary networks, and it is loopback
  exactly when the peer is on this host.
- :func:`serving_host` (servers that rank 0 starts itself): the job's rendezvous address. Rank 0
  hosts the rendezvous (or, under torchrun, its node's agent does), so that address is one of
  rank 0's host's own, and every rank already reached it when the process group formed. It is
  loopback exactly when the whole job runs on one host.

Importing this module is cheap: torch.distributed is imported by :func:`new_process_group` only.
"""
from __future__ import annotations

import ipaddress
import os
import random
import socket
from datetime import timedelta
from typing import Optional
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def free_port(host: str = LOOPBACK) -> int:
    """A port free on ``host`` at the time of the call, below the kernel's ephemeral range.

    The socket is closed before returning and the caller binds later (a server after loading its
    model, seconds on): a port from the ephemeral range could meanwhile become the source port of
    any outgoing connection or a gloo pair's listener (seen: a local server's port taken while
    the trainer's ranks connected). Ports below that range are only ever taken by explicit binds,
    so the window is left to other processes picking ports the same way; where the range is
    unknown, the OS picks."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64 if low else 0):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(_family(host)) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), 0 when unknown or too low to leave
    room below it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    return low if low >= 4096 else 0


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def reachable_host(bind_host: str) -> str:
    """The address a client on this machine uses for a server bound on ``bind_host``."""
    return LOOPBACK if bind_host in _WILDCARDS else bind_host


def http_url(host: str, port: int) -> str:
    """``http://host:port`` for a server bound on ``host`` (IPv6 literals bracketed)."""
    host = reachable_host(host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: the kernel picks) and listening. A ``host``
    that is not one of this machine's addresses fails here, naming it."""
    if host in _WILDCARDS:  # asked for every interface: then that is what it gets
        addr = "::" if ":" in host else "0.0.0.0"
    else:
        addr = resolve(host.strip("[]"))
    s = socket.socket(_family(addr))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
        s.listen(512)
    except OSError as e:
        s.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return s


def serve_store(listener: socket.socket, world: int, timeout_s: float, wait_for_workers: bool = True):
    """torch's TCP store, served on ``listener`` (which it takes over): clients reach it at the
    listener's address only. torch binds its own listener to every interface, whatever host it
    is given; handed a bound socket (``master_listen_fd``) it serves there instead."""
    import torch.distributed as dist

    host, port = listener.getsockname()[:2]
    return dist.TCPStore(host, port, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=wait_for_workers, master_listen_fd=listener.detach())


def normalize_address(address: str) -> str:
    """One spelling per server (``host:port`` gets http://, no trailing slash), so a removed
    address matches the one in the list and a server listed twice is seen as one."""
    address = address.rstrip("/")
    return address if address.startswith(("http://", "https://")) else "http://" + address


LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def server_identity(address: str) -> str:
    """``host:port`` of a server address with this host's own names spelled one way: localhost,
    loopback addresses and this machine's hostname are one host to a server bound to them, so
    ``http://localhost:30000`` and ``http://127.0.0.1:30000`` are one server (it would join the
    weight-update group twice). No DNS lookup: other names are compared as written."""
    from urllib.parse import urlsplit

    parts = urlsplit(normalize_address(address))
    host, port = (parts.hostname or "").lower(), parts.port
    try:
        if ipaddress.ip_address(host).is_loopback:
            host = "loopback"
    except ValueError:
        if host in LOCAL_NAMES:
            host = "loopback"
        elif host == socket.gethostname().lower():
            host = "thishost"
    return f"{host}:{port}"


def new_process_group(addr: str, port: int, rank: int, world: int, name: str, backend: str,
                      timeout_s: float, store=None, listener: Optional[socket.socket] = None):
    """Hosts (rank 0) or joins (rank > 0) a process group outside the default one.

    TCP-store rendezvous at ``addr:port``: rank 0 serves the store on ``listener`` (or a socket
    it binds to ``addr:port``), so it listens on ``addr`` only; ``PrefixStore(name)`` so several
    groups can share a store, and a group built by torch's ``_new_process_group_helper`` and
    registered in torch's group table with an identity rank map: collectives then accept it and
    ``group_src``/``src`` rank numbers are the group's own. Blocks until all ``world`` ranks joined
    or ``timeout_s`` passed. ``store``: meet there instead (e.g. a ``FileStore`` when every rank
    is on this host).
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    if store is None and rank == 0:
        store = serve_store(listener or listening_socket(addr, port), world, timeout_s)
    elif store is None:
        store = dist.TCPStore(addr, int(port), world, is_master=False, timeout=timeout)
    pg, _ = _new_process_group_helper(world, rank, [], backend, dist.PrefixStore(name, store),
                                      group_name=name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def resolve(host: str) -> str:
    """IPv4 address of ``host`` (an address is returned unchanged)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(resolve(host)).is_loopback
    except (OSError, ValueError):
        return False


def is_loopback_name(host: str) -> bool:
    """``host`` names loopback on every machine (``localhost``, ``127.x``, ``::1``), unlike a
    host name that only this machine's hosts file maps there."""
    if host.strip("[]").lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def url_host(url: str) -> str:
    """``http://10.0.0.5:30000`` -> ``10.0.0.5``; a bare ``host:port`` works too."""
    return urlsplit(url if "://" in url else f"http://{url}").hostname or ""


def local_address_towards(peer: str, port: int = 9) -> str:
    """The source address this host uses to reach ``peer`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((resolve(peer), port))
        return s.getsockname()[0]


def advertised_address(configured: str, peer: Optional[str]) -> str:
    """``configured`` unless it is "auto"; "auto": the route's source address towards ``peer``
    (loopback when there is no peer)."""
    if configured != "auto":
        return configured
    if not peer:
        return "127.0.0.1"
    return local_address_towards(peer)


def serving_host(master_addr: Optional[str] = None) -> str:
    """Bind/advertise address for servers rank 0 starts itself. ``master_addr`` defaults to
    $MASTER_ADDR, the launcher's rendezvous address (torchrun, srun via launch/, mpirun via
    launch/mpi.sh, or parallel.init_distributed set it)."""
    master = master_addr if master_addr is not None else os.environ.get("MASTER_ADDR", "127.0.0.1")
    return resolve(master)
