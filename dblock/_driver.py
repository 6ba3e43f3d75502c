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
import sqlite3
import threading
import time
from typing import Any, Iterator, NamedTuple, Sequence

import psycopg
from psycopg.adapt import AdaptersMap
from psycopg.conninfo import conninfo_attempts
from psycopg.types.numeric import Int8Dumper
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from .errors import DatabaseUnavailable, DBLockError, PermissionDenied, SchemaMissing

log = logging.getLogger("dblock.driver")

SQLITE_BUSY_TIMEOUT_MS = 30_000
MIN_CONNECT_TIMEOUT = 2  # libpq counts connect_timeout in whole seconds, and at least 2

_MISSING_SCHEMA_HINT = "run `dblock migrate` or call Locker.create_schema() first"
# SQLSTATE classes of a server that is going away, starting up or out of room:
# connection exception, operator intervention (shutdown, crash recovery), insufficient resources.
_OUTAGE_CLASSES = ("08", "57", "53")


class Busy(DatabaseUnavailable):
    """SQLite stayed write-locked by another connection for the whole time allowed."""


class OutOfTime(DatabaseUnavailable):
    """The call's deadline came before its statement could be sent (no connection free in time,
    or no time left): nothing reached the database, so nothing is in doubt."""

    timed_out = True


class Result(NamedTuple):
    """What ``Driver.run`` got back."""

    rows: list[Sequence[Any]]  # the statement's rows
    extra: list[Sequence[Any]]  # the follow-up statement's rows (``then``), when the first returned none
    retried: bool  # the statement was sent a second time because the first connection broke


class _Conn:
    __slots__ = ("raw", "cursor", "busy_ms", "deadline", "cut", "waiting")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.cursor = raw.cursor()
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

    def __init__(self, engine: Engine, where: str, table: str, *, prepare: bool = True, size: int = 10) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self.where = where  # the URL without its password, for messages
        self.table = table
        self.size = size
        # False behind a transaction pooler (PgBouncer pool_mode=transaction):
        # a statement prepared on one server session may be run by another
        # client's session with that client's parameters.
        self.prepare = prepare
        if self.dialect == "postgresql":
            self._params = connect_params(engine)
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
        if self.dialect != "postgresql":
            return self._connect_sqlite()
        failed: list[psycopg.Error] = []
        attempts = host_attempts(self._params)
        for kwargs in connect_plan(attempts, deadline, self.where):
            try:
                return psycopg.Connection.connect(
                    autocommit=True, prepare_threshold=5 if self.prepare else None, **kwargs
                )
            except psycopg.Error as exc:
                failed.append(exc)
        raise connect_failed(self.where, failed, len(attempts))

    def _connect_sqlite(self) -> Any:
        try:
            fairy = self.engine.raw_connection()
        except (SQLAlchemyError, sqlite3.Error) as exc:
            raise DatabaseUnavailable(f"cannot open {self.where}: {first_line(exc)}") from exc
        # Our own connection from now on: not returned to (or reset by) the engine's pool.
        raw: Any = fairy.driver_connection
        fairy.detach()
        raw.isolation_level = None  # autocommit: each statement is its own transaction
        raw.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        return raw

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
            conn = _Conn(self.connect(deadline))
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
                if self.dialect == "sqlite":
                    self._busy_timeout(conn, deadline)
                    result = self._statements(conn, sql, params, then, before)
                else:
                    _watchdog.watch(conn, deadline)
                    try:
                        result = self._statements(conn, sql, params, then, before)
                    finally:
                        _watchdog.done(conn)
            except (psycopg.Error, sqlite3.Error) as exc:
                if conn.cut:
                    self._discard(conn)
                    raise DatabaseUnavailable(
                        f"{self.where} did not answer in time; the statement was cut off "
                        "(it may or may not have taken effect)"
                    ) from exc
                if _is_broken(conn):
                    self._discard(conn)
                    self._drain()
                    if attempt == 1 and time.monotonic() < deadline:
                        log.warning("connection to %s broke (%s); retrying once", self.where, first_line(exc))
                        continue
                    raise unavailable(f"lost the connection to {self.where}: {first_line(exc)}", exc) from exc
                self._checkin(conn)
                raise self._translate(exc) from exc
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

    @staticmethod
    def _busy_timeout(conn: _Conn, deadline: float) -> None:
        # Set for every call: how long this call may wait for another writer.
        ms = int(min(SQLITE_BUSY_TIMEOUT_MS, max(1.0, (deadline - time.monotonic()) * 1000)))
        if ms != conn.busy_ms:
            conn.raw.execute(f"PRAGMA busy_timeout = {ms}")
            conn.busy_ms = ms

    def _execute(self, conn: _Conn, sql: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        cur = conn.cursor
        if self.dialect == "postgresql":
            # Prepared once per connection, then one round trip per call
            # (unless prepare=False: then each call sends its text unnamed).
            cur.execute(sql, params, prepare=self.prepare)
        else:
            cur.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []

    def _translate(self, exc: Exception) -> DBLockError:
        return translate(exc, self.where, self.table)


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


def translate(exc: Exception, where: str, table: str) -> DBLockError:
    """A driver error of a lock statement as dblock's own (both the sync and the asyncio driver)."""
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(exc, psycopg.errors.UndefinedTable) or (
        isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc)
    ):
        return SchemaMissing(
            f"dblock's table {table!r} does not exist in {where}: {_MISSING_SCHEMA_HINT}",
            sqlstate=sqlstate,
        )
    if isinstance(exc, (psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedFunction)) or (
        isinstance(exc, sqlite3.OperationalError) and "no such column" in str(exc)
    ):
        return SchemaMissing(
            f"dblock's table {table!r} in {where} is from an older dblock ({first_line(exc)}): "
            f"{_MISSING_SCHEMA_HINT.replace('first', 'to upgrade it')}",
            sqlstate=sqlstate,
        )
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return PermissionDenied(
            f"{where}: {first_line(exc)} (grant the privileges listed in the README's "
            "least-privilege section)",
            sqlstate=sqlstate,
        )
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return Busy(f"{where} stayed locked by another writer for the whole time allowed")
    if isinstance(exc, sqlite3.DatabaseError) and "not a database" in str(exc):
        # Permanent, not an outage: a wait must not retry it until its deadline.
        return DBLockError(f"{where} is not a SQLite database: {first_line(exc)}")
    if sqlstate is not None and sqlstate[:2] in _OUTAGE_CLASSES:
        return DatabaseUnavailable(f"{where}: {first_line(exc)}", sqlstate=sqlstate)
    return DBLockError(f"{where}: {first_line(exc)}", sqlstate=sqlstate)


def connect_params(engine: Engine) -> dict[str, Any]:
    """psycopg connection parameters from a PostgreSQL engine's URL (the query's too)."""
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    params = {**dict(cparams), **_conninfo_args(cargs)}
    # Every Python int is sent as a bigint (the statements cast where a column is narrower).
    # psycopg's own choice, int2, int4 or int8 by the value, is part of a prepared
    # statement's key: a token or a listener's pid past 32,767 would prepare it again, a
    # round trip more. The engine's adapters (SQLAlchemy passes its own) are kept otherwise.
    adapters = AdaptersMap(params.get("context") or psycopg.adapters)
    adapters.register_dumper(int, Int8Dumper)
    params["context"] = adapters
    return params


def host_attempts(conninfo: dict[str, Any]) -> list[dict[str, Any]]:
    """The parameters of each connection attempt: one per host of a multi-host URL, with
    dblock's defaults where the URL sets none of its own: notice a dead peer on an idle
    socket (keepalives) and on a socket with unacknowledged data (tcp_user_timeout),
    instead of after the kernel's 15 minutes."""
    params = {
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": 10_000,
        **conninfo,
    }
    return _host_attempts(params) or [params]


def connect_plan(attempts: list[dict[str, Any]], deadline: float, where: str) -> Iterator[dict[str, Any]]:
    """The keywords of each attempt to connect, each given its share of the time left.

    With several hosts (host=a,b,c, e.g. with target_session_attrs=read-write to
    find the primary) psycopg would give each host the whole connect_timeout, so
    three silent hosts would take three times the call's time. Each is tried
    here with its share of what is left, so a silent first host (a primary that
    went away) leaves time for the rest. Raises ``OutOfTime`` if no time is left
    for the first one.
    """
    for i, attempt in enumerate(attempts):
        left = deadline - time.monotonic()
        if left <= 0:
            if i == 0:
                raise OutOfTime(f"no time left to connect to {where}")
            return
        share = left / (len(attempts) - i)
        yield {**attempt, "connect_timeout": max(MIN_CONNECT_TIMEOUT, math.ceil(share))}


def connect_failed(where: str, failed: list[psycopg.Error], hosts: int) -> DBLockError:
    """The error for a connect whose every attempt (``failed``) failed."""
    if not failed:
        return OutOfTime(f"no time left to connect to {where}")
    reasons = "; ".join(dict.fromkeys(first_line(exc) for exc in failed))
    tried = f" ({len(failed)} of {hosts} hosts tried)" if hosts > 1 else ""
    exc = unavailable(f"cannot connect to {where}{tried}: {reasons}", failed[-1])
    exc.__cause__ = failed[-1]
    return exc


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


def _conninfo_args(cargs: Sequence[Any]) -> dict[str, Any]:
    # The psycopg dialect passes everything as keywords; a positional conninfo
    # string (should a dialect version pass one) is kept as psycopg's own.
    return {"conninfo": cargs[0]} if cargs else {}


def _host_attempts(params: dict[str, Any]) -> list[dict[str, Any]] | None:
    """One set of connection parameters per host of a multi-host conninfo (psycopg's own split,
    which also honours load_balance_hosts); None for a single host."""
    hosts = params.get("host") or params.get("hostaddr")
    if "conninfo" in params or not isinstance(hosts, str) or "," not in hosts:
        return None
    try:
        return [dict(a) for a in conninfo_attempts(params)]
    except psycopg.Error:
        return None  # e.g. no host name resolves: let psycopg's connect report it


def unavailable(message: str, exc: BaseException) -> DBLockError:
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):  # e.g. no CONNECT on the database
        return PermissionDenied(message, sqlstate=sqlstate)
    return DatabaseUnavailable(message, sqlstate=sqlstate)


def _is_broken(conn: _Conn) -> bool:
    raw = conn.raw
    if isinstance(raw, psycopg.Connection):
        return bool(raw.broken or raw.closed)
    return False  # sqlite3 connections are in-process: they do not break mid-call


def _close(conn: _Conn) -> None:
    try:
        conn.raw.close()
    except Exception:  # noqa: BLE001 - closing a dead connection may fail; nothing to do
        pass


def first_line(exc: BaseException) -> str:
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        exc = exc.orig
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
