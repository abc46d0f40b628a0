"""The channel between trainer ranks and the rollout manager: typed messages over one TCP stream.

    frame   = u32 header length | header (JSON) | array bytes, in the header's order
    header  = {"type": <message class>, "fields": {...}, "arrays": [[name, dtype, shape], ...]}

Why TCP with raw array frames: it works unchanged on one node (loopback) and across nodes (the
manager on a rollout partition), needs no shared memory, and nothing is unpickled - a frame is
JSON plus bytes read into numpy arrays of a declared dtype and shape (safe deserialization).
A step's batch is a few flat arrays, so a hand-off costs one copy into the socket and one out.

Every message is a dataclass of `megarl.protocol.messages` (no untyped dicts cross the boundary),
a closed set in which no message names a method or an endpoint to call. A connection carries
nothing before its peer proved the run's secret (handshake.py).

Sizes are capped by what the protocol carries, and checked before anything is allocated: a
request's header at `MAX_REQUEST_HEADER` and no arrays (only the manager's `Batch` has arrays),
a reply's header at `MAX_REPLY_HEADER` (a batch's free-form infos) and its arrays at
`MAX_BATCH_BYTES`.

Requests are answered in order on their connection: `Link` may send several requests before it
reads their replies (`Link.submit`), which is how a weight push keeps the manager's admin work
off the trainer's critical path.

Liveness: while the manager works on a request of a link it sends that link a `Beat` every
``Hello.beat_s`` from a thread of its own, whatever the request waits on (a long generation, a
server's load). So a link that hears nothing - no reply, no beat - for ``silence_s`` knows the
manager process stopped running (SIGSTOP, a frozen host, a GIL held forever), not that its work
is slow: `ManagerStalled`, within the silence window of the trainer starting to wait. Whether
slow work progresses is the manager's own deadline (a `BatchRequest`'s ``timeout_s``), which
names the stalled phase. The trainer runs no thread for this: it reads beats only while it waits.
"""
from __future__ import annotations

import dataclasses
import json
import socket
import struct
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import numpy as np

from megarl.protocol.handshake import AuthError, prove
from megarl.protocol.messages import DIRECT_REPLIES, MESSAGES, Beat, Hello, Reply

_LEN = struct.Struct("!I")
# a request is metadata only; the largest, a bucket's announce relayed to every server, is about
# 100 bytes per tensor per server: 4 MiB is ~40k tensor-servers per bucket
MAX_REQUEST_HEADER = 4 * 2**20
MAX_REPLY_HEADER = 64 * 2**20  # a Batch's header carries every sample's free-form info
MAX_BATCH_BYTES = 16 * 2**30  # a step's token arrays (and MoE routes); more is a broken peer


class ChannelError(RuntimeError):
    """The peer is gone, or it sent something that is not a frame of this protocol."""


class ChannelTimeout(ChannelError):
    """No frame within the read's timeout (the connection itself is intact)."""


class ManagerStalled(ChannelError):
    """The manager sent nothing - no reply, no heartbeat - for the link's silence window: its
    process is stopped or hung. The link is broken from then on."""


class SecretRefused(ChannelError):
    """A megarl manager answered, but it and this peer do not hold the same secret."""


class RemoteError(RuntimeError):
    """The manager ran the request and it failed; the message is the manager's one-line error."""


# ------------------------------------------------------------------------------- encoding
def _wire_value(v: Any) -> Any:
    """Wire types (`megarl.protocol.wire` dataclasses) travel as {"__wire__": name, ...fields}."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {"__wire__": type(v).__name__, **{f.name: _wire_value(getattr(v, f.name))
                                                  for f in dataclasses.fields(v)}}
    if isinstance(v, (list, tuple)):
        return [_wire_value(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted(_wire_value(x) for x in v)
    if isinstance(v, dict):
        return {k: _wire_value(x) for k, x in v.items()}
    return v


def _wire_class(name: Any) -> type:
    """Only a dataclass defined in `megarl.protocol.wire` is built from a frame (no other name resolves)."""
    from megarl.protocol import wire

    cls = getattr(wire, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == wire.__name__):
        raise ValueError(f"unknown wire type {name!r}")
    return cls


def from_wire(v: Any) -> Any:
    if isinstance(v, dict):
        if "__wire__" in v:
            fields = {k: from_wire(x) for k, x in v.items() if k != "__wire__"}
            return _wire_class(v["__wire__"])(**fields)
        return {k: from_wire(x) for k, x in v.items()}
    if isinstance(v, list):
        return [from_wire(x) for x in v]
    return v


def encode(msg) -> list:
    """A message -> the buffers of one frame (header length, header, array bytes)."""
    # frame = [4-byte header length][JSON header][raw array bytes...]: arrays travel as bytes, not JSON
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg) if f.name != "arrays"}
    arrays = [(k, np.ascontiguousarray(a)) for k, a in getattr(msg, "arrays", {}).items()]
    header = json.dumps({"type": type(msg).__name__, "fields": _wire_value(fields),
                         "arrays": [[k, a.dtype.str, list(a.shape)] for k, a in arrays]},
                        default=str).encode()
    # memoryviews, not copies: Channel.send joins the frame once
    return [_LEN.pack(len(header)), header, *(memoryview(a).cast("B") for _, a in arrays)]


def decode(header: bytes, payloads: list[bytes]):
    head = json.loads(header)
    cls = MESSAGES.get(head.get("type"))
    if cls is None:
        raise ChannelError(f"unknown message type {head.get('type')!r}")
    msg = cls(**head["fields"])
    if head["arrays"]:
        # frombuffer shares the received bytes (read-only): no second copy of a batch
        msg.arrays = {k: np.frombuffer(buf, dtype=np.dtype(dt)).reshape(shape)
                      for (k, dt, shape), buf in zip(head["arrays"], payloads)}
    return msg


def array_sizes(header: bytes) -> list[int]:
    sizes = []
    for _, dt, shape in json.loads(header)["arrays"]:
        if not all(isinstance(d, int) and 0 <= d < 2**40 for d in shape):
            raise ValueError(f"array shape {shape!r}")
        sizes.append(int(np.dtype(dt).itemsize) * int(np.prod(shape, dtype=object)))
    return sizes


# ------------------------------------------------------------------------------- blocking I/O
class Channel:
    """A blocking connection (trainer side, and each connection thread of the manager); what
    it reads is capped at ``max_header`` bytes of header and ``max_arrays`` bytes of arrays."""

    def __init__(self, sock: socket.socket, peer: str = "rollout manager", max_header: int = MAX_REPLY_HEADER,
                 max_arrays: int = MAX_BATCH_BYTES):
        self.sock, self.peer = sock, peer
        self.max_header, self.max_arrays = max_header, max_arrays
        self.send_lock = threading.Lock()  # a heartbeat thread and the replies share the stream
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small requests go out at once

    def send(self, msg) -> None:
        frame = b"".join(encode(msg))
        try:
            with self.send_lock:  # one frame at a time: never interleaved with a beat
                self.sock.sendall(frame)
        except OSError as e:
            raise ChannelError(f"{self.peer}: send failed ({e})") from None

    def _exact(self, n: int) -> bytearray:
        """Exactly ``n`` bytes, read in place (a writable buffer: arrays decoded from it are too)."""
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except socket.timeout:
                raise  # recv's deadline (a subclass of OSError, not a lost connection)
            except OSError as e:
                raise ChannelError(f"{self.peer}: connection lost ({e})") from None
            if k == 0:
                raise ChannelError(f"{self.peer}: connection closed")
            got += k
        return buf

    def recv(self, timeout_s: Optional[float] = None):
        self.sock.settimeout(timeout_s)
        try:
            (n,) = _LEN.unpack(self._exact(_LEN.size))
            # both caps are checked before the bytes are allocated: a declared size costs nothing
            if n > self.max_header:
                raise ChannelError(f"{self.peer}: header of {n} bytes (more than the {self.max_header} "
                                   f"this protocol carries)")
            header = self._exact(n)
            sizes = array_sizes(header)
            if sum(sizes) > self.max_arrays:
                raise ChannelError(f"{self.peer}: frame declares {sum(sizes)} bytes of arrays (more than the "
                                   f"{self.max_arrays} this protocol carries)")
            # one buffer for all arrays, read in place: each array is a view of it (no second copy)
            body, at, payloads = memoryview(self._exact(sum(sizes))), 0, []
            for k in sizes:
                payloads.append(body[at:at + k])
                at += k
            return decode(header, payloads)
        except socket.timeout:
            raise ChannelTimeout(f"{self.peer}: no answer within {timeout_s:.0f} s") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ChannelError(f"{self.peer}: malformed frame ({e})") from None
        finally:
            # back to blocking: a timeout belongs to one recv, not to later sends
            self.sock.settimeout(None)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Pending:
    """A request sent but not answered yet; `result` reads replies in order until its own."""

    def __init__(self, link: "Link", what: str, deferred: bool = False):
        self.link, self.what, self.deferred = link, what, deferred
        self.reply: Optional[Reply] = None

    def done(self) -> bool:
        return self.reply is not None

    def result(self, timeout: Optional[float] = None) -> Any:
        while self.reply is None:
            self.link._read_one(timeout)
        if self.reply.error is not None:
            raise RemoteError(f"{self.what}: {self.reply.error}")
        return self.reply.value

    def cancel(self) -> None:  # the request is out; its reply is still read in order
        pass


class Link:
    """The trainer's connection to the manager. ``request`` sends and waits; ``submit`` sends and
    returns a `Pending`; replies are matched to requests by order."""

    def __init__(self, address: str, role: str, secret: bytes, rank: int = 0, connect_timeout_s: float = 60.0,
                 silence_s: float = 600.0, silence_field: str = "train.stall_timeout_s"):
        self.address = address
        self.channel = Channel(connect(address, secret, connect_timeout_s), f"rollout manager at {address}")
        self._pending: deque[Pending] = deque()
        self._errors: list[str] = []  # of deferred requests, for the next settle()
        # the manager beats 4x per silence window: a stall is declared after ~4 missed beats
        self.silence_s, self.silence_field = silence_s, silence_field
        self.broken: Optional[str] = None  # set by a stall: every later read fails at once
        self.beats = 0
        self.channel.send(Hello(role, rank, beat_s=beat_period(silence_s)))

    def submit(self, msg, what: Optional[str] = None, deferred: bool = False) -> Pending:
        """Sends ``msg``; its reply is read later, in order. ``deferred``: nobody will ask for the
        result - an error is kept for the next `settle`."""
        self.channel.send(msg)
        p = Pending(self, what or type(msg).__name__, deferred)
        self._pending.append(p)
        return p

    def request(self, msg, timeout_s: Optional[float] = None, what: Optional[str] = None) -> Any:
        return self.submit(msg, what).result(timeout_s)

    def request_reply(self, msg, timeout_s: Optional[float] = None) -> Reply:
        """Like `request`, but the whole `Reply` (for its ``elapsed_s``)."""
        p = self.submit(msg)
        p.result(timeout_s)
        return p.reply

    def _recv_live(self, timeout: Optional[float]):
        """The next frame that is not a `Beat`, within ``timeout`` (None: no overall deadline);
        `ManagerStalled` when nothing at all arrives for ``silence_s``."""
        if self.broken:
            raise ManagerStalled(self.broken)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            wait = self.silence_s if left is None else max(min(left, self.silence_s), 0.001)
            try:
                msg = self.channel.recv(wait)
            except ChannelTimeout:
                if left is not None and left <= self.silence_s:
                    raise  # the request's own deadline, not silence
                raise self._stall() from None
            if not isinstance(msg, Beat):
                return msg
            self.beats += 1

    def wait_while(self, busy: Callable[[], bool], step_s: float = 0.05) -> None:
        """Returns once ``busy()`` is false, reading what arrives meanwhile (beats; replies go to
        their requests): for a caller that waits on something else the manager gates (a
        broadcast the servers join once the manager relayed its announce). `ManagerStalled` when
        the manager is silent for ``silence_s`` while a request of this link is out."""
        heard = time.monotonic()
        while busy():
            if self.broken:
                raise ManagerStalled(self.broken)
            if not self._pending:  # nothing asked: the manager owes no frame, silence means nothing
                time.sleep(step_s)
                heard = time.monotonic()
                continue
            try:
                msg = self.channel.recv(step_s)
            except ChannelTimeout:
                if time.monotonic() - heard >= self.silence_s:
                    raise self._stall() from None
                continue
            heard = time.monotonic()
            if isinstance(msg, Beat):
                self.beats += 1
            else:
                self._take(msg)

    def _stall(self) -> ManagerStalled:
        self.broken = (f"{self.channel.peer}: stalled - no reply and no heartbeat for {self.silence_s:g} s "
                       f"({self.silence_field}) while waiting for {self._pending[0].what}; the manager "
                       f"process is stopped or hung")
        return ManagerStalled(self.broken)

    def _read_one(self, timeout: Optional[float]) -> None:
        if not self._pending:
            raise ChannelError("no request is waiting for a reply")
        self._take(self._recv_live(timeout))

    def _take(self, msg) -> None:
        # (the manager answers a BatchRequest with the Batch itself, arrays attached, an EvalPoll
        # with an EvalReport)
        if isinstance(msg, DIRECT_REPLIES):
            msg = Reply(value=msg)
        if not isinstance(msg, Reply):
            raise ChannelError(f"{self.channel.peer}: expected a reply, got {type(msg).__name__}")
        # one connection, one request at a time on the manager's side: replies come back in request order
        p = self._pending.popleft()
        p.reply = msg
        if p.deferred and msg.error is not None:
            self._errors.append(f"{p.what}: {msg.error}")

    def settle(self, timeout_s: Optional[float] = None) -> list[str]:
        """Reads every outstanding reply; returns the errors of deferred requests (one line each)."""
        while self._pending:
            self._read_one(timeout_s)
        errors, self._errors = self._errors, []
        return errors

    def close(self) -> None:
        self.channel.close()


def beat_period(silence_s: float) -> float:
    """How often the manager beats for a link that declares a stall after ``silence_s``."""
    return min(max(silence_s / 4.0, 0.05), 5.0)


def connect(address: str, secret: bytes, timeout_s: float = 60.0) -> socket.socket:
    """A socket to the manager at ``address`` that passed the handshake. Retries until
    ``timeout_s`` while the manager is still binding its port or busy (it closes a connection
    over its limit before the challenge); a refused secret raises at once."""
    host, port = address.rsplit(":", 1)
    peer = f"rollout manager at {address}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5.0)
        except OSError as e:
            if time.monotonic() > deadline:
                raise ChannelError(f"{peer}: cannot connect ({e})") from None
            time.sleep(0.1)
            continue
        try:
            prove(sock, secret, peer)
            return sock
        except AuthError as e:
            sock.close()
            if not e.retry or time.monotonic() > deadline:
                raise (SecretRefused if e.refused else ChannelError)(str(e)) from None
            time.sleep(0.1)
