"""Who may talk to the rollout manager (megarl.protocol.handshake, docs/reliability.md Security),
against a real manager process spawned as the trainer spawns it (its servers given, so none
starts): a peer proves the run's secret before the manager reads anything else; without it a
connection gets the 48-byte challenge and nothing more - no admin relay, no end of the run, no
allocation however large the sizes it declares; the frame caps hold for authenticated peers too.
The tests share one manager and run in file order: the last one ends it as its driver."""
from __future__ import annotations

import hmac
import json
import os
import socket
import struct
import threading
import time
import tracemalloc
import types

import psutil
import pytest

from megarl.protocol import handshake
from megarl.protocol.channel import MAX_REQUEST_HEADER, Channel, ChannelError, Link, RemoteError, encode
from megarl.protocol.messages import Close, Hello, ServerInfo, StateRequest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHALLENGE = len(handshake.MAGIC) + handshake.NONCE


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    from megarl.config import load_config, save_config
    from megarl.config.server_wire import local_extensions, resolve_wire
    from megarl.trainer.manager_process import start_process, wait_listening

    run = tmp_path_factory.mktemp("auth") / "run"
    cfg = load_config(f"{REPO}/configs/tiny_grpo.yaml", [
        f"model.hf_path={REPO}/examples/tiny/model", f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl",
        "data.eval_path=", f"train.run_dir={run}", "rollout.servers=[http://127.0.0.1:9]"])
    # resolved as megarl-train's preflight would for a megarl-server at that (unused) address
    cfg.weights = resolve_wire(cfg.weights, {"http://127.0.0.1:9": local_extensions("megarl")})
    save_config(cfg, str(run))
    secret = handshake.new_secret()
    log = str(run / "manager.log")
    proc = start_process(str(run / "config.yaml"), "127.0.0.1", log, secret)
    address = wait_listening(proc, log)
    yield types.SimpleNamespace(proc=proc, address=address, secret=secret, log=log,
                                ps=psutil.Process(proc.pid))
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def _raw(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _rest(sock: socket.socket) -> bytes:
    """Everything the manager sends until it closes the connection."""
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with our unread bytes in its buffer
            return out
        if not chunk:
            return out
        out += chunk


def _challenge(sock: socket.socket) -> bytes:
    got = b""
    while len(got) < CHALLENGE:
        chunk = sock.recv(CHALLENGE - len(got))
        assert chunk, got
        got += chunk
    assert got.startswith(handshake.MAGIC)
    return got


def test_the_right_secret_is_accepted_and_a_stage_link_may_only_relay_admin(manager):
    link = Link(manager.address, "stage", manager.secret, rank=1, connect_timeout_s=10)
    try:
        # a stage link is served (its request reaches the manager) but cannot ask for driver requests
        with pytest.raises(RemoteError, match="StateRequest is not a request a stage link may send"):
            link.request(StateRequest(), 10)
        with pytest.raises(RemoteError, match="Close is not a request a stage link may send"):
            link.request(Close(), 10)
        # the admin relay is a typed message; before Init there is no server set to relay to
        with pytest.raises(RemoteError, match="ServerInfo|NoneType"):
            link.request(ServerInfo(timeout_s=5), 10)
    finally:
        link.close()
    assert manager.proc.poll() is None


def test_a_wrong_secret_is_refused(manager):
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="refused this run's secret"):
        Link(manager.address, "driver", b"w" * 32, connect_timeout_s=10)
    assert time.monotonic() - t0 < 2.0  # refused at once, not after a timeout
    assert manager.proc.poll() is None


def test_the_proof_is_compared_with_compare_digest(monkeypatch):
    """In process (a socket pair): the manager's check is `hmac.compare_digest` (constant time)."""
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(handshake.hmac, "compare_digest", lambda a, b: calls.append((len(a), len(b))) or real(a, b))
    for proof_secret, expect in ((b"s" * 32, True), (b"t" * 32, False)):
        server, client = socket.socketpair()
        result = []
        t = threading.Thread(target=lambda: result.append(handshake.accept(server, b"s" * 32, timeout_s=5)))
        t.start()
        try:
            handshake.prove(client, proof_secret, "test manager", timeout_s=5)
        except handshake.AuthError:
            pass
        t.join(10)
        server.close()
        client.close()
        assert result == [expect]
    # server's check of each client proof, and the client's check of the manager's proof once
    assert calls == [(32, 32), (32, 32), (32, 32)], calls


def test_no_secret_gets_the_challenge_and_nothing_else_and_changes_nothing(manager):
    frames = [b"".join(encode(m)) for m in (Hello("driver"), Close(), ServerInfo(), StateRequest())]
    for frame in frames:
        s = _raw(manager.address)
        _challenge(s)
        s.sendall(frame + b"\0" * 64)  # whatever it is, its first 64 bytes are read as a (wrong) proof
        assert _rest(s) == b""  # no reply, only the close
        s.close()
    # a peer that sends nothing is dropped at the handshake deadline
    s = _raw(manager.address)
    t0 = time.monotonic()
    assert len(_rest(s)) == CHALLENGE
    assert handshake.AUTH_TIMEOUT_S - 0.5 < time.monotonic() - t0 < handshake.AUTH_TIMEOUT_S + 2.0
    s.close()
    # nothing changed: the manager runs, and the driver role is still free (claimed in the last test)
    time.sleep(0.5)
    assert manager.proc.poll() is None
    assert "refused a connection" in open(manager.log).read()


def test_memory_stays_flat_under_50_unauthenticated_oversized_frames(manager):
    header = json.dumps({"type": "Batch", "fields": {}, "arrays": [["a", "|u1", [768 * 2**20]]]}).encode()
    huge = [struct.pack("!I", 2**31) + b"x" * 1024, struct.pack("!I", len(header)) + header]
    rss0 = manager.ps.memory_info().rss
    socks = []
    for i in range(50):
        try:
            s = _raw(manager.address)
            s.sendall(huge[i % 2])
            socks.append(s)
        except OSError:  # over the manager's connection limit: closed at once, fine
            pass
    time.sleep(1.0)
    rss1 = manager.ps.memory_info().rss
    for s in socks:
        s.close()
    grew = (rss1 - rss0) / 2**20
    assert grew < 16, f"manager RSS grew {grew:.1f} MiB under 50 oversized unauthenticated frames"
    assert manager.proc.poll() is None


def test_an_authenticated_peer_cannot_declare_more_than_the_protocol_carries(manager):
    from megarl.protocol.channel import connect

    rss0 = manager.ps.memory_info().rss
    header = json.dumps({"type": "StateRequest", "fields": {}, "arrays": [["a", "|u1", [768 * 2**20]]]}).encode()
    for frame in (struct.pack("!I", MAX_REQUEST_HEADER + 1), struct.pack("!I", len(header)) + header):
        sock = connect(manager.address, manager.secret, 10)
        sock.sendall(b"".join(encode(Hello("stage", 1))) + frame)
        assert _rest(sock) == b""  # closed, no reply, nothing allocated
        sock.close()
    assert (manager.ps.memory_info().rss - rss0) / 2**20 < 16
    assert manager.proc.poll() is None


def test_frame_caps_are_checked_before_allocating():
    """In process: a header or arrays declared beyond the caps cost no allocation."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    ch = Channel(b, "peer", max_header=1024, max_arrays=0)
    header = json.dumps({"type": "Close", "fields": {}, "arrays": [["a", "<f8", [2**27]]]}).encode()
    tracemalloc.start()
    try:
        for frame, match in ((struct.pack("!I", 2**31), "more than the 1024"),
                             (struct.pack("!I", len(header)) + header, "1073741824 bytes of arrays")):
            a.sendall(frame)
            with pytest.raises(ChannelError, match=match):
                ch.recv(timeout_s=5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        a.close()
        b.close()
    assert peak < 256 * 1024, peak


def test_only_the_authenticated_driver_ends_the_run_and_only_once(manager):
    driver = Link(manager.address, "driver", manager.secret, connect_timeout_s=10)
    # a second driver is refused: its Hello is read, then the connection closes
    second = Link(manager.address, "driver", manager.secret, connect_timeout_s=10)
    with pytest.raises(ChannelError):
        second.request(StateRequest(), 10)
    second.close()
    assert manager.proc.poll() is None
    driver.request(Close(), 10)
    assert manager.proc.wait(timeout=15) == 0
