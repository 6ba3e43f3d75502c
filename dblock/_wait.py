"""Waiting without polling: the per-process listener, heartbeat and local hotspot queue.

Three pieces, all in-process:

``Listener``: one PostgreSQL connection per Locker that LISTENs on a channel
of its own, ``dblock_<id>``. Its waiters' owner ids start with that id, so a
fair release, which hands the lease to the first live waiter in the same
statement, NOTIFYs ``"owner token expiry"`` to exactly that process; the
listener thread reads it and wakes exactly the waiting thread with that owner
id. Other processes' listeners (and their database sessions) stay asleep. Waiters register
before they send their enqueue, so a hand-off that lands before the waiter
starts to sleep is kept, not lost. A notification can still be lost (the
connection breaks, a pooling proxy swallows LISTEN); waiters therefore also
wake at the current lease's known expiry and on a jittered fallback interval,
and a poll finds the lease theirs (the same owner retrying is granted it).
The listener closes itself when nobody has waited for ``IDLE_CLOSE`` seconds.

``Heartbeat``: keeps one row per Locker process fresh while it has fair
waiters, so a frozen process's waiters lapse without each being refreshed.

``Hotspot``: threads of one process that wait for the same name queue up here,
first come first served, and only the head talks to the database. A release by
this process wakes the local head at once. A name's queue object is dropped as
soon as its last waiter leaves, so the map only holds names being waited for.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import deque
from typing import Any, Callable

from ._acompat import shutdown_socket

log = logging.getLogger("dblock.wait")

CHANNEL_PREFIX = "dblock_"  # + the first ID_LENGTH characters of the new owner's id
ID_LENGTH = 16  # hex digits: 64 random bits per listener, then 64 per wait
APPLICATION_NAME = "dblock listener"
IDLE_CLOSE = 30.0  # seconds without waiters before the listener connection closes
_POLL = 0.25  # how often the listener thread looks up from the socket to check for idleness


class Slot:
    """One waiting thread's mailbox: the hand-off it was sent, and an Event to sleep on."""

    __slots__ = ("event", "grant")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.grant: tuple[int, float] | None = None  # (token, expiry as database epoch seconds)


class Listener:
    """The process's LISTEN connection for one Locker, shared by all its waiting threads."""

    def __init__(self, connect: Callable[[float], Any]) -> None:
        self._connect = connect  # (deadline) -> an autocommit psycopg connection of our own
        self._lock = threading.Lock()
        self._slots: dict[str, Slot] = {}
        self._thread: threading.Thread | None = None
        self._conn: Any = None
        self._ident: tuple[int, str] | None = None  # (backend pid, backend_start) while listening
        self._stop = False
        self._starting = False  # a thread is connecting the listener (outside the lock)
        self._next_start = 0.0  # after a failed start, no new try before this (monotonic)
        self._pid = os.getpid()
        self._id = secrets.token_hex(ID_LENGTH // 2)

    # -- waiters ---------------------------------------------------------------
    def owner_id(self) -> str:
        """A fresh owner id whose hand-offs are notified on this listener's channel."""
        self._after_fork()
        return self._id + secrets.token_hex(ID_LENGTH // 2)

    def register(self, owner: str, deadline: float) -> tuple[Slot, tuple[int, str] | None]:
        """A mailbox for ``owner`` (from ``owner_id``), and the listening session to name
        in its queue entry.

        Starts the listener if it is not running (connecting by ``deadline``,
        and waiting until LISTEN is in effect, so no hand-off sent after this
        returns can be missed). The session is None when LISTEN is unavailable,
        or another thread is starting the listener just now: then the waiter
        polls, and its hand-offs still reach its mailbox once the listener runs.
        """
        self._after_fork()
        slot = Slot()
        with self._lock:
            self._slots[owner] = slot
        self.revive(deadline)
        return slot, self._ident

    def revive(self, deadline: float) -> None:
        """Start the listener if it is not running (after an outage killed it, say).

        Connects outside the lock, so other waiters are never held up by a slow
        or silent server; after a failed try, the next one waits a second.
        """
        with self._lock:
            running = self._thread is not None and self._thread.is_alive()
            if running or self._starting or time.monotonic() < self._next_start:
                return
            self._starting, self._stop = True, False
        conn, ident = None, None
        try:
            conn = self._connect(deadline)
            conn.execute(f"SET application_name = '{APPLICATION_NAME}'")
            conn.execute(f"LISTEN {CHANNEL_PREFIX}{self._id}")
            row = conn.execute(
                "SELECT pg_backend_pid(), backend_start::text FROM pg_stat_get_activity(pg_backend_pid())"
            ).fetchone()
            ident = (int(row[0]), str(row[1]))
        except Exception as exc:  # noqa: BLE001 - no listener: waiters poll instead
            log.warning("cannot LISTEN for lock hand-offs (%s); waiting by polling", exc)
            if conn is not None:
                _close(conn)
            with self._lock:
                self._starting = False
                self._next_start = time.monotonic() + 1.0
            return
        with self._lock:
            self._starting = False
            if self._stop or self._pid != os.getpid():  # closed (or forked) while connecting
                _close(conn)
                return
            self._conn, self._ident = conn, ident
            self._thread = threading.Thread(target=self._run, args=(conn,), name="dblock-listener", daemon=True)
            self._thread.start()

    def unregister(self, owner: str) -> None:
        with self._lock:
            self._slots.pop(owner, None)

    @property
    def ident(self) -> tuple[int, str] | None:
        return self._ident

    def waiting(self) -> int:
        with self._lock:
            return len(self._slots)

    # -- the thread --------------------------------------------------------------
    def _run(self, conn: Any) -> None:
        idle_since: float | None = None
        try:
            while not self._stop:
                for note in conn.notifies(timeout=_POLL):
                    self._dispatch(note.payload)
                with self._lock:
                    if self._slots:
                        idle_since = None
                        continue
                    now = time.monotonic()
                    if idle_since is None:
                        idle_since = now
                    elif now - idle_since >= IDLE_CLOSE:
                        self._retire(conn)
                        return
        except Exception as exc:  # noqa: BLE001 - the connection broke: wake everyone to poll
            if self._stop:  # close() cut it short on purpose
                with self._lock:
                    self._retire(conn)
                return
            log.warning("the lock listener's connection failed (%s); waiters poll until it is back", exc)
            with self._lock:
                self._retire(conn)
                slots = list(self._slots.values())
            for slot in slots:
                slot.event.set()
            return
        with self._lock:
            self._retire(conn)

    def _retire(self, conn: Any) -> None:
        # With self._lock held. The next register() starts a new listener.
        if self._conn is conn:
            self._conn, self._ident, self._thread = None, None, None
        _close(conn)

    def _dispatch(self, payload: str) -> None:
        owner, _, rest = payload.partition(" ")
        with self._lock:
            slot = self._slots.get(owner)
        if slot is None:
            return  # a hand-off to another process, or to a waiter that already polled it
        token, _, expiry = rest.partition(" ")
        try:
            slot.grant = (int(token), float(expiry))
        except ValueError:
            log.warning("ignored a malformed hand-off notification %r", payload)
            return
        slot.event.set()

    def close(self) -> None:
        """End the listener session now: no waiting for the thread's next look-up."""
        if self._pid != os.getpid():
            return  # the parent's listener (after a fork): its socket is not ours to shut
        with self._lock:
            self._stop = True
            thread, conn = self._thread, self._conn
            if conn is not None:
                # Under the lock: the thread closes the connection only while holding it,
                # so its descriptor cannot have been closed (and its number reused) here.
                shutdown_socket(conn)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * _POLL + 1)

    def _after_fork(self) -> None:
        if self._pid != os.getpid():
            # The parent's thread did not survive the fork and its socket is not ours.
            self._lock = threading.Lock()
            self._slots, self._thread, self._conn, self._ident = {}, None, None, None
            self._stop, self._starting, self._next_start = False, False, 0.0
            self._pid = os.getpid()
            self._id = secrets.token_hex(ID_LENGTH // 2)  # the parent's channel is the parent's


def _close(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass


class Heartbeat:
    """Keeps this process's waiters alive in the queue: one statement per interval per
    Locker, however many threads wait (PostgreSQL's fair queue, migration 0005).

    A daemon thread runs ``beat()`` every ``interval`` seconds while at least
    one thread waits, and ends once none has for an interval. A process that
    freezes stops beating, and its waiters lapse together.
    """

    def __init__(self, beat: Callable[[], object], interval: float) -> None:
        self._beat = beat
        self._interval = interval
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._waiting = 0
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def enter(self) -> None:
        if self._pid != os.getpid():
            self._reset()  # the parent's thread did not survive the fork
        with self._cond:
            self._waiting += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dblock-heartbeat", daemon=True)
                self._thread.start()

    def leave(self) -> None:
        with self._cond:
            if self._pid == os.getpid():
                self._waiting -= 1

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait(self._interval)
                if self._waiting <= 0:
                    self._thread = None
                    return
            try:
                self._beat()
            except Exception as exc:  # noqa: BLE001 - the database is away: waiters ride it out, so do we
                log.info("could not refresh this process's waiters (%s); retrying", exc)


class _Line:
    __slots__ = ("waiters", "full")

    def __init__(self) -> None:
        self.waiters: deque[threading.Event] = deque()
        self.full = False  # a semaphore's line: its last grant here took the last free slot


class Hotspot:
    """Per-name FIFO of this process's waiting threads; only the head polls the database."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: dict[str, _Line] = {}
        self._pid = os.getpid()

    def join(self, name: str) -> threading.Event:
        """Queue up for ``name``; the returned Event is set when this thread is the head."""
        self._after_fork()
        me = threading.Event()
        with self._lock:
            line = self._lines.get(name)
            if line is None:
                line = self._lines[name] = _Line()
            line.waiters.append(me)
            if line.waiters[0] is me:
                me.set()
        return me

    def leave(self, name: str, me: threading.Event) -> None:
        """Leave the queue (granted or gave up); the next thread becomes the head and is woken."""
        with self._lock:
            line = self._lines.get(name)
            if line is None:
                return
            was_head = bool(line.waiters) and line.waiters[0] is me
            try:
                line.waiters.remove(me)
            except ValueError:
                return
            if not line.waiters:
                del self._lines[name]  # idle names hold nothing
            elif was_head:
                line.waiters[0].set()

    def released(self, name: str) -> None:
        """This process released ``name``: wake its local head to try at once."""
        with self._lock:
            line = self._lines.get(name)
            if line is not None and line.waiters:
                line.waiters[0].set()

    def mark_full(self, name: str, full: bool) -> None:
        """A grant of ``name`` in this process left no free slot (``full``), or some."""
        with self._lock:
            line = self._lines.get(name)
            if line is not None:
                line.full = full

    def full(self, name: str) -> bool:
        """Whether the last grant of ``name`` in this process left no free slot."""
        with self._lock:
            line = self._lines.get(name)
            return line is not None and line.full

    def __len__(self) -> int:
        with self._lock:
            return len(self._lines)

    def _after_fork(self) -> None:
        if self._pid != os.getpid():
            self._lock = threading.Lock()
            self._lines = {}
            self._pid = os.getpid()


__all__ = ["CHANNEL_PREFIX", "Heartbeat", "Hotspot", "Listener", "Slot"]
