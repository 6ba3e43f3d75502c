"""Locker: the app-wide factory of leases on one database."""

from __future__ import annotations

import logging
import math
import random
import secrets
import threading
import time
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, ParamSpec, TypeVar

from sqlalchemy.engine import URL, Engine

from . import _core as core
from . import backends, metrics
from ._cleanup import Cleanup
from ._core import OUTAGE_RETRY_MIN, Grant
from ._core import EXPIRY_LOOKERS as EXPIRY_LOOKERS, FALLBACK_MAX as FALLBACK_MAX, GRACE as GRACE  # as before
from ._core import OUTAGE_RETRY_MAX as OUTAGE_RETRY_MAX  # importable here as before
from ._driver import Busy, Driver, OutOfTime
from ._engine import engine_for
from ._process import default_label, queue_id
from ._process import describe_process as describe_process  # importable here as before
from ._redact import display_url
from ._wait import Heartbeat, Hotspot, Listener
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
        self._listener = Listener(self._driver.connect, self.backend) if self._queued and notify and self.backend.caps.notify else None
        self._cleanup = Cleanup()
        self._hot = Hotspot()
        # The fair queue's liveness: one heartbeat per Locker process, whatever the number of waiters.
        # A waiter is skipped once its process's row is older than lapse: 4 beats missed, and a second.
        self._lapse = core.lapse(self.poll_max)
        self._heartbeat = Heartbeat(self._beat, self.poll_max) if self._queued else None
        # What this Locker's leases call. One renewal thread for all of them;
        # their extends go out in batches, on at most size - 1 connections.
        self.keeper = Keeper(self, max(1, min(4, max_connections - 1)))
        # Shared leases' (read locks, semaphore slots) verbs, with a renewal of their own.
        self.shared_keeper = SharedKeeper(self, max(1, min(2, max_connections - 1)))
        self._shared_hot = Hotspot()  # this process's threads polling for a shared lease, per name
        self._renewer = self.keeper.renewer
        self._proc = queue_id()
        self._migrated = threading.Lock()
        self._default_label = default_label()

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
        lease = self._measured(name, lambda: self._try(name, secrets.token_hex(16), ttl, hold, self._deadline()))
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
        owner = secrets.token_hex(16)
        deadline = time.monotonic() + timeout
        if timeout <= 0:
            lease = self._try(name, owner, ttl, hold, self._bound(deadline), limit)
            if lease is None:
                raise LockNotAcquired(name, timeout)
            return lease
        if self._queued:
            return self._wait_in_queue(name, owner, ttl, hold, timeout, deadline, limit)
        return self._wait_in_line(name, owner, ttl, hold, timeout, deadline, limit)

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

    def _try(
        self, name: str, owner: str, ttl: float, hold: float, deadline: float, limit: int | None | bool = False
    ) -> Lease | None:
        """One attempt: a Lease, or None if ``name`` is held (``limit`` as in ``_acquire``)."""
        try:
            if core.shared_kind(limit):
                lease, _ = self._share_attempt(name, owner, ttl, core.limit_bind(limit), deadline)
            else:
                lease, _ = self._attempt(name, owner, ttl, deadline, hold=hold)
        except OutOfTime:
            raise  # nothing was sent
        except DatabaseUnavailable:
            self._abandon(name, owner, ttl, limit)
            raise
        return lease

    def _proc_id(self) -> str:
        return self._proc.get()

    def _beat(self) -> None:
        self._driver.run(
            self.backend.queue.beat,
            {"proc": self._proc_id(), "lapse": self._lapse},
            deadline=self._deadline(),
        )

    def _deadline(self) -> float:
        """The deadline of a one-statement call starting now."""
        return time.monotonic() + self.op_timeout

    def _bound(self, deadline: float) -> float:
        """The deadline of one statement of a wait that ends at ``deadline``.

        SQLite's only wait is for another writer, which the wait's own deadline
        bounds; elsewhere a statement may run ``GRACE`` past it, so the attempt
        in flight at the deadline is not cut off when the server is merely slow.
        """
        return core.statement_deadline(
            time.monotonic(), deadline, self.op_timeout, not self.backend.caps.cut_statements
        )

    def _abandon(self, name: str, owner: str, ttl: float, limit: int | None | bool = False) -> None:
        """An attempt for ``owner`` went unanswered: end in the background whatever it granted.

        ``limit`` False: an exclusive attempt; None or an int: a shared one.
        """
        shared = core.shared_kind(limit)
        self._cleanup.add(
            f"a possible grant of {name!r} to owner {owner[:8]}",
            lambda: self._forget(name, owner, shared),
            time.monotonic() + ttl,
        )

    def _forget(self, name: str, owner: str, shared: bool = False) -> None:
        """Take ``owner`` out of ``name``'s queue, and end its lease (a ``shared`` one) if it holds one."""
        sql = self.backend.sql
        # With a fair queue, owned is cancel: the queue entry goes too.
        rows = self._driver.run(
            sql.share_owned if shared else sql.owned, {"name": name, "owner": owner, "seq": None},
            deadline=self._deadline(),
        ).rows
        token = self.backend.owned(rows)
        if token is not None:
            self._end({"name": name, "owner": owner, "token": token}, self._deadline(), shared=shared)

    def _outage(self, exc: DatabaseUnavailable, name: str, delay: float, deadline: float) -> float:
        """Sleep out a moment of an outage (never past ``deadline``); the next pause."""
        pause, later = core.outage_pause(delay, deadline - time.monotonic(), random.random())
        log.info("database unavailable while waiting for %r (%s); retrying in %.3f s", name, exc, max(pause, 0))
        if pause > 0:
            time.sleep(pause)
        return later

    @staticmethod
    def _out_of_time(name: str, timeout: float, outage: DatabaseUnavailable | None) -> Exception:
        if outage is None:
            return LockNotAcquired(name, timeout)
        return DatabaseUnavailable(
            f"lock {name!r} was not acquired within {timeout:g} s: the database was unavailable ({outage})",
            sqlstate=outage.sqlstate,
        )

    def _wait_in_line(
        self,
        name: str,
        owner: str,
        ttl: float,
        hold: float,
        timeout: float,
        deadline: float,
        limit: int | None | bool = False,
    ) -> Lease:
        """Poll with backoff; this process's threads waiting for ``name`` take turns (FIFO).

        ``limit`` False: for the exclusive lock; None (a reader) or an int (a
        semaphore): for a shared lease (``hold`` 0), in a local line of its own.
        """
        hot = self._hot if limit is False else self._shared_hot
        me = hot.join(name)
        promoted = not me.is_set()  # others were ahead in this process's line
        try:
            if not me.wait(core.wait_seconds(deadline - time.monotonic())):
                raise LockNotAcquired(name, timeout)  # never reached the head of the local line
            if promoted and limit is not False and hot.full(name):
                # The thread ahead of us was just granted the semaphore's last free slot:
                # look after a pause, or at once when this process releases one.
                me.clear()
                me.wait(min(core.backoff(self.poll_min, None, random.random()), max(deadline - time.monotonic(), 0)))
            delay, outage_delay = self.poll_min, OUTAGE_RETRY_MIN
            outage: DatabaseUnavailable | None = None  # the last attempt's failure, if it failed
            unsure = False  # an attempt went unanswered: it may have granted us the lease
            while True:
                me.clear()  # set again by a release in this process: try at once
                try:
                    if limit is False:
                        lease, wait = self._attempt(name, owner, ttl, self._bound(deadline), waiting=True, hold=hold)
                    else:
                        lease, wait = self._share_attempt(name, owner, ttl, limit, self._bound(deadline), waiting=True)
                    outage, outage_delay = None, OUTAGE_RETRY_MIN
                except (Busy, OutOfTime):  # SQLite's other writer, or a busy pool, took all the time we had
                    lease, wait = None, None
                except DatabaseUnavailable as exc:  # ride it out until the deadline
                    lease, wait, outage, unsure = None, None, exc, True
                if lease is not None:
                    return lease
                left = deadline - time.monotonic()
                if left <= 0:
                    if unsure:
                        self._abandon(name, owner, ttl, limit)
                    raise self._out_of_time(name, timeout, outage)
                if outage is not None:
                    outage_delay = self._outage(outage, name, outage_delay, deadline)
                    continue
                pause = core.backoff(delay, wait, random.random())
                delay = core.next_delay(delay, self.poll_max)
                log.debug("lock %r is held; retrying in %.3f s", name, min(pause, left))
                me.wait(min(pause, left))
        finally:
            hot.leave(name, me)

    def _wait_in_queue(
        self,
        name: str,
        owner: str,
        ttl: float,
        hold: float,
        timeout: float,
        deadline: float,
        limit: int | None | bool = False,
    ) -> Lease:
        """Fair waiting on PostgreSQL: join the queue, be handed the lease by a release.

        ``limit`` False: for the exclusive lock; None (a reader) or an int (a
        semaphore): for a shared lease, in the same line as the name's writers.
        """
        self._ensure_schema()
        shared = core.shared_kind(limit)
        listener, heartbeat = self._listener, self._heartbeat
        slot, ident = None, None
        if listener is not None:
            owner = listener.owner_id()  # hand-offs to it are notified on this listener's channel
            slot, ident = listener.register(owner, min(deadline, self._deadline()))
        # The last attempt that queued us: its send time (monotonic) and the database's time
        # when it ran, which is no earlier: together they place database times on our clock.
        queued_at: tuple[float, float] | None = None
        outage: DatabaseUnavailable | None = None  # the last attempt's failure, if it failed
        outage_delay = OUTAGE_RETRY_MIN
        seq: int | None = None  # our place in line, once queued
        if heartbeat is not None:
            heartbeat.enter()
        try:
            while True:
                left = deadline - time.monotonic()
                if listener is not None:
                    ident = listener.ident
                    if ident is None:  # not running (an outage killed it): start it again
                        listener.revive(min(deadline, self._deadline()))
                        ident = listener.ident
                sent_at = time.monotonic()
                try:
                    rows = self._driver.run(
                        self.backend.queue.share_enqueue if shared else self.backend.queue.enqueue,
                        {
                            "name": name, "owner": owner, "ttl": ttl, "label": self._label(),
                            "proc": self._proc_id(), "lapse": self._lapse,
                            "pid": ident[0] if ident else None, "start": ident[1] if ident else None,
                            "until": core.entry_lifetime(left), "seq": seq, "limit": core.limit_bind(limit),
                        },
                        deadline=self._bound(deadline),
                        waiting=True,
                    ).rows
                    outage, outage_delay = None, OUTAGE_RETRY_MIN
                except OutOfTime:  # nothing was sent: out of time, not an outage
                    if time.monotonic() >= deadline:
                        break
                    continue
                except DatabaseUnavailable as exc:  # ride it out until the deadline
                    outage = exc
                    if time.monotonic() >= deadline:
                        break
                    outage_delay = self._outage(exc, name, outage_delay, deadline)
                    continue
                outcome = self.backend.enqueued(rows)
                if outcome is None:
                    continue  # a concurrent first acquire created the row just now: look again
                if isinstance(outcome, Grant):
                    return Lease(
                        self, name, owner, outcome.token, outcome.expires_at, ttl, sent_at, hold, self._keeper_of(shared)
                    )
                wait, seq, ahead = outcome.wait, outcome.seq, outcome.ahead
                queued_at = (sent_at, outcome.at)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if slot is not None and ident is not None:
                    # Woken by a hand-off's notification, or looking in case one was lost.
                    pause = core.look_pause(self.poll_max, ahead, wait, random.random())
                    slot.event.wait(min(pause, left))
                    if slot.grant is not None:
                        token, expiry = slot.grant
                        try:
                            lease = self._handed(
                                name, owner, ttl, hold, Grant(token, core.when(expiry)), queued_at, deadline, shared
                            )
                        except DatabaseUnavailable as exc:
                            # The lease is ours but could not be renewed for use: the next
                            # attempt (same owner, G6) takes it up again, or the wait's end
                            # leaves it; either way it is not leaked, and the wait rides on.
                            outage, lease = exc, None
                        if lease is not None:
                            return lease
                        slot.grant = None  # handed, then lost (or unconfirmed) before we could use it: wait on
                    slot.event.clear()
                else:
                    # Polling: nobody will wake us, and a lease handed to us sits unused until we look.
                    delay = core.poll_delay(self.poll_min, self.poll_max, ahead)
                    pause = core.backoff(delay, wait, random.random())
                    time.sleep(min(pause, left))
                if pause >= left or time.monotonic() >= deadline:
                    break  # slept to the deadline (the sleep may end a hair early)
            # Out of time: leave the queue, unless a release handed us the lease first.
            try:
                rows = self._driver.run(
                    self.backend.queue.cancel,
                    {"name": name, "owner": owner, "seq": seq},
                    deadline=self._bound(deadline),
                ).rows
            except DatabaseUnavailable as exc:
                self._abandon(name, owner, ttl, limit)  # our entry dies with its own deadline anyway
                raise self._out_of_time(name, timeout, core.left_line_failed(exc, outage, queued_at is not None)) from exc
            handed = self.backend.cancelled(rows)
            if handed is not None:
                # A release handed us the lease, or an attempt whose reply was
                # lost granted it. Either way after the last attempt that came
                # back "queued" was sent, which then starts its trust (G5).
                try:
                    if queued_at is not None:
                        lease = self._handed(name, owner, ttl, hold, handed, queued_at, deadline, shared)
                        if lease is not None:
                            return lease
                    else:  # no such attempt: we cannot tell when it was granted, so end it
                        key = {"name": name, "owner": owner, "token": handed.token}
                        self._end(key, self._bound(deadline), shared=shared)
                except DatabaseUnavailable as exc:
                    self._abandon(name, owner, ttl, limit)  # ours, unconfirmed: ended in the background
                    raise self._out_of_time(name, timeout, exc) from exc
            raise self._out_of_time(name, timeout, outage)
        finally:
            if heartbeat is not None:
                heartbeat.leave()
            if listener is not None:
                listener.unregister(owner)

    def _handed(
        self,
        name: str,
        owner: str,
        ttl: float,
        hold: float,
        handed: Grant,
        queued_at: tuple[float, float],
        deadline: float,
        shared: bool = False,
    ) -> Lease | None:
        """A lease a release handed us, or None if it was lost before we woke.

        Trusted until its database expiry placed on our clock (G5, see
        ``core.handed_trust``): our last queueing attempt was sent at ``sent``
        and ran at database time ``at``. If little of the ttl is left, one
        extend renews it; if meanwhile it expired and someone else took it
        over, the caller goes on waiting.
        """
        sent, at = queued_at
        now = time.monotonic()
        trusted = core.handed_trust(sent, at, handed.expires_at.timestamp(), now, ttl)
        expires_at, sent_at = handed.expires_at, trusted - ttl  # the Lease trusts sent_at + ttl
        keeper = self._keeper_of(shared)
        if core.needs_refresh(trusted, now, ttl):
            done = keeper.extend(name, owner, handed.token, ttl, self._bound(deadline))
            if done is None:
                return None
            expires_at, sent_at = done
        return Lease(self, name, owner, handed.token, expires_at, ttl, sent_at, hold, keeper)

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

    def _attempt(
        self,
        name: str,
        owner: str,
        ttl: float,
        deadline: float | None = None,
        *,
        waiting: bool = False,
        hold: float = 0.0,
    ) -> Attempt:
        self._ensure_schema()
        if deadline is None:
            deadline = self._deadline()
        sent_at = time.monotonic()
        result = self._driver.run(
            self.backend.sql.acquire,
            {"name": name, "owner": owner, "ttl": ttl, "label": self._label()},
            self.backend.sql.holder,
            deadline=deadline,
            waiting=waiting,
        )
        outcome = self.backend.acquired(result.rows, result.extra)
        if not isinstance(outcome, Grant):
            return Attempt(None, outcome.wait)
        log.debug("granted %r token=%s", name, outcome.token)
        return Attempt(Lease(self, name, owner, outcome.token, outcome.expires_at, ttl, sent_at, hold), None)

    def _share_attempt(
        self, name: str, owner: str, ttl: float, limit: int | None, deadline: float | None = None, *, waiting: bool = False
    ) -> Attempt:
        """One attempt at a shared lease of ``name`` (``limit`` None: a reader)."""
        self._ensure_schema()
        if deadline is None:
            deadline = self._deadline()
        sent_at = time.monotonic()
        result = self._driver.run(
            self.backend.sql.share_acquire,
            {"name": name, "owner": owner, "ttl": ttl, "label": self._label(), "limit": limit},
            self.backend.sql.share_holder,
            deadline=deadline,
            waiting=waiting,
        )
        outcome, free = self.backend.share_acquired(result.rows, result.extra)
        if not isinstance(outcome, Grant):
            return Attempt(None, outcome.wait)
        self._shared_hot.mark_full(name, free is not None and free <= 0)
        log.debug("granted %r (shared, limit %s) token=%s", name, limit, outcome.token)
        lease = Lease(self, name, owner, outcome.token, outcome.expires_at, ttl, sent_at, keeper=self.shared_keeper)
        return Attempt(lease, None)

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
        lease = self._try(name, secrets.token_hex(16), ttl, 0.0, self._deadline(), limit)
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
        """Release the lease ``key`` (name, owner, token): ended by this call, or kept until
        ``hold`` s after its grant if that has not passed yet (see ``statements.release_held``).
        ``shared``: a reader's or semaphore holder's lease (no hold)."""
        held = core.holds(hold) and not shared
        sql = self.backend.sql
        if shared:
            result = self._driver.run(sql.share_release, key, deadline=deadline)
        elif held:
            result = self._driver.run(sql.release_held, {**key, "hold": hold}, deadline=deadline)
        else:
            result = self._driver.run(sql.release, key, deadline=deadline)
        rows = result.rows
        if not rows and result.retried:
            # The first try may have ended the lease before its reply was lost.
            # Ours ended without a takeover if the row still has our token, free.
            # (A hold the first try set is set again by the retry itself.)
            released = sql.share_released if shared else sql.released
            return self.backend.ended(self._driver.run(released, key, deadline=deadline).rows, held=False)
        return self.backend.ended(rows, held)

    # -- operators ---------------------------------------------------------
    def leases(self) -> list[LeaseInfo]:
        """The unexpired leases now, ``remaining`` computed by the database clock."""
        self._ensure_schema()
        rows = self._driver.run(self.backend.sql.leases, {}, deadline=self._deadline()).rows
        return [
            LeaseInfo(n, o, t, core.when(a), core.when(e), float(r), label, bool(sh), lim)
            for n, o, t, a, e, r, label, sh, lim in rows
        ]

    def waiters(self) -> dict[str, int]:
        """How many acquires wait in each name's fair queue now (PostgreSQL; names nobody waits for are absent).

        Counts live waiters of every Locker on this table, in any process. Empty
        on SQLite, which has no queue (its waiters poll and leave no trace).
        """
        if not self.backend.caps.fair_queue:
            return {}
        self._ensure_schema()
        rows = self._driver.run(self.backend.queue.waiters, {}, deadline=self._deadline()).rows
        return {name: count for name, count in rows}

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
        sql = self.backend.sql
        rows = self._driver.run(sql.prune, {"age": age}, before=sql.prune_lock, deadline=self._deadline()).rows
        # Shared leases that ended long ago (names pruned or not): their rows go too.
        self._driver.run(sql.share_prune, {"age": age}, deadline=self._deadline())
        return len(rows)

    def close(self) -> None:
        """Close dblock's own connections (leases stay granted until released or expired)."""
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


class Extended(NamedTuple):
    """An extend that took: the lease's new database expiry, and when the statement was sent."""

    expires_at: datetime
    sent_at: float


class Keeper:
    """The Locker's side of its leases (internal, not API): the statements behind a Lease's verbs.

    A Locker makes one (``Locker.keeper``) and each Lease it grants holds it.
    The Lease keeps its own state (``LeaseState``) and calls only these, so
    neither reaches into the other's private names. Also holds the Locker's
    renewal (``renewer``), whose batched extends it sends.
    """

    __slots__ = ("locker", "renewer")
    shared = False  # the exclusive (write) lock's leases; SharedKeeper's are shared

    def __init__(self, locker: Locker, renew_workers: int) -> None:
        self.locker = locker
        self.renewer = Renewer(self.extend_many, locker.op_timeout, renew_workers)

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
        if not locker._queued:  # fair waiters (shared ones too) are handed the lease by the release itself
            if outcome.held_until is None:
                locker._hot.released(name)
            locker._shared_hot.released(name)
        return outcome.ended

    def extend(self, name: str, owner: str, token: int, ttl: float, deadline: float | None = None) -> Extended | None:
        """Extend the lease by ``ttl`` s (database clock); None if it was released or taken over."""
        locker = self.locker
        locker._ensure_schema()
        sent_at = time.monotonic()
        rows = locker._driver.run(
            locker.backend.sql.share_extend if self.shared else locker.backend.sql.extend,
            {"name": name, "owner": owner, "token": token, "ttl": ttl},
            deadline=locker._deadline() if deadline is None else deadline,
        ).rows
        return Extended(core.when(rows[0][0]), sent_at) if rows else None

    def extend_many(self, leases: list[Lease], deadline: float) -> tuple[float, list[datetime | None]]:
        """Renewal's extend: ``leases`` by their own ttl in one statement.

        Returns when it was sent, and per lease (in the order given) its new
        expiry, or None if it was not extended (released or taken over). A
        background statement (``waiting``): however many leases renew, it
        leaves a connection of the pool for releases and other calls.
        """
        locker = self.locker
        batch = sorted(leases, key=lambda lease: lease.name)  # row locks in one order
        params = locker.backend.batch([(lease.name, lease.owner, lease.token, lease.ttl) for lease in batch])
        sent_at = time.monotonic()
        sql = locker.backend.sql.share_extend_many if self.shared else locker.backend.sql.extend_many
        rows = locker._driver.run(sql, params, deadline=deadline, waiting=True).rows
        return sent_at, locker.backend.extended(rows, [(lease.name, lease.token) for lease in leases])


class SharedKeeper(Keeper):
    """The statements behind a shared lease's verbs (read locks and semaphore slots; internal)."""

    __slots__ = ()
    shared = True
