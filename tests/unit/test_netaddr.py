"""megarl.common.net: the addresses other nodes reach this process by."""
import socket

import pytest

from megarl.common.net import (advertised_address, is_loopback, local_address_towards, resolve, serving_host,
                               url_host)


def test_url_host_and_loopback():
    assert url_host("http://10.0.0.5:30000") == "10.0.0.5"
    assert url_host("gpu07:30001") == "gpu07"
    assert url_host("https://[::1]:8") == "::1"
    assert is_loopback("127.0.0.3") and is_loopback("localhost") and not is_loopback("10.1.2.3")
    assert resolve("127.0.0.2") == "127.0.0.2" and resolve("localhost") == "127.0.0.1"


def test_advertised_address():
    assert advertised_address("10.9.8.7", "127.0.0.1") == "10.9.8.7"  # configured wins
    assert advertised_address("auto", None) == "127.0.0.1"
    assert advertised_address("auto", "127.0.0.2") == "127.0.0.1"  # a peer on this host: loopback


def test_serving_host(monkeypatch):
    assert serving_host("127.0.0.1") == "127.0.0.1" and serving_host("localhost") == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.5")
    assert serving_host() == "127.0.0.5"  # e.g. a fake node's own loopback address
    try:  # this host's address on its default route, if it has one
        here = local_address_towards("192.0.2.1")
    except OSError:
        pytest.skip("no route off this host")
    if is_loopback(here):
        pytest.skip("no non-loopback address")
    assert serving_host(here) == here  # a multi-node rendezvous address: the servers bind to it
    with socket.socket() as s:
        s.bind((here, 0))  # and it is one of ours
