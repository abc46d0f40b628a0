"""What another user of the node could plant or read (issue 40), in-process: the shared-memory
handover is created exclusively under an unpredictable name (a link or a foreign file planted at
the name it will use leaves the victim untouched and the setup refused), the run's key file and
config.yaml are created owner-only without following links, and a secret file that belongs to
someone else is refused. Another user is played by chown to `nobody` (the tests run as root in
CI; elsewhere those cases skip)."""
from __future__ import annotations

import os
import stat
import types

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.config.load import save_config
from megarl.protocol import handshake
from megarl.protocol.wire import SHM_DIR, SHM_PREFIX
from megarl.rollout.local import write_key_file
from megarl.weights import transports
from megarl.weights.transports import SharedMemoryTransport

NOBODY = 65534
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs chown (root)")


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim"
    path.write_bytes(b"precious")
    return path


def _fixed_token(monkeypatch, token="0123456789abcdef"):
    import secrets

    monkeypatch.setattr(secrets, "token_hex", lambda n=None: token)
    return os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-pp0-{token}")


def test_the_handover_name_is_unpredictable():
    names = set()
    for _ in range(3):
        t = SharedMemoryTransport(admin=None, timeout_s=1)
        t.setup(0)
        try:
            assert stat.S_IMODE(os.stat(t.path).st_mode) == 0o600 and os.path.dirname(t.path) == SHM_DIR
            names.add(t.path)
        finally:
            t.close()
        assert not os.path.exists(t.path)
    assert len(names) == 3  # 64 random bits each


def test_a_link_planted_at_the_handover_name_is_not_followed(monkeypatch, victim):
    name = _fixed_token(monkeypatch)
    os.symlink(victim, name)
    try:
        t = SharedMemoryTransport(admin=None, timeout_s=1)
        with pytest.raises(RuntimeError, match="weights.transport=shm: cannot create"):
            t.setup(0)
        t.close()
        assert os.path.islink(name)  # not removed by close either: it is not the trainer's
    finally:
        os.unlink(name)
    assert victim.read_bytes() == b"precious"


@as_root
def test_a_foreign_file_at_the_handover_name_receives_nothing(monkeypatch):
    name = _fixed_token(monkeypatch, "fedcba9876543210")
    with open(name, "wb") as f:
        f.write(b"theirs")
    os.chown(name, NOBODY, NOBODY)
    try:
        with pytest.raises(RuntimeError, match="cannot create"):
            SharedMemoryTransport(admin=None, timeout_s=1).setup(0)
        assert open(name, "rb").read() == b"theirs"
    finally:
        os.unlink(name)


def test_the_handover_writes_through_its_own_descriptor(monkeypatch):
    """The bytes the server maps are the bucket's (the mapping of the trainer's own descriptor)."""
    posted = []
    monkeypatch.setattr(transports, "post_tensor_update", lambda admin, update, *a: posted.append(update))
    t = SharedMemoryTransport(admin=None, timeout_s=1)
    t.setup(0)
    try:
        a, b = torch.arange(6, dtype=torch.float32).view(2, 3), torch.ones(5, dtype=torch.int64)
        t.send(types.SimpleNamespace(names=["a", "b"], tensors=[a, b]), "1")
        t.send(types.SimpleNamespace(names=["a"], tensors=[torch.full((40, 40), 2.0)]), "1")  # grows the file
        data = open(t.path, "rb").read()
        assert torch.frombuffer(bytearray(data[:6400]), dtype=torch.float32).eq(2.0).all()
        assert len(posted) == 2 and t.shared_bytes == 24 + 40 + 6400
    finally:
        t.close()


def test_the_key_file_is_owner_only_and_replaces_a_planted_link(tmp_path, victim):
    path = tmp_path / "run" / "servers" / "api_key"
    path.parent.mkdir(parents=True)
    os.symlink(victim, path)
    write_key_file(str(path), "k" * 43)
    assert victim.read_bytes() == b"precious" and not os.path.islink(path)
    assert path.read_text() == "k" * 43
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


def test_config_yaml_is_owner_only_and_never_written_through_a_link(tmp_path, victim):
    cfg = load_config(os.path.join(REPO, "configs", "tiny_grpo.yaml"), ["rollout.api_key=s3cret-key-of-the-run"])
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.symlink(victim, run / "config.yaml.tmp")
    path = save_config(cfg, str(run))
    assert victim.read_bytes() == b"precious"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    fresh = tmp_path / "fresh"
    save_config(cfg, str(fresh))
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700


@as_root
def test_a_secret_file_of_another_user_is_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(os.urandom(32).hex().encode())
    os.chmod(path, 0o600)
    assert len(handshake.read_secret_file(str(path))) == 64
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=r"rollout.manager_secret_file: .* belongs to uid 65534, not to you"):
        handshake.read_secret_file(str(path))


def test_megarl_server_takes_its_key_from_a_file_or_a_pipe_never_a_readable_file(tmp_path, caplog):
    from megarl.server.__main__ import StartupError, parse_args, read_api_key

    key = tmp_path / "key"
    key.write_text("a" * 40 + "\n")
    os.chmod(key, 0o644)
    args = parse_args(["--model", "m", "--api-key-file", str(key)])
    with pytest.raises(StartupError, match="--api-key-file: .* is readable by others"):
        read_api_key(args)
    os.chmod(key, 0o600)
    read_api_key(args)
    assert args.api_key == "a" * 40
    fd = handshake.secret_pipe(b"b" * 40)
    args = parse_args(["--model", "m", "--api-key-fd", str(fd)])
    read_api_key(args)
    assert args.api_key == "b" * 40
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--api-key", "x", "--api-key-file", str(key)])




def test_the_servers_key_file_is_read_at_load_and_kept_out_of_config_yaml(tmp_path):
    demo = os.path.join(REPO, "configs", "tiny_grpo.yaml")
    key = tmp_path / "api_key"
    key.write_text("c" * 43 + "\n")
    os.chmod(key, 0o644)
    with pytest.raises(ConfigError, match=r"^rollout.api_key_file: .* is readable by others \(mode 644\)"):
        load_config(demo, [f"rollout.api_key_file={key}"])
    os.chmod(key, 0o600)
    cfg = load_config(demo, [f"rollout.api_key_file={key}"])
    assert cfg.rollout.api_key == "c" * 43
    path = save_config(cfg, str(tmp_path / "run"))
    assert "c" * 43 not in open(path).read()  # the key stays in its file
    assert load_config(path).rollout.api_key == "c" * 43  # reloading the run's config reads it again
    with pytest.raises(ConfigError, match="^rollout.api_key_file: holds another key than rollout.api_key"):
        load_config(demo, [f"rollout.api_key_file={key}", "rollout.api_key=other-key-0123456789"])
    with pytest.raises(ConfigError, match=r"^rollout.api_key_file: cannot read '.*absent'"):
        load_config(demo, [f"rollout.api_key_file={tmp_path}/absent"])


# SGLang's and its router's way of reading the key: argparse (a separate "--api-key KEY" whose
# key starts with "-", as 1 in 64 token_urlsafe keys do, is refused as a missing argument)
ECHO_ARGV = """import argparse, json, sys
p = argparse.ArgumentParser(); p.add_argument("--port"); p.add_argument("--api-key")
print(json.dumps([sys.argv[1:], vars(p.parse_args())]))"""


def test_a_planned_sglang_server_reads_its_key_file_never_argv(tmp_path):
    """KEYED_LAUNCH (how megarl-launch starts SGLang and its router keyed) runs the module with
    --api-key from the file, only when the file is the user's own and unreadable by others."""
    import json
    import subprocess
    import sys

    from megarl.rollout.sglang_local import keyed

    (tmp_path / "echo_argv.py").write_text(ECHO_ARGV)
    key = tmp_path / "api_key"
    key.write_text("-" + "d" * 42)
    os.chmod(key, 0o640)
    argv = keyed(sys.executable, ["-m", "echo_argv", "--port", "1"], str(key))
    assert "d" * 42 not in " ".join(argv)
    run = lambda: subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    out = run()
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == f"--api-key-file: {key} must be yours and readable by nobody else (chmod 600)"
    os.chmod(key, 0o600)
    out = run()
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [["--port", "1", "--api-key=-" + "d" * 42], {"port": "1", "api_key": "-" + "d" * 42}]
    key.unlink()
    os.symlink(tmp_path / "echo_argv.py", key)  # a link at the key's name is not followed
    assert run().returncode == 1


ATTACKER = """
import socket, sys, time
socks = []
for _ in range(24):
    try:
        socks.append(socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5))
    except OSError:
        pass
print(len(socks), flush=True)
time.sleep(60)  # silent: never answers the challenge
"""
SYSTEM_PYTHON = "/usr/bin/python3"  # one that uid nobody may execute (the test's may live under /root)


@as_root
@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"no {SYSTEM_PYTHON} for the other user")
def test_another_user_holding_silent_connections_cannot_lock_the_trainer_out():
    """24 silent connections of another local user (uid nobody) hold at most their own
    MAX_HANDSHAKES_PER_PEER slots: the run's trainer still passes the handshake at once."""
    import functools
    import socket
    import subprocess
    import threading
    import time

    from megarl.protocol.channel import connect
    from megarl.rollout.links import MAX_HANDSHAKES_PER_PEER, serve_forever
    from megarl.rollout.manager import RolloutManager

    secret = os.urandom(32)
    manager = RolloutManager(None)
    manager.admit = functools.partial(_handshake_only, manager)  # the slots and handshake, no link served
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    threading.Thread(target=serve_forever, args=(manager, listener, secret), daemon=True).start()
    attacker = subprocess.Popen([SYSTEM_PYTHON, "-c", ATTACKER, str(port)], stdout=subprocess.PIPE, text=True,
                                cwd="/", env={}, preexec_fn=lambda: (os.setgid(NOBODY), os.setuid(NOBODY)))
    try:
        assert attacker.stdout.readline().strip() == "24"  # the kernel accepted them all
        time.sleep(0.5)  # the manager has taken each into a handshake slot, or closed it
        assert manager._peer_slots[("uid", NOBODY)] == MAX_HANDSHAKES_PER_PEER
        t0 = time.monotonic()
        sock = connect(f"127.0.0.1:{port}", secret, timeout_s=3.0)
        assert time.monotonic() - t0 < 1.0
        sock.close()
    finally:
        attacker.kill()
        attacker.wait()
        manager.stopped.set()

def _handshake_only(manager, sock, addr, secret, peer=None):
    """RolloutManager.admit's slot accounting around the real handshake, without serving a link."""
    try:
        handshake.accept(sock, secret)
    finally:
        with manager._slots:
            manager.handshaking -= 1
            manager._peer_slots[peer] -= 1
        sock.close()
