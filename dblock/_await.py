"""Waiting without polling: the per-process listener, heartbeat and local line.

Three pieces, all in-process, written once for both faces (``tools/async_to_sync.py``
writes the sync ``_wait.py`` from this module; a waiter is a task here, a
thread there):

``AsyncListener``: one connection per Locker that LISTENs on a channel of its
own (the backend names it: ``Backend.listen``). Its waiters' owner ids start
with the listener's id, so a fair release, which hands the lease to the first
live waiter in the same statement, notifies exactly that process; the
listener reads it and wakes exactly the waiter with that owner id. Other
processes' listeners (and their database sessions) stay asleep. With asyncio a
task of the listener reads the connection; with threads a waiter does, while no
other does (``AsyncListener.wait``), so the hand-off wakes the waiting thread
from its socket, not a listener thread that must then wake it. Waiters
register before they send their enqueue, so a hand-off that lands before the
waiter starts to sleep is kept, not lost. A notification can still be lost
(the connection breaks, a pooling proxy swallows LISTEN); waiters therefore
also wake at the current lease's known expiry and on a jittered fallback
interval, and a poll finds the lease theirs (the same owner retrying is
granted it). The listener closes itself when nobody has waited for
``IDLE_CLOSE`` seconds: PostgreSQL signals every LISTENing session of the
database at each NOTIFY, so an idle listener would cost every hand-off of
every process (about 14 us each, ``benchmarks/idle_listeners.py``); the next
wait pays one connection instead, while a lease it waits for is held anyway.

``AsyncHeartbeat``: keeps one row per Locker process fresh while it has fair
waiters, so a frozen process's waiters lapse without each being refreshed.

``AsyncHotspot``: waiters of one process for the same name queue up here,
first come first served, and only the head talks to the database. A release
by this process wakes the local head at once. A name's line is dropped as
soon as its last waiter leaves, so the map only holds names being waited for.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from . import _process as process
from ._acompat import AEvent, AMutex, Worker, aevent_wait, ajoin, asleep, aspawn, astop, running, shutdown_socket
from ._faults import OutOfTime
from .errors import Misconfigured

if TYPE_CHECKING:
    from .backends import Backend

log = logging.getLogger("dblock.wait")

ID_LENGTH = 16  # hex digits: 64 random bits per listener, then 64 per wait
IDLE_CLOSE = 1.0  # seconds without waiters before the listener connection closes
_POLL = 0.25  # how often the listener looks up from its connection to check for idleness


class AsyncSlot:
    """One waiter's mailbox: the hand-off it was sent, and an Event to sleep on."""

    __slots__ = ("event", "grant", "nudged", "dozing")

    def __init__(self) -> None:
        self.event = AEvent()
        self.grant: tuple[int, float] | None = None  # (token, expiry as database epoch seconds)
        self.nudged = False  # threads: woken to take over reading the connection, nothing handed
        self.dozing = False  # threads: sleeping on the event while another waiter reads


class AsyncListener:
    """The LISTEN connection of one Locker, shared by all its waiters."""

    def __init__(self, connect: Callable[[float], Any], backend: Backend) -> None:
        self._connect = connect  # (deadline) -> (awaitable) an autocommit connection of our own
        self._backend = backend
        self._reset()

    def _reset(self) -> None:
        self._lock = AMutex()
        self._slots: dict[str, AsyncSlot] = {}
        self._worker: Worker | None = None
        self._conn: Any = None
        self._ident: tuple[int, str] | None = None  # (backend pid, backend_start) while listening
        self._stop = False
        self._starting = False  # a waiter is connecting the listener (outside the lock)
        self._next_start = 0.0  # after a failed start, no new try before this (monotonic)
        self._said: str | None = None  # why the last start failed, as logged
        self._reader: AsyncSlot | None = None  # threads: the waiter reading the connection now
        if True:  # ASYNC
            pass
        else:
            self._tick = AEvent()  # wakes the listener thread at once: close()
        self._pid = process.pid
        self._id = secrets.token_hex(ID_LENGTH // 2)  # after a fork: the parent's channel is the parent's

    # -- waiters ---------------------------------------------------------------
    def owner_id(self) -> str:
        """A fresh owner id whose hand-offs are notified on this listener's channel."""
        self._after_fork()
        return self._id + secrets.token_hex(ID_LENGTH // 2)

    def reaches(self, owner: str) -> bool:
        """Whether hand-offs to ``owner`` are notified on this listener's channel (it came from ``owner_id``)."""
        return owner.startswith(self._id)

    async def register(self, owner: str, deadline: float) -> tuple[AsyncSlot, tuple[int, str] | None]:
        """A mailbox for ``owner`` (from ``owner_id``), and the listening session to name
        in its queue entry.

        Starts the listener if it is not running (connecting by ``deadline``,
        and waiting until LISTEN is in effect, so no hand-off sent after this
        returns can be missed). The session is None when LISTEN is unavailable,
        or another waiter is starting the listener just now: then the waiter
        polls, and its hand-offs still reach its mailbox once the listener runs.
        """
        self._after_fork()
        slot = AsyncSlot()
        with self._lock:
            self._slots[owner] = slot
        await self.revive(deadline)
        return slot, self._ident

    async def revive(self, deadline: float) -> None:
        """Start the listener if it is not running (after an outage killed it, say).

        Connects outside the lock, so other waiters are never held up by a slow
        or silent server; after a failed try, the next one waits a second.
        """
        with self._lock:
            if running(self._worker) or self._starting or time.monotonic() < self._next_start:
                return
            self._starting, self._stop = True, False
            if True:  # ASYNC
                pass
            else:
                self._tick.clear()
        conn, ident = None, None
        try:
            conn = await self._connect(deadline)
            for statement in self._backend.listen(self._id):
                await conn.execute(statement)
            cur = await conn.execute(self._backend.session)
            row = await cur.fetchone()
            ident = (int(row[0]), str(row[1]))
        except Exception as exc:  # noqa: BLE001 - no listener: waiters poll instead
            said = str(exc)
            # Once per cause, not at every waiter's try. A misconfigured URL is the waiter's own error
            # to raise, and a call out of time tried nothing: neither is a cause to tell.
            quiet = said == self._said or isinstance(exc, (Misconfigured, OutOfTime))
            level = logging.DEBUG if quiet else logging.WARNING
            log.log(level, "cannot LISTEN for lock hand-offs (%s); waiting by polling", said)
            if not isinstance(exc, OutOfTime):
                self._said = said
            if conn is not None:
                await _close(conn)
            with self._lock:
                self._starting = False
                self._next_start = time.monotonic() + 1.0
            return
        with self._lock:
            self._starting = False
            self._said = None
            stale = self._stop or self._pid != process.pid  # closed (or forked) while connecting
            if not stale:
                self._conn, self._ident = conn, ident
                self._worker = aspawn(lambda: self._run(conn), name="dblock-listener")
        if stale:
            await _close(conn)

    def unregister(self, owner: str) -> None:
        with self._lock:
            self._slots.pop(owner, None)

    @property
    def ident(self) -> tuple[int, str] | None:
        return self._ident

    def waiting(self) -> int:
        with self._lock:
            return len(self._slots)

    # -- the listener ------------------------------------------------------------
    async def wait(self, slot: AsyncSlot, timeout: float) -> None:
        """Sleep until ``slot`` is handed a lease (or woken to look), for at most ``timeout`` s.

        With asyncio the listener task reads the connection and sets the slot's
        event. With threads a waiter reads the connection itself while no other waiter
        does, so a hand-off wakes one thread (the waiter, from its socket), not
        the listener thread and then the waiter, two wake-ups that cost about
        0.1 ms each here. The other waiters sleep on their events, set by the
        reader that reads their hand-offs, and one of them takes over reading
        when the reader leaves.
        """
        if True:  # ASYNC
            await aevent_wait(slot.event, timeout)
        else:
            deadline = time.monotonic() + timeout
            while True:
                with self._lock:
                    if slot.event.is_set() and slot.nudged and slot.grant is None:
                        slot.event.clear()  # only told to read: the reader left
                    slot.nudged = False
                    if slot.grant is not None or slot.event.is_set() or time.monotonic() >= deadline:
                        self._nudge()  # the next reader, if we were told to be it
                        return
                    conn = self._conn
                    lead = conn is not None and self._reader is None and not self._stop
                    if lead:
                        self._reader = slot
                    slot.dozing = not lead
                if lead:
                    self._read(conn, slot, deadline)
                    if slot.grant is not None:
                        return  # ours, read by this thread (which handed reading on as it left)
                else:
                    aevent_wait(slot.event, deadline - time.monotonic())
                    with self._lock:
                        slot.dozing = False

    if True:  # ASYNC
        pass
    else:

        def _read(self, conn: Any, slot: AsyncSlot, deadline: float) -> None:
            """Read hand-offs for every waiter until ``slot``'s comes (or ``deadline``); then
            hand reading over. Whoever finds the connection broken (or closing) closes it."""
            failed: Exception | None = None
            whole = False  # read to the end of a batch, not interrupted mid-read
            try:
                while slot.grant is None and not slot.event.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    for note in conn.notifies(timeout=left, stop_after=1):  # a whole batch, never cut
                        self._dispatch(note.payload)
                whole = True
            except Exception as exc:  # noqa: BLE001 - the connection broke: everyone polls
                failed = exc
            finally:
                with self._lock:
                    self._reader = None
                    closing = not whole or self._stop or self._conn is not conn
                    if closing:
                        if self._conn is conn:
                            self._conn, self._ident, self._worker = None, None, None
                        _close(conn)  # under the lock, as in _retire: close() may be shutting its socket
                    else:
                        self._nudge()
                if failed is not None and not self._stop:
                    self._failed(failed)
                elif not whole and not self._stop:
                    # Interrupted mid-read (KeyboardInterrupt, say): the connection is gone, so
                    # the others poll (or start a new listener) instead of sleeping on.
                    self._wake_all()

        def _nudge(self) -> None:
            """Under the lock: while nobody reads, wake a sleeping waiter to read."""
            if self._reader is not None or self._conn is None or self._stop:
                return
            chosen: AsyncSlot | None = None
            for s in self._slots.values():  # one pass, no generator: a reader leaving runs this on its way out
                if s.nudged:
                    return  # one is on its way
                if chosen is None and s.dozing and not s.event.is_set():
                    chosen = s
            if chosen is not None:
                chosen.nudged = True
                chosen.event.set()

    async def _run(self, conn: Any) -> None:
        if True:  # ASYNC
            idle_since: float | None = None
            failed: Exception | None = None
            try:
                while not self._stop:
                    async for note in conn.notifies(timeout=_POLL):
                        self._dispatch(note.payload)
                    with self._lock:
                        idle_since = self._idle(idle_since)
                        if idle_since is not None and time.monotonic() - idle_since >= IDLE_CLOSE:
                            # Under the lock: a waiter registering from now on names no session (it
                            # polls, and its next look starts a new listener), never this closing one.
                            self._ident = None
                            break
            except Exception as exc:  # noqa: BLE001 - the connection broke: wake everyone to poll
                failed = exc
            finally:
                await self._retire(conn)
            if failed is not None and not self._stop:  # not close() cutting it short on purpose
                self._failed(failed)
        else:
            self._watch(conn)

    def _idle(self, since: float | None) -> float | None:
        """Under the lock: when the listener's idle spell began (``since``, or now), or None
        while anyone waits."""
        if self._slots:
            return None
        return time.monotonic() if since is None else since

    def _failed(self, exc: Exception) -> None:
        # Retired first: a waiter woken now finds no listening session and polls (or revives it).
        log.warning("the lock listener's connection failed (%s); waiters poll until it is back", exc)
        self._wake_all()

    def _wake_all(self) -> None:
        with self._lock:
            slots = list(self._slots.values())
        for slot in slots:
            slot.event.set()

    if True:  # ASYNC
        pass
    else:

        def _watch(self, conn: Any) -> None:
            """The listener thread: it reads nothing (the waiters do), and closes the connection
            once nobody has waited for IDLE_CLOSE s, or at close()."""
            idle_since: float | None = None
            while True:
                self._tick.wait(_POLL)
                with self._lock:
                    if self._conn is not conn:
                        return  # a reader found it broken and closed it
                    if self._stop and self._reader is not None:
                        return  # the reader, woken by close(), closes it on its way out
                    if not self._stop:
                        idle_since = self._idle(idle_since)
                        if idle_since is None or time.monotonic() - idle_since < IDLE_CLOSE:
                            continue
                    # Nobody waits, so nobody reads. Under the lock: a waiter registering from now
                    # on names no session (it polls, and its next look starts a new listener).
                    self._conn, self._ident, self._worker = None, None, None
                    _close(conn)  # under the lock, as in _retire
                    return

    async def _retire(self, conn: Any) -> None:
        # The next register() starts a new listener. Closed under the lock: close() shuts
        # the socket down under it, so the descriptor cannot be closed (and reused) meanwhile.
        with self._lock:
            if self._conn is conn:
                self._conn, self._ident, self._worker = None, None, None
            await _close(conn)

    def _dispatch(self, payload: str) -> None:
        handed = self._backend.handed(payload)
        if handed is None:
            log.warning("ignored a malformed hand-off notification %r", payload)
            return
        owner, token, expiry = handed
        with self._lock:  # with the grant, under the lock: a waiter told only to read clears its event under it
            slot = self._slots.get(owner)
            if slot is None:
                return  # a hand-off to another process, or to a waiter that already polled it
            slot.grant = (token, expiry)
            if slot is not self._reader:  # threads: the reader sees its own grant once its read returns
                slot.event.set()

    async def close(self) -> None:
        """End the listener session now: no waiting for its next look-up."""
        if self._pid != process.pid:
            return  # the parent's listener (after a fork): its socket is not ours to shut
        with self._lock:
            self._stop = True
            worker, conn = self._worker, self._conn
            if conn is not None:
                shutdown_socket(conn)  # wakes the listener (or the waiter reading) at once
            if True:  # ASYNC
                pass
            else:
                self._tick.set()
        await astop(worker, 2 * _POLL + 1)

    def _after_fork(self) -> None:
        if self._pid != process.pid:
            self._reset()  # the parent's listener did not survive the fork and its socket is not ours


async def _close(conn: Any) -> None:
    try:
        await conn.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass


class AsyncHeartbeat:
    """Keeps this process's waiters alive in the fair queue: one statement per interval per
    Locker, however many wait.

    A background worker runs ``beat()`` every ``interval`` seconds while at
    least one waits, and ends once none has for an interval. A process that
    freezes stops beating, and its waiters lapse together.
    """

    def __init__(self, beat: Callable[[], Any], interval: float) -> None:
        self._beat = beat
        self._interval = interval
        self._reset()

    def _reset(self) -> None:
        self._lock = AMutex()
        self._waiting = 0
        self._worker: Worker | None = None
        self._beating = False  # a beat is on its way to the database
        self._closed = False
        self._pid = process.pid

    def enter(self) -> None:
        if self._pid != process.pid:
            self._reset()  # the parent's worker did not survive the fork
        with self._lock:
            self._waiting += 1
            if self._worker is None and not self._closed:
                self._worker = aspawn(self._run, name="dblock-heartbeat")

    def leave(self) -> None:
        with self._lock:
            if self._pid == process.pid:
                self._waiting -= 1

    async def _run(self) -> None:
        said: str | None = None  # the failure last logged: told once, not at every beat
        while True:
            await asleep(self._interval)
            with self._lock:
                if self._closed:
                    return
                if self._waiting <= 0:
                    self._worker = None
                    return
                self._beating = True
            try:
                await self._beat()
                said = None
            except Exception as exc:  # noqa: BLE001 - the database is away: waiters ride it out, so do we
                level = logging.DEBUG if str(exc) == said else logging.INFO
                said = str(exc)
                log.log(level, "could not refresh this process's waiters (%s); retrying", said)
            finally:
                with self._lock:
                    self._beating = False
                    closed = self._closed
            if closed:
                return  # close() may be waiting for this beat to land before it deletes the row

    async def close(self, deadline: float) -> None:
        """Stop beating now (the worker would end by itself an interval after the last waiter).

        A beat on its way is given until ``deadline`` to land first, so it cannot write the
        row again after close() deleted it.
        """
        with self._lock:
            self._closed = True
            worker, self._worker = self._worker, None
            beating = self._beating and self._pid == process.pid
        if beating:
            await ajoin(worker, max(0.0, deadline - time.monotonic()))
        await astop(worker, 0)


class _Line:
    __slots__ = ("waiters", "full")

    def __init__(self) -> None:
        self.waiters: deque[AEvent] = deque()
        self.full = False  # the last grant here left no free slot (an exclusive grant always), no release since


class AsyncHotspot:
    """Per-name FIFO of this process's waiters; only the head polls the database."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = AMutex()
        self._lines: dict[str, _Line] = {}
        self._pid = process.pid

    def join(self, name: str) -> AEvent:
        """Queue up for ``name``; the returned Event is set when this waiter is the head."""
        if self._pid != process.pid:
            self._reset()
        me = AEvent()
        with self._lock:
            line = self._lines.get(name)
            if line is None:
                line = self._lines[name] = _Line()
            line.waiters.append(me)
            if line.waiters[0] is me:
                me.set()
        return me

    def leave(self, name: str, me: AEvent) -> None:
        """Leave the line (granted or gave up); the next waiter becomes the head and is woken."""
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
            if line is not None:
                line.full = False
                if line.waiters:
                    line.waiters[0].set()

    def mark_full(self, name: str, full: bool) -> None:
        """A grant of ``name`` here left no free slot (``full``: an exclusive grant, or a
        semaphore's last free slot), or some."""
        with self._lock:
            line = self._lines.get(name)
            if line is not None:
                line.full = full

    def full(self, name: str) -> bool:
        """Whether the last grant of ``name`` here left no free slot."""
        with self._lock:
            line = self._lines.get(name)
            return line is not None and line.full

    def __len__(self) -> int:
        with self._lock:
            return len(self._lines)


__all__ = ["AsyncHeartbeat", "AsyncHotspot", "AsyncListener", "AsyncSlot"]
