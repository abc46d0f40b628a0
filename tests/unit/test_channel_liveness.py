"""Liveness on the trainer<->manager channel (channel.py "Liveness", links.Heartbeat): a
manager busy for longer than the link's silence window still answers, because it beats while it
works; a peer that passed the handshake and then says nothing is a `ManagerStalled` within the
window, and the link stays broken; a request's own shorter deadline is not a stall."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from megarl.protocol import handshake
from megarl.protocol.channel import Channel, ChannelTimeout, Link, ManagerStalled, beat_period
from megarl.protocol.messages import ServerInfo, StateRequest
from megarl.rollout.manager import RolloutManager

SECRET = handshake.new_secret()


class SlowManager(RolloutManager):
    """Answers every request after ``busy_s`` of work (a long generation, a slow server)."""

    busy_s = 2.0

    def handle(self, msg):
        time.sleep(self.busy_s)
        return "done"


def _listen(serve) -> str:
    """A loopback listener whose first connection runs ``serve(sock)`` in a thread."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run():
        sock, addr = listener.accept()
        listener.close()
        serve(sock, addr)

    threading.Thread(target=run, daemon=True).start()
    return "127.0.0.1:%d" % listener.getsockname()[1]


def _silent(sock, addr):
    """Proves the secret, reads what comes, never answers (a manager stopped after its handshake)."""
    assert handshake.accept(sock, SECRET)
    ch = Channel(sock, "peer")
    try:
        while True:
            ch.recv()
    except Exception:  # noqa: BLE001 - the link closed
        pass


def test_a_manager_busy_past_the_silence_window_still_answers_because_it_beats():
    manager = SlowManager(None)
    address = _listen(lambda sock, addr: (manager.take_slot(), manager.admit(sock, addr, SECRET)))
    link = Link(address, "driver", SECRET, silence_s=0.5)
    t0 = time.monotonic()
    assert link.request(StateRequest(), timeout_s=None) == "done"
    took = time.monotonic() - t0
    assert 2.0 <= took < 3.0, took  # 4x the silence window, and no stall
    assert beat_period(0.5) == 0.125
    assert 10 <= link.beats <= 17, link.beats  # one per 0.125 s of the 2 s of work
    link.close()


def test_a_silent_manager_is_a_stall_within_the_window_and_the_link_stays_broken():
    link = Link(_listen(_silent), "driver", SECRET, silence_s=0.5, silence_field="train.stall_timeout_s")
    t0 = time.monotonic()
    with pytest.raises(ManagerStalled) as e:
        link.request(StateRequest(), timeout_s=None)  # no overall deadline: silence alone bounds it
    took = time.monotonic() - t0
    assert 0.5 <= took < 0.8, took
    msg = str(e.value)
    assert "\n" not in msg and "no reply and no heartbeat for 0.5 s (train.stall_timeout_s)" in msg, msg
    assert "while waiting for StateRequest" in msg and "stopped or hung" in msg
    t0 = time.monotonic()
    with pytest.raises(ManagerStalled):
        link.request(ServerInfo(), timeout_s=30.0)
    assert time.monotonic() - t0 < 0.05  # broken: no second wait
    link.close()


def test_a_requests_own_shorter_deadline_is_a_timeout_not_a_stall():
    link = Link(_listen(_silent), "driver", SECRET, silence_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout) as e:
        link.request(StateRequest(), timeout_s=0.3)
    assert not isinstance(e.value, ManagerStalled)
    assert 0.3 <= time.monotonic() - t0 < 0.6
    assert link.broken is None
    link.close()


def test_wait_while_reads_beats_and_replies_and_stops_at_silence():
    manager = SlowManager(None)
    manager.busy_s = 1.0
    address = _listen(lambda sock, addr: (manager.take_slot(), manager.admit(sock, addr, SECRET)))
    link = Link(address, "driver", SECRET, silence_s=0.4)
    pending = link.submit(StateRequest())
    end = time.monotonic() + 1.5  # longer than the request: its reply is read meanwhile
    link.wait_while(lambda: time.monotonic() < end)
    assert pending.done() and pending.result() == "done" and link.beats >= 5
    link.close()

    link = Link(_listen(_silent), "driver", SECRET, silence_s=0.4)
    link.submit(StateRequest())
    t0 = time.monotonic()
    with pytest.raises(ManagerStalled):
        link.wait_while(lambda: True)
    assert 0.4 <= time.monotonic() - t0 < 0.7
    link.close()
