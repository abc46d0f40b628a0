"""Which address other nodes reach this process by (stdlib only).

A job that spans nodes must never hand out 127.0.0.1: on another node it names that node's own
loopback. Two rules cover every address megarl advertises:

- :func:`advertised_address` (a weight-update group's rendezvous, one per pipeline-stage source
  rank): the configured address, or for "auto" the local address the kernel picks to reach the
  peer that will connect back (a UDP ``connect`` sends no packet). Whoever we reach over a route
  can reach us back at that route's source address on ordinary networks, and it is loopback
  exactly when the peer is on this host.
- :func:`serving_host` (servers that rank 0 starts itself): the job's rendezvous address. Rank 0
  hosts the rendezvous (or, under torchrun, its node's agent does), so that address is one of
  rank 0's host's own, and every rank already reached it when the process group formed. It is
  loopback exactly when the whole job runs on one host.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from typing import Optional
from urllib.parse import urlsplit


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
