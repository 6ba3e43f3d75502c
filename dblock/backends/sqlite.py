"""SQLite, the embedded default: the standard sqlite3 module (aiosqlite for asyncio), one writer at a time.

Everything dblock knows about SQLite lives here: every lock statement with
its contract comment, the row decoders, how a connection is opened (dblock's
own, in autocommit, out of the engine's pool) and how a driver error becomes
dblock's own. SQLite has no fair queue and no NOTIFY: waiters poll with
backoff, and threads of one process take turns (``_wait.Hotspot``).
"""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
import time
from typing import Any, Sequence

from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy import create_engine
from sqlalchemy.engine import URL, Dialect, Engine
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from .. import _core as core
from .._core import Grant, Miss, Rows
from .._faults import Busy, first_line, no_table, outdated
from ..errors import DatabaseUnavailable, DBLockError, Misconfigured
from ..schema import default_sqlite_path, holders_table_name
from .base import SHARED as _SHARED
from .base import WRITER_WAIT_MS, Backend, Capabilities, Statements, json_batch, leases_statement, owned_token, shared_grant

SQLITE_BUSY_TIMEOUT_MS = WRITER_WAIT_MS  # a new connection's, until a call sets its own


class SQLite(Backend):
    name = "sqlite"
    title = "SQLite"
    caps = Capabilities(
        fair_queue=False, notify=False, schemas=False, cut_statements=False, batch_binds="json",
        server_prepare=False, token_sequence=False, advisory_lock=False, replication=False, triggers=True,
    )
    errors = (sqlite3.Error,)

    def __init__(self, engine: Engine, table: str, schema: str | None, where: str, *, prepare: bool = True) -> None:
        super().__init__(engine, table, schema, where, prepare=prepare)
        cargs, cparams = engine.dialect.create_connect_args(engine.url)
        self._aio_args = (list(cargs), {**dict(cparams), "isolation_level": None})

    # -- statements ------------------------------------------------------------
    @classmethod
    def statements(cls, dialect: Dialect, table: str, schema: str | None) -> Statements:
        quote = dialect.identifier_preparer.quote
        t = quote(table)
        return Statements(**_sqlite(t), **_sqlite_shared(t, quote(holders_table_name(table))), prune_lock=None)

    # -- rows into outcomes ----------------------------------------------------
    @staticmethod
    def acquired(rows: Rows, holder: Rows) -> Grant | Miss:
        if not rows:
            return Miss(holder[0][0] if holder else None)
        token, expires_at = rows[0]
        return Grant(token, core.when(expires_at))

    share_acquired = staticmethod(shared_grant)
    owned = staticmethod(owned_token)
    batch = staticmethod(json_batch)

    # -- connections -----------------------------------------------------------
    def connect(self, deadline: float) -> Any:
        try:
            fairy = self.engine.raw_connection()
        except (SQLAlchemyError, sqlite3.Error) as exc:
            raise cannot_open(self.where, exc) from exc
        # Our own connection from now on: not returned to (or reset by) the engine's pool.
        raw: Any = fairy.driver_connection
        fairy.detach()
        raw.isolation_level = None  # autocommit: each statement is its own transaction
        raw.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        return raw

    def execute(self, cursor: Any, sql: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description is not None else []

    async def aconnect(self, deadline: float) -> Any:
        import aiosqlite  # noqa: PLC0415 - only the asyncio API on SQLite needs it

        cargs, cparams = self._aio_args
        pending = aiosqlite.connect(*cargs, **cparams)
        try:
            raw = await pending
        except sqlite3.Error as exc:
            # aiosqlite stops its worker thread then, which reports to this event loop as it ends:
            # let it end while the loop runs (else, the loop closed, it fails with a traceback).
            worker = getattr(pending, "_thread", None)
            if worker is not None and worker.is_alive():
                await asyncio.to_thread(worker.join, max(0.0, deadline - time.monotonic()))
            raise cannot_open(self.where, exc) from exc
        await raw.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        return raw

    async def acursor(self, raw: Any) -> Any:
        return await raw.cursor()

    async def aexecute(self, cursor: Any, sql: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        await cursor.execute(sql, params)
        return list(await cursor.fetchall()) if cursor.description is not None else []

    def set_writer_wait(self, raw: Any, ms: int) -> None:
        raw.execute(f"PRAGMA busy_timeout = {ms}")

    async def aset_writer_wait(self, raw: Any, ms: int) -> None:
        await raw.execute(f"PRAGMA busy_timeout = {ms}")

    def translate(self, exc: BaseException) -> DBLockError:
        return translate(exc, self.where, self.table, self.schema)

    def table_check(self) -> tuple[str, dict[str, Any]]:
        return "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = :t", {"t": self.table}

    # -- fencing -------------------------------------------------------------
    @classmethod
    def lease_check(cls, t: str) -> str:
        # The same contract as PostgreSQL's: a no-op UPDATE takes the database's
        # write lock, so no acquire can write (take over) before this transaction ends.
        return (
            f"UPDATE {t} SET owner = owner WHERE name = :name AND owner = :owner AND token = :token"
            f" AND expires_at > {SQLITE_NOW} RETURNING token"
        )

    @classmethod
    def shared_check(cls, t: str, h: str) -> str:
        return (
            f"UPDATE {h} SET owner = owner WHERE name = :name AND owner = :owner AND token = :token"
            f" AND expires_at > {SQLITE_NOW}"
            f" AND EXISTS (SELECT 1 FROM {t} AS l WHERE l.name = :name AND l.owner = {_SHARED}) RETURNING token"
        )

    @staticmethod
    def missing_table(orig: BaseException | None) -> bool:
        return isinstance(orig, sqlite3.OperationalError) and "no such table" in str(orig)

    @classmethod
    def insert(cls) -> Any:
        return sqlite_insert

    # -- engines -----------------------------------------------------------------------
    @classmethod
    def engine_for_url(cls, url: URL) -> Engine:
        return _sqlite_engine(_pysqlite(url))

    @classmethod
    def adopt(cls, engine: Engine) -> tuple[Engine, bool]:
        # dblock's own engine on the same file: its pool must hand connections across threads.
        return _sqlite_engine(_pysqlite(engine.url)), True

    @classmethod
    def prepare_database(cls, engine: Engine) -> None:
        use_wal(engine)

    @classmethod
    def schema_error(
        cls, exc: BaseException, orig: BaseException, reason: str, where: str, table: str, path: str
    ) -> DBLockError:
        code = getattr(orig, "sqlite_errorname", "")  # Python 3.11+; the message otherwise
        embedded = path == str(default_sqlite_path())
        elsewhere = (
            "set DBLOCK_HOME to another directory" if embedded and os.environ.get("DBLOCK_HOME") else "use another file"
        )
        if code == "SQLITE_NOTADB" or "file is not a database" in reason:
            return DBLockError(f"{path} is not a SQLite database ({reason}): move it aside, or {elsewhere}")
        if code == "SQLITE_CORRUPT" or "malformed" in reason:
            return DBLockError(f"{path} is damaged ({reason}): restore it, or move it aside and {elsewhere}")
        if code == "SQLITE_CANTOPEN" or "unable to open" in reason:
            return cannot_open(path, orig)
        if code == "SQLITE_BUSY" or "locked" in reason:
            return DatabaseUnavailable(f"{path} stayed locked by another writer: {reason}")
        return DBLockError(f"cannot create or upgrade dblock's table in {path}: {reason}")


def cannot_open(where: str, exc: BaseException) -> DBLockError:
    """A file SQLite cannot open (a directory, in a directory that does not exist or that this
    user may not write): the same on every try, so not waited out as an outage."""
    reason = first_line(exc)
    if "unable to open" in reason or getattr(exc, "sqlite_errorname", "") == "SQLITE_CANTOPEN":
        return Misconfigured(
            f"cannot open {where}: {reason} (is the path a directory, or in a directory that does not exist"
            " or that this user cannot write?): not retried"
        )
    return DatabaseUnavailable(f"cannot open {where}: {reason}")


def translate(exc: BaseException, where: str, table: str, schema: str | None = None) -> DBLockError:
    """A sqlite3 error of a lock statement as dblock's own."""
    text = str(exc)
    if isinstance(exc, sqlite3.OperationalError) and "no such table" in text:
        return no_table(where, table, schema)
    if isinstance(exc, sqlite3.OperationalError) and ("no such column" in text or "has no column named" in text):
        return outdated(where, table, schema, first_line(exc))  # or no table at all: the driver asks
    if isinstance(exc, sqlite3.OperationalError) and "locked" in text:
        return Busy(f"{where} stayed locked by another writer for the whole time allowed")
    if isinstance(exc, sqlite3.DatabaseError) and "not a database" in text:
        # Permanent, not an outage: a wait must not retry it until its deadline.
        return DBLockError(f"{where} is not a SQLite database: {first_line(exc)}")
    return DBLockError(f"{where}: {first_line(exc)}")


def _pysqlite(url: URL) -> URL:
    """A SQLite URL checked, as the standard sqlite3 module's (an aiosqlite URL is the same file)."""
    if url.get_driver_name() == "aiosqlite":
        url = url.set(drivername="sqlite")
    _check_sqlite(url)
    return url


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


def use_wal(engine: Engine) -> None:
    """Switch a SQLite database to WAL, which lets readers and the one writer work at the same time.

    Switching needs an exclusive lock; when another process is migrating the
    new file, SQLite reports a deadlock at once instead of waiting, so retry.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA journal_mode=WAL")
            return
        except OperationalError as exc:
            if "locked" not in str(exc.orig) or time.monotonic() > deadline:
                raise
            time.sleep(0.005 + random.random() * 0.02)


# -- the statements ---------------------------------------------------------------------
# SQLite's clock as Unix seconds; 'now' is fixed for the whole statement.
SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
# SQLite's 'now' is truncated to whole milliseconds (and the julianday
# arithmetic adds ~25 us of rounding), so it can read up to ~1 ms behind the
# real time. Expiries are pushed 2 ms later so that the database's expiry is
# never earlier than (client's send time + ttl), which the client trusts (G5).
_EXPIRES = f"({SQLITE_NOW} + :ttl + 0.002)"
# A renewal batch's leases (bind: batch, a JSON array of [name, owner, token, ttl] arrays),
# joined to the rows they extend.
_BATCH = """FROM (
    SELECT json_extract(value, '$[0]') AS b_name, json_extract(value, '$[1]') AS b_owner,
           json_extract(value, '$[2]') AS b_token, json_extract(value, '$[3]') AS ttl
    FROM json_each(:batch)
) AS b
WHERE name = b.b_name AND owner = b.b_owner AND token = b.b_token"""


def _sqlite(t: str) -> dict[str, str]:
    # acquire
    # binds: name, owner, ttl, label
    # returns one row (token, expires_at) when granted; zero rows when held
    #   (then `holder` tells how long the current lease has left).
    # SQLite runs one writer at a time and this statement takes the write lock
    # before it reads, so max(token) + 1 is larger than every token granted
    # before it. prune never deletes the row that holds the maximum, so the
    # maximum never goes down (G2).
    acquire = f"""
INSERT INTO {t} (name, owner, token, acquired_at, expires_at, label)
VALUES (:name, :owner, (SELECT coalesce(max(token), 0) + 1 FROM {t}), {SQLITE_NOW}, {_EXPIRES}, :label)
ON CONFLICT (name) DO UPDATE SET
    token = CASE WHEN owner = excluded.owner THEN token ELSE (SELECT max(token) + 1 FROM {t}) END,
    acquired_at = CASE WHEN owner = excluded.owner THEN acquired_at ELSE excluded.acquired_at END,
    owner = excluded.owner,
    -- Ours already (a retry): never shorten it, see extend.
    expires_at = CASE WHEN owner = excluded.owner THEN max(expires_at, excluded.expires_at) ELSE excluded.expires_at END,
    label = excluded.label
WHERE owner IS NULL OR expires_at <= excluded.acquired_at OR owner = excluded.owner
RETURNING token, expires_at"""
    # holder
    # binds: name
    # returns one row (wait): seconds until the current lease ends; NULL if free.
    # zero rows: the name has no row.
    holder = f"SELECT expires_at - {SQLITE_NOW} FROM {t} WHERE name = :name"
    # release, released, extend, prune: the same contracts as PostgreSQL's (backends/postgresql.py).
    release = f"""
UPDATE {t} SET owner = NULL, expires_at = NULL
WHERE name = :name AND owner = :owner AND token = :token
RETURNING token"""
    # release_held: release_held's contract above; SQLite has no queue to hand over to.
    hold = f"acquired_at + :hold > {SQLITE_NOW}"
    release_held = f"""
UPDATE {t} SET
    owner = CASE WHEN {hold} THEN owner END,
    expires_at = CASE WHEN {hold} THEN acquired_at + :hold END
WHERE name = :name AND owner = :owner AND token = :token
RETURNING token, 0, expires_at"""
    released = f"SELECT token FROM {t} WHERE name = :name AND token = :token AND owner IS NULL"
    # extend, extend_many: never shorten a lease, as PostgreSQL's (greatest()) do. A
    # matching row has an expiry: release clears owner and expiry together.
    extend = f"""
UPDATE {t} SET expires_at = max(expires_at, {_EXPIRES})
WHERE name = :name AND owner = :owner AND token = :token
RETURNING expires_at"""
    # binds: batch, a JSON array of [name, owner, token, ttl] arrays.
    extend_many = f"""
UPDATE {t} SET expires_at = max(expires_at, {SQLITE_NOW} + b.ttl + 0.002)
{_BATCH}
RETURNING name, token, expires_at"""
    prune = f"""
DELETE FROM {t}
WHERE acquired_at < {SQLITE_NOW} - :age
  AND (owner IS NULL OR expires_at < {SQLITE_NOW} - :age)
  AND token < (SELECT max(token) FROM {t})
RETURNING name"""
    # owned (after an acquire whose reply was lost)
    # binds: name, owner
    # returns one row (token) when owner holds the name; zero rows: it does not.
    owned = f"SELECT token FROM {t} WHERE name = :name AND owner = :owner"
    # relabel (base.Statements): binds name, owner, token, label (channel unused: no NOTIFY here)
    relabel = f"""
UPDATE {t} SET label = :label
WHERE name = :name AND owner = :owner AND token = :token
RETURNING acquired_at"""
    return dict(
        acquire=acquire, holder=holder, release=release, release_held=release_held, released=released, extend=extend,
        extend_many=extend_many, prune=prune, owned=owned, relabel=relabel,
    )


def _sqlite_shared(t: str, h: str) -> dict[str, str]:
    # share_acquire
    # binds: name, owner, ttl, label, limit, upgradeable (1: the upgradeable reader)
    # returns one row (token, expires_at, free) when granted; zero rows when not
    #   (then share_holder tells how long to wait). The same grant rule as
    #   PostgreSQL's, less the fair queue (SQLite's writers poll): no live
    #   writer, and fewer live holders than the caller's limit and every live
    #   holder's; and no live upgradeable reader asks to upgrade (nor, for an upgradeable
    #   reader, is another live). The token is max(token) + 1 over the lock table, inside
    #   SQLite's single-writer transaction; the grant trigger (migration 0007)
    #   writes it into the name's row, so the next grant, of any kind, draws above it (G2).
    #   Not a retry-safe upsert: a second attempt with the same owner is a miss.
    live = f"(SELECT count(*) FROM {h} WHERE name = :name AND expires_at > {SQLITE_NOW})"
    share_acquire = f"""
INSERT INTO {h} (name, owner, token, acquired_at, expires_at, label, lim, upgradeable)
SELECT :name, :owner, (SELECT coalesce(max(token), 0) + 1 FROM {t}), {SQLITE_NOW}, {_EXPIRES}, :label, :limit,
    :upgradeable
WHERE NOT EXISTS (
    SELECT 1 FROM {t} WHERE name = :name AND owner IS NOT NULL AND owner <> {_SHARED} AND expires_at > {SQLITE_NOW})
  AND (:limit IS NULL OR {live} < :limit)
  AND NOT EXISTS (SELECT 1 FROM {h} WHERE name = :name AND expires_at > {SQLITE_NOW} AND lim <= {live})
  AND NOT EXISTS (
    SELECT 1 FROM {h} WHERE name = :name AND expires_at > {SQLITE_NOW} AND upgradeable >= 2 - :upgradeable)
ON CONFLICT (name, owner) DO NOTHING
RETURNING token, expires_at,
    (SELECT min(lim) - count(*) FROM {h} WHERE name = :name AND expires_at > {SQLITE_NOW})"""
    # share_holder
    # binds: name. One row (wait): seconds until a live writer's lease ends, or
    #   else until the first live holder's ends; NULL when nothing holds the name.
    share_holder = f"""
SELECT coalesce(
    (SELECT expires_at FROM {t} WHERE name = :name AND owner <> {_SHARED} AND expires_at > {SQLITE_NOW}),
    (SELECT min(expires_at) FROM {h} WHERE name = :name AND expires_at > {SQLITE_NOW})) - {SQLITE_NOW}"""
    # share_release, share_released, share_extend, share_extend_many: PostgreSQL's contracts
    # above (share_released: one row when the lease is gone); a release hands nothing over.
    share_release = f"""
DELETE FROM {h} WHERE name = :name AND owner = :owner AND token = :token
  AND EXISTS (SELECT 1 FROM {t} WHERE name = :name AND owner = {_SHARED})
RETURNING token"""
    share_released = f"""
SELECT :token WHERE NOT EXISTS (SELECT 1 FROM {h} WHERE name = :name AND owner = :owner AND token = :token)"""
    share_extend = f"""
UPDATE {h} SET expires_at = max(expires_at, {_EXPIRES})
WHERE name = :name AND owner = :owner AND token = :token
  AND EXISTS (SELECT 1 FROM {t} WHERE name = :name AND owner = {_SHARED})
RETURNING expires_at"""
    share_extend_many = f"""
UPDATE {h} SET expires_at = max(expires_at, {SQLITE_NOW} + b.ttl + 0.002)
{_BATCH}
  AND EXISTS (SELECT 1 FROM {t} AS l WHERE l.name = b.b_name AND l.owner = {_SHARED})
RETURNING name, token, expires_at"""
    # upgrade, downgrade: PostgreSQL's contracts (backends/postgresql.py), but for the retry
    #   of an upgrade after a lost reply: SQLite's statements are never cut off, so never
    #   retried (an upgrade that already happened answers zero rows).
    # upgrade: one UPDATE of the upgradeable reader's row. Alone among the live holders, the
    #   row takes the write lease's expiry and is marked 3, and the upgrade trigger (migration
    #   0010) makes the name's row the write lease, with the next token (max + 1, which the
    #   RETURNING clause reads before that trigger runs), and drops the name's holders; else
    #   the row is marked 2 (an ask to upgrade: share_acquire grants nobody beside it).
    others = f"EXISTS (SELECT 1 FROM {h} AS o WHERE o.name = :name AND o.owner <> :owner AND o.expires_at > {SQLITE_NOW})"
    upgrade = f"""
UPDATE {h} SET
    upgradeable = CASE WHEN {others} THEN 2 ELSE 3 END,
    expires_at = CASE WHEN {others} THEN expires_at ELSE {_EXPIRES} END
WHERE name = :name AND owner = :owner AND token = :token AND upgradeable > 0 AND expires_at > {SQLITE_NOW}
  AND EXISTS (SELECT 1 FROM {t} WHERE name = :name AND owner = {_SHARED})
RETURNING upgradeable = 3, (SELECT max(token) + 1 FROM {t}), expires_at,
    (SELECT min(o.expires_at) FROM {h} AS o WHERE o.name = :name AND o.owner <> :owner AND o.expires_at > {SQLITE_NOW})
    - {SQLITE_NOW}"""
    # downgrade: one upsert of the holder's row. From owner's write lease, a
    #   new row (token max + 1, the grant trigger marks the name's row shared); from the
    #   upgradeable reader's live row, the same row back to 1 (its ask withdrawn).
    downgrade = f"""
INSERT INTO {h} (name, owner, token, acquired_at, expires_at, label, lim, upgradeable)
SELECT :name, :owner, (SELECT max(token) + 1 FROM {t}), {SQLITE_NOW}, {_EXPIRES}, l.label, NULL, 1
FROM {t} AS l
WHERE l.name = :name AND (l.owner = :owner OR l.owner = {_SHARED} AND EXISTS (
    SELECT 1 FROM {h} AS x WHERE x.name = :name AND x.owner = :owner AND x.upgradeable > 0
      AND x.expires_at > {SQLITE_NOW}))
ON CONFLICT (name, owner) DO UPDATE SET upgradeable = 1
RETURNING token, expires_at"""
    return dict(
        upgrade=upgrade, downgrade=downgrade,
        share_acquire=share_acquire, share_release=share_release, share_released=share_released,
        share_extend=share_extend, share_extend_many=share_extend_many,
        leases=leases_statement(t, h, SQLITE_NOW, "{0}.expires_at - " + SQLITE_NOW, "0", "1"),
        leases_of=leases_statement(t, h, SQLITE_NOW, "{0}.expires_at - " + SQLITE_NOW, "0", "1", ":name"),
        share_holder=share_holder, share_owned=f"SELECT token FROM {h} WHERE name = :name AND owner = :owner",
        share_prune=f"DELETE FROM {h} WHERE expires_at < {SQLITE_NOW} - :age RETURNING name",
    )
