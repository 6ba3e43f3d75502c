"""The Locker: the app-wide factory of leases on one database, its constructor and public verbs.

Written once for both faces (``tools/async_to_sync.py`` writes ``_locker.py``,
whose ``Locker`` is ``dblock.Locker``, from this module's ``AsyncLocker``).
The work is done in rooms of its own: the backend (``dblock.backends``), the
connection pool (``_adriver``), the one-round-trip verbs (``_averbs``),
acquiring and waiting (``_aacquire``), the listener, heartbeat and local line
(``_await``), the lease and its keeper (``_alease``, ``_akeeper``), renewal
(``_arenew``) and background clean-up (``_acleanup``). Here: validation of
every argument before any SQL runs, and wiring.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
import weakref
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Generic, Iterable, NamedTuple, ParamSpec, TypeVar, cast

from sqlalchemy.engine import URL, Engine

from . import _core as core
from . import backends, metrics
from ._aacquire import AsyncAcquirer, Try
from ._aelection import AsyncElection
from ._agroup import AsyncLeaseGroup, release_all
from ._acleanup import AsyncCleanup
from ._acompat import ALock, AMutex, acurrent_worker, ato_thread
from ._adriver import AsyncDriver
from ._akeeper import AsyncKeeper
from ._alease import AsyncLease, AsyncOnLost, AsyncUpgradeableLease
from ._arenew import AsyncRenewer
from ._averbs import AsyncVerbs
from ._await import AsyncHeartbeat, AsyncListener
from ._core import Granted
from ._defaults import (
    DEFAULT_DRIFT, DEFAULT_DRIFT_FIXED, DEFAULT_MAX_CONNECTIONS, DEFAULT_OP_TIMEOUT, DEFAULT_TTL, make_schema,
)
from ._engine import engine_for
from ._lease_state import HeldHere, LeaseInfo
from ._process import default_label, queue_id
from ._redact import display_url
from ._validate import (
    check_blocking, check_limit, check_min_hold, check_name, check_names, check_options, check_owner, check_renew,
    check_timeout, check_trusted, check_ttl,
)
from .errors import DBLockError, LockNotAcquired
from .schema import DEFAULT_TABLE

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine  # needs greenlet at run time; only its URL is read
    from .migrate import Migrated  # Alembic: imported only when the schema is made

P = ParamSpec("P")
R = TypeVar("R")
L = TypeVar("L", bound=AsyncLease, covariant=True)  # the lease a with-block gets

release_log = logging.getLogger("dblock.release")
log = logging.getLogger("dblock.locker")

# Who acquires a lease, in messages: a task on the asyncio face, a thread on the sync one.
if True:  # ASYNC
    WORKER = "task"
else:
    WORKER = "thread"


class Attempt(NamedTuple):
    """One acquire attempt: the lease it got, or None and the seconds until the holder's lease ends."""

    lease: AsyncLease | None
    wait: float | None


class AsyncLocker:
    """Hands out leases on named locks stored in one database.

    ``url`` is a SQLAlchemy URL (``postgresql+psycopg://...``, ``sqlite:///file``),
    an existing ``Engine``, or None: the ``DBLOCK_URL`` environment variable's URL
    when it is set (as the ``dblock`` command reads it), else the embedded default,
    a per-user SQLite file (see ``dblock.schema.default_sqlite_path``) whose table
    dblock creates on first use. Make one per database (and, on asyncio, per event loop) and
    share it. A psycopg2 or asyncpg URL or engine (also an ``AsyncEngine``)
    works too: dblock opens its own psycopg 3 connections from its URL, and
    ``engine`` is then a psycopg 3 engine dblock made (disposed of on close).

    ``label`` is written next to each lease it grants so that an operator can
    tell who holds it (``dblock status``); by default ``"host:pid command line"``
    of this process.

    Waiting (``acquire``, ``lock``), see "Locks and waiting" in the documentation: on PostgreSQL
    with ``fair=True`` waiters queue (one row each), first come first
    served, and a release hands the lease to the first live waiter in the same
    statement; with ``notify=True`` that waiter is woken by NOTIFY through one
    listener connection per Locker, otherwise it polls. ``fair=False`` (and
    SQLite) waits by polling with backoff, never past the current lease's
    known expiry, and waiters of this process for one name queue locally so
    only the first of them polls.

    ``prepare=False`` sends every statement unprepared: needed behind a
    transaction pooler (PgBouncer with ``pool_mode = transaction``), where a
    server-side prepared statement can be run by another client's session.
    Use ``notify=False`` there too (LISTEN needs a session of its own).

    Trust and the clocks (see "Guarantees" in the documentation): a lease is trusted
    (``lease.remaining()``) for its ttl from when its grant or extend was sent, less a
    clock allowance of ``drift`` (a fraction of the ttl, 0 to 0.5; 0.01 is 1%) plus
    ``drift_fixed`` seconds (0 to 60): the database server's clock may run that much
    faster than this machine's. A ttl that leaves no trust after the allowance is refused.
    The server's clock must not be stepped forward (NTP slewing it is fine).

    Time and connections are bounded (see "Failures and limits" in the documentation):
    every call but a waiting ``acquire`` returns or raises within
    ``op_timeout`` seconds whatever the server does; a waiting ``acquire``
    within its ``timeout`` plus 2.5 s, riding out
    outages shorter than that; and it opens at most ``max_connections`` connections for its
    statements, plus one listener connection while waiters wait (1,000
    waiting tasks or threads hold no connection each).
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
        drift: float = DEFAULT_DRIFT,
        drift_fixed: float = DEFAULT_DRIFT_FIXED,
    ) -> None:
        opts = check_options(
            url is None, table, schema, label, ttl, timeout, poll_min, poll_max, fair, notify, prepare, op_timeout,
            max_connections, drift, drift_fixed,
        )
        self.table, self.schema, self.label = opts.table, opts.schema, opts.label
        self.ttl, self.timeout, self.op_timeout = opts.ttl, opts.timeout, opts.op_timeout
        self.drift, self.drift_fixed = opts.drift  # the clock allowance: less trust in every lease
        self._drift = opts.drift
        self.poll_min, self.poll_max, self.fair, self.notify = opts.poll_min, opts.poll_max, opts.fair, opts.notify
        # A sync engine of the database: its URL and dialect, and create_schema's migrations.
        self.engine, self._needs_migration, self._own_engine = engine_for(url)
        where = display_url(self.engine.url)  # for repr and messages: no password, whatever its form
        # The database's statements, decoders, connections and abilities (``dblock.backends``).
        self.backend = backends.of(self.engine)(self.engine, self.table, self.schema, where, prepare=prepare)
        self._driver = AsyncDriver(self.backend, size=max_connections)
        self._queued = fair and self.backend.caps.fair_queue  # waiters queue (a table of their own)
        notified = self._queued and notify and self.backend.caps.notify
        self._listener = AsyncListener(self._driver.connect, self.backend) if notified else None
        self._cleanup = AsyncCleanup()
        self._proc = queue_id()
        self._default_label = default_label()
        self._migrated = ALock()
        # The fair queue's liveness: one heartbeat per Locker process, whatever the number of waiters.
        # A waiter is skipped once its process's row is older than lapse: 4 beats missed, and a second.
        self._lapse = core.lapse(self.poll_max)
        # The one-round-trip verbs (binds built once), and acquiring and waiting.
        self._verbs = AsyncVerbs(
            self.backend, self._driver, op_timeout=self.op_timeout, label=self._label, proc=self._proc.get,
            lapse=self._lapse,
        )
        self._heartbeat = AsyncHeartbeat(self._verbs.beat, self.poll_max) if self._queued else None
        self._acquirer = AsyncAcquirer(
            self._verbs, self._cleanup, queued=self._queued, listener=self._listener, heartbeat=self._heartbeat,
            poll_min=self.poll_min, poll_max=self.poll_max, drift=self._drift,
        )
        # What its leases call: the exclusive lock's, and shared leases' (read locks, semaphore slots).
        self.keeper = AsyncKeeper(self, self._verbs, self._cleanup, self._acquirer, shared=False)
        self.shared_keeper = AsyncKeeper(self, self._verbs, self._cleanup, self._acquirer, shared=True)
        self.keeper.partner, self.shared_keeper.partner = self.shared_keeper, self.keeper
        # Renewal, one for both kinds of lease: the extends that fall due together go out in
        # batches (each kind in a statement of its own), on at most size - 1 connections.
        self._renewer = AsyncRenewer(self._extend_many, self.op_timeout, max(1, min(4, max_connections - 1)))
        self.keeper.renewer = self.shared_keeper.renewer = self._renewer
        self._closed = False
        self._ready = not self._needs_migration  # not closed, tables made: _ensure_schema has nothing to do
        self._held_here = HeldHere()  # its exclusive leases, by the thread or task that acquired each
        # Its leases acquired with an owner key, by (name, the key's owner id): a re-entry finds them.
        self._keyed: weakref.WeakValueDictionary[tuple[str, str], AsyncLease] = weakref.WeakValueDictionary()
        self._keyed_lock = AMutex()

    # -- schema ------------------------------------------------------------
    async def create_schema(self) -> Migrated:
        """Create or upgrade dblock's tables with its migrations (idempotent); what it did.

        The answer (``dblock.migrate.Migrated``) says whether the tables were created,
        upgraded (from which revision to which) or already current, in its ``str()`` too;
        a change is also logged on the ``dblock.migrate`` logger (INFO).

        Tables already current (made by dblock's history or the app's own) are
        left unchanged, needing no privilege beyond reading. Database trouble
        raises ``PermissionDenied``, ``DatabaseUnavailable`` or ``DBLockError``.
        Alembic is synchronous: on asyncio the migration runs on a worker thread.
        """
        return await ato_thread(make_schema, self.engine, self.table, self.schema)

    def _check_ttl(self, ttl: object) -> float:
        """A call's ``ttl``, checked: a span of seconds that leaves some trust once this Locker's clock
        allowance (``drift``, ``drift_fixed``) is taken off."""
        return check_trusted(check_ttl(ttl), self._drift)

    async def _ensure_schema(self) -> None:
        """Before each verb that sends a statement: refuse a closed Locker, and make the embedded
        default's tables on first use."""
        if self._closed:
            raise RuntimeError(
                "this AsyncLocker is closed (its connections and renewal ended): make a new one; "
                "leases it granted may still be released"
            )
        if self._needs_migration:
            async with self._migrated:
                if self._needs_migration:
                    await self.create_schema()
                    self._needs_migration = False
                    self._ready = not self._closed

    # -- acquiring ---------------------------------------------------------
    async def try_acquire(
        self,
        name: str,
        *,
        ttl: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
        min_hold: float | None = None,
        owner: str | None = None,
    ) -> AsyncLease | None:
        """One attempt: a lease, or None if another owner holds ``name``.

        ``renew=True`` keeps extending the lease until it is released (see
        ``start_renewal``); ``on_lost(lease)`` runs if renewal loses it.
        ``min_hold`` (seconds, may exceed the ttl): a release sooner than that
        after the grant, by the database clock, keeps the lease until then
        instead of ending it (see the lease's ``release``), so that a job
        started on several machines runs once however far apart their clocks
        start it.

        ``owner``: a key that names the holder (a job id, a worker's name), for
        re-entry: a holder that asks again with its key, while its lease lasts,
        gets that lease back at once, with its token, and the lease ends at the
        outermost release; in another process (after a crash, say) the same key
        takes up the lease it still holds (see "Re-entry" in the documentation).
        """
        check_name(name)
        ttl = self.ttl if ttl is None else self._check_ttl(ttl)
        check_renew(renew, on_lost, on_expiring, expiring_margin)
        hold = 0.0 if min_hold is None else check_min_hold(min_hold)  # (the defaults cost no call)
        key = None if owner is None else check_owner(owner)
        lease: AsyncLease | None = await self._measured(name, self._try, name, ttl, hold, owner=key)
        if lease is not None and renew and not lease.renewing:
            lease.start_renewal(on_lost, on_expiring=on_expiring, expiring_margin=expiring_margin)
        return lease

    async def acquire(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
        min_hold: float | None = None,
        blocking: bool = True,
        owner: str | None = None,
    ) -> AsyncLease:
        """Wait up to ``timeout`` seconds (default: the Locker's, for ever) for ``name``.

        Raises LockNotAcquired when the time runs out. Between attempts it sleeps
        a jittered backoff in [d, 2d), d doubling from poll_min to poll_max, and
        never past the moment the current lease is known to end. ``renew``,
        ``on_lost``, ``min_hold`` and ``owner`` (re-entry) as in ``try_acquire``. ``blocking=False``
        (threading's and redis-py's word for it) tries once: LockNotAcquired at
        once if the name is held. On asyncio,
        cancelling the task leaves the queue, and releases a lease that was
        granted in the meantime, before ``CancelledError`` propagates.
        """
        check_name(name)
        ttl = self.ttl if ttl is None else self._check_ttl(ttl)
        timeout = check_blocking(blocking, None if timeout is None else check_timeout(timeout))
        timeout = self.timeout if timeout is None else timeout
        check_renew(renew, on_lost, on_expiring, expiring_margin)
        hold = 0.0 if min_hold is None else check_min_hold(min_hold)  # (the defaults cost no call)
        key = None if owner is None else check_owner(owner)
        lease: AsyncLease = await self._measured(name, self._acquire, name, ttl, hold, timeout, owner=key)
        if renew and not lease.renewing:
            lease.start_renewal(on_lost, on_expiring=on_expiring, expiring_margin=expiring_margin)
        return lease

    async def _measured(self, name: str, acquire: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``acquire(*args, **kwargs)``, its wait (and what it came to) recorded by ``dblock.metrics``
        (the arguments passed on, not a lambda: the hot path makes no closure)."""
        recorder = metrics.recorder
        if recorder is metrics.OFF:
            return await acquire(*args, **kwargs)  # metrics off: not even a call that records nothing
        started = time.monotonic()
        try:
            lease = await acquire(*args, **kwargs)
        except BaseException as exc:
            recorder.waited(self.backend.name, name, started, exc)
            raise
        recorder.waited(self.backend.name, name, started, lease)
        return lease

    async def _acquire(
        self,
        name: str,
        ttl: float,
        hold: float,
        timeout: float,
        limit: int | None | bool = False,
        *,
        owner: str | None = None,
        label: str | None = None,
    ) -> AsyncLease:
        """A waiting acquire; ``limit`` False: the exclusive lock, None: a reader's lease, an int: a
        semaphore's. ``owner``: an owner key (re-entry); ``label``: written with the grant (an
        election's value) instead of the Locker's."""
        if not self._ready:
            await self._ensure_schema()
        keyed = None if owner is None else core.keyed_owner(owner)
        if keyed is not None:
            again = self._reenter(name, keyed)
            if again is not None:
                return again
        elif limit is False and timeout > 0:
            mine = self._held_here.holding(name, acurrent_worker())
            if mine is not None and (math.isinf(timeout) or mine.remaining() >= timeout):
                # It could only wait out its own lease, to no end: say so now instead.
                raise LockNotAcquired(
                    name, timeout, f"this {WORKER} holds it already, through this AsyncLocker (token {mine.token}), "
                    "and would wait for its own lease: use the lease you hold, release it first, or acquire with "
                    "an owner key (owner=...) to re-enter",
                )
            if mine is not None:
                log.warning(
                    "waiting for %r, which this %s holds already through this AsyncLocker (token %s): the wait "
                    "takes it over when that lease ends, in %.3f s (to re-enter it instead, acquire with an owner key)",
                    name, WORKER, mine.token, mine.remaining(),
                )
        acquirer = self._acquirer
        attempt = acquirer.new_try(hold, limit, waiting=timeout > 0, owner=keyed, label=label)
        granted = await acquirer.guarded(name, ttl, attempt, acquirer.wait, name, attempt, ttl, timeout)
        return self._lease(name, attempt, ttl, granted, keyed=keyed is not None)

    async def _try(
        self, name: str, ttl: float, hold: float, limit: int | None | bool = False, *, owner: str | None = None
    ) -> AsyncLease | None:
        """One attempt: a lease, or None if ``name`` is held (``limit`` and ``owner`` as in ``_acquire``)."""
        if not self._ready:
            await self._ensure_schema()
        keyed = None if owner is None else core.keyed_owner(owner)
        if keyed is not None:
            again = self._reenter(name, keyed)
            if again is not None:
                return again
        acquirer = self._acquirer
        attempt = acquirer.new_try(hold, limit, owner=keyed)
        deadline = self._verbs.deadline()
        granted, _ = await acquirer.guarded(name, ttl, attempt, acquirer.attempt, name, attempt, ttl, deadline)
        return None if granted is None else self._lease(name, attempt, ttl, granted, keyed=keyed is not None)

    def _reenter(self, name: str, keyed: str) -> AsyncLease | None:
        """The lease on ``name`` this Locker granted to the owner key with id ``keyed``, entered once
        more, if the holder may still rely on it; else None (the database decides)."""
        with self._keyed_lock:
            lease = self._keyed.get((name, keyed))
            if lease is None or not self.keeper.enter_again(lease):
                return None
        return lease

    def _lease(self, name: str, attempt: Try, ttl: float, granted: Granted, *, keyed: bool = False) -> AsyncLease:
        shared = attempt.shared
        kind = AsyncUpgradeableLease if attempt.limit is core.UPGRADEABLE else AsyncLease
        lease = kind(
            self, name, attempt.owner, granted.token, granted.expires_at, ttl, granted.sent_at, attempt.hold,
            self.shared_keeper if shared else self.keeper,
        )
        if keyed:
            with self._keyed_lock:
                # Another caller with the same key, here, may have been granted the same lease meanwhile
                # (same owner, same token): it is one lease, entered once more.
                known = self._keyed.get((name, attempt.owner))
                if known is not None and known.token == lease.token and self.keeper.enter_again(known):
                    return known
                self._keyed[(name, attempt.owner)] = lease
        elif not shared:
            self._held_here.add(name, lease, acurrent_worker())
        return lease

    async def _attempt(self, name: str, owner: str, ttl: float, *, limit: int | None | bool = False) -> Attempt:
        """One attempt by ``owner`` (tests: a retry after a lost reply, G6)."""
        if not self._ready:
            await self._ensure_schema()
        attempt = Try(owner, 0.0, limit)
        granted, wait = await self._acquirer.attempt(name, attempt, ttl, self._deadline())
        return Attempt(None if granted is None else self._lease(name, attempt, ttl, granted), wait)

    def lock(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
        min_hold: float | None = None,
        blocking: bool = True,
        owner: str | None = None,
    ) -> _AsyncLockContext[AsyncLease]:
        """``with locker.lock(name) as lease:`` acquires, and releases on exit (also on error);
        on asyncio the context manager is an asynchronous one.

        With ``renew=True`` the lease is extended while the block runs; check
        ``lease.lost`` (or pass ``on_lost``) in long blocks. The exit raises LeaseLost
        if the lease was lost while the block ran (renewal gave it up, its trusted time
        ran out, or it was taken over), after releasing it where it is still this
        holder's. With ``min_hold``
        the exit keeps the lease until that long after its grant (see ``try_acquire``).
        ``blocking=False`` tries once, as ``acquire``; ``owner`` re-enters, as in ``try_acquire``.
        """
        check_name(name)
        check_renew(renew, on_lost, on_expiring, expiring_margin)
        return _AsyncLockContext(
            self,
            name,
            None if ttl is None else self._check_ttl(ttl),
            check_blocking(blocking, None if timeout is None else check_timeout(timeout)),
            dict(renew=renew, on_lost=on_lost, on_expiring=on_expiring, expiring_margin=expiring_margin),
            check_min_hold(min_hold),
            owner=check_owner(owner),
        )

    # -- several names at once -----------------------------------------------
    async def try_acquire_all(
        self,
        names: Iterable[str],
        *,
        ttl: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
        min_hold: float | None = None,
    ) -> AsyncLeaseGroup | None:
        """One attempt at every name: all of their leases, as one ``AsyncLeaseGroup``, or None
        and nothing held.

        The names are taken in one canonical order (sorted), whatever order
        they are given in; when one is held, those taken before it are
        released before this returns. ``ttl``, ``renew``, ``on_lost`` and
        ``min_hold`` apply to each lease, as in ``try_acquire``.
        """
        ordered = check_names(names)
        ttl = self.ttl if ttl is None else self._check_ttl(ttl)
        check_renew(renew, on_lost, on_expiring, expiring_margin)
        hold = check_min_hold(min_hold)
        renewal = (on_lost, on_expiring, expiring_margin) if renew else None

        async def take(name: str) -> AsyncLease | None:
            lease: AsyncLease | None = await self._measured(name, self._try, name, ttl, hold)
            return lease

        return await self._take_all(ordered, take, renewal)

    async def acquire_all(
        self,
        names: Iterable[str],
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
        min_hold: float | None = None,
        blocking: bool = True,
    ) -> AsyncLeaseGroup:
        """Wait up to ``timeout`` seconds in all (default: the Locker's) for every name: all of their
        leases, as one ``AsyncLeaseGroup``, or ``LockNotAcquired`` with nothing held.

        The names are taken one by one in one canonical order (sorted),
        whatever order they are given in, waiting for each as ``acquire``
        does: two callers asking for the same names in different orders
        never wait for each other in a circle. While it waits for a later
        name it holds the earlier ones; when the time runs out (or the call
        fails, or is cancelled) it releases them before raising. Each lease's
        ``ttl`` counts from its own grant: with ``renew=True`` each is renewed
        from then on, so the first stay held while the last are waited for.
        """
        ordered = check_names(names)
        ttl = self.ttl if ttl is None else self._check_ttl(ttl)
        timeout = check_blocking(blocking, None if timeout is None else check_timeout(timeout))
        timeout = self.timeout if timeout is None else timeout
        check_renew(renew, on_lost, on_expiring, expiring_margin)
        hold = check_min_hold(min_hold)
        deadline = time.monotonic() + timeout
        renewal = (on_lost, on_expiring, expiring_margin) if renew else None

        async def take(name: str) -> AsyncLease:
            left = max(deadline - time.monotonic(), 0.0)
            lease: AsyncLease = await self._measured(name, self._acquire, name, ttl, hold, left)
            return lease

        try:
            group = await self._take_all(ordered, take, renewal)
        except LockNotAcquired as exc:
            before = ordered.index(exc.name) if exc.name in ordered else 0
            taken = f"; the {before} taken before it were released" if before else ""
            raise LockNotAcquired(
                exc.name, timeout, f"it is held by another owner (one of {len(ordered)} names asked for together){taken}"
            ) from exc
        assert group is not None  # a waiting take returns a lease or raises
        return group

    def lock_all(
        self,
        names: Iterable[str],
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
        min_hold: float | None = None,
        blocking: bool = True,
    ) -> _AsyncGroupContext:
        """``with locker.lock_all(names) as group:`` acquires every name as ``acquire_all`` does, and
        releases them all on exit (also on error; asynchronous on asyncio)."""
        ordered = check_names(names)
        check_renew(renew, on_lost, on_expiring, expiring_margin)
        options: dict[str, Any] = dict(
            ttl=None if ttl is None else self._check_ttl(ttl),
            timeout=check_blocking(blocking, None if timeout is None else check_timeout(timeout)),
            renew=renew, on_lost=on_lost, on_expiring=on_expiring, expiring_margin=expiring_margin,
            min_hold=check_min_hold(min_hold),
        )
        return _AsyncGroupContext(self, ordered, options)

    async def _take_all(
        self,
        ordered: list[str],
        take: Callable[[str], Any],
        renewal: tuple[AsyncOnLost | None, AsyncOnLost | None, float | None] | None,
    ) -> AsyncLeaseGroup | None:
        """Take ``ordered`` names one by one (``take``: a lease, or None if the name is held), renewing
        each from its grant (``renewal``: on_lost, on_expiring, expiring_margin; None: no renewal).
        All of them, or None (a name was held) or an error with nothing held."""
        held: list[AsyncLease] = []
        try:
            for name in ordered:
                lease: AsyncLease | None = await take(name)
                if lease is None:
                    await self._give_back(held)
                    return None
                held.append(lease)
                if renewal is not None:
                    on_lost, on_expiring, margin = renewal
                    lease.start_renewal(on_lost, on_expiring=on_expiring, expiring_margin=margin)
        except BaseException:
            await self._give_back(held)
            raise
        return AsyncLeaseGroup(held)

    async def _give_back(self, held: list[AsyncLease]) -> None:
        """Release what an ``acquire_all`` that failed had taken (a failed release is logged: its
        lease ends at its expiry)."""
        try:
            await release_all(held)
        except Exception as exc:  # noqa: BLE001 - the caller's own error is the one to raise
            release_log.warning("could not release every lease of a group that was not completed: %s", exc)

    if True:  # ASYNC

        def synchronized(
            self,
            name: str,
            *,
            ttl: float | None = None,
            timeout: float | None = None,
            renew: bool = False,
            on_lost: AsyncOnLost | None = None,
            on_expiring: AsyncOnLost | None = None,
            expiring_margin: float | None = None,
            min_hold: float | None = None,
            owner: str | None = None,
        ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
            """``@locker.synchronized("report-{customer_id}", ttl=60)`` on a coroutine function: each call
            runs holding the lock, as ``Locker.synchronized`` (name templates, ``dblock.current_lease()``)."""
            from .decorator import locked  # noqa: PLC0415 - loaded with the first decorated function

            options: dict[str, Any] = dict(
                ttl=ttl, timeout=timeout, renew=renew, on_lost=on_lost, on_expiring=on_expiring,
                expiring_margin=expiring_margin, min_hold=min_hold, owner=owner,
            )
            return locked(self, name, **options)

    else:

        def synchronized(
            self,
            name: str,
            *,
            ttl: float | None = None,
            timeout: float | None = None,
            renew: bool = False,
            on_lost: AsyncOnLost | None = None,
            on_expiring: AsyncOnLost | None = None,
            expiring_margin: float | None = None,
            min_hold: float | None = None,
            owner: str | None = None,
        ) -> Callable[[Callable[P, R]], Callable[P, R]]:
            """``@locker.synchronized("report-{customer_id}", ttl=60)``: each call runs holding the lock.

            Works on functions and coroutine functions. ``name`` may name the
            function's arguments (``str.format`` fields, defaults applied); a field
            that names no parameter is refused here, when the function is decorated.
            A call acquires as ``lock`` does, waiting up to ``timeout``, and raises
            ``LockNotAcquired`` without running the function if the lock stays
            held (``timeout=0``: at once). Inside, ``dblock.current_lease()`` is
            the lease (its token fences writes). Coroutine functions acquire and
            release on a worker thread, so the event loop never waits for the database.
            ``min_hold`` as in ``try_acquire``: a job run at most once per period.
            ``owner``, an owner key (a template like ``name``), makes a call
            made inside another call with the same key re-enter its lease.
            """
            from .decorator import locked  # noqa: PLC0415 - loaded with the first decorated function

            return locked(
                self, name, ttl=ttl, timeout=timeout, renew=renew, on_lost=on_lost, on_expiring=on_expiring,
                expiring_margin=expiring_margin, min_hold=min_hold, owner=owner,
            )

    def locked(self, name: str, **options: Any) -> Any:
        """Deprecated: ``synchronized``, the decorator, by its old name. In threading, asyncio and
        redis-py ``locked()`` asks whether a lock is held; here that question is ``is_held(name)``."""
        warnings.warn(
            "AsyncLocker.locked() is the decorator, renamed synchronized(); to ask whether a name is held, "
            "use is_held(name)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.synchronized(name, **options)

    # -- leader election ----------------------------------------------------
    def election(self, name: str) -> AsyncElection:
        """An election on ``name``: candidates ``campaign``, one leads at a time, and its term is its
        lease's fencing token (see "Leader election" in the documentation). The election is the
        exclusive lock of ``name``: don't use the name as a plain lock too."""
        check_name(name)
        watch = self._watch if self.notify and self.backend.caps.notify else None
        channel = core.election_channel(self.table, self.schema, name)
        return AsyncElection(self, name, self._campaign, self._relabel, self._label, watch, channel)

    async def _campaign(
        self,
        name: str,
        value: str,
        *,
        ttl: float | None,
        timeout: float | None,
        on_lost: AsyncOnLost | None,
        on_expiring: AsyncOnLost | None,
        expiring_margin: float | None,
    ) -> AsyncLease:
        """A candidate's wait: a waiting acquire whose grant carries ``value`` as its label, renewed."""
        ttl = self.ttl if ttl is None else self._check_ttl(ttl)
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        check_renew(True, on_lost, on_expiring, expiring_margin)
        lease: AsyncLease = await self._measured(name, self._acquire, name, ttl, 0.0, timeout, label=value)
        lease.start_renewal(on_lost, on_expiring=on_expiring, expiring_margin=expiring_margin)
        return lease

    async def _relabel(self, lease: AsyncLease, value: str, channel: str) -> datetime | None:
        return await self._verbs.relabel(lease.name, lease.owner, lease.token, value, channel)

    async def _watch(self, channel: str, deadline: float) -> Any:
        """A connection of its own that hears ``channel``'s notifications (an election's observer)."""
        conn = await self._driver.connect(deadline)
        try:
            for statement in self.backend.watch(channel):
                await conn.execute(statement)
        except BaseException:
            await conn.close()
            raise
        return conn

    # -- shared leases -----------------------------------------------------
    def semaphore(self, name: str, limit: int) -> AsyncShared[AsyncLease]:
        """A counting semaphore: at most ``limit`` leases of ``name`` held at once.

        The returned object has the Locker's verbs (``try_acquire``,
        ``acquire``, ``lock``), without the name. Each lease has
        its own token and the usual release, extend, renewal and ``lost``.
        Callers that disagree about ``limit`` are held to the smallest: a grant
        is made only while fewer leases are live than the caller's limit and
        than every live holder's, so each holder, while it holds, never sees
        more leases of the name than its own limit. An exclusive lock (a write
        lock) on ``name`` excludes every semaphore holder, and the other way round.
        """
        check_name(name)
        return AsyncShared(self, name, check_limit(limit), self._measured, self._share_try, self._share_acquire)

    def readers(self, name: str) -> AsyncShared[AsyncLease]:
        """The read side of ``name``'s read/write lock: any number of readers, no writer, at once.

        The write side is the exclusive lock of the same name (``acquire``,
        ``lock``, or ``write_lock``). On PostgreSQL (``fair=True``) readers
        and writers wait in one line, first come first served: a writer in
        line holds off new readers, and a writer's release admits every
        reader queued behind it at once.
        """
        check_name(name)
        return AsyncShared(self, name, None, self._measured, self._share_try, self._share_acquire)

    def upgradeable(self, name: str) -> AsyncUpgradeable:
        """The upgradeable reader of ``name``: a reader (beside any number of others, never a
        writer) of which at most one holds at a time, whose lease can become the write lease
        without letting go (``lease.upgrade()``) and back (``lease.downgrade()``).

        The returned object has the Locker's verbs without the name (``try_acquire``,
        ``acquire``, ``lock``); its leases are ``AsyncUpgradeableLease``. On PostgreSQL
        (``fair=True``) it waits in the name's one line with readers and writers.
        """
        check_name(name)
        return AsyncUpgradeable(self, name, core.UPGRADEABLE, self._measured, self._share_try, self._share_acquire)

    def upgradeable_lock(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
    ) -> _AsyncLockContext[AsyncUpgradeableLease]:
        """``with locker.upgradeable_lock(name) as lease:`` the upgradeable reader's lease of ``name``
        (see ``upgradeable``); ``lease.upgrade()`` makes it the writer. The exit releases it, whichever it is."""
        return self.upgradeable(name).lock(
            ttl=ttl, timeout=timeout, renew=renew, on_lost=on_lost, on_expiring=on_expiring, expiring_margin=expiring_margin
        )

    def read_lock(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
    ) -> _AsyncLockContext[AsyncLease]:
        """``with locker.read_lock(name) as lease:`` a shared lease of ``name`` (see ``readers``)."""
        return self.readers(name).lock(
            ttl=ttl, timeout=timeout, renew=renew, on_lost=on_lost, on_expiring=on_expiring, expiring_margin=expiring_margin
        )

    def write_lock(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
    ) -> _AsyncLockContext[AsyncLease]:
        """``with locker.write_lock(name) as lease:`` the same as ``lock(name)``: a write lock is the exclusive lock."""
        return self.lock(
            name, ttl=ttl, timeout=timeout, renew=renew, on_lost=on_lost, on_expiring=on_expiring,
            expiring_margin=expiring_margin,
        )

    async def _share_try(
        self,
        name: str,
        limit: int | None | bool,
        ttl: float | None,
        renew: bool,
        on_lost: AsyncOnLost | None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
    ) -> AsyncLease | None:
        ttl = self.ttl if ttl is None else self._check_ttl(ttl)
        check_renew(renew, on_lost, on_expiring, expiring_margin)
        lease = await self._try(name, ttl, 0.0, limit)
        if lease is not None and renew:
            lease.start_renewal(on_lost, on_expiring=on_expiring, expiring_margin=expiring_margin)
        return lease

    async def _share_acquire(
        self,
        name: str,
        limit: int | None | bool,
        ttl: float | None,
        timeout: float | None,
        renew: bool,
        on_lost: AsyncOnLost | None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
    ) -> AsyncLease:
        ttl = self.ttl if ttl is None else self._check_ttl(ttl)
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        check_renew(renew, on_lost, on_expiring, expiring_margin)
        lease = await self._acquire(name, ttl, 0.0, timeout, limit)
        if renew:
            lease.start_renewal(on_lost, on_expiring=on_expiring, expiring_margin=expiring_margin)
        return lease

    # -- helpers -----------------------------------------------------------
    async def _extend_many(
        self, leases: list[AsyncLease], deadline: float, shared: bool
    ) -> tuple[float, list[datetime | None]]:
        """Renewal's extend: ``leases`` (of one kind) by their own ttl in one statement."""
        return await (self.shared_keeper if shared else self.keeper).extend_many(leases, deadline)

    def _deadline(self) -> float:
        """The deadline of a one-statement call starting now."""
        return self._verbs.deadline()

    def _label(self) -> str:
        return self._default_label.get() if self.label is None else self.label

    # -- operators ---------------------------------------------------------
    async def leases(self, name: str | None = None) -> list[LeaseInfo]:
        """The unexpired leases now, ``remaining`` computed by the database clock; of ``name`` only
        if given (one statement, by the name's key), exclusive or shared."""
        if name is not None:
            check_name(name)
        if not self._ready:
            await self._ensure_schema()
        return await self._verbs.leases(name)

    async def is_held(self, name: str) -> bool:
        """Whether anyone (this Locker or another) holds an unexpired lease on ``name`` now,
        exclusive or shared, by the database clock: ``threading.Lock.locked()``'s question.

        An answer about a moment that has passed when it arrives: to act only if the name is
        free, ``try_acquire`` it instead (one statement that asks and takes).
        """
        return bool(await self.leases(name))

    async def waiters(self) -> dict[str, int]:
        """How many acquires wait in each name's fair queue now (PostgreSQL; names nobody waits for are absent).

        Counts live waiters of every Locker on this table, in any process. Empty
        on SQLite, which has no queue (its waiters poll and leave no trace).
        """
        if not self.backend.caps.fair_queue:
            return {}
        if not self._ready:
            await self._ensure_schema()
        return await self._verbs.waiters()

    async def force_release(self, lease: LeaseInfo) -> bool:
        """End someone else's lease, as an operator: ``lease`` is a row of ``leases()``.

        Compares (name, owner, token) like a lease's ``release``, so it ends exactly
        the lease you looked at: False if that one already ended or was replaced.
        Its holder finds out at its next extend (``LeaseLost``, or ``lease.lost``
        with renewal); until then it may still be working, so fence your writes.
        """
        if not isinstance(lease, LeaseInfo):
            raise TypeError(f"force_release takes a LeaseInfo from leases(), not {type(lease).__name__}")
        check_name(lease.name)
        if not self._ready:
            await self._ensure_schema()
        key = {"name": lease.name, "owner": lease.owner, "token": lease.token}
        ended = (await self._verbs.end(key, self._deadline(), shared=lease.shared)).ended
        if ended:
            release_log.info(
                "ended the lease on %r (token %s, held by %s) by force", lease.name, lease.token, lease.label
            )
        return ended

    async def prune(self, older_than: float) -> int:
        """Delete rows of names nobody held for ``older_than`` seconds; returns how many.

        Tokens keep growing for a name that is used again after a prune: a later grant's token is
        larger than every earlier one, pruned or not.
        """
        age = check_ttl(older_than, "older_than")
        if not self._ready:
            await self._ensure_schema()
        return await self._verbs.prune(age)

    def open_connections(self) -> int:
        """How many of its statement connections are open now (not the listener's)."""
        return self._driver.open_connections()

    async def aclose(self) -> None:
        """Close dblock's own connections; stop renewals (leases stay granted until released or expired).

        Background clean-up still running (ending a lease a call could not
        confirm, or a cancelled call may have been granted) gets ``op_timeout``
        to finish first. On PostgreSQL, the row its fair waiters kept alive in
        the queue's table of processes is deleted (within 2 s, or ``op_timeout``
        if shorter; when the database does not answer, the row lapses by itself).
        A Locker never closed has it deleted at the process's clean exit, within
        the same bound.
        """
        await self._cleanup.close(self.op_timeout)
        await self._renewer.aclose(self.op_timeout)
        if self._listener is not None:
            await self._listener.close()
        if self._heartbeat is not None:
            # What its fair waiters wrote goes with it (their process's heartbeat row), within a
            # bound: when the database does not answer, the row lapses by itself as a crash's does.
            deadline = time.monotonic() + self._verbs.quit_within()
            await self._heartbeat.close(deadline)
            try:
                await self._verbs.quit(deadline)
            except DBLockError as exc:
                log.info("could not delete this process's row of waiters (%s); it lapses by itself", exc)
        await self._driver.close()
        if self._own_engine:  # made by dblock (a URL, or another driver's engine): nothing of the caller's
            self.engine.dispose()
        self._closed = True
        self._ready = False

    async def __aenter__(self) -> AsyncLocker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<AsyncLocker {self._driver.where} table={self.table!r}>"


class _AsyncLockContext(Generic[L]):
    __slots__ = ("_locker", "_name", "_ttl", "_timeout", "_renewal", "_hold", "_lease", "_acquire", "_owner")

    def __init__(
        self,
        locker: AsyncLocker,
        name: str,
        ttl: float | None,
        timeout: float | None,
        renewal: dict[str, Any],
        hold: float = 0.0,
        acquire: Callable[..., Any] | None = None,
        *,
        owner: str | None = None,
    ) -> None:
        self._locker, self._name, self._ttl, self._timeout, self._owner = locker, name, ttl, timeout, owner
        self._renewal, self._hold = renewal, hold  # renew, on_lost, on_expiring, expiring_margin
        self._lease: L | None = None
        self._acquire = acquire  # a shared lease's acquire (bound to its name); None: the exclusive lock's

    async def __aenter__(self) -> L:
        if self._acquire is not None:
            lease = await self._acquire(ttl=self._ttl, timeout=self._timeout, **self._renewal)
        else:
            lease = await self._locker.acquire(
                self._name, ttl=self._ttl, timeout=self._timeout, min_hold=self._hold, owner=self._owner,
                **self._renewal,
            )
        self._lease = cast(L, lease)  # the kind the Locker's method that made this context promised
        return self._lease

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            await lease.__aexit__(exc_type, exc, tb)


class _AsyncGroupContext:
    __slots__ = ("_locker", "_names", "_options", "_group")

    def __init__(self, locker: AsyncLocker, names: list[str], options: dict[str, Any]) -> None:
        self._locker, self._names, self._options = locker, names, options
        self._group: AsyncLeaseGroup | None = None

    async def __aenter__(self) -> AsyncLeaseGroup:
        self._group = await self._locker.acquire_all(self._names, **self._options)
        return self._group

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        group, self._group = self._group, None
        if group is not None:
            await group.__aexit__(exc_type, exc, tb)


class AsyncShared(Generic[L]):
    """Shared leases of one name: at most ``limit`` at once (None: a read lock's readers, no limit).

    Every lease it grants excludes the exclusive (write) lock of the same name,
    and has a token of its own, larger than every earlier grant of the name.
    """

    __slots__ = ("locker", "name", "limit", "_want", "_measured", "_try", "_acquire")

    def __init__(
        self,
        locker: AsyncLocker,
        name: str,
        limit: int | None | bool,
        measured: Callable[..., Any],
        try_: Callable[..., Any],
        acquire: Callable[..., Any],
    ) -> None:
        # ``limit``: None a reader, an int a semaphore slot, core.UPGRADEABLE the upgradeable reader.
        self.locker, self.name, self.limit, self._want = locker, name, core.limit_bind(limit), limit
        # The Locker's own steps, handed over once (its metrics, one attempt, a wait), so that
        # this view of one name needs none of the Locker's private names.
        self._measured, self._try, self._acquire = measured, try_, acquire

    async def try_acquire(
        self,
        *,
        ttl: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
    ) -> L | None:
        """One attempt: a lease, or None if a writer holds the name, someone waits in the fair queue, or it is full
        (or, for the upgradeable reader, another holds it, or it asks to upgrade)."""
        lease: L | None = await self._measured(
            self.name, lambda: self._try(self.name, self._want, ttl, renew, on_lost, on_expiring, expiring_margin)
        )
        return lease

    async def acquire(
        self,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
    ) -> L:
        """Wait up to ``timeout`` seconds; LockNotAcquired after.

        On PostgreSQL with ``fair=True`` it waits in the name's fair queue, in
        one line with writers, and a release hands it the lease; otherwise it
        polls with backoff, never past a known expiry. On asyncio, cancelling
        the task leaves the queue and releases a lease granted meanwhile.
        """
        lease: L = await self._measured(
            self.name,
            lambda: self._acquire(self.name, self._want, ttl, timeout, renew, on_lost, on_expiring, expiring_margin),
        )
        return lease

    def lock(
        self,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
    ) -> _AsyncLockContext[L]:
        """``with sem.lock() as lease:`` acquires, and releases on exit (also on error; asynchronous on asyncio)."""
        check_renew(renew, on_lost, on_expiring, expiring_margin)
        renewal = dict(renew=renew, on_lost=on_lost, on_expiring=on_expiring, expiring_margin=expiring_margin)
        return _AsyncLockContext(
            self.locker,
            self.name,
            None if ttl is None else check_ttl(ttl),  # and against the clock allowance by the acquire
            None if timeout is None else check_timeout(timeout),
            renewal,
            0.0,
            acquire=self.acquire,
        )

    def __repr__(self) -> str:
        kind = "readers" if self.limit is None else f"semaphore limit={self.limit}"
        return f"<AsyncShared {self.name!r} {kind}>"


class AsyncUpgradeable(AsyncShared[AsyncUpgradeableLease]):
    """The upgradeable reader of one name (``AsyncLocker.upgradeable``): its leases are
    ``AsyncUpgradeableLease``, which ``upgrade`` to the write lease and ``downgrade`` back."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<AsyncUpgradeable {self.name!r}>"


__all__ = ["Attempt", "AsyncLocker", "AsyncShared", "AsyncUpgradeable"]
