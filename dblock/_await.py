"""Waiting without polling, for the asyncio API: the listener, heartbeat and local line as tasks.

The asyncio twins of ``_wait``'s three pieces (read that module's docstring
for why each exists); what differs is only how to wait:

``AsyncListener``: one ``psycopg.AsyncConnection`` per AsyncLocker that
LISTENs on a channel of its own; a task reads its notifications and sets the
``asyncio.Event`` of exactly the waiting task whose owner id a hand-off names.
A waiter is a coroutine with a mailbox, not a thread. Waiters register before
they send their enqueue, so a hand-off that lands before the waiter starts to
sleep is kept; a notification can still be lost, so waiters also look on
their own (``core.look_pause``). The listener closes after ``IDLE_CLOSE``
seconds without waiters.

``AsyncHeartbeat``: one task per AsyncLocker keeps its process's row fresh
while any of its tasks waits in a fair queue.

``AsyncHotspot``: tasks of one AsyncLocker waiting for the same name (polling
modes) queue up here, first come first served; only the head asks the database.
Shared waiters (read locks, semaphores) have a line of their own, as threads do.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from typing import Any, Awaitable, Callable

from ._wait import APPLICATION_NAME, CHANNEL_PREFIX, ID_LENGTH, IDLE_CLOSE

log = logging.getLogger("dblock.wait")

_POLL = 1.0  # how often the listener task looks up from its connection to check for idleness


class AsyncSlot:
    """One waiting task's mailbox: the hand-off it was sent, and an Event to sleep on."""

    __slots__ = ("event", "grant")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.grant: tuple[int, float] | None = None  # (token, expiry as database epoch seconds)


class AsyncListener:
    """The LISTEN connection of one AsyncLocker, shared by all its waiting tasks."""

    def __init__(self, connect: Callable[[float], Awaitable[Any]]) -> None:
        self._connect = connect  # (deadline) -> an autocommit psycopg AsyncConnection of our own
        self._slots: dict[str, AsyncSlot] = {}
        self._task: asyncio.Task[None] | None = None
        self._conn: Any = None
        self._ident: tuple[int, str] | None = None  # (backend pid, backend_start) while listening
        self._starting = False
        self._next_start = 0.0  # after a failed start, no new try before this (monotonic)
        self._id = secrets.token_hex(ID_LENGTH // 2)

    def owner_id(self) -> str:
        """A fresh owner id whose hand-offs are notified on this listener's channel."""
        return self._id + secrets.token_hex(ID_LENGTH // 2)

    async def register(self, owner: str, deadline: float) -> tuple[AsyncSlot, tuple[int, str] | None]:
        """A mailbox for ``owner``, and the listening session to name in its queue entry
        (None: not listening, the waiter polls). Starts the listener if needed."""
        slot = AsyncSlot()
        self._slots[owner] = slot
        await self.revive(deadline)
        return slot, self._ident

    async def revive(self, deadline: float) -> None:
        """Start the listener if it is not running; after a failed try, the next one waits a second."""
        running = self._task is not None and not self._task.done()
        if running or self._starting or time.monotonic() < self._next_start:
            return
        self._starting = True
        conn = None
        try:
            conn = await self._connect(deadline)
            await conn.execute(f"SET application_name = '{APPLICATION_NAME}'")
            await conn.execute(f"LISTEN {CHANNEL_PREFIX}{self._id}")
            cur = await conn.execute(
                "SELECT pg_backend_pid(), backend_start::text FROM pg_stat_get_activity(pg_backend_pid())"
            )
            row = await cur.fetchone()
            ident = (int(row[0]), str(row[1]))
        except Exception as exc:  # noqa: BLE001 - no listener: waiters poll instead
            log.warning("cannot LISTEN for lock hand-offs (%s); waiting by polling", exc)
            if conn is not None:
                await _close(conn)
            self._next_start = time.monotonic() + 1.0
            return
        finally:
            self._starting = False
        self._conn, self._ident = conn, ident
        self._task = asyncio.get_running_loop().create_task(self._run(conn), name="dblock-listener")

    def unregister(self, owner: str) -> None:
        self._slots.pop(owner, None)

    @property
    def ident(self) -> tuple[int, str] | None:
        return self._ident

    def waiting(self) -> int:
        return len(self._slots)

    async def _run(self, conn: Any) -> None:
        idle_since: float | None = None
        try:
            while True:
                async for note in conn.notifies(timeout=_POLL):
                    self._dispatch(note.payload)
                if self._slots:
                    idle_since = None
                    continue
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                elif now - idle_since >= IDLE_CLOSE:
                    return
        except asyncio.CancelledError:
            raise  # close()
        except Exception as exc:  # noqa: BLE001 - the connection broke: wake everyone to poll
            log.warning("the lock listener's connection failed (%s); waiters poll until it is back", exc)
            for slot in list(self._slots.values()):
                slot.event.set()
        finally:
            if self._conn is conn:
                self._conn, self._ident, self._task = None, None, None
            await _close(conn)

    def _dispatch(self, payload: str) -> None:
        owner, _, rest = payload.partition(" ")
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

    async def close(self) -> None:
        """End the listener session now."""
        await _stop(self._task)


async def _stop(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (a listener's or heartbeat's) and wait until it has ended."""
    if task is not None and not task.done():
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it is closing
            pass


async def _close(conn: Any) -> None:
    try:
        await conn.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass


class AsyncHeartbeat:
    """Keeps this AsyncLocker's fair waiters alive in the queue: one statement per interval,
    however many tasks wait; the task ends once none has waited for an interval."""

    def __init__(self, beat: Callable[[], Awaitable[object]], interval: float) -> None:
        self._beat = beat
        self._interval = interval
        self._waiting = 0
        self._task: asyncio.Task[None] | None = None

    def enter(self) -> None:
        self._waiting += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="dblock-heartbeat")

    def leave(self) -> None:
        self._waiting -= 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            if self._waiting <= 0:
                return
            try:
                await self._beat()
            except Exception as exc:  # noqa: BLE001 - the database is away: waiters ride it out, so do we
                log.info("could not refresh this process's waiters (%s); retrying", exc)

    async def close(self) -> None:
        task, self._task = self._task, None
        await _stop(task)


class AsyncHotspot:
    """Per-name FIFO of an AsyncLocker's waiting tasks; only the head polls the database."""

    def __init__(self) -> None:
        self._lines: dict[str, deque[asyncio.Event]] = {}
        self._full: set[str] = set()  # names whose last grant here left a semaphore no free slot

    def join(self, name: str) -> asyncio.Event:
        """Queue up for ``name``; the returned Event is set when this task is the head."""
        me = asyncio.Event()
        line = self._lines.setdefault(name, deque())
        line.append(me)
        if line[0] is me:
            me.set()
        return me

    def leave(self, name: str, me: asyncio.Event) -> None:
        """Leave the line (granted or gave up); the next task becomes the head and is woken."""
        line = self._lines.get(name)
        if line is None:
            return
        was_head = bool(line) and line[0] is me
        try:
            line.remove(me)
        except ValueError:
            return
        if not line:
            del self._lines[name]  # idle names hold nothing
            self._full.discard(name)
        elif was_head:
            line[0].set()

    def released(self, name: str) -> None:
        """This AsyncLocker released ``name``: wake its local head to try at once."""
        line = self._lines.get(name)
        if line:
            line[0].set()

    def mark_full(self, name: str, full: bool) -> None:
        """A grant of ``name`` here left no free slot (``full``), or some (as ``Hotspot.mark_full``)."""
        if full and name in self._lines:
            self._full.add(name)
        else:
            self._full.discard(name)

    def full(self, name: str) -> bool:
        """Whether the last grant of ``name`` here left no free slot."""
        return name in self._full

    def __len__(self) -> int:
        return len(self._lines)


__all__ = ["AsyncHeartbeat", "AsyncHotspot", "AsyncListener", "AsyncSlot"]
