"""Locker: the app-wide factory of leases on one database."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import secrets
import socket
import sqlite3
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, Sequence

from sqlalchemy import create_engine
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.pool import NullPool

from . import statements
from ._cleanup import Cleanup
from ._driver import SQLITE_BUSY_TIMEOUT_MS, Busy, Driver, OutOfTime
from ._redact import display_url, redact_command
from ._wait import Heartbeat, Hotspot, Listener
from ._validate import check_identifier, check_interval, check_name, check_text, check_timeout, check_ttl
from .errors import DatabaseUnavailable, LeaseLost, LockNotAcquired
from .lease import Lease, LeaseInfo
from .renew import OnLost, Renewer
from .schema import DEFAULT_TABLE, LABEL_LENGTH, prepare_default_sqlite_path

log = logging.getLogger("dblock.acquire")
release_log = logging.getLogger("dblock.release")

DEFAULT_TTL = 30.0
DEFAULT_OP_TIMEOUT = 5.0
DEFAULT_MAX_CONNECTIONS = 10
# A waiting acquire's last statements (the attempt in flight at its deadline,
# leaving the queue) may run this much past it before they are cut off.
GRACE = 1.0
# While the database is unreachable, a wait retries after this pause, doubling.
OUTAGE_RETRY_MIN, OUTAGE_RETRY_MAX = 0.05, 1.0
# A fair waiter behind others looks (in case a notification was lost) at most this rarely.
FALLBACK_MAX = 30.0
# When the current lease is known to end, the first few in line look: a lease that ran
# out unreleased is handed to the first live waiter by whoever looks (or leaves) first.
EXPIRY_LOOKERS = 3


class Locker:
    """Hands out leases on named locks stored in one database.

    ``url`` is a SQLAlchemy URL (``postgresql+psycopg://...``, ``sqlite:///file``),
    an existing ``Engine``, or None for the embedded default: a per-user SQLite
    file (see ``dblock.schema.default_sqlite_path``) whose table dblock creates
    on first use. Make one Locker per database and share it between threads.

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
        url: str | URL | Engine | None = None,
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
        self.table = check_identifier(table, "table")
        self.schema = None if schema is None else check_identifier(schema, "schema")
        if url is None and self.schema is not None:
            # Checked before _engine, which creates the embedded default's directory.
            raise ValueError("schema is not supported on SQLite (the embedded default); leave it None")
        self.label = None if label is None else check_text(label, "label", LABEL_LENGTH)
        self.ttl = check_ttl(ttl)
        self.timeout = check_timeout(timeout)
        self.poll_min = check_interval(poll_min, "poll_min")
        self.poll_max = check_interval(poll_max, "poll_max")
        if self.poll_max < self.poll_min:
            raise ValueError(f"poll_max ({poll_max:g}) must not be smaller than poll_min ({poll_min:g})")
        for option, value in (("fair", fair), ("notify", notify), ("prepare", prepare)):
            if not isinstance(value, bool):
                raise TypeError(f"{option} must be True or False, not {type(value).__name__}")
        self.fair, self.notify = fair, notify
        self.op_timeout = check_interval(op_timeout, "op_timeout")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int):
            raise TypeError(f"max_connections must be an int, not {type(max_connections).__name__}")
        if not 1 <= max_connections <= 1000:
            raise ValueError(f"max_connections must be between 1 and 1000, not {max_connections}")
        self.engine, self._needs_migration = _engine(url)
        if self.engine.dialect.name == "sqlite" and self.schema is not None:
            raise ValueError("schema is not supported on SQLite; leave it None")
        where = display_url(self.engine.url)  # for repr and messages: no password, whatever its form
        self._sql = statements.build(self.engine.dialect, self.table, self.schema)
        self._driver = Driver(self.engine, where, self.table, prepare=prepare, size=max_connections)
        self._queued = fair and self._sql.enqueue is not None  # PostgreSQL: waiters queue (a table of their own)
        self._listener = Listener(self._driver.connect) if self._queued and notify else None
        self._cleanup = Cleanup()
        self._hot = Hotspot()
        # The fair queue's liveness: one heartbeat per Locker process, whatever the number of waiters.
        # A waiter is skipped once its process's row is older than lapse: 4 beats missed, and a second.
        self._lapse = 4 * self.poll_max + 1.0
        self._heartbeat = Heartbeat(self._beat, self.poll_max) if self._queued else None
        # One renewal thread for all of this Locker's renewing leases; their
        # extends go out in batches, on at most size - 1 connections.
        self._renewer = Renewer(self._extend_many, self.op_timeout, max(1, min(4, max_connections - 1)))
        self._proc = ("", -1)  # (liveness id, pid it was made in)
        self._migrated = threading.Lock()
        self._default_label = ("", -1)  # (label, pid it was made in)

    # -- schema ------------------------------------------------------------
    def create_schema(self) -> None:
        """Create or upgrade dblock's tables with its migrations (idempotent).

        Tables already current (made by dblock's history or the app's own) are
        left unchanged, needing no privilege beyond reading. Database trouble
        raises ``PermissionDenied``, ``DatabaseUnavailable`` or ``DBLockError``.
        """
        from . import migrate  # Alembic loads only when the schema is made, not on every start

        with migrate.database_errors(self.engine, self.table):
            if self.engine.dialect.name == "sqlite":
                self._use_wal()
            migrate.upgrade(self.engine, self.table, self.schema)

    def _use_wal(self) -> None:
        # WAL lets readers and the one writer work at the same time. Switching
        # needs an exclusive lock; when another process is migrating the new
        # file, SQLite reports a deadlock at once instead of waiting, so retry.
        deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
        while True:
            try:
                with self.engine.connect() as conn:
                    conn.exec_driver_sql("PRAGMA journal_mode=WAL")
                return
            except OperationalError as exc:
                if "locked" not in str(exc.orig) or time.monotonic() > deadline:
                    raise
                time.sleep(0.005 + random.random() * 0.02)

    def _ensure_schema(self) -> None:
        if self._needs_migration:
            with self._migrated:
                if self._needs_migration:
                    self.create_schema()
                    self._needs_migration = False

    # -- acquiring ---------------------------------------------------------
    def try_acquire(
        self, name: str, *, ttl: float | None = None, renew: bool = False, on_lost: OnLost | None = None
    ) -> Lease | None:
        """One attempt: a Lease, or None if another owner holds ``name``.

        ``renew=True`` keeps extending the lease until it is released (see
        ``Lease.start_renewal``); ``on_lost(lease)`` runs if renewal loses it.
        """
        check_name(name)
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        _check_renew(renew, on_lost)
        owner = secrets.token_hex(16)
        try:
            lease, _ = self._attempt(name, owner, ttl, self._deadline())
        except OutOfTime:
            raise  # nothing was sent
        except DatabaseUnavailable:
            self._abandon(name, owner, ttl)
            raise
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
    ) -> Lease:
        """Wait up to ``timeout`` seconds (Locker default: for ever) for ``name``.

        Raises LockNotAcquired when the time runs out. Between attempts it sleeps
        a jittered backoff in [d, 2d), d doubling from poll_min to poll_max, and
        never past the moment the current lease is known to end. ``renew`` and
        ``on_lost`` as in ``try_acquire``.
        """
        check_name(name)
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        _check_renew(renew, on_lost)
        lease = self._acquire(name, ttl, timeout)
        if renew:
            lease.start_renewal(on_lost)
        return lease

    def _acquire(self, name: str, ttl: float, timeout: float) -> Lease:
        owner = secrets.token_hex(16)
        deadline = time.monotonic() + timeout
        if timeout <= 0:
            try:
                lease, _ = self._attempt(name, owner, ttl, self._bound(deadline))
            except OutOfTime:
                raise  # nothing was sent
            except DatabaseUnavailable:
                self._abandon(name, owner, ttl)
                raise
            if lease is None:
                raise LockNotAcquired(name, timeout)
            return lease
        if self._queued:
            return self._wait_in_queue(name, owner, ttl, timeout, deadline)
        return self._wait_in_line(name, owner, ttl, timeout, deadline)

    def _proc_id(self) -> str:
        proc, pid = self._proc
        if pid != os.getpid():  # made before a fork: the child is another process
            proc = secrets.token_hex(8)
            self._proc = (proc, os.getpid())
        return proc

    def _beat(self) -> None:
        self._driver.run(
            self._sql.beat,  # type: ignore[arg-type]
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
        now = time.monotonic()
        if self._sql.dialect == "sqlite":
            return min(now + self.op_timeout, max(deadline, now + 0.001))
        return min(now + self.op_timeout, deadline + GRACE)

    def _abandon(self, name: str, owner: str, ttl: float) -> None:
        """An attempt for ``owner`` went unanswered: end in the background whatever it granted."""
        self._cleanup.add(
            f"a possible grant of {name!r} to owner {owner[:8]}", lambda: self._forget(name, owner), time.monotonic() + ttl
        )

    def _forget(self, name: str, owner: str) -> None:
        """Take ``owner`` out of ``name``'s queue, and end its lease if it holds one."""
        if self._sql.cancel is not None:  # PostgreSQL: the queue entry goes too
            rows = self._driver.run(
                self._sql.cancel, {"name": name, "owner": owner, "seq": None}, deadline=self._deadline()
            ).rows
            held = bool(rows and rows[0][0])
        else:
            rows = self._driver.run(
                self._sql.owned, {"name": name, "owner": owner}, deadline=self._deadline()  # type: ignore[arg-type]
            ).rows
            held = bool(rows)
        if held:
            token = rows[0][1] if self._sql.cancel is not None else rows[0][0]
            self._end({"name": name, "owner": owner, "token": token}, self._deadline())

    def _outage(self, exc: DatabaseUnavailable, name: str, delay: float, deadline: float) -> float:
        """Sleep out a moment of an outage (never past ``deadline``); the next pause."""
        left = deadline - time.monotonic()
        pause = min(delay * (1 + random.random()), left)
        log.info("database unavailable while waiting for %r (%s); retrying in %.3f s", name, exc, max(pause, 0))
        if pause > 0:
            time.sleep(pause)
        return min(delay * 2, OUTAGE_RETRY_MAX)

    @staticmethod
    def _out_of_time(name: str, timeout: float, outage: DatabaseUnavailable | None) -> Exception:
        if outage is None:
            return LockNotAcquired(name, timeout)
        return DatabaseUnavailable(
            f"lock {name!r} was not acquired within {timeout:g} s: the database was unavailable ({outage})",
            sqlstate=outage.sqlstate,
        )

    def _wait_in_line(self, name: str, owner: str, ttl: float, timeout: float, deadline: float) -> Lease:
        """Poll with backoff; this process's threads waiting for ``name`` take turns (FIFO)."""
        me = self._hot.join(name)
        try:
            if not me.wait(_seconds(deadline - time.monotonic())):
                raise LockNotAcquired(name, timeout)  # never reached the head of the local line
            delay, outage_delay = self.poll_min, OUTAGE_RETRY_MIN
            outage: DatabaseUnavailable | None = None  # the last attempt's failure, if it failed
            unsure = False  # an attempt went unanswered: it may have granted us the lease
            while True:
                me.clear()  # set again by a release in this process: try at once
                try:
                    lease, wait = self._attempt(name, owner, ttl, self._bound(deadline), waiting=True)
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
                        self._abandon(name, owner, ttl)
                    raise self._out_of_time(name, timeout, outage)
                if outage is not None:
                    outage_delay = self._outage(outage, name, outage_delay, deadline)
                    continue
                pause = self._backoff(delay, wait)
                delay = min(delay * 2, self.poll_max)
                log.debug("lock %r is held; retrying in %.3f s", name, min(pause, left))
                me.wait(min(pause, left))
        finally:
            self._hot.leave(name, me)

    def _backoff(self, delay: float, wait: float | None) -> float:
        """A jittered pause in [delay, 2 delay), cut short at the holder's known expiry."""
        pause = delay + random.random() * delay
        if wait is not None:
            # The holder's lease ends in `wait` s (database clock): no point
            # polling before then, nor sleeping past it.
            pause = min(pause, max(wait, 0.001))
        return pause

    def _wait_in_queue(self, name: str, owner: str, ttl: float, timeout: float, deadline: float) -> Lease:
        """Fair waiting on PostgreSQL: join the queue, be handed the lease by a release."""
        self._ensure_schema()
        listener, heartbeat = self._listener, self._heartbeat
        slot, ident = None, None
        if listener is not None:
            owner = listener.owner_id()  # hand-offs to it are notified on this listener's channel
            slot, ident = listener.register(owner, min(deadline, self._deadline()))
        # The last attempt that queued us: its send time (monotonic) and the database's time
        # when it ran, which is no earlier: together they place database times on our clock.
        queued_at: tuple[float, float] | None = None
        outage: DatabaseUnavailable | None = None  # the last attempt's failure, if it failed
        unsure = False  # an attempt went unanswered: it may have queued us or granted us the lease
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
                        self._sql.enqueue,  # type: ignore[arg-type]
                        {
                            "name": name, "owner": owner, "ttl": ttl, "label": self._label(),
                            "proc": self._proc_id(), "lapse": self._lapse,
                            "pid": ident[0] if ident else None, "start": ident[1] if ident else None,
                            # The entry dies with the wait: skipped if this process cannot leave the line.
                            "until": None if left == math.inf else max(left, 0.0) + GRACE, "seq": seq,
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
                    outage, unsure = exc, True
                    if time.monotonic() >= deadline:
                        break
                    outage_delay = self._outage(exc, name, outage_delay, deadline)
                    continue
                if not rows:
                    continue  # a concurrent first acquire created the row just now: look again
                granted, token, expires_at, wait, seq, ahead, at = rows[0]
                if granted:
                    return Lease(self, name, owner, token, _when(expires_at), ttl, sent_at)
                queued_at = (sent_at, float(at))
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if slot is not None and ident is not None:
                    # A release hands over and notifies; looking is a fallback in case a
                    # notification was lost, rarer the further back in line. The first
                    # few in line also look when the current lease ends (a holder that
                    # died): that look hands the lease to the first live waiter.
                    pause = min((self.poll_max + random.random() * self.poll_max) * (1 + ahead), FALLBACK_MAX)
                    if wait is not None and ahead < EXPIRY_LOOKERS:
                        pause = min(pause, max(wait, 0.001))
                    slot.event.wait(min(pause, left))
                    if slot.grant is not None:
                        token, expiry = slot.grant
                        lease = self._handed(name, owner, ttl, token, _when(expiry), queued_at, deadline)
                        if lease is not None:
                            return lease
                        slot.grant = None  # handed, then lost before we could use it: wait on
                    slot.event.clear()
                else:
                    # Polling: nobody will wake us, and a lease handed to us sits
                    # unused until we look. The first in line looks every poll_min;
                    # the others back off with their place in the queue.
                    delay = min(self.poll_min * (1 + (ahead or 0)), self.poll_max)
                    pause = self._backoff(delay, wait)
                    time.sleep(min(pause, left))
                if pause >= left or time.monotonic() >= deadline:
                    break  # slept to the deadline (the sleep may end a hair early)
            # Out of time: leave the queue, unless a release handed us the lease first.
            try:
                rows = self._driver.run(
                    self._sql.cancel,  # type: ignore[arg-type]
                    {"name": name, "owner": owner, "seq": seq},
                    deadline=self._bound(deadline),
                ).rows
            except DatabaseUnavailable as exc:
                self._abandon(name, owner, ttl)  # our entry dies with its own deadline anyway
                raise self._out_of_time(name, timeout, outage if isinstance(exc, OutOfTime) else exc) from exc
            if rows and rows[0][0]:
                # A release handed us the lease, or an attempt whose reply was
                # lost granted it. Either way after the last attempt that came
                # back "queued" was sent, which then starts its trust (G5).
                if queued_at is not None:
                    lease = self._handed(name, owner, ttl, rows[0][1], _when(rows[0][2]), queued_at, deadline)
                    if lease is not None:
                        return lease
                else:  # no such attempt: we cannot tell when it was granted, so end it
                    self._end({"name": name, "owner": owner, "token": rows[0][1]}, self._bound(deadline))
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
        token: int,
        expires_at: datetime,
        queued_at: tuple[float, float],
        deadline: float,
    ) -> Lease | None:
        """A lease a release handed us, or None if it was lost before we woke.

        Trusted until its database expiry placed on our clock (G5): our last
        queueing attempt was sent at ``sent`` and ran at database time ``at``,
        a moment no earlier, so expiry ``E`` comes no earlier than
        ``sent + (E - at)`` on our clock (the two clocks running at the same
        rate, as G5 assumes). The hand-off came after that attempt, so this is
        at least ``sent + ttl``; it does not age while we sleep far back in the
        line. If little of the ttl is left, one extend renews it; if meanwhile
        it expired and someone else took it over, the caller goes on waiting.
        """
        sent, at = queued_at
        until = sent + (expires_at.timestamp() - at)
        lease = Lease(self, name, owner, token, expires_at, ttl, min(until, time.monotonic() + ttl) - ttl)
        if lease.remaining() < ttl / 2:
            try:
                self._extend(lease, None, self._bound(deadline))
            except LeaseLost:
                return None
        return lease

    def lock(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: OnLost | None = None,
    ) -> _LockContext:
        """``with locker.lock(name) as lease:`` acquires, and releases on exit (also on error).

        With ``renew=True`` the lease is extended while the block runs; check
        ``lease.lost`` (or pass ``on_lost``) in long blocks.
        """
        check_name(name)
        _check_renew(renew, on_lost)
        return _LockContext(
            self,
            name,
            None if ttl is None else check_ttl(ttl),
            None if timeout is None else check_timeout(timeout),
            renew,
            on_lost,
        )

    def _attempt(
        self, name: str, owner: str, ttl: float, deadline: float | None = None, *, waiting: bool = False
    ) -> tuple[Lease | None, float | None]:
        self._ensure_schema()
        if deadline is None:
            deadline = self._deadline()
        sent_at = time.monotonic()
        rows, holder, _ = self._driver.run(
            self._sql.acquire,
            {"name": name, "owner": owner, "ttl": ttl, "label": self._label()},
            self._sql.holder,
            deadline=deadline,
            waiting=waiting,
        )
        if self._sql.dialect == "postgresql":
            if not rows:
                return None, None
            granted, token, expires_at, wait = rows[0]
            if not granted:
                return None, wait
        else:
            if not rows:
                return None, holder[0][0] if holder else None
            token, expires_at = rows[0]
        log.debug("granted %r token=%s", name, token)
        return Lease(self, name, owner, token, _when(expires_at), ttl, sent_at), None

    def _label(self) -> str:
        if self.label is not None:
            return self.label
        label, pid = self._default_label
        if pid != os.getpid():  # made before a fork: the pid changed
            label = describe_process(sys.argv)
            self._default_label = (label, os.getpid())
        return label

    # -- the holder's verbs (called through Lease) ---------------------------
    def _release(self, lease: Lease) -> bool:
        self._ensure_schema()
        # Before the statement: a renewal extend that finds the row cleared by
        # this release must not take it for a loss.
        lease._released = True
        key = _key(lease)
        try:
            ended = self._end(key, self._deadline())
        except DatabaseUnavailable:
            # Unconfirmed: keep ending it in the background until it would expire.
            self._cleanup.add(
                f"the lease on {lease.name!r} (token {lease.token})",
                lambda: self._end(key, self._deadline()),
                time.monotonic() + lease.ttl,
            )
            raise
        if not self._queued:  # fair waiters are handed the lease by the release itself
            self._hot.released(lease.name)
        return ended

    def _end(self, key: dict[str, Any], deadline: float) -> bool:
        rows, _, retried = self._driver.run(self._sql.release, key, deadline=deadline)
        if not rows and retried:
            # The first try may have ended the lease before its reply was lost.
            # Ours ended without a takeover if the row still has our token, free.
            rows = self._driver.run(self._sql.released, key, deadline=deadline).rows
        return bool(rows)

    def _extend(self, lease: Lease, ttl: float | None, deadline: float | None = None) -> None:
        ttl = lease.ttl if ttl is None else check_ttl(ttl)
        self._ensure_schema()
        sent_at = time.monotonic()
        rows = self._driver.run(
            self._sql.extend, {**_key(lease), "ttl": ttl}, deadline=self._deadline() if deadline is None else deadline
        ).rows
        if not rows:
            if not lease._released:
                lease._lose()
            raise LeaseLost(f"lease on {lease.name!r} (token {lease.token}) was released or taken over; not extended")
        lease._extended(_when(rows[0][0]), ttl, sent_at)

    def _extend_many(self, leases: list[Lease], deadline: float) -> list[Lease]:
        """Renewal's extend: ``leases`` by their own ttl in one statement; returns those not extended.

        A background statement (``waiting``): however many leases renew, it
        leaves a connection of the pool for releases and other calls.
        """
        leases = sorted(leases, key=lambda lease: lease.name)  # row locks in one order
        if self._sql.dialect == "postgresql":
            params: dict[str, Any] = {
                "names": [lease.name for lease in leases],
                "owners": [lease.owner for lease in leases],
                "tokens": [lease.token for lease in leases],
                "ttls": [lease.ttl for lease in leases],
            }
        else:
            params = {"batch": json.dumps([[lease.name, lease.owner, lease.token, lease.ttl] for lease in leases])}
        sent_at = time.monotonic()
        rows = self._driver.run(self._sql.extend_many, params, deadline=deadline, waiting=True).rows
        expiries = {(name, token): expires_at for name, token, expires_at in rows}
        missing = []
        for lease in leases:
            expires_at = expiries.get((lease.name, lease.token))
            if expires_at is None:
                missing.append(lease)
            else:
                lease._extended(_when(expires_at), lease.ttl, sent_at)
        return missing

    def _exit(self, lease: Lease, failing: bool) -> None:
        released_before = lease._released
        try:
            ended = lease.release()
        except Exception:
            if not failing:
                raise
            release_log.exception("could not release %r after an error in the with-block", lease.name)
            return
        if not ended and not released_before and not failing:
            raise LeaseLost(
                f"lease on {lease.name!r} (token {lease.token}) was lost before the with-block ended: "
                "another owner may have acquired it"
            )

    # -- operators ---------------------------------------------------------
    def leases(self) -> list[LeaseInfo]:
        """The unexpired leases now, ``remaining`` computed by the database clock."""
        self._ensure_schema()
        rows = self._driver.run(self._sql.leases, {}, deadline=self._deadline()).rows
        return [LeaseInfo(n, o, t, _when(a), _when(e), float(r), label) for n, o, t, a, e, r, label in rows]

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
        ended = self._end({"name": lease.name, "owner": lease.owner, "token": lease.token}, self._deadline())
        if ended:
            release_log.info("ended the lease on %r (token %s, held by %s) by force", lease.name, lease.token, lease.label)
        return ended

    def prune(self, older_than: float) -> int:
        """Delete rows of names nobody held for ``older_than`` seconds; returns how many.

        Tokens keep growing for a name that is used again after a prune (G2).
        """
        age = check_ttl(older_than)
        self._ensure_schema()
        rows = self._driver.run(
            self._sql.prune, {"age": age}, before=self._sql.prune_lock, deadline=self._deadline()
        ).rows
        return len(rows)

    def close(self) -> None:
        """Close dblock's own connections (leases stay granted until released or expired)."""
        if self._listener is not None:
            self._listener.close()
        self._driver.close()

    def __enter__(self) -> Locker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Locker {self._driver.where} table={self.table!r}>"


class _LockContext:
    __slots__ = ("_locker", "_name", "_ttl", "_timeout", "_renew", "_on_lost", "_lease")

    def __init__(
        self,
        locker: Locker,
        name: str,
        ttl: float | None,
        timeout: float | None,
        renew: bool,
        on_lost: OnLost | None,
    ) -> None:
        self._locker, self._name, self._ttl, self._timeout = locker, name, ttl, timeout
        self._renew, self._on_lost = renew, on_lost
        self._lease: Lease | None = None

    def __enter__(self) -> Lease:
        self._lease = self._locker.acquire(
            self._name, ttl=self._ttl, timeout=self._timeout, renew=self._renew, on_lost=self._on_lost
        )
        return self._lease

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            self._locker._exit(lease, exc is not None)


def _seconds(value: float) -> float | None:
    """A timeout for Event.wait: None for ever, never negative."""
    return None if value == math.inf else max(value, 0.0)


def _key(lease: Lease) -> dict[str, Any]:
    return {"name": lease.name, "owner": lease.owner, "token": lease.token}


def _check_renew(renew: object, on_lost: object) -> None:
    if not isinstance(renew, bool):
        raise TypeError(f"renew must be True or False, not {type(renew).__name__}")
    if on_lost is not None:
        if not callable(on_lost):
            raise TypeError(f"on_lost must be a callable taking the lease, or None; not {type(on_lost).__name__}")
        if not renew:
            raise ValueError("on_lost is called by renewal: pass renew=True with it")


def describe_process(command: Sequence[str]) -> str:
    """A lease label: ``"host:pid command line"``, passwords masked, cut to fit the column."""
    words = [str(w).replace("\x00", "") for w in command if w is not None]
    if words:
        words[0] = Path(words[0]).name or words[0]
    # A command line may carry a database URL or password: user:***@, ?password=***, PGPASSWORD=***.
    line = redact_command(words) if words else "python"
    label = f"{socket.gethostname()}:{os.getpid()} {line}"
    # One readable line: no newlines or other control characters, valid UTF-8.
    label = "".join(c if c.isprintable() else " " for c in label).encode("utf-8", "replace").decode("utf-8")
    return label if len(label) <= LABEL_LENGTH else label[: LABEL_LENGTH - 3] + "..."


def _when(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value
    return datetime.fromtimestamp(float(value), timezone.utc)  # SQLite keeps Unix seconds


def _engine(url: str | URL | Engine | None) -> tuple[Engine, bool]:
    """An engine for ``url``, and whether dblock owns the schema (the embedded default)."""
    if url is None:
        path = prepare_default_sqlite_path()
        return _sqlite_engine(URL.create("sqlite", database=str(path))), True
    if isinstance(url, Engine):
        if url.dialect.name == "sqlite":
            _check_sqlite(url.url)
            return _sqlite_engine(url.url), False
        _check_driver(url.url)
        return url, False
    if not isinstance(url, (str, URL)):
        raise TypeError(f"url must be a str, a sqlalchemy URL or Engine, or None; not {type(url).__name__}")
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: e.g. libpq's host list "a:5432,b:5432"
        raise ValueError(
            "not a database URL; expected e.g. postgresql+psycopg://user@host/db or sqlite:///path/to/locks.db"
            " (several hosts: postgresql+psycopg://user@/db?host=a:5432&host=b:5432&target_session_attrs=read-write)"
        ) from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")  # psycopg 3 is dblock's driver
    if parsed.get_backend_name() == "sqlite":
        _check_sqlite(parsed)
        return _sqlite_engine(parsed), False
    _check_driver(parsed)
    try:
        return create_engine(parsed, poolclass=NullPool), False
    except (NoSuchModuleError, ArgumentError) as exc:
        raise ValueError(f"cannot use {parsed.render_as_string(hide_password=True)}: {exc}") from None


def _check_driver(url: URL) -> None:
    if url.get_backend_name() != "postgresql" or url.get_driver_name() not in ("psycopg", ""):
        raise ValueError(
            f"dblock supports postgresql+psycopg:// and sqlite:/// URLs, not {url.drivername}://"
        )


def _check_sqlite(url: URL) -> None:
    if url.get_driver_name() not in ("pysqlite", ""):
        raise ValueError(f"dblock supports SQLite through the standard sqlite3 module, not {url.drivername}")
    if url.database in (None, "", ":memory:"):
        raise ValueError("an in-memory SQLite database cannot be shared between connections; give a file path")
    if sqlite3.sqlite_version_info < (3, 35):
        raise ValueError(f"dblock needs SQLite 3.35 or newer (RETURNING); this Python has {sqlite3.sqlite_version}")


def _sqlite_engine(url: URL) -> Engine:
    # dblock's pool hands a connection to one thread at a time, but not always
    # the same thread.
    return create_engine(url, poolclass=NullPool, connect_args={"check_same_thread": False})
