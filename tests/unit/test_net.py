"""megarl.common.net: free ports, client-side URLs for bind addresses, the weight-update group helper."""
import socket

import torch
import torch.distributed as dist

from megarl.common.net import LOOPBACK, free_port, http_url, new_process_group, reachable_host


def test_free_port_is_bindable_and_urls_reach_wildcard_binds():
    port = free_port()
    with socket.socket() as s:
        s.bind((LOOPBACK, port))
    assert reachable_host("0.0.0.0") == LOOPBACK and reachable_host("10.1.2.3") == "10.1.2.3"
    assert http_url("0.0.0.0", 30000) == "http://127.0.0.1:30000"
    assert http_url("node7", 8) == "http://node7:8" and http_url("::1", 8) == "http://[::1]:8"


def test_free_ports_come_from_below_the_ephemeral_range():
    """An outgoing connection's source port or a gloo listener can never take a port chosen here
    before its owner binds it: 20 picks all lie below the kernel's ephemeral range, each bindable."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(max(1024, low - 12000) <= p < low for p in ports), (low, ports)
    assert len(set(ports)) > 1  # random, not one fixed port every caller would share
    for p in ports[:3]:
        with socket.socket() as s:
            s.bind((LOOPBACK, p))


def test_new_process_group_single_rank_broadcast():
    pg = new_process_group(LOOPBACK, free_port(), 0, 1, "megarl-test-net", "gloo", 30)
    try:
        t = torch.arange(4.0)
        dist.broadcast(t, group=pg, group_src=0)
        assert torch.equal(t, torch.arange(4.0)) and dist.get_world_size(pg) == 1
    finally:
        dist.destroy_process_group(pg)
