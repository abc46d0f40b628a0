"""Who may talk to the rollout manager: a per-run secret, proved by HMAC challenge-response
before the first message of the channel is read (docs/reliability.md, "Security").

    manager                                         peer (trainer rank 0, a stage source)
      accept ─── MAGIC (16) | server nonce (32) ──▶
             ◀── client nonce (32) | HMAC(secret, "client" | s | c) (32) ──
      compare_digest; wrong or late -> close, nothing else read
             ─── HMAC(secret, "server" | s | c) (32) ──▶   compare_digest: it is this run's manager

Every read is of a fixed size (64 bytes at most) under one deadline for the whole exchange, so
a peer without the secret can make the manager allocate nothing and hold a connection slot for
`AUTH_TIMEOUT_S` at most. Both nonces are fresh per connection: a recorded exchange does not
replay, and the labels differ per direction, so a proof cannot be reflected back.

Where the secret comes from: trainer rank 0 makes one per run (`new_secret`) and hands it to the
manager it spawns through an inherited pipe (never argv, never a log line); a manager started
apart (``rollout.manager_address``) and the trainer read the same file the user made
(``rollout.manager_secret_file``, `read_secret_file`: owner-only permissions).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
import time

MAGIC = b"megarl-channel/1"  # 16 bytes: a peer that answers with anything else is not a manager
NONCE = 32
PROOF = 32  # sha256
MIN_SECRET = 16
AUTH_TIMEOUT_S = 5.0


class AuthError(RuntimeError):
    """The handshake failed: ``retry`` when the manager closed before its challenge (busy, or
    still starting), not when a proof was refused."""

    def __init__(self, message: str, retry: bool = False, refused: bool = False):
        super().__init__(message)
        self.retry, self.refused = retry, refused  # refused: a manager that does not share the secret


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def read_secret_file(path: str, field: str = "rollout.manager_secret_file") -> bytes:
    """The secret in ``path`` (trailing whitespace dropped). The file must belong to this user and
    be readable by nobody else (as ssh asks of a private key): a secret others can read is none."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())  # of the file read, not of whatever the path names a moment later
            secret = f.read().rstrip()
    except OSError as e:
        raise ValueError(f"{field}: cannot read {path!r} ({e.strerror or e})") from None
    if st.st_uid != os.geteuid():
        raise ValueError(f"{field}: {path!r} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): "
                         f"another user could have written it")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{field}: {path!r} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                         f"chmod 600 it")
    if len(secret) < MIN_SECRET:
        raise ValueError(f"{field}: {path!r} holds {len(secret)} bytes; a secret needs at least {MIN_SECRET} "
                         f"(e.g. head -c 32 /dev/urandom | base64 > FILE)")
    return secret


def secret_pipe(secret: bytes) -> int:
    """A pipe's read end holding ``secret``, for a child to inherit (``pass_fds``); the caller
    closes it once the child started."""
    r, w = os.pipe()
    try:
        os.write(w, secret)  # 32 bytes: far below the pipe's buffer, never blocks
    finally:
        os.close(w)
    return r


def read_secret_fd(fd: int, flag: str = "--secret-fd") -> bytes:
    try:
        with os.fdopen(fd, "rb") as f:
            secret = f.read()
    except OSError as e:
        raise ValueError(f"{flag} {fd}: cannot read it ({e.strerror or e})") from None
    if len(secret) < MIN_SECRET:
        raise ValueError(f"{flag} {fd}: {len(secret)} bytes, not a secret")
    return secret


def _mac(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes before ``deadline``; b"" when the peer closed or the time is up."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            return b""
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except OSError:  # timeout, reset
            return b""
        if not chunk:
            return b""
        buf += chunk
    return bytes(buf)


def accept(sock: socket.socket, secret: bytes, timeout_s: float = AUTH_TIMEOUT_S) -> bool:
    """Manager side: True when the peer proved ``secret``. Reads 64 bytes at most; on False the
    caller closes the socket and has read nothing else from it."""
    deadline = time.monotonic() + timeout_s
    server_nonce = secrets.token_bytes(NONCE)
    try:
        sock.settimeout(timeout_s)
        sock.sendall(MAGIC + server_nonce)
        got = _read(sock, NONCE + PROOF, deadline)
        if not got:
            return False
        client_nonce, proof = got[:NONCE], got[NONCE:]
        # constant time: how much of a wrong proof matched is not measurable
        if not hmac.compare_digest(proof, _mac(secret, b"client", server_nonce, client_nonce)):
            return False
        sock.sendall(_mac(secret, b"server", server_nonce, client_nonce))
        return True
    except OSError:
        return False
    finally:
        try:
            sock.settimeout(None)
        except OSError:
            pass


def prove(sock: socket.socket, secret: bytes, peer: str, timeout_s: float = AUTH_TIMEOUT_S) -> None:
    """Peer side: proves ``secret`` to the manager and checks the manager's own proof; raises
    `AuthError` naming what went wrong."""
    deadline = time.monotonic() + timeout_s
    try:
        challenge = _read(sock, len(MAGIC) + NONCE, deadline)
        if not challenge:
            raise AuthError(f"{peer}: no channel handshake within {timeout_s:g} s (busy, still starting, "
                            f"or not a megarl rollout manager)", retry=True)
        if challenge[:len(MAGIC)] != MAGIC:
            raise AuthError(f"{peer}: not a megarl rollout manager (it does not speak the channel)")
        server_nonce, client_nonce = challenge[len(MAGIC):], secrets.token_bytes(NONCE)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
        answer = _read(sock, PROOF, deadline)
    except OSError as e:
        raise AuthError(f"{peer}: handshake failed ({e})", retry=True) from None
    finally:
        try:
            sock.settimeout(None)
        except OSError:
            pass
    if not answer:
        raise AuthError(f"{peer}: refused this run's secret (a manager started apart reads "
                        f"rollout.manager_secret_file: the trainer must name the same file)", refused=True)
    if not hmac.compare_digest(answer, _mac(secret, b"server", server_nonce, client_nonce)):
        raise AuthError(f"{peer}: the manager did not prove the secret (not this run's manager)", refused=True)
