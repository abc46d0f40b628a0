"""Every listening socket of a demo run binds the host it was told (loopback), read from
/proc/net/tcp{,6} while a real run goes on (trainer, rollout manager, megarl-server): the
session's shared 4-step demo run (demo_run.py), which records them as it runs.

The weight-update group's rendezvous store on trainer rank 0 is among them (the servers join it
as clients: SGLang's `/init_weights_update_group` makes them meet through a TCP store). torch's
TCPStore would bind every interface whatever address it is given; megarl serves it on a socket
it bound itself (docs/reliability.md, Security), so any wildcard bind fails the test."""
from __future__ import annotations

# listening and socket_inodes: tests/dist/spawn_worker.py imports them from here
import pytest
from demo_run import demo_run, listening, socket_inodes  # noqa: F401

pytestmark = pytest.mark.xdist_group("demo_run")  # reads the shared run made by the first test to ask (conftest.py)


def test_no_wildcard_listener_during_a_demo_run(shared_train):
    run = demo_run(shared_train).check()
    seen, server_peers = run.probe["seen"], run.probe["server_peers"]
    roles = {role for role, _, _ in seen}
    assert {"manager", "server"} <= roles, seen  # the run's listeners were seen at all
    assert all(host == "127.0.0.1" for _, host, _ in seen), sorted(seen)
    # the weight-update store was among them: a trainer listener the servers connected to
    store = [port for role, _, port in seen if role == "trainer" and port in server_peers]
    assert store, (sorted(seen), sorted(server_peers))
