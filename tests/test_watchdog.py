"""The sync face's watchdog (``_acompat._Watchdog``), on real sockets: a statement still running at
its deadline has its socket shut down, also when it is armed just as the thread goes idle; one
that answered in time (``cancel``) is left alone."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from dblock._acompat import _Watchdog


class Conn:
    """What the watchdog needs of a pooled connection: a socket, a guard (its pool's lock)."""

    def __init__(self) -> None:
        self.raw, self.peer = socket.socketpair()
        self.cut = False
        self.guard = threading.Lock()
        self.watch: Any = None

    def close(self) -> None:
        self.raw.close()
        self.peer.close()


@pytest.fixture
def watchdog() -> _Watchdog:
    dog = _Watchdog()
    dog.LINGER = 0.05  # idle soon: the thread then sleeps until a statement wakes it
    return dog


def blocked_read(conn: Conn) -> tuple[threading.Thread, list[bytes]]:
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(conn.raw.recv(1)), daemon=True)
    reader.start()
    return reader, got


@pytest.mark.parametrize("idle_first", [False, True], ids=["busy", "after going idle"])
def test_a_statement_past_its_deadline_is_cut(watchdog: _Watchdog, idle_first: bool) -> None:
    conn = Conn()
    try:
        warm = watchdog.watch(conn, time.monotonic() + 60)  # starts the thread
        warm.cancel()
        if idle_first:
            time.sleep(0.3)  # past LINGER: the thread waits for a statement to wake it
            assert watchdog._wake_at == float("inf")
        reader, got = blocked_read(conn)
        watchdog.watch(conn, time.monotonic() + 0.2)
        reader.join(10)
        assert not reader.is_alive() and got == [b""], "the blocked read was not woken by the cut"
        assert conn.cut
    finally:
        conn.close()


def test_a_statement_that_answered_is_not_cut(watchdog: _Watchdog) -> None:
    conn = Conn()
    try:
        armed = watchdog.watch(conn, time.monotonic() + 0.2)
        armed.cancel()
        time.sleep(0.6)  # past the deadline, and a look of the thread (TICK)
        assert not conn.cut
        conn.peer.sendall(b"x")
        assert conn.raw.recv(1) == b"x"  # the socket is still whole
    finally:
        conn.close()


def test_a_cut_waits_for_the_pools_lock(watchdog: _Watchdog) -> None:
    """The connection's return to its pool takes the pool's lock: a cut never lands between that
    and the next statement on the connection."""
    conn = Conn()
    try:
        with conn.guard:
            watchdog.watch(conn, time.monotonic() + 0.05)
            time.sleep(0.5)  # due, but the pool's lock is held
            assert not conn.cut
        deadline = time.monotonic() + 10
        while not conn.cut and time.monotonic() < deadline:
            time.sleep(0.01)
        assert conn.cut
    finally:
        conn.close()
