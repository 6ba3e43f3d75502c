"""Locker: the app-wide factory of leases on one database."""

from __future__ import annotations

import logging
import math
import random
import secrets
import sqlite3
import threading
import time
from datetime import datetime, timezone
from types import TracebackType
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.pool import NullPool

from . import migrate, statements
from ._driver import Busy, Driver
from ._validate import check_identifier, check_interval, check_name, check_timeout, check_ttl
from .errors import LeaseLost, LockNotAcquired
from .lease import Lease, LeaseInfo
from .schema import DEFAULT_TABLE, default_sqlite_path

log = logging.getLogger("dblock.acquire")
release_log = logging.getLogger("dblock.release")

DEFAULT_TTL = 30.0


class Locker:
    """Hands out leases on named locks stored in one database.

    ``url`` is a SQLAlchemy URL (``postgresql+psycopg://...``, ``sqlite:///file``),
    an existing ``Engine``, or None for the embedded default: a per-user SQLite
    file (see ``dblock.schema.default_sqlite_path``) whose table dblock creates
    on first use. Make one Locker per database and share it between threads.
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
    ) -> None:
        self.table = check_identifier(table, "table")
        self.schema = None if schema is None else check_identifier(schema, "schema")
        self.ttl = check_ttl(ttl)
        self.timeout = check_timeout(timeout)
        self.poll_min = check_interval(poll_min, "poll_min")
        self.poll_max = check_interval(poll_max, "poll_max")
        if self.poll_max < self.poll_min:
            raise ValueError(f"poll_max ({poll_max:g}) must not be smaller than poll_min ({poll_min:g})")
        self.engine, self._needs_migration = _engine(url)
        if self.engine.dialect.name == "sqlite" and self.schema is not None:
            raise ValueError("schema is not supported on SQLite; leave it None")
        where = self.engine.url.render_as_string(hide_password=True)
        self._sql = statements.build(self.engine.dialect, self.table, self.schema)
        self._driver = Driver(self.engine, where, self.table)
        self._migrated = threading.Lock()

    # -- schema ------------------------------------------------------------
    def create_schema(self) -> None:
        """Create or upgrade dblock's tables with its migrations (idempotent)."""
        if self.engine.dialect.name == "sqlite":
            # WAL lets readers and the one writer work at the same time.
            with self.engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        migrate.upgrade(self.engine, self.table, self.schema)

    def _ensure_schema(self) -> None:
        if self._needs_migration:
            with self._migrated:
                if self._needs_migration:
                    self.create_schema()
                    self._needs_migration = False

    # -- acquiring ---------------------------------------------------------
    def try_acquire(self, name: str, *, ttl: float | None = None) -> Lease | None:
        """One attempt: a Lease, or None if another owner holds ``name``."""
        check_name(name)
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        lease, _ = self._attempt(name, secrets.token_hex(16), ttl)
        return lease

    def acquire(self, name: str, *, ttl: float | None = None, timeout: float | None = None) -> Lease:
        """Wait up to ``timeout`` seconds (Locker default: for ever) for ``name``.

        Raises LockNotAcquired when the time runs out. Between attempts it sleeps
        a jittered backoff in [d, 2d), d doubling from poll_min to poll_max, and
        never past the moment the current lease is known to end.
        """
        check_name(name)
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        owner = secrets.token_hex(16)
        deadline = time.monotonic() + timeout
        delay = self.poll_min
        while True:
            try:
                lease, wait = self._attempt(name, owner, ttl, budget=deadline - time.monotonic())
            except Busy:  # SQLite: another writer held the file for all the time we had
                lease, wait = None, None
            if lease is not None:
                return lease
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockNotAcquired(name, timeout)
            pause = delay + random.random() * delay
            if wait is not None:
                # The holder's lease ends in `wait` s (database clock): no
                # point polling before then, nor sleeping past it.
                pause = min(pause, max(wait, 0.001))
            delay = min(delay * 2, self.poll_max)
            log.debug("lock %r is held; retrying in %.3f s", name, min(pause, left))
            time.sleep(min(pause, left))

    def lock(self, name: str, *, ttl: float | None = None, timeout: float | None = None) -> _LockContext:
        """``with locker.lock(name) as lease:`` acquires, and releases on exit (also on error)."""
        check_name(name)
        return _LockContext(
            self,
            name,
            None if ttl is None else check_ttl(ttl),
            None if timeout is None else check_timeout(timeout),
        )

    def _attempt(
        self, name: str, owner: str, ttl: float, budget: float | None = None
    ) -> tuple[Lease | None, float | None]:
        self._ensure_schema()
        sent_at = time.monotonic()
        rows, holder, _ = self._driver.run(
            self._sql.acquire,
            {"name": name, "owner": owner, "ttl": ttl},
            self._sql.holder,
            budget=None if budget is None else max(budget, 0.001),
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

    # -- the holder's verbs (called through Lease) ---------------------------
    def _release(self, lease: Lease) -> bool:
        self._ensure_schema()
        rows, _, retried = self._driver.run(self._sql.release, _key(lease))
        if not rows and retried:
            # The first try may have ended the lease before its reply was lost.
            # Ours ended without a takeover if the row still has our token, free.
            rows, _, _ = self._driver.run(self._sql.released, _key(lease))
        lease._released = True
        return bool(rows)

    def _extend(self, lease: Lease, ttl: float | None) -> None:
        ttl = lease.ttl if ttl is None else check_ttl(ttl)
        self._ensure_schema()
        sent_at = time.monotonic()
        rows, _, _ = self._driver.run(self._sql.extend, {**_key(lease), "ttl": ttl})
        if not rows:
            raise LeaseLost(f"lease on {lease.name!r} (token {lease.token}) was released or taken over; not extended")
        lease._extended(_when(rows[0][0]), ttl, sent_at)

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
        rows, _, _ = self._driver.run(self._sql.leases, {})
        return [LeaseInfo(n, o, t, _when(a), _when(e), float(r)) for n, o, t, a, e, r in rows]

    def prune(self, older_than: float) -> int:
        """Delete rows of names nobody held for ``older_than`` seconds; returns how many.

        Tokens keep growing for a name that is used again after a prune (G2).
        """
        age = check_ttl(older_than)
        self._ensure_schema()
        rows, _, _ = self._driver.run(self._sql.prune, {"age": age}, before=self._sql.prune_lock)
        return len(rows)

    def close(self) -> None:
        """Close dblock's own connections (leases stay granted until released or expired)."""
        self._driver.close()

    def __enter__(self) -> Locker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Locker {self._driver.where} table={self.table!r}>"


class _LockContext:
    __slots__ = ("_locker", "_name", "_ttl", "_timeout", "_lease")

    def __init__(self, locker: Locker, name: str, ttl: float | None, timeout: float | None) -> None:
        self._locker, self._name, self._ttl, self._timeout = locker, name, ttl, timeout
        self._lease: Lease | None = None

    def __enter__(self) -> Lease:
        self._lease = self._locker.acquire(self._name, ttl=self._ttl, timeout=self._timeout)
        return self._lease

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            self._locker._exit(lease, exc is not None)


def _key(lease: Lease) -> dict[str, Any]:
    return {"name": lease.name, "owner": lease.owner, "token": lease.token}


def _when(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value
    return datetime.fromtimestamp(float(value), timezone.utc)  # SQLite keeps Unix seconds


def _engine(url: str | URL | Engine | None) -> tuple[Engine, bool]:
    """An engine for ``url``, and whether dblock owns the schema (the embedded default)."""
    if url is None:
        path = default_sqlite_path()
        path.parent.mkdir(parents=True, exist_ok=True)
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
    except ArgumentError:
        raise ValueError(
            "not a database URL; expected e.g. postgresql+psycopg://user@host/db or sqlite:///path/to/locks.db"
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
