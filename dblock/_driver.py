"""Connections for lock statements, and running one statement on one of them, in bounded time.

Lock statements never share the caller's transaction: each runs in autocommit
on a connection dblock keeps for itself, so a grant is visible to every other
client the moment it is made. The hot path talks to the driver directly
(psycopg 3, with server-side prepared statements unless ``prepare=False``, or
sqlite3): SQLAlchemy knows the URL and the dialect, but adds nothing per call.

Three bounds keep every call's time and cost finite whatever the server does:

- **A pool of at most ``size`` connections** per Driver. A thread that finds
  them all busy waits for one, within its own deadline. Waiters between
  attempts hold none.
- **Connecting** is bounded by libpq's ``connect_timeout`` (whole seconds, at
  least 2), set from the caller's deadline; TCP keepalives and
  ``tcp_user_timeout`` make a dead peer show up on idle and busy sockets.
- **A statement** is bounded by one watchdog thread per process: a statement
  still running at its deadline (or at most ``_Watchdog.TICK`` after it) has
  its socket shut down, so the waiting call
  returns at once with an error. That covers what the server cannot bound
  itself (a frozen postmaster, a black-holed network), and works behind a
  transaction pooler, which would refuse per-session settings at connect.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from ._faults import Busy, OutOfTime, first_line
from .errors import DatabaseUnavailable

if TYPE_CHECKING:
    from .backends import Backend

log = logging.getLogger("dblock.driver")

__all__ = ["Busy", "Driver", "OutOfTime", "Result", "first_line", "pool_busy", "pool_turn", "shutdown_socket"]

# The most a statement waits for another writer where the database bounds it (SQLite).
SQLITE_BUSY_TIMEOUT_MS = 30_000


class Result(NamedTuple):
    """What ``Driver.run`` got back."""

    rows: list[Sequence[Any]]  # the statement's rows
    extra: list[Sequence[Any]]  # the follow-up statement's rows (``then``), when the first returned none
    retried: bool  # the statement was sent a second time because the first connection broke


class _Conn:
    __slots__ = ("raw", "cursor", "busy_ms", "deadline", "cut", "waiting")

    def __init__(self, raw: Any, cursor: Any) -> None:
        self.raw = raw
        self.cursor = cursor
        self.busy_ms = SQLITE_BUSY_TIMEOUT_MS
        self.deadline = math.inf  # while a statement runs: when the watchdog cuts it
        self.cut = False  # the watchdog shut this connection's socket down
        self.waiting = False  # checked out for a waiting acquire's statement


IDLE, OPEN, WAIT = "idle", "open", "wait"


def pool_turn(waiting: bool, fresh: bool, waiting_out: int, idle: int, opened: int, size: int) -> str:
    """What a checkout does now (both drivers' pools): take an ``IDLE`` connection, ``OPEN``
    a new one, or ``WAIT`` for one to come back.

    Statements of waiting acquires may hold at most ``size - 1`` connections
    at once (one is kept for releases and the rest); ``fresh``: not an idle
    one (a retry after a broken connection).
    """
    if waiting and waiting_out >= max(1, size - 1):
        return WAIT  # wait for another waiter's statement to finish
    if idle and not fresh:
        return IDLE
    return OPEN if opened < size else WAIT


def pool_busy(size: int, where: str, owner: str) -> OutOfTime:
    return OutOfTime(
        f"all {size} of this {owner}'s connections to {where} stayed busy "
        f"until the call's deadline (see {owner}(max_connections=...))"
    )


class Driver:
    """A bounded LIFO pool of autocommit driver connections, safe across threads and forks."""

    def __init__(self, backend: Backend, *, size: int = 10) -> None:
        self.backend = backend
        self.engine = backend.engine
        self.where = backend.where  # the URL without its password, for messages
        self.table = backend.table
        self.size = size
        self._errors = backend.errors
        self._cut = backend.caps.cut_statements  # else the database bounds a statement (a writer wait)
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._idle: list[_Conn] = []
        self._open = 0  # connections checked out or idle (the listener's is not counted)
        self._waiting_out = 0  # connections checked out for waiting acquires' statements
        self._pid = os.getpid()

    # -- connections -------------------------------------------------------
    def connect(self, deadline: float) -> Any:
        """A new autocommit driver connection (outside the pool), opened before ``deadline``."""
        return self.backend.connect(deadline)

    def _checkout(self, deadline: float, fresh: bool = False, waiting: bool = False) -> _Conn:
        """A connection of the pool: an idle one, a new one while fewer than ``size`` are
        open, or else the next one returned, waiting no later than ``deadline``.

        Statements of waiting acquires (``waiting``) may hold at most ``size - 1``
        connections at once: one is kept for releases, extends and the rest, so
        a crowd of waiters cannot make a release wait for a connection.
        """
        if self._pid != os.getpid():
            # A forked child must not talk over its parent's sockets, and must not
            # wait for a lock some other parent thread held at the fork.
            self._reset()
        with self._cond:
            while True:
                turn = pool_turn(waiting, fresh, self._waiting_out, len(self._idle), self._open, self.size)
                if turn == IDLE:
                    conn = self._idle.pop()
                    conn.waiting = waiting
                    self._waiting_out += waiting
                    return conn
                if turn == OPEN:
                    self._open += 1
                    self._waiting_out += waiting
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise pool_busy(self.size, self.where, "Locker")
                self._cond.wait(left)
        try:
            raw = self.connect(deadline)
            conn = _Conn(raw, self.backend.cursor(raw))
        except BaseException:
            self._forget(1, waiting)
            raise
        conn.waiting = waiting
        return conn

    def _checkin(self, conn: _Conn) -> None:
        with self._cond:
            if self._pid == os.getpid() and not conn.cut:
                self._waiting_out -= conn.waiting
                conn.waiting = False
                self._idle.append(conn)
                self._cond.notify_all()  # waiters' and others' turns differ: let each look
                return
        self._discard(conn)

    def _discard(self, conn: _Conn) -> None:
        _close(conn)
        self._forget(1, conn.waiting)
        conn.waiting = False

    def _forget(self, count: int, waiting: bool = False) -> None:
        with self._cond:
            if self._pid == os.getpid():
                self._open -= count
                self._waiting_out -= waiting
                self._cond.notify_all()

    def _drain(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
        for conn in idle:
            _close(conn)
        self._forget(len(idle))

    def open_connections(self) -> int:
        """How many pooled connections are open now (idle or running a statement)."""
        with self._cond:
            return self._open if self._pid == os.getpid() else 0

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
            mine = self._pid == os.getpid()
        if mine:
            for conn in idle:
                _close(conn)
            self._forget(len(idle))

    # -- statements --------------------------------------------------------
    def run(
        self,
        sql: str,
        params: dict[str, Any],
        then: str | None = None,
        *,
        deadline: float,
        before: str | None = None,
        waiting: bool = False,
    ) -> Result:
        """Run ``sql`` (and, if it returned no row, ``then``) on one connection, by ``deadline``.

        ``deadline`` (``time.monotonic()`` seconds) bounds the whole call:
        waiting for a connection, connecting, the statement, and SQLite's wait
        for another writer (then ``Busy``). A statement still running at the
        deadline is cut off (``DatabaseUnavailable``): it may or may not have
        committed. ``before`` runs first, in one transaction with ``sql``.
        ``waiting`` marks a waiting acquire's statement (see ``_checkout``).

        A connection that breaks mid-statement is thrown away, with the idle
        ones (after a restart or failover they are all dead), and the statement
        is sent once more on a new connection. Every dblock statement is safe
        to repeat: an acquire retried with the same owner returns the lease it
        may already have granted (G6), and release and extend compare (name,
        owner, token), so a second try changes nothing the first did not.
        """
        for attempt in (1, 2):
            if time.monotonic() >= deadline:
                # Sent now, it could only be cut off: it would leave its outcome unknown for nothing.
                raise OutOfTime(f"no time left for a statement on {self.where}")
            conn = self._checkout(deadline, fresh=attempt == 2, waiting=waiting)
            try:
                if self._cut:
                    _watchdog.watch(conn, deadline)
                    try:
                        result = self._statements(conn, sql, params, then, before)
                    finally:
                        _watchdog.done(conn)
                else:
                    self._busy_timeout(conn, deadline)
                    result = self._statements(conn, sql, params, then, before)
            except self._errors as exc:
                if conn.cut:
                    self._discard(conn)
                    raise DatabaseUnavailable(
                        f"{self.where} did not answer in time; the statement was cut off "
                        "(it may or may not have taken effect)"
                    ) from exc
                if self.backend.is_broken(conn.raw):
                    self._discard(conn)
                    self._drain()
                    if attempt == 1 and time.monotonic() < deadline:
                        log.warning("connection to %s broke (%s); retrying once", self.where, first_line(exc))
                        continue
                    raise unavailable(f"lost the connection to {self.where}: {first_line(exc)}", exc) from exc
                self._checkin(conn)
                raise self.backend.translate(exc) from exc
            except BaseException:
                self._discard(conn)  # interrupted mid-statement: its state is unknown
                raise
            # Answered, though maybe in the instant the watchdog cut it: the
            # result stands, and a cut connection is not put back (_checkin).
            self._checkin(conn)
            return Result(*result, attempt == 2)
        raise AssertionError("unreachable")

    def _statements(
        self, conn: _Conn, sql: str, params: dict[str, Any], then: str | None, before: str | None
    ) -> tuple[list[Sequence[Any]], list[Sequence[Any]]]:
        if before is not None:
            with conn.raw.transaction():
                self._execute(conn, before, {})
                rows = self._execute(conn, sql, params)
        else:
            rows = self._execute(conn, sql, params)
        return rows, self._execute(conn, then, params) if then is not None and not rows else []

    def _busy_timeout(self, conn: _Conn, deadline: float) -> None:
        # Set for every call: how long this call may wait for another writer.
        ms = int(min(SQLITE_BUSY_TIMEOUT_MS, max(1.0, (deadline - time.monotonic()) * 1000)))
        if ms != conn.busy_ms:
            self.backend.wait_for_writer(conn.raw, ms)
            conn.busy_ms = ms

    def _execute(self, conn: _Conn, sql: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        return self.backend.execute(conn.cursor, sql, params)


class _Watchdog:
    """One thread per process that cuts statements still running at their deadline.

    The hot path only records the deadline on the connection and adds it to a
    set. While statements run, the thread looks every ``TICK`` seconds (or at
    the earliest deadline, if sooner), so a statement is cut at most ``TICK``
    late and a new statement has to wake the thread only when its deadline is
    nearer than the next look: rare, so the hot path costs no thread switch.
    After ``LINGER`` idle seconds the thread sleeps until the next statement.
    """

    TICK = 0.25
    LINGER = 2.0

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._busy: set[_Conn] = set()
        self._wake_at = math.inf  # when the thread looks next
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def watch(self, conn: _Conn, deadline: float) -> None:
        if self._pid != os.getpid():
            self._reset()  # the parent's thread did not survive the fork
        with self._cond:
            conn.deadline = deadline
            self._busy.add(conn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dblock-watchdog", daemon=True)
                self._thread.start()
            elif deadline < self._wake_at:
                self._cond.notify()

    def done(self, conn: _Conn) -> None:
        with self._cond:
            self._busy.discard(conn)

    def _run(self) -> None:
        idle_since: float | None = None
        with self._cond:
            while True:
                now = time.monotonic()
                for conn in [c for c in self._busy if c.deadline <= now]:
                    # Under the lock: done() cannot return the connection to the
                    # pool (and another statement start on it) while we cut it.
                    self._busy.discard(conn)
                    conn.cut = True
                    shutdown_socket(conn.raw)
                if self._busy:
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                if idle_since is not None and now - idle_since >= self.LINGER:
                    self._wake_at = math.inf
                    self._cond.wait()
                else:
                    soonest = min((c.deadline for c in self._busy), default=math.inf)
                    self._wake_at = min(soonest, now + self.TICK)
                    self._cond.wait(max(self._wake_at - now, 0.0))


_watchdog = _Watchdog()


def shutdown_socket(raw: Any) -> None:
    """Wake any thread blocked on ``raw``'s socket at once: it reads end-of-file.

    Shut down through a duplicate descriptor, so the connection's own
    descriptor is never closed under the thread using it (its number could be
    reused by another file meanwhile).
    """
    try:
        fd = os.dup(raw.fileno())
    except Exception:  # noqa: BLE001 - already closed: nothing is blocked on it
        return
    with socket.socket(fileno=fd) as sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def unavailable(message: str, exc: BaseException) -> DatabaseUnavailable:
    """The error of a connection lost mid-statement, keeping the database's code."""
    sqlstate = getattr(exc, "sqlstate", None)
    return DatabaseUnavailable(message, sqlstate=sqlstate)


def _close(conn: _Conn) -> None:
    try:
        conn.raw.close()
    except Exception:  # noqa: BLE001 - closing a dead connection may fail; nothing to do
        pass
