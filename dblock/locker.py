"""Locker: the app-wide factory of leases on one database."""

from __future__ import annotations

import logging
import math
import threading
import time
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, ParamSpec, TypeVar

from sqlalchemy.engine import URL, Engine

from . import _core as core
from . import backends, metrics
from ._acquire import Acquirer, Try
from ._cleanup import Cleanup
from ._core import Extended as Extended  # importable here as before
from ._core import Granted
from ._core import EXPIRY_LOOKERS as EXPIRY_LOOKERS, FALLBACK_MAX as FALLBACK_MAX, GRACE as GRACE  # as before
from ._core import OUTAGE_RETRY_MAX as OUTAGE_RETRY_MAX  # importable here as before
from ._driver import Driver
from ._engine import engine_for
from ._process import default_label, queue_id
from ._process import describe_process as describe_process  # importable here as before
from ._redact import display_url
from ._verbs import Verbs
from ._wait import Heartbeat, Listener
from ._validate import check_limit, check_min_hold, check_name, check_options, check_renew, check_timeout, check_ttl
from .errors import DatabaseUnavailable, LockNotAcquired
from .lease import Lease, LeaseInfo, LeaseState
from .renew import OnLost, Renewal, Renewer
from .schema import DEFAULT_TABLE

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine  # needs greenlet at run time; only its URL is read

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("dblock.acquire")
release_log = logging.getLogger("dblock.release")

DEFAULT_TTL = 30.0
DEFAULT_OP_TIMEOUT = 5.0
DEFAULT_MAX_CONNECTIONS = 10


class Attempt(NamedTuple):
    """One acquire attempt: the lease it got, or None and the seconds until the holder's lease ends."""

    lease: Lease | None
    wait: float | None


class Locker:
    """Hands out leases on named locks stored in one database.

    ``url`` is a SQLAlchemy URL (``postgresql+psycopg://...``, ``sqlite:///file``),
    an existing ``Engine``, or None for the embedded default: a per-user SQLite
    file (see ``dblock.schema.default_sqlite_path``) whose table dblock creates
    on first use. Make one Locker per database and share it between threads.
    A psycopg2 or asyncpg URL or engine (also an ``AsyncEngine``) works too:
    dblock opens its own psycopg 3 connections from its URL, and ``engine`` is
    then a psycopg 3 engine dblock made (disposed of by ``close``).

    ``label`` is written next to each lease this Locker grants so that an
    operator can tell who holds it (``dblock status``); by default
    ``"host:pid command line"`` of this process.

    Waiting (``acquire``, ``lock``), see the README's "Waiting": on PostgreSQL
    with ``fair=True`` waiters queue (one row each, migration 0005), first come first
    served, and a release hands the lease to the first live waiter in the same
    statement; with ``notify=True`` that waiter is woken by NOTIFY through one
    listener connection per Locker, otherwise it polls. ``fair=False`` (and
    SQLite) waits by polling with backoff, never past the current lease's
    known expiry, and threads of this process waiting for one name queue
    locally so only the first of them polls.

    ``prepare=False`` sends every statement unprepared: needed behind a
    transaction pooler (PgBouncer with ``pool_mode = transaction``), where a
    server-side prepared statement can be run by another client's session.
    Use ``notify=False`` there too (LISTEN needs a session of its own).

    Time and connections are bounded (see the README's "Failures and limits"):
    every call but a waiting ``acquire`` returns or raises within
    ``op_timeout`` seconds whatever the server does; a waiting ``acquire``
    within its ``timeout`` plus ``GRACE``, riding out outages shorter than
    that; and the Locker opens at most ``max_connections`` connections for its
    statements, plus one listener connection while threads wait.
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
        self.table, self.schema, self.label, self.ttl, self.timeout = opts.table, opts.schema, opts.label, opts.ttl, opts.timeout
        self.poll_min, self.poll_max, self.fair, self.notify = opts.poll_min, opts.poll_max, opts.fair, opts.notify
        self.op_timeout = opts.op_timeout
        self.engine, self._needs_migration, self._own_engine = engine_for(url)
        where = display_url(self.engine.url)  # for repr and messages: no password, whatever its form
        # The database's statements, decoders, connections and abilities (``dblock.backends``).
        self.backend = backends.of(self.engine)(self.engine, self.table, self.schema, where, prepare=prepare)
        self._driver = Driver(self.backend, size=max_connections)
        self._queued = fair and self.backend.caps.fair_queue  # waiters queue (a table of their own)
        notified = self._queued and notify and self.backend.caps.notify
        self._listener = Listener(self._driver.connect, self.backend) if notified else None
        self._cleanup = Cleanup()
        self._proc = queue_id()
        self._default_label = default_label()
        # The fair queue's liveness: one heartbeat per Locker process, whatever the number of waiters.
        # A waiter is skipped once its process's row is older than lapse: 4 beats missed, and a second.
        self._lapse = core.lapse(self.poll_max)
        # The one-round-trip verbs (binds built once), and acquiring and waiting.
        self._verbs = Verbs(
            self.backend, self._driver, op_timeout=self.op_timeout, label=self._label, proc=self._proc_id,
            lapse=self._lapse,
        )
        heartbeat = Heartbeat(self._verbs.beat, self.poll_max) if self._queued else None
        self._acquirer = Acquirer(
            self._verbs, self._cleanup, queued=self._queued, listener=self._listener, heartbeat=heartbeat,
            poll_min=self.poll_min, poll_max=self.poll_max,
        )
        self._hot = self._acquirer.hot
        # What this Locker's leases call: the exclusive lock's, and shared leases' (read locks, semaphore
        # slots). One renewal thread for all of them; their extends go out in batches, on at most size - 1
        # connections.
        self._renewer = Renewer(self._extend_many, self.op_timeout, max(1, min(4, max_connections - 1)))
        self.keeper = Keeper(self, self._renewer)
        self.shared_keeper = SharedKeeper(self, self._renewer)
        self._migrated = threading.Lock()

    # -- schema ------------------------------------------------------------
    def create_schema(self) -> None:
        """Create or upgrade dblock's tables with its migrations (idempotent).

        Tables already current (made by dblock's history or the app's own) are
        left unchanged, needing no privilege beyond reading. Database trouble
        raises ``PermissionDenied``, ``DatabaseUnavailable`` or ``DBLockError``.
        """
        make_schema(self.engine, self.table, self.schema)

    def _ensure_schema(self) -> None:
        if self._needs_migration:
            with self._migrated:
                if self._needs_migration:
                    self.create_schema()
                    self._needs_migration = False

    # -- acquiring ---------------------------------------------------------
    def try_acquire(
        self,
        name: str,
        *,
        ttl: float | None = None,
        renew: bool = False,
        on_lost: OnLost | None = None,
        min_hold: float | None = None,
    ) -> Lease | None:
        """One attempt: a Lease, or None if another owner holds ``name``.

        ``renew=True`` keeps extending the lease until it is released (see
        ``Lease.start_renewal``); ``on_lost(lease)`` runs if renewal loses it.
        ``min_hold`` (seconds, may exceed the ttl): a release sooner than that
        after the grant, by the database clock, keeps the lease until then
        instead of ending it (see ``Lease.release``), so that a job started on
        several machines runs once however far apart their clocks start it.
        """
        check_name(name)
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        check_renew(renew, on_lost)
        hold = check_min_hold(min_hold)
        lease = self._measured(name, lambda: self._try(name, ttl, hold))
        if lease is not None and renew:
            lease.start_renewal(on_lost)
        return lease

    def acquire(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: OnLost | None = None,
        min_hold: float | None = None,
    ) -> Lease:
        """Wait up to ``timeout`` seconds (Locker default: for ever) for ``name``.

        Raises LockNotAcquired when the time runs out. Between attempts it sleeps
        a jittered backoff in [d, 2d), d doubling from poll_min to poll_max, and
        never past the moment the current lease is known to end. ``renew``,
        ``on_lost`` and ``min_hold`` as in ``try_acquire``.
        """
        check_name(name)
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        check_renew(renew, on_lost)
        hold = check_min_hold(min_hold)
        lease = self._measured(name, lambda: self._acquire(name, ttl, hold, timeout))
        if renew:
            lease.start_renewal(on_lost)
        return lease

    def _acquire(self, name: str, ttl: float, hold: float, timeout: float, limit: int | None | bool = False) -> Lease:
        """A waiting acquire; ``limit`` False: the exclusive lock, None: a reader's lease, an int: a semaphore's."""
        self._ensure_schema()
        attempt = self._acquirer.new_try(hold, limit, waiting=timeout > 0)
        granted = self._acquirer.guarded(name, ttl, attempt, lambda: self._acquirer.wait(name, attempt, ttl, timeout))
        return self._lease(name, attempt, ttl, granted)

    def _try(self, name: str, ttl: float, hold: float, limit: int | None | bool = False) -> Lease | None:
        """One attempt: a Lease, or None if ``name`` is held (``limit`` as in ``_acquire``)."""
        self._ensure_schema()
        attempt = self._acquirer.new_try(hold, limit)
        deadline = self._deadline()
        granted = self._acquirer.guarded(name, ttl, attempt, lambda: self._acquirer.once(name, attempt, ttl, deadline))
        return None if granted is None else self._lease(name, attempt, ttl, granted)

    def _lease(self, name: str, attempt: Try, ttl: float, granted: Granted) -> Lease:
        shared = core.shared_kind(attempt.limit)
        return Lease(
            self, name, attempt.owner, granted.token, granted.expires_at, ttl, granted.sent_at, attempt.hold,
            self._keeper_of(shared),
        )

    def _measured(self, name: str, acquire: Callable[[], R]) -> R:
        """``acquire()``, its wait (and what it came to) recorded by ``dblock.metrics``."""
        started = time.monotonic()
        try:
            lease = acquire()
        except BaseException as exc:
            metrics.recorder.waited(self.backend.name, name, started, exc)
            raise
        metrics.recorder.waited(self.backend.name, name, started, lease)
        return lease

    def _proc_id(self) -> str:
        return self._proc.get()

    def _deadline(self) -> float:
        """The deadline of a one-statement call starting now."""
        return self._verbs.deadline()

    def _attempt(self, name: str, owner: str, ttl: float, *, limit: int | None | bool = False) -> Attempt:
        """One attempt by ``owner`` (tests: a retry after a lost reply, G6)."""
        self._ensure_schema()
        attempt = Try(owner, 0.0, limit)
        granted, wait = self._acquirer.attempt(name, attempt, ttl, self._deadline())
        return Attempt(None if granted is None else self._lease(name, attempt, ttl, granted), wait)

    def _keeper_of(self, shared: bool) -> Keeper:
        """The statements behind a lease's verbs: a shared lease's, or the exclusive lock's."""
        return self.shared_keeper if shared else self.keeper

    def lock(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: OnLost | None = None,
        min_hold: float | None = None,
    ) -> _LockContext:
        """``with locker.lock(name) as lease:`` acquires, and releases on exit (also on error).

        With ``renew=True`` the lease is extended while the block runs; check
        ``lease.lost`` (or pass ``on_lost``) in long blocks. With ``min_hold``
        the exit keeps the lease until that long after its grant (see ``try_acquire``).
        """
        check_name(name)
        check_renew(renew, on_lost)
        return _LockContext(
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
        on_lost: OnLost | None = None,
        min_hold: float | None = None,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """``@locker.locked("report-{customer_id}", ttl=60)``: each call runs holding the lock.

        Works on functions and coroutine functions. ``name`` may name the
        function's arguments (``str.format`` fields, defaults applied); a field
        that names no parameter is refused here, when the function is decorated.
        A call acquires as ``lock`` does, waiting up to ``timeout``, and raises
        ``LockNotAcquired`` without running the function if the lock stays
        held (``timeout=0``: at once). Inside, ``dblock.current_lease()`` is
        the lease (its token fences writes). Coroutine functions acquire and
        release on a worker thread, so the event loop never waits for the database.
        ``min_hold`` as in ``try_acquire``: a job run at most once per period.
        """
        from .decorator import locked  # noqa: PLC0415 - loaded with the first decorated function

        return locked(self, name, ttl=ttl, timeout=timeout, renew=renew, on_lost=on_lost, min_hold=min_hold)

    # -- shared leases -----------------------------------------------------
    def semaphore(self, name: str, limit: int) -> Shared:
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
        return Shared(self, name, check_limit(limit))

    def readers(self, name: str) -> Shared:
        """The read side of ``name``'s read/write lock: any number of readers, no writer, at once.

        The write side is the exclusive lock of the same name (``acquire``,
        ``lock``, or ``write_lock``). On PostgreSQL (``fair=True``) readers
        and writers wait in one line, first come first served: a writer in
        line holds off new readers, and a writer's release admits every
        reader queued behind it at once.
        """
        check_name(name)
        return Shared(self, name, None)

    def read_lock(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: OnLost | None = None,
    ) -> _LockContext:
        """``with locker.read_lock(name) as lease:`` a shared lease of ``name`` (see ``readers``)."""
        return self.readers(name).lock(ttl=ttl, timeout=timeout, renew=renew, on_lost=on_lost)

    def write_lock(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: OnLost | None = None,
    ) -> _LockContext:
        """``with locker.write_lock(name) as lease:`` the same as ``lock(name)``: a write lock is the exclusive lock."""
        return self.lock(name, ttl=ttl, timeout=timeout, renew=renew, on_lost=on_lost)

    def _share_try(
        self, name: str, limit: int | None, ttl: float | None, renew: bool, on_lost: OnLost | None
    ) -> Lease | None:
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        check_renew(renew, on_lost)
        lease = self._try(name, ttl, 0.0, limit)
        if lease is not None and renew:
            lease.start_renewal(on_lost)
        return lease

    def _share_acquire(
        self,
        name: str,
        limit: int | None,
        ttl: float | None,
        timeout: float | None,
        renew: bool,
        on_lost: OnLost | None,
    ) -> Lease:
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        check_renew(renew, on_lost)
        lease = self._acquire(name, ttl, 0.0, timeout, limit)
        if renew:
            lease.start_renewal(on_lost)
        return lease

    def _label(self) -> str:
        return self._default_label.get() if self.label is None else self.label

    def _end(self, key: dict[str, Any], deadline: float, hold: float = 0.0, *, shared: bool = False) -> core.Ended:
        """Release the lease ``key`` (name, owner, token), or keep it for its ``hold`` (``Verbs.end``)."""
        return self._verbs.end(key, deadline, hold, shared=shared)

    def _extend_many(self, leases: list[Lease], deadline: float, shared: bool) -> tuple[float, list[datetime | None]]:
        """Renewal's extend: ``leases`` (of one kind) by their own ttl in one statement."""
        return self._keeper_of(shared).extend_many(leases, deadline)

    # -- operators ---------------------------------------------------------
    def leases(self) -> list[LeaseInfo]:
        """The unexpired leases now, ``remaining`` computed by the database clock."""
        self._ensure_schema()
        return self._verbs.leases()

    def waiters(self) -> dict[str, int]:
        """How many acquires wait in each name's fair queue now (PostgreSQL; names nobody waits for are absent).

        Counts live waiters of every Locker on this table, in any process. Empty
        on SQLite, which has no queue (its waiters poll and leave no trace).
        """
        if not self.backend.caps.fair_queue:
            return {}
        self._ensure_schema()
        return self._verbs.waiters()

    def force_release(self, lease: LeaseInfo) -> bool:
        """End someone else's lease, as an operator: ``lease`` is a row of ``leases()``.

        Compares (name, owner, token) like ``Lease.release``, so it ends exactly
        the lease you looked at: False if that one already ended or was replaced.
        Its holder finds out at its next extend (``LeaseLost``, or ``lease.lost``
        with renewal); until then it may still be working, so fence your writes.
        """
        if not isinstance(lease, LeaseInfo):
            raise TypeError(f"force_release takes a LeaseInfo from Locker.leases(), not {type(lease).__name__}")
        check_name(lease.name)
        self._ensure_schema()
        ended = self._end(
            {"name": lease.name, "owner": lease.owner, "token": lease.token}, self._deadline(), shared=lease.shared
        ).ended
        if ended:
            release_log.info("ended the lease on %r (token %s, held by %s) by force", lease.name, lease.token, lease.label)
        return ended

    def prune(self, older_than: float) -> int:
        """Delete rows of names nobody held for ``older_than`` seconds; returns how many.

        Tokens keep growing for a name that is used again after a prune (G2).
        """
        age = check_ttl(older_than)
        self._ensure_schema()
        return self._verbs.prune(age)

    def close(self) -> None:
        """Close dblock's own connections (leases stay granted until released or expired).

        Background clean-up still running (ending a lease a call could not
        confirm) gets ``op_timeout`` to finish first.
        """
        self._cleanup.close(self.op_timeout)
        if self._listener is not None:
            self._listener.close()
        self._driver.close()
        if self._own_engine:  # made by dblock (a URL, or another driver's engine): nothing of the caller's
            self.engine.dispose()

    def __enter__(self) -> Locker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Locker {self._driver.where} table={self.table!r}>"


def make_schema(engine: Engine, table: str, schema: str | None) -> None:
    """``create_schema`` of both faces: dblock's migrations, and WAL on SQLite."""
    from . import migrate  # noqa: PLC0415 - Alembic loads only when the schema is made, not on every start

    with migrate.database_errors(engine, table):
        backends.of(engine).prepare_database(engine)
        migrate.upgrade(engine, table, schema)


class _LockContext:
    __slots__ = ("_locker", "_name", "_ttl", "_timeout", "_renew", "_on_lost", "_hold", "_lease", "_acquire")

    def __init__(
        self,
        locker: Locker,
        name: str,
        ttl: float | None,
        timeout: float | None,
        renew: bool,
        on_lost: OnLost | None,
        hold: float,
        acquire: Callable[..., Lease] | None = None,
    ) -> None:
        self._locker, self._name, self._ttl, self._timeout = locker, name, ttl, timeout
        self._renew, self._on_lost, self._hold = renew, on_lost, hold
        self._lease: Lease | None = None
        self._acquire = acquire  # a Shared's acquire (bound to its name); None: the exclusive lock's

    def __enter__(self) -> Lease:
        if self._acquire is not None:
            self._lease = self._acquire(ttl=self._ttl, timeout=self._timeout, renew=self._renew, on_lost=self._on_lost)
        else:
            self._lease = self._locker.acquire(
                self._name, ttl=self._ttl, timeout=self._timeout, renew=self._renew, on_lost=self._on_lost,
                min_hold=self._hold,
            )
        return self._lease

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.__exit__(exc_type, exc, tb)


class Shared:
    """Shared leases of one name: at most ``limit`` at once (None: a read lock's readers, no limit).

    Every lease it grants excludes the exclusive (write) lock of the same name,
    and has a token of its own, larger than every earlier grant of the name.
    """

    __slots__ = ("locker", "name", "limit")

    def __init__(self, locker: Locker, name: str, limit: int | None) -> None:
        self.locker, self.name, self.limit = locker, name, limit

    def try_acquire(self, *, ttl: float | None = None, renew: bool = False, on_lost: OnLost | None = None) -> Lease | None:
        """One attempt: a Lease, or None if a writer holds the name, someone waits in the fair queue, or it is full."""
        locker = self.locker
        return locker._measured(self.name, lambda: locker._share_try(self.name, self.limit, ttl, renew, on_lost))

    def acquire(
        self, *, ttl: float | None = None, timeout: float | None = None, renew: bool = False, on_lost: OnLost | None = None
    ) -> Lease:
        """Wait up to ``timeout`` seconds; LockNotAcquired after.

        On PostgreSQL with ``fair=True`` it waits in the name's fair queue, in
        one line with writers, and a release hands it the lease; otherwise it
        polls with backoff, never past a known expiry.
        """
        locker = self.locker
        return locker._measured(
            self.name, lambda: locker._share_acquire(self.name, self.limit, ttl, timeout, renew, on_lost)
        )

    def lock(
        self, *, ttl: float | None = None, timeout: float | None = None, renew: bool = False, on_lost: OnLost | None = None
    ) -> _LockContext:
        """``with sem.lock() as lease:`` acquires, and releases on exit (also on error)."""
        check_renew(renew, on_lost)
        return _LockContext(
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
        return f"<Shared {self.name!r} {kind}>"


class Keeper:
    """The Locker's side of its leases (internal, not API): the statements behind a Lease's verbs.

    A Locker makes one (``Locker.keeper``) and each Lease it grants holds it.
    The Lease keeps its own state (``LeaseState``) and calls only these, so
    neither reaches into the other's private names. Also holds the Locker's
    renewal (``renewer``), whose batched extends it sends.
    """

    __slots__ = ("locker", "renewer")
    shared = False  # the exclusive (write) lock's leases; SharedKeeper's are shared

    def __init__(self, locker: Locker, renewer: Renewer) -> None:
        self.locker = locker
        self.renewer = renewer

    def release(
        self, name: str, owner: str, token: int, state: LeaseState, hold: float = 0.0, renewal: Renewal | None = None
    ) -> bool:
        """End the lease, or keep it until ``hold`` s after its grant (``state.held_until``).

        True if this call ended it or set its hold. Marks ``state`` released
        first. A held lease keeps its owner, so an extend landing after the
        release would push its expiry out: its ``renewal`` leaves the schedule
        and an extend of it in flight is waited for before the release goes out.
        """
        locker = self.locker
        locker._ensure_schema()
        # Before the statement: a renewal extend that finds the row cleared by
        # this release must not take it for a loss.
        state.released = True
        deadline = locker._deadline()
        if renewal is not None and core.holds(hold):
            self.renewer.settle(renewal, deadline)
        key = {"name": name, "owner": owner, "token": token}
        shared = self.shared
        ended: bool | None = None
        try:
            outcome = locker._end(key, deadline, hold, shared=shared)
            ended = outcome.ended
        except DatabaseUnavailable:
            # Unconfirmed: keep ending it in the background until it would expire.
            locker._cleanup.add(
                f"the lease on {name!r} (token {token})",
                lambda: locker._end(key, locker._deadline(), hold, shared=shared),
                time.monotonic() + state.ttl,
            )
            raise
        finally:
            state.hold.end(lost=ended is False)  # False: someone else ended it first (a takeover, a force release)
        state.held_until = outcome.held_until
        locker._acquirer.released(name, held=outcome.held_until is not None)
        return outcome.ended

    def extend(self, name: str, owner: str, token: int, ttl: float, deadline: float | None = None) -> Extended | None:
        """Extend the lease by ``ttl`` s (database clock); None if it was released or taken over."""
        locker = self.locker
        locker._ensure_schema()
        return locker._verbs.extend(
            name, owner, token, ttl, locker._deadline() if deadline is None else deadline, self.shared
        )

    def extend_many(self, leases: list[Lease], deadline: float) -> tuple[float, list[datetime | None]]:
        """Renewal's extend: ``leases`` by their own ttl in one statement (``Verbs.extend_many``)."""
        batch = [(lease.name, lease.owner, lease.token, lease.ttl) for lease in leases]
        return self.locker._verbs.extend_many(batch, deadline, self.shared)


class SharedKeeper(Keeper):
    """The statements behind a shared lease's verbs (read locks and semaphore slots; internal)."""

    __slots__ = ()
    shared = True
