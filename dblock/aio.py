"""dblock for asyncio: ``AsyncLocker`` and ``AsyncLease``, and fenced writes on async connections.

The same locks, tokens, guarantees and statements as ``Locker``: both faces
are thin over ``_core`` (what a row means, every pause, deadline and trust
window) and ``statements`` (the SQL), and differ only in how they wait. Here a
waiter is a coroutine, not a thread: fair waiters sleep on an
``asyncio.Event`` that the AsyncLocker's one listener task sets when a release
hands them the lease; renewal is one task per AsyncLocker, batching the
extends that fall due together (``_arenew``); ``lease.lost`` is an
``asyncio.Event``; ``on_lost`` runs on the event loop. PostgreSQL goes through
psycopg's ``AsyncConnection``, SQLite through ``aiosqlite``.

Cancelling a waiting or acquiring task (``task.cancel()``, ``asyncio.timeout``)
leaves the queue, and a grant that raced the cancellation is released before
the ``CancelledError`` propagates: nothing is leaked.

An AsyncLocker belongs to one event loop (the one it is first used on).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ParamSpec, TypeVar, Union

from sqlalchemy.engine import URL, Engine

from . import _core as core
from . import metrics
from . import backends
from ._aacquire import AsyncAcquirer, Try
from ._acleanup import AsyncCleanup
from ._adriver import AsyncDriver
from ._arenew import AsyncRenewer, Renewal
from ._averbs import AsyncVerbs
from ._await import AsyncHeartbeat, AsyncListener
from ._core import Extended, Granted
from ._engine import engine_for
from ._process import default_label, queue_id
from ._redact import display_url
from ._validate import check_limit, check_min_hold, check_name, check_options, check_renew, check_timeout, check_ttl
from .errors import DatabaseUnavailable, LeaseLost, LockNotAcquired
from .lease import LeaseInfo, LeaseState, LeaseView
from .locker import DEFAULT_MAX_CONNECTIONS, DEFAULT_OP_TIMEOUT, DEFAULT_TTL, make_schema
from .schema import DEFAULT_TABLE

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger("dblock.acquire")
release_log = logging.getLogger("dblock.release")

AsyncOnLost = Callable[["AsyncLease"], Union[object, Awaitable[object]]]
T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")

__all__ = [
    "AsyncLease", "AsyncLocker", "AsyncOnLost", "AsyncShared",
    "check_lease", "commit_guard", "fence", "fenced", "fenced_read", "fenced_session", "fenced_update", "fenced_upsert",
]
# Fenced writes on AsyncConnection / AsyncSession (``aio_fencing``), loaded on first use;
# ``fenced`` (which only builds a statement) is the sync module's own.
_FENCING = {name: ".aio_fencing" for name in __all__[4:]} | {"fenced": ".fencing"}


def __getattr__(name: str) -> Any:
    module = _FENCING.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    value = getattr(importlib.import_module(module, __package__), name)
    globals()[name] = value
    return value


class AsyncLocker:
    """Hands out leases on named locks stored in one database, for asyncio code.

    Takes what ``Locker`` takes (a URL, an ``Engine`` or ``AsyncEngine``, or
    None for the embedded SQLite default) and the same options, with the same
    meaning and defaults; see ``Locker``. Make one per database and event loop,
    and close it with ``await locker.aclose()`` or ``async with AsyncLocker(...)``.

    Every call but a waiting ``acquire`` returns or raises within
    ``op_timeout`` seconds whatever the server does; a waiting ``acquire``
    within its ``timeout`` plus ``core.GRACE``. It opens at most
    ``max_connections`` connections for its statements, plus one listener
    connection while tasks wait in a fair queue: 1,000 waiting tasks hold no
    connection and no thread each.
    """

    def __init__(
        self,
        url: str | URL | Engine | AsyncEngine | None = None,
        *,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        ttl: float = DEFAULT_TTL,
        timeout: float = math.inf,
        poll_min: float = 0.01,
        poll_max: float = 0.5,
        label: str | None = None,
        fair: bool = True,
        notify: bool = True,
        prepare: bool = True,
        op_timeout: float = DEFAULT_OP_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        opts = check_options(
            url is None, table, schema, label, ttl, timeout, poll_min, poll_max, fair, notify, prepare, op_timeout,
            max_connections,
        )
        self.table, self.schema, self.label = opts.table, opts.schema, opts.label
        self.ttl, self.timeout, self.op_timeout = opts.ttl, opts.timeout, opts.op_timeout
        self.poll_min, self.poll_max, self.fair, self.notify = opts.poll_min, opts.poll_max, opts.fair, opts.notify
        # A sync engine of the same database: its URL and dialect, and create_schema's migrations.
        self.engine, self._needs_migration, self._own_engine = engine_for(url)
        where = display_url(self.engine.url)
        # The database's statements, decoders, connections and abilities (``dblock.backends``).
        self.backend = backends.of(self.engine)(self.engine, self.table, self.schema, where, prepare=prepare)
        self._driver = AsyncDriver(self.backend, size=max_connections)
        self._queued = fair and self.backend.caps.fair_queue
        notified = self._queued and notify and self.backend.caps.notify
        self._listener = AsyncListener(self._driver.connect, self.backend) if notified else None
        self._cleanup = AsyncCleanup()
        self._proc = queue_id()
        self._default_label = default_label()
        self._lapse = core.lapse(self.poll_max)
        # The one-round-trip verbs (binds built once), and acquiring and waiting.
        self._verbs = AsyncVerbs(
            self.backend, self._driver, op_timeout=self.op_timeout, label=self._label, proc=self._proc.get,
            lapse=self._lapse,
        )
        self._heartbeat = AsyncHeartbeat(self._verbs.beat, self.poll_max) if self._queued else None
        self._acquirer = AsyncAcquirer(
            self._verbs, self._cleanup, queued=self._queued, listener=self._listener, heartbeat=self._heartbeat,
            poll_min=self.poll_min, poll_max=self.poll_max,
        )
        self._migrated: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # background work: renewal, on_lost
        # One renewal task for all its leases, as the sync face's; its extends leave a connection for releases.
        workers = max(1, min(4, max_connections - 1))
        self._renewer = AsyncRenewer(self._extend_many, self.op_timeout, workers)
        self._closed = False

    # -- schema ------------------------------------------------------------
    async def create_schema(self) -> None:
        """Create or upgrade dblock's tables with its migrations (idempotent), as ``Locker.create_schema``.

        Alembic is synchronous: the migration runs on a worker thread, so the
        event loop goes on meanwhile.
        """
        await asyncio.to_thread(make_schema, self.engine, self.table, self.schema)

    async def _ensure_schema(self) -> None:
        if self._needs_migration:
            if self._migrated is None:
                self._migrated = asyncio.Lock()
            async with self._migrated:
                if self._needs_migration:
                    await self.create_schema()
                    self._needs_migration = False

    # -- acquiring ---------------------------------------------------------
    async def try_acquire(
        self,
        name: str,
        *,
        ttl: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        min_hold: float | None = None,
    ) -> AsyncLease | None:
        """One attempt: an AsyncLease, or None if another owner holds ``name`` (see ``Locker.try_acquire``,
        also for ``min_hold``)."""
        check_name(name)
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        check_renew(renew, on_lost)
        lease = await self._measured(name, self._try(name, ttl, check_min_hold(min_hold)))
        if lease is not None and renew:
            lease.start_renewal(on_lost)
        return lease

    async def acquire(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        min_hold: float | None = None,
    ) -> AsyncLease:
        """Wait up to ``timeout`` seconds (default: the AsyncLocker's, for ever) for ``name``.

        Raises ``LockNotAcquired`` when the time runs out; see ``Locker.acquire``.
        Cancelling the task leaves the queue, and releases a lease that was
        granted in the meantime, before ``CancelledError`` propagates.
        """
        check_name(name)
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        check_renew(renew, on_lost)
        hold = check_min_hold(min_hold)
        lease = await self._measured(name, self._acquire(name, ttl, hold, timeout))
        if renew:
            lease.start_renewal(on_lost)
        return lease

    async def _measured(self, name: str, acquire: Awaitable[T]) -> T:
        """``await acquire``, its wait and outcome recorded for ``dblock.metrics``."""
        started = time.monotonic()
        try:
            lease = await acquire
        except BaseException as exc:
            metrics.recorder.waited(self.backend.name, name, started, exc)
            raise
        metrics.recorder.waited(self.backend.name, name, started, lease)
        return lease

    async def _acquire(
        self, name: str, ttl: float, hold: float, timeout: float, limit: int | None | bool = False
    ) -> AsyncLease:
        """A waiting acquire; ``limit`` False: the exclusive lock, None: a reader's lease, an int: a semaphore's."""
        await self._ensure_schema()
        acquirer = self._acquirer
        attempt = acquirer.new_try(hold, limit, waiting=timeout > 0)
        granted = await acquirer.guarded(name, ttl, attempt, lambda: acquirer.wait(name, attempt, ttl, timeout))
        return self._lease(name, attempt, ttl, granted)

    async def _try(self, name: str, ttl: float, hold: float, limit: int | None | bool = False) -> AsyncLease | None:
        """One attempt: an AsyncLease, or None if ``name`` is held (``limit`` as in ``_acquire``)."""
        await self._ensure_schema()
        acquirer = self._acquirer
        attempt = acquirer.new_try(hold, limit)
        deadline = self._deadline()
        granted = await acquirer.guarded(name, ttl, attempt, lambda: acquirer.once(name, attempt, ttl, deadline))
        return None if granted is None else self._lease(name, attempt, ttl, granted)

    def _lease(self, name: str, attempt: Try, ttl: float, granted: Granted) -> AsyncLease:
        shared = core.shared_kind(attempt.limit)
        return AsyncLease(
            self, name, attempt.owner, granted.token, granted.expires_at, ttl, granted.sent_at, attempt.hold, shared
        )

    async def _attempt(
        self, name: str, owner: str, ttl: float, *, limit: int | None | bool = False
    ) -> tuple[AsyncLease | None, float | None]:
        """One attempt by ``owner`` (tests: a retry after a lost reply, G6)."""
        await self._ensure_schema()
        attempt = Try(owner, 0.0, limit)
        granted, wait = await self._acquirer.attempt(name, attempt, ttl, self._deadline())
        return (None if granted is None else self._lease(name, attempt, ttl, granted)), wait

    def lock(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        min_hold: float | None = None,
    ) -> _AsyncLockContext:
        """``async with locker.lock(name) as lease:`` acquires, and releases on exit (also on error)."""
        check_name(name)
        check_renew(renew, on_lost)
        return _AsyncLockContext(
            self,
            name,
            None if ttl is None else check_ttl(ttl),
            None if timeout is None else check_timeout(timeout),
            renew,
            on_lost,
            check_min_hold(min_hold),
        )

    def locked(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        min_hold: float | None = None,
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
        """``@locker.locked("report-{customer_id}", ttl=60)`` on a coroutine function: each call
        runs holding the lock, as ``Locker.locked`` (name templates, ``dblock.current_lease()``)."""
        from .decorator import locked  # noqa: PLC0415 - loaded with the first decorated function

        return locked(
            self, name, ttl=ttl, timeout=timeout, renew=renew, on_lost=on_lost, min_hold=min_hold  # type: ignore[arg-type]
        )

    # -- shared leases -----------------------------------------------------
    def semaphore(self, name: str, limit: int) -> AsyncShared:
        """A counting semaphore: at most ``limit`` leases of ``name`` held at once (see ``Locker.semaphore``).

        The returned ``AsyncShared`` has the verbs without the name:
        ``await try_acquire()``, ``await acquire()``, ``async with lock()``.
        """
        check_name(name)
        return AsyncShared(self, name, check_limit(limit))

    def readers(self, name: str) -> AsyncShared:
        """The read side of ``name``'s read/write lock: any number of readers, no writer, at once.

        The write side is the exclusive lock of the same name (``acquire``,
        ``lock``, or ``write_lock``). On PostgreSQL (``fair=True``) readers and
        writers wait in one line, first come first served (see ``Locker.readers``).
        """
        check_name(name)
        return AsyncShared(self, name, None)

    def read_lock(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
    ) -> _AsyncLockContext:
        """``async with locker.read_lock(name) as lease:`` a shared lease of ``name`` (see ``readers``)."""
        return self.readers(name).lock(ttl=ttl, timeout=timeout, renew=renew, on_lost=on_lost)

    def write_lock(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
    ) -> _AsyncLockContext:
        """``async with locker.write_lock(name) as lease:`` the same as ``lock(name)``: a write lock is the exclusive lock."""
        return self.lock(name, ttl=ttl, timeout=timeout, renew=renew, on_lost=on_lost)

    async def _share_try(
        self, name: str, limit: int | None, ttl: float | None, renew: bool, on_lost: AsyncOnLost | None
    ) -> AsyncLease | None:
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        check_renew(renew, on_lost)
        lease = await self._try(name, ttl, 0.0, limit)
        if lease is not None and renew:
            lease.start_renewal(on_lost)
        return lease

    async def _share_acquire(
        self,
        name: str,
        limit: int | None,
        ttl: float | None,
        timeout: float | None,
        renew: bool,
        on_lost: AsyncOnLost | None,
    ) -> AsyncLease:
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        check_renew(renew, on_lost)
        lease = await self._acquire(name, ttl, 0.0, timeout, limit)
        if renew:
            lease.start_renewal(on_lost)
        return lease

    # -- the statements behind a lease's verbs -------------------------------
    # ``shared``: a reader's or semaphore holder's lease, whose verbs are the shared
    # statements (as ``SharedKeeper``'s); otherwise the exclusive lock's.
    async def _extend(
        self, name: str, owner: str, token: int, ttl: float, deadline: float, shared: bool = False
    ) -> Extended | None:
        await self._ensure_schema()
        return await self._verbs.extend(name, owner, token, ttl, deadline, shared)

    async def _extend_many(
        self, leases: list[AsyncLease], deadline: float, shared: bool
    ) -> tuple[float, list[datetime | None]]:
        """Renewal's extend: ``leases`` by their own ttl in one statement (``AsyncVerbs.extend_many``)."""
        batch = [(lease.name, lease.owner, lease.token, lease.ttl) for lease in leases]
        return await self._verbs.extend_many(batch, deadline, shared)

    async def _end(self, key: dict[str, Any], deadline: float, hold: float = 0.0, *, shared: bool = False) -> core.Ended:
        """Release the lease ``key`` (name, owner, token), or keep it for its ``hold`` (``AsyncVerbs.end``)."""
        return await self._verbs.end(key, deadline, hold, shared=shared)

    async def _release(
        self, name: str, owner: str, token: int, state: LeaseState, hold: float, shared: bool = False
    ) -> bool:
        await self._ensure_schema()
        state.released = True  # before the statement: renewal must not take the cleared row for a loss
        key = {"name": name, "owner": owner, "token": token}
        ended: bool | None = None
        try:
            outcome = await self._end(key, self._deadline(), hold, shared=shared)
            ended = outcome.ended
        except DatabaseUnavailable:
            # Unconfirmed: keep ending it in the background until it would expire.
            self._cleanup.add(
                f"the lease on {name!r} (token {token})",
                lambda: self._end(key, self._deadline(), hold, shared=shared),
                time.monotonic() + state.ttl,
            )
            raise
        finally:
            state.hold.end(lost=ended is False)  # False: someone else ended it first (a takeover, a force release)
        state.held_until = outcome.held_until
        self._acquirer.released(name, held=outcome.held_until is not None)
        return outcome.ended

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _deadline(self) -> float:
        return self._verbs.deadline()

    def _label(self) -> str:
        return self._default_label.get() if self.label is None else self.label

    # -- renewal -----------------------------------------------------------
    def _renew(self, lease: AsyncLease, state: LeaseState, on_lost: AsyncOnLost | None) -> Renewal:
        return self._renewer.add(lease, state, on_lost)

    # -- operators ---------------------------------------------------------
    async def leases(self) -> list[LeaseInfo]:
        """The unexpired leases now, ``remaining`` computed by the database clock."""
        await self._ensure_schema()
        return await self._verbs.leases()

    async def waiters(self) -> dict[str, int]:
        """How many acquires wait in each name's fair queue now (PostgreSQL; empty on SQLite)."""
        if not self.backend.caps.fair_queue:
            return {}
        await self._ensure_schema()
        return await self._verbs.waiters()

    async def force_release(self, lease: LeaseInfo) -> bool:
        """End someone else's lease, as an operator: ``lease`` is a row of ``leases()`` (see ``Locker``)."""
        if not isinstance(lease, LeaseInfo):
            raise TypeError(f"force_release takes a LeaseInfo from leases(), not {type(lease).__name__}")
        check_name(lease.name)
        await self._ensure_schema()
        key = {"name": lease.name, "owner": lease.owner, "token": lease.token}
        ended = (await self._end(key, self._deadline(), shared=lease.shared)).ended
        if ended:
            release_log.info("ended the lease on %r (token %s, held by %s) by force", lease.name, lease.token, lease.label)
        return ended

    async def prune(self, older_than: float) -> int:
        """Delete rows of names nobody held for ``older_than`` seconds; returns how many."""
        age = check_ttl(older_than)
        await self._ensure_schema()
        return await self._verbs.prune(age)

    def open_connections(self) -> int:
        """How many of its statement connections this AsyncLocker has open now (not the listener's)."""
        return self._driver.open_connections()

    async def aclose(self) -> None:
        """Close dblock's own connections; stop renewals (leases stay granted until released or expired).

        Background clean-up still running (ending a lease a cancelled call may
        have been granted) gets ``op_timeout`` to finish first.
        """
        await self._cleanup.close(self.op_timeout)
        await self._renewer.aclose(self.op_timeout)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.op_timeout)
        if self._listener is not None:
            await self._listener.close()
        if self._heartbeat is not None:
            await self._heartbeat.close()
        await self._driver.close()
        if self._own_engine:
            self.engine.dispose()
        self._closed = True

    async def __aenter__(self) -> AsyncLocker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<AsyncLocker {self._driver.where} table={self.table!r}>"


class AsyncLease(LeaseView):
    """A grant of lock ``name`` to this process, for asyncio code (see ``Lease``).

    ``token`` is the fencing token. ``lost`` is an ``asyncio.Event``, set once
    this holder learns that the lease is gone without its release.
    """

    __slots__ = ("_locker", "name", "owner", "token", "_min_hold", "_shared", "_state", "_renewal", "__weakref__")

    def __init__(
        self,
        locker: AsyncLocker,
        name: str,
        owner: str,
        token: int,
        expires_at: datetime,
        ttl: float,
        sent_at: float,
        min_hold: float = 0.0,
        shared: bool = False,
    ) -> None:
        self._locker = locker
        self._min_hold = min_hold
        self._shared = shared  # its verbs send the shared statements (share_release, share_extend)
        self.name = name
        self.owner = owner
        self.token = token
        hold = metrics.recorder.hold(locker.backend.name, name)
        self._state = LeaseState(expires_at, ttl, core.trusted_until(sent_at, ttl), hold, lost=asyncio.Event())
        self._renewal: Renewal | None = None  # its place in the AsyncLocker's renewal schedule

    @property
    def locker(self) -> AsyncLocker:
        """The AsyncLocker that granted this lease."""
        return self._locker

    @property
    def shared(self) -> bool:
        """True for a read lock's or semaphore's lease; False for the exclusive (write) lock's."""
        return self._shared

    @property
    def lost(self) -> asyncio.Event:
        """Set once this holder learns that the lease is gone without its release."""
        return self._state.lost  # type: ignore[return-value]

    async def extend(self, ttl: float | None = None) -> None:
        """Push the expiry to (database now + ttl); raises ``LeaseLost`` if someone else took the lock."""
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        if self._state.released:
            raise LeaseLost(f"lease on {self.name!r} (token {self.token}) was released; not extended")
        done = await self._locker._extend(self.name, self.owner, self.token, ttl, self._locker._deadline(), self._shared)
        if done is None:
            if not self._state.released:
                self._state.lose()
                self._stop_renewal()
            raise LeaseLost(f"lease on {self.name!r} (token {self.token}) was released or taken over; not extended")
        self._state.extended(done.expires_at, ttl, done.sent_at)

    async def release(self) -> bool:
        """End the lease (and its renewal). True if this call ended it, False if it was already released or taken over.

        With a ``min_hold`` not yet passed, keeps it until then instead (``held_until``), as ``Lease.release``.
        """
        if self._state.held_until is not None:
            return False  # kept for its hold by an earlier release: nothing left to end
        renewal = self._renewal
        if renewal is not None and core.holds(self._min_hold):
            # A held lease keeps its owner: an extend in flight landing after the release
            # would push the hold out. It carries its batch's other leases too, so it is
            # waited for (up to op_timeout), not cancelled.
            await self._locker._renewer.settle(renewal, self._locker._deadline())
        else:
            self._stop_renewal()
        return await self._locker._release(self.name, self.owner, self.token, self._state, self._min_hold, self._shared)

    def start_renewal(self, on_lost: AsyncOnLost | None = None) -> None:
        """Extend this lease every ttl/3 until it is released or lost.

        The AsyncLocker's renewal task does it (one for all its leases, sending
        the extends that fall due together as one statement), and holds only a
        weak reference: renewal also stops when the lease is garbage-collected.
        When lost, ``lost`` is set, ``remaining()`` returns 0 and ``on_lost(lease)``
        (a plain or async callable) runs on the event loop.
        """
        if on_lost is not None and not callable(on_lost):
            raise TypeError(f"on_lost must be a callable taking the lease, or None; not {type(on_lost).__name__}")
        if self._state.ended():
            raise LeaseLost(f"lease on {self.name!r} (token {self.token}) has ended; nothing to renew")
        if self._renewal is not None:
            raise RuntimeError(f"lease on {self.name!r} (token {self.token}) is already renewing")
        self._renewal = self._locker._renew(self, self._state, on_lost)

    def _stop_renewal(self) -> None:
        if self._renewal is not None:
            self._locker._renewer.drop(self._renewal)

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Release; raise LeaseLost if the lease was lost before the block ended (unless it is failing)."""
        failing = exc is not None
        released_before = self._state.released
        try:
            ended = await self.release()
        except Exception:
            if not failing:
                raise
            release_log.exception("could not release %r after an error in the async with-block", self.name)
            return
        lost = self._lost_in_block(ended, released_before, failing)
        if lost is not None:
            raise lost

    def __repr__(self) -> str:
        return f"<AsyncLease {self.name!r} token={self.token} {self._status()}>"


class _AsyncLockContext:
    __slots__ = ("_locker", "_name", "_ttl", "_timeout", "_renew", "_on_lost", "_hold", "_lease", "_acquire")

    def __init__(
        self,
        locker: AsyncLocker,
        name: str,
        ttl: float | None,
        timeout: float | None,
        renew: bool,
        on_lost: AsyncOnLost | None,
        hold: float = 0.0,
        acquire: Callable[..., Awaitable[AsyncLease]] | None = None,
    ) -> None:
        self._locker, self._name, self._ttl, self._timeout = locker, name, ttl, timeout
        self._renew, self._on_lost, self._hold = renew, on_lost, hold
        self._lease: AsyncLease | None = None
        self._acquire = acquire  # an AsyncShared's acquire (bound to its name); None: the exclusive lock's

    async def __aenter__(self) -> AsyncLease:
        if self._acquire is not None:
            self._lease = await self._acquire(
                ttl=self._ttl, timeout=self._timeout, renew=self._renew, on_lost=self._on_lost
            )
        else:
            self._lease = await self._locker.acquire(
                self._name, ttl=self._ttl, timeout=self._timeout, renew=self._renew, on_lost=self._on_lost,
                min_hold=self._hold,
            )
        return self._lease

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            await lease.__aexit__(exc_type, exc, tb)


class AsyncShared:
    """Shared leases of one name, for asyncio code: at most ``limit`` at once (None: a read lock's
    readers, no limit). The twin of ``dblock.Shared``; every lease it grants is an ``AsyncLease``
    whose ``shared`` is True, with a token of its own, larger than every earlier grant of the name.
    """

    __slots__ = ("locker", "name", "limit")

    def __init__(self, locker: AsyncLocker, name: str, limit: int | None) -> None:
        self.locker, self.name, self.limit = locker, name, limit

    async def try_acquire(
        self, *, ttl: float | None = None, renew: bool = False, on_lost: AsyncOnLost | None = None
    ) -> AsyncLease | None:
        """One attempt: an AsyncLease, or None if a writer holds the name, someone waits in the fair queue, or it is full."""
        locker = self.locker
        return await locker._measured(self.name, locker._share_try(self.name, self.limit, ttl, renew, on_lost))

    async def acquire(
        self,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
    ) -> AsyncLease:
        """Wait up to ``timeout`` seconds; ``LockNotAcquired`` after.

        On PostgreSQL with ``fair=True`` the task waits in the name's fair
        queue, in one line with writers, and a release hands it the lease
        (woken by the AsyncLocker's listener); otherwise it polls with
        backoff, never past a known expiry. Cancelling the task leaves the
        queue and releases a lease granted meanwhile, as ``AsyncLocker.acquire``.
        """
        locker = self.locker
        return await locker._measured(
            self.name, locker._share_acquire(self.name, self.limit, ttl, timeout, renew, on_lost)
        )

    def lock(
        self,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
    ) -> _AsyncLockContext:
        """``async with sem.lock() as lease:`` acquires, and releases on exit (also on error)."""
        check_renew(renew, on_lost)
        return _AsyncLockContext(
            self.locker,
            self.name,
            None if ttl is None else check_ttl(ttl),
            None if timeout is None else check_timeout(timeout),
            renew,
            on_lost,
            0.0,
            acquire=self.acquire,
        )

    def __repr__(self) -> str:
        kind = "readers" if self.limit is None else f"semaphore limit={self.limit}"
        return f"<AsyncShared {self.name!r} {kind}>"
