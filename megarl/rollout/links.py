"""The rollout manager's trainer links: who may connect (the run's secret, slots per peer), which
role a link has and what it may send, and serving one link's requests in order with a heartbeat.

Roles (the `Hello` a link opens with): one "driver" (global rank 0: every request; its closing
ends the run), any number of "stage" links (pipeline-stage weight sources: admin messages only)
and "push" links (an overlapped push's flight, weights.overlap: admin messages and the push's own
steps). `MAX_LINKS` in all; at most `MAX_HANDSHAKES` connections may be proving the secret at
once (`MAX_HANDSHAKES_PER_PEER` of them from one local user or remote address), `AUTH_TIMEOUT_S`
each."""
from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from typing import Optional

from megarl.protocol import handshake
from megarl.protocol.channel import MAX_REQUEST_HEADER, Channel, ChannelError
from megarl.protocol.messages import (ADMIN_MESSAGES, CLUSTER_MESSAGES, DIRECT_REPLIES, BatchRequest, Beat, Close,
                                      EvalPoll, EvalSubmit, FinishPush, Hello, Init, PauseForUpdate, PushFailed, RemoveServer,
                                      Reply, Resume, StateRequest, Unhealthy)

log = logging.getLogger("megarl.manager")

# what each role may send after its Hello (a stage source only announces its own buckets)
STAGE_MESSAGES = ADMIN_MESSAGES
# an overlapped push's flight (weights.overlap): the push protocol's steps on a link of their own
# (a failed flight drops the servers that do not answer at once: the trainer may be waiting for
# a batch that needs their requests re-sent elsewhere)
PUSH_MESSAGES = (*ADMIN_MESSAGES, PauseForUpdate, FinishPush, Resume, Unhealthy, RemoveServer, PushFailed)
DRIVER_MESSAGES = (Init, BatchRequest, EvalSubmit, EvalPoll, StateRequest, Close, *ADMIN_MESSAGES,
                   *CLUSTER_MESSAGES)
MAX_LINKS = 64  # authenticated links: the driver and one per pipeline stage
MAX_HANDSHAKES = 16  # connections still proving the secret
MAX_HANDSHAKES_PER_PEER = 4  # of them, from one peer (a local user, or a remote address)

class LinkServer:
    """The link half of `megarl.rollout.manager.RolloutManager`: slots, handshakes and serving;
    requests go to ``self.handle`` and the run stops (``self.stopped``) with the driver's link."""

    def __init__(self):
        self.stopped = threading.Event()
        self._slots = threading.Lock()
        self.handshaking = self.links = 0  # connections proving the secret / authenticated links
        self._peer_slots: collections.Counter = collections.Counter()  # handshakes per `peer_of`
        self._driver_seen = False

    def handle(self, msg):
        raise NotImplementedError

    def close(self) -> None:
        """After the last link: the owner's resources."""

    def serve(self, channel: Channel) -> None:
        """One authenticated link: its `Hello` (the role), then requests in, replies out, in
        order. Only the driver link ends the run - by `Close`, or by closing (the trainer ended
        or died); a second driver is refused."""
        try:
            hello = channel.recv(timeout_s=handshake.AUTH_TIMEOUT_S)
        except ChannelError:
            channel.close()
            return
        role = self._claim(hello)
        if role is None:
            log.warning("%s: refused (first message %s)", channel.peer, type(hello).__name__)
            channel.close()
            return
        driver = role == "driver"
        allowed = {"driver": DRIVER_MESSAGES, "stage": STAGE_MESSAGES, "push": PUSH_MESSAGES}[role]
        beat = Heartbeat(channel, hello.beat_s)
        try:
            while not self.stopped.is_set():
                msg = channel.recv()
                t0 = time.perf_counter()
                beat.busy(t0)
                try:
                    if not isinstance(msg, allowed):
                        raise PermissionError(f"{type(msg).__name__} is not a request a {role} link may send")
                    value = self.handle(msg)
                    reply = value if isinstance(value, DIRECT_REPLIES) else Reply(value=value)
                except Exception as e:  # noqa: BLE001 - the trainer gets the error as one line
                    log.warning("%s failed: %s: %s", type(msg).__name__, type(e).__name__, e)
                    # first line only: the trainer re-raises it as one line (RemoteError), the traceback stays in this log
                    reply = Reply(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                if isinstance(reply, Reply):
                    reply.elapsed_s = time.perf_counter() - t0
                beat.busy(None)
                channel.send(reply)
        except ChannelError:
            pass
        finally:
            beat.stop()
            channel.close()
            if driver:
                self.stopped.set()

    def _claim(self, hello) -> Optional[str]:
        """The link's role: "driver" (the run's one), "stage" (a pipeline stage's weight source),
        "push" (an overlapped push's flight); None: refused."""
        if not isinstance(hello, Hello) or hello.role not in ("driver", "stage", "push"):
            return None
        if hello.role != "driver":
            return hello.role
        with self._slots:
            if self._driver_seen:
                return None
            self._driver_seen = True
        return "driver"

    def admit(self, sock: socket.socket, addr, secret: bytes, peer=None) -> None:
        """A connection thread: the handshake, then `serve`; a peer that does not prove the
        secret is closed with nothing read but its 64 handshake bytes. ``peer``: the slot's
        owner from `take_slot`."""
        try:
            ok = handshake.accept(sock, secret)
        finally:
            with self._slots:
                self.handshaking -= 1
                self._peer_slots[peer] -= 1
                self.links += ok
        if not ok:
            log.warning("refused a connection from %s: no proof of the run's secret", addr)
            sock.close()
            return
        try:
            self.serve(Channel(sock, f"trainer link {addr}", max_header=MAX_REQUEST_HEADER, max_arrays=0))
        finally:
            with self._slots:
                self.links -= 1

    def take_slot(self, peer=None) -> bool:
        """Room for one more connection (handshakes and links are both capped, and so are one
        peer's handshakes: `peer_of`, so a user who holds silent connections open fills its
        own slots, never the run's trainer's)."""
        with self._slots:
            if (self.handshaking >= MAX_HANDSHAKES or self.handshaking + self.links >= MAX_LINKS
                    or self._peer_slots[peer] >= MAX_HANDSHAKES_PER_PEER):
                return False
            self.handshaking += 1
            self._peer_slots[peer] += 1
            return True


class Heartbeat:
    """A link's liveness signal (channel.py, "Liveness"): a thread that sends the link a `Beat`
    every ``period_s`` while one of its requests is being handled. It runs beside the request,
    so a request that waits minutes on generation still beats; a stopped process does not."""

    def __init__(self, channel: Channel, period_s: float):
        self.channel = channel
        self.period_s = min(max(float(period_s), 0.05), 5.0)  # a peer's value, bounded
        self._since: Optional[float] = None  # perf_counter when the request in hand started
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="megarl-beat", daemon=True)
        self.thread.start()

    def busy(self, since: Optional[float]) -> None:
        self._since = since

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            since = self._since
            if since is None:
                continue
            try:
                self.channel.send(Beat(busy_s=time.perf_counter() - since))
            except ChannelError:
                return

    def stop(self) -> None:
        self._stop.set()


def serve_forever(manager: LinkServer, listener: socket.socket, secret: bytes) -> None:
    # accept() wakes every 0.5 s to notice `stopped` (set when the driver's link closes)
    listener.settimeout(0.5)
    while not manager.stopped.is_set():
        try:
            sock, addr = listener.accept()
        except socket.timeout:
            continue
        peer = peer_of(sock, addr)
        if not manager.take_slot(peer):  # over the limits: closed before the challenge (a trainer retries)
            sock.close()
            continue
        threading.Thread(target=manager.admit, args=(sock, addr, secret, peer), name="megarl-link",
                         daemon=True).start()
    manager.close()


def peer_of(sock: socket.socket, addr) -> tuple:
    """Who a connection's handshake slot is counted against: for a peer on this host, the user
    owning its socket (the kernel's /proc/net/tcp{,6}: every local user shares the loopback
    address, so an address alone would let one of them lock the trainer out); else its address."""
    import ipaddress

    host, port = addr[0], addr[1]
    try:
        loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        loopback = False
    uid = _local_socket_uid(port, sock.getsockname()[1]) if loopback else None
    return ("uid", uid) if uid is not None else ("addr", host)


def _local_socket_uid(port: int, our_port: int):
    """The uid owning the local TCP socket bound to ``port`` and connected to ``our_port``."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[1].rsplit(":", 1)[1] == f"{port:04X}" and f[2].rsplit(":", 1)[1] == f"{our_port:04X}":
                return int(f[7])
    return None
