"""Connections for lock statements, and running one statement on one of them, in bounded time.

Lock statements never share the caller's transaction: each runs in autocommit
on a connection dblock keeps for itself, so a grant is visible to every other
client the moment it is made. The hot path talks to the driver directly, as
the backend opens it (psycopg 3, with server-side prepared statements unless
``prepare=False``; sqlite3, or aiosqlite for asyncio): SQLAlchemy knows the
URL and the dialect, but adds nothing per call.

Three bounds keep every call's time and cost finite whatever the server does:

- **A pool of at most ``size`` connections** per driver. A caller that finds
  them all busy waits for one, within its own deadline. Statements of waiting
  acquires (``waiting``) may hold at most ``size - 1`` of them, and waiters
  between attempts hold none.
- **Connecting** is bounded by the backend (PostgreSQL: each host of the URL
  gets its share of the time left; TCP keepalives and ``tcp_user_timeout``
  make a dead peer show up on idle and busy sockets).
- **A statement** still running at its deadline has its socket shut down
  (``_acompat.cut_at``: a timer on the event loop, or the process's one
  watchdog thread), so the waiting call returns at once with an error. That
  covers what the server cannot bound itself (a frozen postmaster, a
  black-holed network), and works behind a transaction pooler, which would
  refuse per-session settings at connect. Where the database bounds a
  statement itself (SQLite, whose only wait is for another writer) the call's
  deadline becomes that wait's bound instead.

A pool is safe across forks: a child does not talk over its parent's sockets.
Cancelling a task mid-statement (``task.cancel()``, ``asyncio.timeout``)
throws its connection away, whatever the driver did to end the query: its
state is unknown. The caller then ends whatever the statement may have granted.
An asyncio driver belongs to the event loop it was first used on; another loop
gets a clear error, not a connection bound to a loop that may be gone.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

from . import _process as process
from ._acompat import ACondition, AMutex, Armed, acond_wait, acut_at, afinished
from ._core import IDLE, OPEN, WAIT, Result, pool_turn
from ._faults import Busy, OutOfTime, Outdated, first_line, pool_busy
from .backends.base import WRITER_WAIT_MS
from .errors import DatabaseUnavailable, DBLockError

if True:  # ASYNC
    # The asyncio driver is the source: tools/async_to_sync.py writes the sync one from it.
    import asyncio

if TYPE_CHECKING:
    from .backends import Backend

log = logging.getLogger("dblock.driver")

__all__ = ["IDLE", "OPEN", "WAIT", "AsyncDriver", "Busy", "OutOfTime", "Result", "pool_busy", "pool_turn"]


class _AConn:
    __slots__ = ("raw", "cursor", "busy_ms", "cut", "waiting", "guard", "watch")

    def __init__(self, raw: Any, cursor: Any, guard: Any) -> None:
        self.raw = raw
        self.cursor = cursor
        self.busy_ms = WRITER_WAIT_MS
        self.cut = False  # its statement's deadline came and its socket was shut down
        self.waiting = False  # checked out for a waiting acquire's statement
        self.guard = guard  # the pool's lock, taken to return it: the sync watchdog cuts under it
        self.watch: Any = None  # its deadline, for the sync watchdog (_acompat._Watch)


class AsyncDriver:
    """A bounded LIFO pool of autocommit connections of one backend."""

    def __init__(self, backend: Backend, *, size: int = 10) -> None:
        self.backend = backend
        self.engine = backend.engine
        self.where = backend.where  # the URL without its password, for messages
        self.table = backend.table
        self.size = size
        self._errors = backend.errors
        self._cut = backend.caps.cut_statements  # else the database bounds a statement (a writer wait)
        if True:  # ASYNC
            self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False  # close() was called: a connection used since goes when its call ends
        self._reset()

    def _reset(self) -> None:
        if True:  # ASYNC
            self._cond = ACondition()
            self._lock: Any = self._cond  # taken by ``async with``, as the condition's own
        else:
            # The condition's lock, taken by ``with`` directly: on the Condition, ``with``
            # costs two Python calls more, four times per statement.
            self._lock = AMutex()
            self._cond = ACondition(self._lock)
        self._idle: list[_AConn] = []
        self._open = 0  # connections checked out or idle (the listener's is not counted)
        self._waiting_out = 0  # connections checked out for waiting acquires' statements
        self._asking = 0  # callers waiting in _checkout for a connection (a return wakes them)
        self._pid = process.pid

    def _bind(self) -> ACondition:
        """The pool's condition (asyncio: bound to the first loop that uses it)."""
        if True:  # ASYNC
            loop = asyncio.get_running_loop()
            if self._loop is None:
                self._loop = loop
            elif self._loop is not loop:
                raise RuntimeError(
                    "this AsyncLocker was first used on another event loop: make one AsyncLocker per event loop"
                )
        return self._cond

    # -- connections -------------------------------------------------------
    async def connect(self, deadline: float) -> Any:
        """A new autocommit driver connection (outside the pool), opened before ``deadline``."""
        return await self.backend.aconnect(deadline)

    async def _checkout(self, deadline: float, fresh: bool = False, waiting: bool = False) -> _AConn:
        """A connection of the pool: an idle one, a new one while fewer than ``size`` are
        open, or else the next one returned, waiting no later than ``deadline``.

        Statements of waiting acquires (``waiting``) may hold at most ``size - 1``
        connections at once: one is kept for releases, extends and the rest, so
        a crowd of waiters cannot make a release wait for a connection.
        """
        if self._pid != process.pid:
            # A forked child must not talk over its parent's sockets, and must not
            # wait for a lock some other parent thread held at the fork.
            self._reset()
        cond = self._bind()
        async with self._lock:
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
                    raise pool_busy(self.size, self.where, type(self).__name__.replace("Driver", "Locker"))
                self._asking += 1
                try:
                    await acond_wait(cond, left)  # then looked at once more above, or out of time
                finally:
                    self._asking -= 1
        try:
            raw = await self.connect(deadline)
            conn = _AConn(raw, await self.backend.acursor(raw), self._lock)
        except BaseException:
            await self._forget(1, waiting)
            raise
        conn.waiting = waiting
        return conn

    async def _checkin(self, conn: _AConn) -> None:
        async with self._lock:
            if self._pid == process.pid and not conn.cut and not self._closed:
                self._waiting_out -= conn.waiting
                conn.waiting = False
                self._idle.append(conn)
                if self._asking:  # the condition was bound at checkout, on this loop
                    self._cond.notify_all()  # waiters' and others' turns differ: let each look
                return
        await self._discard(conn)

    async def _discard(self, conn: _AConn) -> None:
        await _close(conn.raw)
        await self._forget(1, conn.waiting)
        conn.waiting = False

    async def _forget(self, count: int, waiting: bool = False) -> None:
        async with self._lock:
            if self._pid == process.pid:
                self._open -= count
                self._waiting_out -= waiting
                self._cond.notify_all()

    async def _drain(self) -> None:
        async with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            await _close(conn.raw)
        await self._forget(len(idle))

    def open_connections(self) -> int:
        """How many pooled connections are open now (idle or running a statement)."""
        return self._open if self._pid == process.pid else 0

    async def close(self) -> None:
        """Close the idle connections (a forked child leaves its parent's alone). A call made
        after this (a lease's release: a closed Locker still ends what it granted) closes its
        connection when it ends, instead of leaving it idle in a pool nobody closes."""
        if self._pid == process.pid:
            self._closed = True
            await self._drain()

    # -- statements --------------------------------------------------------
    async def run(
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
        The result's ``sent_at`` is when the statement that answered went out,
        on a connection already open: the moment a lease it grants or extends
        is trusted from (time spent connecting or waiting for a connection is
        not, however long it took).

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
            conn = await self._checkout(deadline, fresh=attempt == 2, waiting=waiting)
            # Sent from now on, on an open connection: waiting for it or connecting is not counted
            # (a lease is trusted from here, G5). A retry on a fresh connection takes its own.
            sent_at = time.monotonic()
            timer: Armed | None = None
            result: tuple[list[Sequence[Any]], list[Sequence[Any]]]
            try:
                if self._cut:
                    timer = acut_at(conn, deadline)
                    if then is None and before is None:  # one statement: the common case
                        result = (await self._execute(conn, sql, params), [])
                    else:
                        result = await self._statements(conn, sql, params, then, before)
                else:
                    await self._busy_timeout(conn, deadline)
                    result = await afinished(self._statements(conn, sql, params, then, before))
            except self._errors as exc:
                if timer is not None:
                    timer.cancel()
                if conn.cut:
                    await self._discard(conn)
                    raise DatabaseUnavailable(
                        f"{self.where} did not answer in time; the statement was cut off "
                        "(it may or may not have taken effect)"
                    ) from exc
                if self.backend.is_broken(conn.raw):
                    await self._discard(conn)
                    await self._drain()
                    if attempt == 1 and time.monotonic() < deadline:
                        log.warning("connection to %s broke (%s); retrying once", self.where, first_line(exc))
                        continue
                    sqlstate = getattr(exc, "sqlstate", None)
                    message = f"lost the connection to {self.where}: {first_line(exc)}"
                    raise DatabaseUnavailable(message, sqlstate=sqlstate) from exc
                error = self.backend.translate(exc)
                if isinstance(error, Outdated):
                    error = await self._outdated(conn, error, deadline)
                await self._checkin(conn)
                raise error from exc
            except BaseException:
                if timer is not None:
                    timer.cancel()
                # Interrupted (or cancelled) mid-statement: its state is unknown.
                conn.cut = True
                if True:  # ASYNC
                    await asyncio.shield(self._discard(conn))  # the clean-up outlives the cancellation
                else:
                    self._discard(conn)
                raise
            if timer is not None:
                timer.cancel()
            # Answered, though maybe in the instant it was cut: the result
            # stands, and a cut connection is not put back (_checkin).
            await self._checkin(conn)
            return Result(*result, attempt == 2, sent_at)
        raise AssertionError("unreachable")

    async def _statements(
        self, conn: _AConn, sql: str, params: dict[str, Any], then: str | None, before: str | None
    ) -> tuple[list[Sequence[Any]], list[Sequence[Any]]]:
        if before is not None:
            async with conn.raw.transaction():
                await self._execute(conn, before, {})
                rows = await self._execute(conn, sql, params)
        else:
            rows = await self._execute(conn, sql, params)
        return rows, await self._execute(conn, then, params) if then is not None and not rows else []

    async def _outdated(self, conn: _AConn, error: Outdated, deadline: float) -> DBLockError:
        """A statement found a function or a column of dblock's missing: ``error`` (a table of an
        older dblock) if the table is there, else that it does not exist. Asked on the same
        connection, within the call's deadline; if the question fails, ``error`` stands."""
        sql, params = self.backend.table_check()
        timer = acut_at(conn, deadline) if self._cut else None
        try:
            rows = await self._execute(conn, sql, params)
        except self._errors:
            return error
        finally:
            if timer is not None:
                timer.cancel()
        return error if not rows or rows[0][0] else self.backend.no_table(error.sqlstate)

    async def _busy_timeout(self, conn: _AConn, deadline: float) -> None:
        # Set for every call: how long this call may wait for another writer.
        ms = int(min(WRITER_WAIT_MS, max(1.0, (deadline - time.monotonic()) * 1000)))
        if ms != conn.busy_ms:
            await self.backend.aset_writer_wait(conn.raw, ms)
            conn.busy_ms = ms

    async def _execute(self, conn: _AConn, sql: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        return await self.backend.aexecute(conn.cursor, sql, params)


async def _close(raw: Any) -> None:
    try:
        await raw.close()
    except Exception:  # noqa: BLE001 - closing a dead connection may fail; nothing to do
        pass
