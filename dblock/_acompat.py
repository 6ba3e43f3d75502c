"""Where the two faces truly differ, as pairs: the asyncio one and the thread one, side by side.

The asyncio modules are the source (``_adriver.py``, ...); ``tools/async_to_sync.py``
writes their sync twins, renaming each name below to its pair (``ACondition``
to ``Condition``, ``acond_wait`` to ``cond_wait``, ...) and dropping ``await``.
So a difference lives here once, next to its twin, instead of in two copies of
the logic around it.

- waiting on a condition with a timeout: ``asyncio.wait_for`` vs ``Condition.wait``;
- cutting off a statement at its deadline: a timer on the event loop vs the one
  watchdog thread per process (``_Watchdog``), both shutting the socket down;
- a statement that must run to its end once started (SQLite's, on aiosqlite's
  thread): shielded from the task's cancellation vs a plain call;
- background work: a task on the running loop vs a daemon thread (``aspawn``,
  ``astop``), events, sleeping, and a critical section that needs no lock on
  one event loop (``AMutex``: nothing between its ``with`` lines awaits) but
  does across threads.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import threading
import time
import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Awaitable, Callable, Coroutine, Protocol, TypeVar, Union

from . import _process as process
from ._core import wait_seconds

T = TypeVar("T")

ACondition = asyncio.Condition
Condition = threading.Condition
AEvent = asyncio.Event
Event = threading.Event
asleep = asyncio.sleep
sleep = time.sleep
Worker = Union["asyncio.Task[None]", threading.Thread]


ACancelled = asyncio.CancelledError


class Cancelled(BaseException):
    """The sync twin of ``asyncio.CancelledError``: a thread is never cancelled, so never raised."""


def AMutex() -> AbstractContextManager[None]:  # noqa: N802 - a pair with threading.Lock
    """A critical section on one event loop: the code inside never awaits, so it needs no lock."""
    return nullcontext()


Mutex = threading.Lock
ALock = asyncio.Lock  # held across awaits (the schema's migration), unlike AMutex
Lock = threading.Lock


class Cut(Protocol):
    """A connection whose statement can be cut off: ``cut`` set, its socket shut down (``raw``);
    ``guard``, its pool's lock, and ``watch``, its deadline for the sync watchdog (``_Watch``)."""

    cut: bool
    raw: Any
    guard: Any
    watch: Any


class Armed(Protocol):
    def cancel(self) -> None: ...


# -- asyncio --------------------------------------------------------------------------
async def acond_wait(cond: asyncio.Condition, timeout: float) -> None:
    """Wait (holding ``cond``) until notified or ``timeout`` seconds passed."""
    try:
        await asyncio.wait_for(cond.wait(), timeout)
    except asyncio.TimeoutError:
        pass


def acut_at(conn: Cut, deadline: float) -> Armed:
    """Cut ``conn``'s statement off at ``deadline`` (a timer on the running loop: no task per statement)."""
    return asyncio.get_running_loop().call_later(max(deadline - time.monotonic(), 0.0), cut, conn)


async def afinished(work: Awaitable[T]) -> T:
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


def aspawn(work: Callable[[], Coroutine[Any, Any, None]], name: str) -> asyncio.Task[None]:
    """Run ``work()`` in the background: a task on the running loop."""
    return asyncio.get_running_loop().create_task(work(), name=name)


async def aevent_wait(event: asyncio.Event, timeout: float | None) -> bool:
    """``event.wait()`` for at most ``timeout`` s (None or inf: for ever); True if it was set."""
    if event.is_set():
        return True
    if timeout is not None and timeout <= 0:
        return False
    try:
        await asyncio.wait_for(event.wait(), None if timeout is None or timeout == math.inf else timeout)
    except asyncio.TimeoutError:
        return False
    return True


async def ajoin(worker: Worker | None, timeout: float) -> None:
    """Wait up to ``timeout`` s for ``worker`` to end by itself."""
    if isinstance(worker, asyncio.Task) and not worker.done():
        await asyncio.wait([worker], timeout=timeout)


async def astop(worker: Worker | None, timeout: float) -> None:
    """End ``worker`` (a task of ``aspawn``) now and wait until it has ended."""
    if isinstance(worker, asyncio.Task) and not worker.done():
        worker.cancel()
        try:
            await worker
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it is closing
            pass


async def ato_thread(call: Callable[..., T], *args: Any) -> T:
    """Run a blocking ``call(*args)`` (Alembic's migrations) on a worker thread; the loop goes on."""
    return await asyncio.to_thread(call, *args)


def acurrent_worker() -> Any:
    """The task this runs in (a lease's acquirer, for telling a re-entry apart)."""
    return asyncio.current_task()


def running(worker: Worker | None) -> bool:
    """Whether a background worker (a task or a thread) is still at work."""
    if isinstance(worker, asyncio.Task):
        return not worker.done()
    return worker is not None and worker.is_alive()


# -- threads --------------------------------------------------------------------------
def spawn(work: Callable[[], None], name: str) -> threading.Thread:
    """Run ``work()`` in the background: a daemon thread."""
    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    return thread


# The thread this runs in (threading's own function: no wrapper to call on the hot path).
current_worker: Callable[[], Any] = threading.current_thread


def event_wait(event: threading.Event, timeout: float | None) -> bool:
    return event.wait(None if timeout is None else wait_seconds(timeout))


def join(worker: Worker | None, timeout: float) -> None:
    if isinstance(worker, threading.Thread) and worker is not threading.current_thread():
        worker.join(timeout=timeout)


def to_thread(call: Callable[..., T], *args: Any) -> T:
    return call(*args)


def stop(worker: Worker | None, timeout: float) -> None:
    """Wait up to ``timeout`` s for ``worker`` (a thread of ``spawn``, told to stop) to end."""
    if isinstance(worker, threading.Thread) and worker is not threading.current_thread():
        worker.join(timeout=timeout)

def cond_wait(cond: threading.Condition, timeout: float) -> None:
    cond.wait(timeout)


def finished(work: T) -> T:
    return work


# -- both -----------------------------------------------------------------------------
def cut(conn: Cut) -> None:
    """The statement's deadline came: wake whoever waits on ``conn`` with end-of-file."""
    conn.cut = True
    shutdown_socket(conn.raw)


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


class _Watch:
    """A connection's statement deadline for the watchdog (``inf``: no statement running).

    One per connection, made at its first statement and kept. Arming and
    ``cancel`` are plain stores: a statement pays no lock, no set and no object
    of its own for its deadline. The watchdog cuts under the connection's
    ``guard`` (its pool's lock), which the connection's return to the pool also
    takes, so it never cuts the next statement on the same connection: a
    statement that answered in the instant it was cut keeps its result, and its
    connection, marked cut, is thrown away instead of going back to the pool.
    """

    __slots__ = ("conn", "deadline", "__weakref__")

    def __init__(self, conn: Cut) -> None:
        self.conn = conn
        self.deadline = math.inf

    def cancel(self) -> None:
        self.deadline = math.inf


class _Watchdog:
    """One thread per process that cuts statements still running at their deadline.

    The hot path only stores the deadline on the connection's ``_Watch``.
    While statements run, the thread looks every ``TICK`` seconds (or at the
    earliest deadline, if sooner), so a statement is cut at most ``TICK`` late,
    and a new statement wakes the thread only when its deadline is nearer than
    the next look: rare, so the hot path costs no thread switch. After
    ``LINGER`` idle seconds the thread sleeps until the next statement: before
    it does, it says so (``_wake_at`` is ``inf``, which makes the next
    statement wake it) and looks once more, so a statement armed meanwhile is
    never missed.
    """

    TICK = 0.25
    LINGER = 2.0

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._watches: weakref.WeakSet[_Watch] = weakref.WeakSet()  # one per connection that ran a statement
        self._wake_at = math.inf  # when the thread looks next
        self._thread: threading.Thread | None = None
        self._pid = process.pid

    def watch(self, conn: Cut, deadline: float) -> _Watch:
        watch: _Watch | None = conn.watch
        if watch is None or self._pid != process.pid:
            watch = self._register(conn)
        watch.deadline = deadline
        if deadline < self._wake_at:
            with self._lock:
                self._cond.notify()
        return watch

    def _register(self, conn: Cut) -> _Watch:
        if self._pid != process.pid:
            self._reset()  # the parent's thread did not survive the fork
        watch = conn.watch = _Watch(conn)
        with self._lock:
            self._watches.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dblock-watchdog", daemon=True)
                self._thread.start()
        return watch

    def _due(self, watches: list[_Watch], now: float) -> float:
        """Cut what is due at ``now``; the earliest deadline still armed (``inf``: none)."""
        soonest = math.inf
        for watch in watches:
            deadline = watch.deadline
            if deadline <= now:
                with watch.conn.guard:  # the pool's lock: see _Watch
                    if watch.deadline <= now:
                        watch.deadline = math.inf
                        cut(watch.conn)
            elif deadline < soonest:
                soonest = deadline
        return soonest

    def _run(self) -> None:
        idle_since: float | None = None
        while True:
            now = time.monotonic()
            with self._lock:  # a connection's first statement adds to the set under it
                watches = list(self._watches)
            soonest = self._due(watches, now)
            if soonest < math.inf:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            with self._lock:
                if idle_since is not None and now - idle_since >= self.LINGER:
                    self._wake_at = math.inf  # from now on a new statement wakes the thread
                    if self._due(list(self._watches), time.monotonic()) == math.inf:  # one armed before is seen
                        self._cond.wait()
                    idle_since = None
                else:
                    self._wake_at = min(soonest, now + self.TICK)
                    self._cond.wait(max(self._wake_at - now, 0.0))


_watchdog = _Watchdog()
# cut_at(conn, deadline): cut ``conn``'s statement off at ``deadline`` (the process's watchdog
# thread). The watchdog's own method, so that a statement pays no call to a wrapper.
cut_at: Callable[[Cut, float], Armed] = _watchdog.watch
