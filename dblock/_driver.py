"""Connections for lock statements, and running one statement on one of them.

Lock statements never share the caller's transaction: each runs in autocommit
on a connection dblock keeps for itself, so a grant is visible to every other
client the moment it is made. The hot path talks to the driver directly
(psycopg 3 with server-side prepared statements, or sqlite3): SQLAlchemy opens
the connections and knows the dialect, but adds nothing per call.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from typing import Any, Sequence

import psycopg
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from .errors import DatabaseUnavailable, DBLockError, SchemaMissing

log = logging.getLogger("dblock.driver")

SQLITE_BUSY_TIMEOUT_MS = 30_000
MAX_IDLE = 8

_MISSING_SCHEMA_HINT = "run `dblock migrate` or call Locker.create_schema() first"


class Busy(DatabaseUnavailable):
    """SQLite stayed write-locked by another connection for the whole time allowed."""


class _Conn:
    __slots__ = ("raw", "cursor", "busy_ms")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.cursor = raw.cursor()
        self.busy_ms = SQLITE_BUSY_TIMEOUT_MS


class Driver:
    """A small LIFO pool of autocommit driver connections, safe across threads and forks."""

    def __init__(self, engine: Engine, where: str, table: str, *, prepare: bool = True) -> None:
        self.engine = engine
        # False behind a transaction pooler (PgBouncer pool_mode=transaction):
        # a statement prepared on one server session may be run by another
        # client's session with that client's parameters.
        self.prepare = prepare
        self.dialect = engine.dialect.name
        self.where = where  # the URL without its password, for messages
        self.table = table
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    # -- connections -------------------------------------------------------
    def _connect(self) -> _Conn:
        try:
            fairy = self.engine.raw_connection()
        except (SQLAlchemyError, psycopg.Error, sqlite3.Error) as exc:
            raise DatabaseUnavailable(f"cannot connect to {self.where}: {_first_line(exc)}") from exc
        # Our own connection from now on: not returned to (or reset by) the
        # engine's pool, so the caller's pool is not drained by held locks.
        raw: Any = fairy.driver_connection
        fairy.detach()
        if self.dialect == "postgresql":
            raw.autocommit = True
            if not self.prepare:
                raw.prepare_threshold = None  # never prepare, not even after 5 runs
        else:
            raw.isolation_level = None  # autocommit: each statement is its own transaction
            raw.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        return _Conn(raw)

    def listen_connection(self) -> Any:
        """A new autocommit psycopg connection for the listener, outside the pool."""
        return self._connect().raw

    def _get(self) -> _Conn:
        if self._pid != os.getpid():
            # A forked child must not talk over its parent's sockets, and must not
            # wait for a lock some other parent thread held at the fork.
            self._lock = threading.Lock()
            self._idle = []
            self._pid = os.getpid()
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _put(self, conn: _Conn) -> None:
        with self._lock:
            if self._pid == os.getpid() and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        _close(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            mine = self._pid == os.getpid()
        if mine:
            for conn in idle:
                _close(conn)

    # -- statements --------------------------------------------------------
    def run(
        self,
        sql: str,
        params: dict[str, Any],
        then: str | None = None,
        *,
        before: str | None = None,
        budget: float | None = None,
    ) -> tuple[list[Sequence[Any]], list[Sequence[Any]], bool]:
        """Run ``sql`` (and, if it returned no row, ``then``) on one connection.

        Returns both statements' rows, and whether the statement had to be
        sent twice because the first connection broke. ``before`` runs first,
        in one transaction with ``sql``. ``budget`` caps, in seconds, how long
        SQLite may wait for another writer (then ``Busy`` is raised).

        A connection that breaks mid-statement is thrown away, with the idle
        ones (after a restart or failover they are all dead), and the statement
        is sent once more on a new connection. Every dblock statement is safe
        to repeat: an acquire retried with the same owner returns the lease it
        may already have granted (G6), and release and extend compare (name,
        owner, token), so a second try changes nothing the first did not.
        """
        for attempt in (1, 2):
            conn = self._get() if attempt == 1 else self._connect()
            try:
                if budget is not None and self.dialect == "sqlite":
                    self._busy_timeout(conn, budget)
                if before is not None:
                    with conn.raw.transaction():
                        self._execute(conn, before, {})
                        rows = self._execute(conn, sql, params)
                else:
                    rows = self._execute(conn, sql, params)
                extra = self._execute(conn, then, params) if then is not None and not rows else []
            except (psycopg.Error, sqlite3.Error) as exc:
                if _is_broken(conn):
                    _close(conn)
                    self._drain()
                    if attempt == 1:
                        log.warning("connection to %s broke (%s); retrying once", self.where, _first_line(exc))
                        continue
                    raise DatabaseUnavailable(f"lost the connection to {self.where}: {_first_line(exc)}") from exc
                self._put(conn)
                raise self._translate(exc, budget) from exc
            except BaseException:
                _close(conn)  # interrupted mid-statement: its state is unknown
                raise
            self._put(conn)
            return rows, extra, attempt == 2
        raise AssertionError("unreachable")

    def _drain(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            _close(conn)

    @staticmethod
    def _busy_timeout(conn: _Conn, budget: float) -> None:
        ms = int(min(SQLITE_BUSY_TIMEOUT_MS, max(1.0, budget * 1000)))
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

    def _translate(self, exc: Exception, budget: float | None) -> DBLockError:
        if isinstance(exc, psycopg.errors.UndefinedTable) or (
            isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc)
        ):
            return SchemaMissing(f"dblock's table {self.table!r} does not exist in {self.where}: {_MISSING_SCHEMA_HINT}")
        if isinstance(exc, psycopg.errors.UndefinedColumn) or (
            isinstance(exc, sqlite3.OperationalError) and "no such column" in str(exc)
        ):
            return SchemaMissing(
                f"dblock's table {self.table!r} in {self.where} is from an older dblock ({_first_line(exc)}): "
                f"{_MISSING_SCHEMA_HINT.replace('first', 'to upgrade it')}"
            )
        if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
            waited = SQLITE_BUSY_TIMEOUT_MS / 1000 if budget is None else min(budget, SQLITE_BUSY_TIMEOUT_MS / 1000)
            return Busy(f"{self.where} stayed locked by another writer for {waited:g} s")
        return DBLockError(f"{self.where}: {_first_line(exc)}")


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


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        exc = exc.orig
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
