"""The asyncio twin of ``_driver``: a bounded pool of async connections, one statement in bounded time.

The same three bounds as the sync Driver, with asyncio's own means:

- **A pool of at most ``size`` connections**: a task that finds them all busy
  waits on an ``asyncio.Condition`` within its own deadline; statements of
  waiting acquires (``waiting``) may hold at most ``size - 1`` of them.
- **Connecting** is bounded per host as in ``_driver.connect_plan``.
- **A statement** still running at its deadline has its socket shut down by a
  timer on the event loop (``loop.call_later``): the awaiting call returns at
  once with an error, as the sync watchdog thread does. A timer costs no task
  per statement, so the hot path stays one round trip and a few microseconds.

The backend opens the connections (``Backend.aconnect``: PostgreSQL through
``psycopg.AsyncConnection``, SQLite through ``aiosqlite``, whose one thread per
connection runs sqlite3; SQLite's only wait, for another writer, is bounded
by ``busy_timeout`` as in the sync Driver).

Cancelling a task mid-statement (``task.cancel()``, ``asyncio.timeout``)
throws its connection away, whatever psycopg did to end the query: its state
is unknown. The caller (``AsyncLocker``) then ends whatever the statement may
have granted.

An AsyncDriver belongs to the event loop it was first used on; another loop
gets a clear error, not a connection bound to a loop that may be gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Sequence, TypeVar

from ._driver import (
    IDLE,
    OPEN,
    SQLITE_BUSY_TIMEOUT_MS,
    Busy,
    OutOfTime,
    Result,
    first_line,
    pool_busy,
    pool_turn,
    shutdown_socket,
    unavailable,
)

from .errors import DatabaseUnavailable

if TYPE_CHECKING:
    from .backends import Backend

log = logging.getLogger("dblock.driver")
T = TypeVar("T")

__all__ = ["AsyncDriver", "Busy", "OutOfTime", "Result"]


class _AConn:
    __slots__ = ("raw", "cursor", "busy_ms", "cut", "waiting")

    def __init__(self, raw: Any, cursor: Any) -> None:
        self.raw = raw
        self.cursor = cursor
        self.busy_ms = SQLITE_BUSY_TIMEOUT_MS
        self.cut = False  # the deadline timer shut this connection's socket down
        self.waiting = False  # checked out for a waiting acquire's statement


class AsyncDriver:
    """A bounded LIFO pool of autocommit async connections, for one event loop."""

    def __init__(self, backend: Backend, *, size: int = 10) -> None:
        self.backend = backend
        self.where = backend.where  # the URL without its password, for messages
        self.table = backend.table
        self.size = size
        self._errors = backend.errors
        self._cut = backend.caps.cut_statements  # else the database bounds a statement (a writer wait)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond: asyncio.Condition | None = None
        self._idle: list[_AConn] = []
        self._open = 0  # connections checked out or idle (the listener's is not counted)
        self._waiting_out = 0  # connections checked out for waiting acquires' statements

    def _bind(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._cond = loop, asyncio.Condition()
        elif self._loop is not loop:
            raise RuntimeError(
                "this AsyncLocker was first used on another event loop: make one AsyncLocker per event loop"
            )
        assert self._cond is not None
        return self._cond

    # -- connections -------------------------------------------------------
    async def connect(self, deadline: float) -> Any:
        """A new autocommit async connection (outside the pool), opened before ``deadline``."""
        return await self.backend.aconnect(deadline)

    async def _checkout(self, deadline: float, fresh: bool, waiting: bool) -> _AConn:
        cond = self._bind()
        async with cond:
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
                    raise pool_busy(self.size, self.where, "AsyncLocker")
                try:
                    await asyncio.wait_for(cond.wait(), left)
                except asyncio.TimeoutError:
                    pass  # looked at once more above, then out of time
        try:
            raw = await self.connect(deadline)
            cursor = await self.backend.acursor(raw)
        except BaseException:
            await self._forget(1, waiting)
            raise
        conn = _AConn(raw, cursor)
        conn.waiting = waiting
        return conn

    async def _checkin(self, conn: _AConn) -> None:
        if conn.cut:
            await self._discard(conn)
            return
        cond = self._bind()
        async with cond:
            self._waiting_out -= conn.waiting
            conn.waiting = False
            self._idle.append(conn)
            cond.notify_all()  # waiters' and others' turns differ: let each look

    async def _discard(self, conn: _AConn) -> None:
        await _close(conn.raw)
        await self._forget(1, conn.waiting)
        conn.waiting = False

    async def _forget(self, count: int, waiting: bool = False) -> None:
        cond = self._bind()
        async with cond:
            self._open -= count
            self._waiting_out -= waiting
            cond.notify_all()

    async def _drain(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await _close(conn.raw)
        await self._forget(len(idle))

    def open_connections(self) -> int:
        """How many pooled connections are open now (idle or running a statement)."""
        return self._open

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await _close(conn.raw)
        self._open -= len(idle)

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

        The contract of ``Driver.run``: the deadline bounds the whole call; a
        statement still running at it is cut off (``DatabaseUnavailable``:
        it may or may not have committed); a connection that breaks
        mid-statement is thrown away with the idle ones and the statement is
        sent once more on a new one (every dblock statement is safe to repeat).
        """
        for attempt in (1, 2):
            if time.monotonic() >= deadline:
                raise OutOfTime(f"no time left for a statement on {self.where}")
            conn = await self._checkout(deadline, fresh=attempt == 2, waiting=waiting)
            timer = None
            try:
                if self._cut:
                    assert self._loop is not None
                    timer = self._loop.call_later(max(deadline - time.monotonic(), 0.0), _cut, conn)
                    result = await self._statements(conn, sql, params, then, before)
                else:
                    await self._busy_timeout(conn, deadline)
                    result = await _finished(self._statements(conn, sql, params, then, before))
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
                    raise unavailable(f"lost the connection to {self.where}: {first_line(exc)}", exc) from exc
                await self._checkin(conn)
                raise self.backend.translate(exc) from exc
            except BaseException:
                if timer is not None:
                    timer.cancel()
                # Cancelled (or interrupted) mid-statement: its state is unknown.
                conn.cut = True
                await asyncio.shield(self._discard(conn))
                raise
            if timer is not None:
                timer.cancel()
            # Answered, though maybe in the instant the timer cut it: the result
            # stands, and a cut connection is not put back (_checkin).
            await self._checkin(conn)
            return Result(*result, attempt == 2)
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

    async def _busy_timeout(self, conn: _AConn, deadline: float) -> None:
        ms = int(min(SQLITE_BUSY_TIMEOUT_MS, max(1.0, (deadline - time.monotonic()) * 1000)))
        if ms != conn.busy_ms:
            await self.backend.await_for_writer(conn.raw, ms)
            conn.busy_ms = ms

    async def _execute(self, conn: _AConn, sql: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        return await self.backend.aexecute(conn.cursor, sql, params)


async def _finished(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even if the caller is cancelled meanwhile, then re-raise the cancellation.

    For SQLite: aiosqlite runs a statement on its connection's thread, where
    cancelling the awaiting task does not stop it. Were the task to go on
    (say, to end what the statement granted) the statement could still grant
    afterwards. Its wait is bounded by ``busy_timeout`` (the call's deadline).
    """
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                continue
            except Exception:  # noqa: BLE001 - its outcome no longer matters: we were cancelled
                break
        raise


def _cut(conn: _AConn) -> None:
    """The statement's deadline came: wake its awaiting task with end-of-file."""
    conn.cut = True
    shutdown_socket(conn.raw)


async def _close(raw: Any) -> None:
    try:
        await raw.close()
    except Exception:  # noqa: BLE001 - closing a dead connection may fail; nothing to do
        pass
