"""PostgreSQL, the reference backend: psycopg 3, a fair queue in PL/pgSQL, LISTEN/NOTIFY.

Everything dblock knows about PostgreSQL lives here: every lock statement with
its contract comment, the row decoders, how a connection is opened (each host
of a multi-host URL with its share of the deadline, keepalives set) and how a
driver error becomes dblock's own. The functions the statements call (the fair
queue's hand-off, the shared leases' verbs) are made by the migrations; their
text, as the database runs it, is in ``postgresql.sql`` beside this file.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from typing import Any, Iterator, Sequence

import psycopg
from psycopg import pq
from psycopg.adapt import AdaptersMap, PyFormat, Transformer
from psycopg.errors import error_from_result
from psycopg.pq import ExecStatus
from psycopg.conninfo import conninfo_attempts, make_conninfo
from psycopg.types.numeric import Int8Dumper
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, Dialect, Engine
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError
from sqlalchemy.pool import NullPool

from .. import _core as core
from .._core import Grant, Miss, Queued, Rows
from .._faults import OutOfTime, first_line, no_table, outdated
from .._redact import display_url
from ..errors import DatabaseUnavailable, DBLockError, Misconfigured, PermissionDenied
from ..schema import (
    LISTENER_LOCK,
    holders_table_name,
    lean_function_names,
    procs_table_name,
    queue_function_names,
    shared_function_names,
    shared_queue_function_names,
    token_sequence_name,
    upgrade_function_names,
    waiters_table_name,
)
from .base import SHARED as _SHARED
from .base import Backend, Capabilities, QueueStatements, Statements, leases_statement

MIN_CONNECT_TIMEOUT = 2  # libpq counts connect_timeout in whole seconds, and at least 2
# SQLSTATE classes of a server that is going away, starting up or out of room:
# connection exception, operator intervention (shutdown, crash recovery), insufficient resources.
_OUTAGE_CLASSES = ("08", "57", "53")
# The fair queue's NOTIFY: a hand-off to owner "<listener id><wait id>" goes to channel
# CHANNEL_PREFIX + listener id with the payload "owner token expiry" (migration 0005's hand-off).
CHANNEL_PREFIX = "dblock_"
TUPLES_OK = ExecStatus.TUPLES_OK
APPLICATION_NAME = "dblock listener"  # the listener's session, as pg_stat_activity shows it
# Errors of making the schema that mean the server is out of reach, not that the DDL is wrong.
_UNAVAILABLE_SQLSTATES = {
    "53300",  # too_many_connections
    "57014",  # query_canceled: a statement outlived its time limit
    "57P01",  # admin_shutdown
    "57P02",  # crash_shutdown
    "57P03",  # cannot_connect_now
}


class PostgreSQL(Backend):
    name = "postgresql"
    title = "PostgreSQL"
    caps = Capabilities(
        fair_queue=True, notify=True, schemas=True, cut_statements=True, batch_binds="arrays",
        server_prepare=True, token_sequence=True, advisory_lock=True, replication=True,
    )
    errors = (psycopg.Error,)

    def __init__(self, engine: Engine, table: str, schema: str | None, where: str, *, prepare: bool = True) -> None:
        super().__init__(engine, table, schema, where, prepare=prepare)
        self._params = connect_params(engine)
        self._plans: dict[str, _Plan] = {}  # each statement sent, as libpq takes it

    # -- statements ------------------------------------------------------------
    @classmethod
    def statements(cls, dialect: Dialect, table: str, schema: str | None) -> Statements:
        names = _Names(dialect, table, schema)
        exclusive = _postgresql(
            names.table, names.seq, names.procs, names.enqueue, names.cancel, names.queue, *names.lean
        )
        shared = _postgresql_shared(names.table, names.holders, *names.shared, *names.upgrade)
        return Statements(
            acquire=exclusive["acquire"], holder=None, release=exclusive["release"],
            release_held=exclusive["release_held"], released=exclusive["released"], extend=exclusive["extend"],
            extend_many=exclusive["extend_many"], prune=exclusive["prune"], prune_lock=exclusive["prune_lock"],
            # After a lost reply the owner leaves the queue too: cancel, exclusive and shared alike.
            owned=exclusive["cancel"], share_owned=exclusive["cancel"], share_holder=None, **shared,
            relabel=exclusive["relabel"],
        )

    @classmethod
    def queue_statements(cls, dialect: Dialect, table: str, schema: str | None) -> QueueStatements:
        names = _Names(dialect, table, schema)
        exclusive = _postgresql(
            names.table, names.seq, names.procs, names.enqueue, names.cancel, names.queue, *names.lean
        )
        return QueueStatements(
            enqueue=exclusive["enqueue"], share_enqueue=_share_enqueue(names.share_enqueue),
            cancel=exclusive["cancel"], beat=exclusive["beat"], quit=exclusive["quit"],
            waiters=exclusive["waiters"],
        )

    # -- rows into outcomes ----------------------------------------------------
    @staticmethod
    def acquired(rows: Rows, holder: Rows) -> Grant | Miss:
        if not rows:
            return Miss(None)  # a concurrent first acquire created the row just now
        granted, token, expires_at, wait = rows[0]
        if not granted:
            return Miss(wait)
        return Grant(token, expires_at)  # psycopg reads a timestamptz as an aware datetime: nothing to convert

    @staticmethod
    def share_acquired(rows: Rows, holder: Rows) -> tuple[Grant | Miss, int | None]:
        granted, token, expires_at, wait, free = rows[0]
        if not granted:
            return Miss(wait), None
        return Grant(token, core.when(expires_at)), free

    @staticmethod
    def owned(rows: Rows) -> int | None:
        # owned is cancel here: it took the owner out of the queue, and reports the
        # lease a release handed it (or the one it already held) as granted.
        grant = PostgreSQL.cancelled(rows)
        return None if grant is None else grant.token

    @staticmethod
    def enqueued(rows: Rows) -> Grant | Queued | None:
        if not rows:
            return None
        granted, token, expires_at, wait, seq, ahead, at = rows[0]
        if granted:
            return Grant(token, core.when(expires_at))
        return Queued(wait, seq, ahead, float(at))

    @staticmethod
    def cancelled(rows: Rows) -> Grant | None:
        if rows and rows[0][0]:
            return Grant(rows[0][1], core.when(rows[0][2]))
        return None

    @staticmethod
    def batch(leases: Sequence[tuple[str, str, int, float]]) -> dict[str, Any]:
        return {
            "names": [lease[0] for lease in leases],
            "owners": [lease[1] for lease in leases],
            "tokens": [lease[2] for lease in leases],
            "ttls": [lease[3] for lease in leases],
        }

    # -- connections -----------------------------------------------------------
    def connect(self, deadline: float) -> Any:
        failed: list[psycopg.Error] = []
        attempts = host_attempts(self._params)
        for kwargs in connect_plan(attempts, deadline, self.where):
            try:
                raw = psycopg.Connection.connect(
                    autocommit=True, prepare_threshold=5 if self.prepare else None, **kwargs
                )
            except psycopg.Error as exc:
                failed.append(exc)
            else:
                self.reached = True
                return raw
        raise connect_failed(self.where, failed, len(attempts), self.reached)

    # -- statements: through libpq, as psycopg's cursor would send them ------------------
    # A pooled connection's statements skip psycopg's cursor: what it does per call in
    # Python (about 50 calls: the query's conversion, its cache of prepared statements, its
    # result bookkeeping) is done once per statement text here, and each call is psycopg's
    # own adaptation (its Transformer, the connection's adapters) around one libpq call.
    # Same binds, same types, same rows; one round trip per call, prepared once per
    # connection (unless prepare=False: then each call sends its text unnamed).
    def cursor(self, raw: Any) -> Session:
        return Session(raw)

    async def acursor(self, raw: Any) -> Session:
        return Session(raw)

    def execute(self, session: Session, sql: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        text, values, types, name, new = self._call(session, sql, params)
        pgconn = session.pgconn
        try:
            if name is None:
                return session.rows(pgconn.exec_params(text, values, types, session.tx.formats, BINARY))
            if new:
                session.check(pgconn.prepare(name, text, types), (sql, types))
            return session.rows(pgconn.exec_prepared(name, values, session.tx.formats, BINARY))
        except psycopg.OperationalError as exc:
            session.failed(exc)
            raise

    def _call(
        self, session: Session, sql: str, params: dict[str, Any]
    ) -> tuple[bytes, Sequence[Any], tuple[int, ...], bytes | None, bool]:
        """What one call sends (both faces): the statement's text, its binds as psycopg dumps
        them, their types, the name it is prepared under (None: sent unprepared), and whether
        that name is new on this connection (then it is prepared first, and remembered)."""
        plan = self._plans.get(sql) or self._plan(sql)
        tx = session.tx
        values = tx.dump_sequence([params[key] for key in plan.keys], plan.formats)
        types: tuple[int, ...] = tx.types or ()
        if not self.prepare:
            return plan.text, values, types, None, False
        name = session.prepared.get((sql, types))
        if name is not None:
            return plan.text, values, types, name, False
        name = session.prepared[(sql, types)] = plan.name(types)
        return plan.text, values, types, name, True

    def _plan(self, sql: str) -> _Plan:
        """``sql`` as libpq takes it, made once per statement text."""
        plan = self._plans.get(sql)
        if plan is None:
            plan = self._plans[sql] = _Plan(sql)
        return plan

    async def aconnect(self, deadline: float) -> Any:
        failed: list[psycopg.Error] = []
        attempts = host_attempts(self._params)
        for i, kwargs in enumerate(connect_plan(attempts, deadline, self.where)):
            # libpq counts connect_timeout in whole seconds, at least 2; asyncio can keep
            # each host to its share of the time left exactly.
            share = max(0.001, (deadline - time.monotonic()) / (len(attempts) - i))
            try:
                raw = await asyncio.wait_for(
                    psycopg.AsyncConnection.connect(
                        autocommit=True, prepare_threshold=5 if self.prepare else None, **kwargs
                    ),
                    share,
                )
            except psycopg.Error as exc:
                failed.append(exc)
            except asyncio.TimeoutError:
                failed.append(psycopg.OperationalError(f"no answer within {share:.3g} s (connect)"))
            else:
                self.reached = True
                return raw
        raise connect_failed(self.where, failed, len(attempts), self.reached)

    async def aexecute(self, session: Session, sql: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        text, values, types, name, new = self._call(session, sql, params)
        pgconn = session.pgconn
        try:
            if name is None:
                pgconn.send_query_params(text, values, types, session.tx.formats, BINARY)
            else:
                if new:
                    pgconn.send_prepare(name, text, types)
                    session.check(await _result(pgconn), (sql, types))
                pgconn.send_query_prepared(name, values, session.tx.formats, BINARY)
            return session.rows(await _result(pgconn))
        except psycopg.OperationalError as exc:
            session.failed(exc)
            raise

    # -- engines -----------------------------------------------------------------------
    @classmethod
    def engine_for_url(cls, url: URL) -> Engine:
        if url.drivername in ("postgresql", "postgres"):
            url = url.set(drivername="postgresql+psycopg")  # psycopg 3 is dblock's driver
        if url.get_driver_name() in CONVERTED:
            url = psycopg_url(url)
        _check_driver(url)
        _check_query(url, url.query)
        try:
            return _postgresql_engine(url)
        except (NoSuchModuleError, ArgumentError) as exc:
            raise ValueError(f"cannot use {display_url(url)}: {exc}") from None

    @classmethod
    def adopt(cls, engine: Engine) -> tuple[Engine, bool]:
        if engine.url.get_driver_name() in CONVERTED:
            return _postgresql_engine(psycopg_url(engine.url)), True
        _check_driver(engine.url)
        return engine, False

    # -- notifications -----------------------------------------------------------------
    @staticmethod
    def listen(listener: str) -> list[str]:
        return [f"SET application_name = '{APPLICATION_NAME}'", f"LISTEN {CHANNEL_PREFIX}{listener}"]

    @staticmethod
    def watch(channel: str) -> list[str]:
        if not channel.replace("_", "").isalnum():
            raise ValueError(f"not a channel name: {channel!r}")
        return [f"SET application_name = '{APPLICATION_NAME}'", f"LISTEN {channel}"]

    # The listening session as the hand-off checks a waiter's liveness (its pid and start),
    # which from now on holds the advisory lock (LISTENER_LOCK, pid) until it ends (migration
    # 0011): a hand-off that cannot take it shared knows the session lives, in O(1). It waits
    # at most for a hand-off that checked a gone session of the same pid to commit.
    session = (
        "SELECT pg_backend_pid(), backend_start::text FROM pg_stat_get_activity(pg_backend_pid()),"
        f" pg_advisory_lock({LISTENER_LOCK}, pg_backend_pid())"
    )

    @staticmethod
    def handed(payload: str) -> tuple[str, int, float] | None:
        owner, _, rest = payload.partition(" ")
        token, _, expiry = rest.partition(" ")
        try:
            return owner, int(token), float(expiry)
        except ValueError:
            return None

    def is_broken(self, raw: Any) -> bool:
        return bool(raw.broken or raw.closed)

    def translate(self, exc: BaseException) -> DBLockError:
        return translate(exc, self.where, self.table, self.schema)

    def table_check(self) -> tuple[str, dict[str, Any]]:
        quote = self.engine.dialect.identifier_preparer.quote
        name = (quote(self.schema) + "." if self.schema else "") + quote(self.table)
        return "SELECT to_regclass(%(t)s::text) IS NOT NULL", {"t": name}

    # -- fencing -------------------------------------------------------------
    @classmethod
    def lease_check(cls, t: str) -> str:
        # binds: name, owner, token. One row: the lease is live and now locked
        # against a takeover (an acquire's UPDATE waits) until this transaction
        # ends. Zero rows: expired, released or taken over. clock_timestamp(),
        # not now(): now() is the time the transaction began.
        return (
            f"SELECT token FROM {t} WHERE name = :name AND owner = :owner AND token = :token"
            " AND expires_at > clock_timestamp() FOR SHARE"
        )

    @classmethod
    def shared_check(cls, t: str, h: str) -> str:
        return (
            f"SELECT x.token FROM {h} AS x JOIN {t} AS l ON l.name = x.name AND l.owner = {_SHARED}"
            " WHERE x.name = :name AND x.owner = :owner AND x.token = :token"
            " AND x.expires_at > clock_timestamp() FOR SHARE OF l"
        )

    @staticmethod
    def denied(orig: BaseException | None) -> bool:
        return (getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)) == "42501"

    @staticmethod
    def missing_table(orig: BaseException | None) -> bool:
        # psycopg's sqlstate, psycopg2's pgcode: undefined_table.
        return (getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)) == "42P01"

    @classmethod
    def insert(cls) -> Any:
        return pg_insert

    # -- migrations ------------------------------------------------------------
    @classmethod
    def serialise(cls, conn: Any, key: int) -> None:
        # Held until the migration's transaction ends.
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})

    @classmethod
    def schema_error(
        cls, exc: BaseException, orig: BaseException, reason: str, where: str, table: str, path: str
    ) -> DBLockError:
        sqlstate = getattr(orig, "sqlstate", None)
        if (isinstance(exc, DBAPIError) and exc.connection_invalidated) or (
            sqlstate is None and isinstance(orig, psycopg.OperationalError)  # no server reply: refused, lost, timed out
        ) or (sqlstate is not None and (sqlstate.startswith("08") or sqlstate in _UNAVAILABLE_SQLSTATES)):
            return DatabaseUnavailable(f"cannot reach {where}: {reason}", sqlstate=sqlstate)
        return DBLockError(
            f"cannot create or upgrade dblock's table {table!r} in {where}: {reason}", sqlstate=sqlstate
        )


class _Names:
    """The quoted, schema-qualified names of a table's objects, as the statements use them."""

    def __init__(self, dialect: Dialect, table: str, schema: str | None) -> None:
        quote = dialect.identifier_preparer.quote
        prefix = quote(schema) + "." if schema else ""
        self.table = prefix + quote(table)
        self.enqueue, _, self.cancel = (prefix + quote(n) for n in queue_function_names(table))
        self.lean = [prefix + quote(n) for n in lean_function_names(table)]  # (missed, hand_on)
        self.seq = prefix + quote(token_sequence_name(table))
        self.procs = prefix + quote(procs_table_name(table))
        self.queue = prefix + quote(waiters_table_name(table))
        self.holders = prefix + quote(holders_table_name(table))
        self.shared = [prefix + quote(n) for n in shared_function_names(table)]
        self.share_enqueue = prefix + quote(shared_queue_function_names(table)[1])
        self.upgrade = [prefix + quote(n) for n in upgrade_function_names(table)]


# -- engines: dblock's own connections are psycopg 3, whatever the app's driver ----------
# Drivers whose URLs dblock converts to psycopg 3 (its own connections), and
# asyncpg's URL arguments: the libpq keyword each one becomes, or None where it
# tunes asyncpg's own statement cache, which dblock's connections do not use.
CONVERTED = ("psycopg2", "asyncpg", "psycopg_async")
_ASYNCPG_ARGUMENTS: dict[str, str | None] = {
    "host": "host",  # SQLAlchemy's host list (host=a:5432&host=b:5432), read alike by both dialects
    "target_session_attrs": "target_session_attrs",
    "password": "password",
    "ssl": "sslmode",
    "sslmode": "sslmode",
    "prepared_statement_cache_size": None,
    "prepared_statement_name_func": None,
}
_SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")



# create_schema's connections (dblock's own statements bound theirs by op_timeout):
# without a timeout libpq waits for ever on a host that accepts and then stays silent.
SCHEMA_CONNECT_TIMEOUT = 10


def _postgresql_engine(url: URL) -> Engine:
    """An engine dblock makes for a PostgreSQL URL (used by ``create_schema``): its connections
    give up connecting after ``SCHEMA_CONNECT_TIMEOUT`` s per host, unless the URL says otherwise."""
    connect_args = {} if "connect_timeout" in url.query else {"connect_timeout": SCHEMA_CONNECT_TIMEOUT}
    return create_engine(url, poolclass=NullPool, connect_args=connect_args)



def psycopg_url(url: URL) -> URL:
    """The ``postgresql+psycopg`` URL of a psycopg2 or asyncpg one (password kept).

    psycopg2 passes its query arguments to libpq as they are; asyncpg's are
    renamed (``ssl`` is libpq's ``sslmode``) or dropped (its statement cache).
    Either way every argument left must be one libpq knows, checked here,
    before any connection: a typo fails now, not at the first acquire.
    """
    query: dict[str, Any] = dict(url.query)
    if url.get_driver_name() == "asyncpg":
        query = {}
        for key, value in url.query.items():
            if key not in _ASYNCPG_ARGUMENTS:
                raise ValueError(
                    f"dblock opens psycopg connections from the asyncpg URL {display_url(url)},"
                    f" and knows no libpq equivalent of its argument {key!r}: give dblock a postgresql+psycopg:// URL"
                )
            renamed = _ASYNCPG_ARGUMENTS[key]
            if renamed is None:
                continue
            if renamed == "sslmode" and value not in _SSL_MODES:
                raise ValueError(f"{key}={value!r} in the asyncpg URL: dblock understands the sslmode names {_SSL_MODES}")
            query[renamed] = value
    _check_query(url, query)
    return url.set(drivername="postgresql+psycopg", query=query)


def _check_query(url: URL, query: Any) -> None:
    """Every argument of the URL's query must be one libpq knows: a typo (``?sslmod=``) is a
    ValueError now, on every driver's URL, not a failed connection at the first call."""
    libpq = {key: value for key, value in query.items() if isinstance(value, str)}  # host=a&host=b: a list
    try:
        make_conninfo(**libpq)  # libpq parses it: an unknown keyword is refused here
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"{display_url(url)}: {str(exc).strip()}") from None


def _check_driver(url: URL) -> None:
    if url.get_backend_name() != "postgresql" or url.get_driver_name() not in ("psycopg", ""):
        raise ValueError(
            f"dblock supports postgresql+psycopg://, postgresql+psycopg2://, postgresql+asyncpg:// and sqlite:///"
            f" URLs, not {url.drivername}://"
        )


# -- errors and connections (the asyncio face's too) -----------------------------------
def translate(exc: BaseException, where: str, table: str, schema: str | None = None) -> DBLockError:
    """A psycopg error of a lock statement as dblock's own."""
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(exc, psycopg.errors.UndefinedTable):
        return no_table(where, table, schema, sqlstate)
    if isinstance(exc, (psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedFunction)):
        return outdated(where, table, schema, first_line(exc), sqlstate)  # or no table at all: the driver asks
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return PermissionDenied(
            f"{where}: {first_line(exc)} (grant the privileges listed at "
            "https://dblock.readthedocs.io/en/latest/least-privilege/)",
            sqlstate=sqlstate,
        )
    if sqlstate is not None and sqlstate[:2] in _OUTAGE_CLASSES:
        return DatabaseUnavailable(f"{where}: {first_line(exc)}", sqlstate=sqlstate)
    return DBLockError(f"{where}: {first_line(exc)}", sqlstate=sqlstate)


def connect_params(engine: Engine) -> dict[str, Any]:
    """psycopg connection parameters from a PostgreSQL engine's URL (the query's too)."""
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    params = {**dict(cparams), **_conninfo_args(cargs)}
    # Every Python int is sent as a bigint (the statements cast where a column is narrower).
    # psycopg's own choice, int2, int4 or int8 by the value, is part of a prepared
    # statement's key: a token or a listener's pid past 32,767 would prepare it again, a
    # round trip more. The engine's adapters (SQLAlchemy passes its own) are kept otherwise.
    adapters = AdaptersMap(params.get("context") or psycopg.adapters)
    adapters.register_dumper(int, Int8Dumper)
    params["context"] = adapters
    return params


def host_attempts(conninfo: dict[str, Any]) -> list[dict[str, Any]]:
    """The parameters of each connection attempt: one per host of a multi-host URL, with
    dblock's defaults where the URL sets none of its own: notice a dead peer on an idle
    socket (keepalives) and on a socket with unacknowledged data (tcp_user_timeout),
    instead of after the kernel's 15 minutes."""
    params = {
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": 10_000,
        **conninfo,
    }
    return _host_attempts(params) or [params]


def connect_plan(attempts: list[dict[str, Any]], deadline: float, where: str) -> Iterator[dict[str, Any]]:
    """The keywords of each attempt to connect, each given its share of the time left.

    With several hosts (host=a,b,c, e.g. with target_session_attrs=read-write to
    find the primary) psycopg would give each host the whole connect_timeout, so
    three silent hosts would take three times the call's time. Each is tried
    here with its share of what is left, so a silent first host (a primary that
    went away) leaves time for the rest. Raises ``OutOfTime`` if no time is left
    for the first one.
    """
    for i, attempt in enumerate(attempts):
        left = deadline - time.monotonic()
        if left <= 0:
            if i == 0:
                raise OutOfTime(f"no time left to connect to {where}")
            return
        share = left / (len(attempts) - i)
        # Whole seconds, rounded down so the connect ends within its share (psycopg, as libpq,
        # reads connect_timeout as whole seconds), and never under libpq's least, 2 s.
        yield {**attempt, "connect_timeout": max(MIN_CONNECT_TIMEOUT, math.floor(share))}


def connect_failed(where: str, failed: list[psycopg.Error], hosts: int, reached: bool = False) -> DBLockError:
    """The error for a connect whose every attempt (``failed``) failed; ``reached``: a connect of
    this Locker's succeeded before (a refused connection is then an outage, not the URL)."""
    if not failed:
        return OutOfTime(f"no time left to connect to {where}")
    reasons = "; ".join(dict.fromkeys(first_line(exc) for exc in failed))
    tried = f" ({len(failed)} of {hosts} hosts tried)" if hosts > 1 else ""
    message = f"cannot connect to {where}{tried}: {reasons}"
    causes = [cause for cause in (misconfiguration(exc, reached) for exc in failed) if cause is not None]
    exc: DBLockError
    if len(causes) == len(failed) == hosts:
        # Every host was tried and each will say the same again: waiting would not help.
        exc = Misconfigured(f"{message} ({'; '.join(dict.fromkeys(causes))}: not retried)")
    else:
        exc = unavailable(message, failed[-1])
    exc.__cause__ = failed[-1]
    return exc


# What libpq and the server say at connect when the URL (or the server's settings for it) is
# wrong: retrying cannot help. The server's words are those of its lc_messages (English by
# default); a message in another language is taken for an outage, as before.
_MISCONFIGURED = [
    (re.compile(r"failed to resolve host|could not translate host name", re.I), "the host name does not resolve"),
    (
        re.compile(r"password authentication failed|authentication failed|no password supplied|"
                   r"no pg_hba\.conf entry|role \S+ does not exist|is not permitted to log in", re.I),
        "the server refused the user or password",
    ),
    (re.compile(r"database \S+ does not exist", re.I), "the database does not exist"),
]
_REFUSED = re.compile(r"connection refused|failed: No such file or directory", re.I)
_MISCONFIGURED_SQLSTATES = {"28000": "the server refused the user or password", "28P01": "the server refused the user or password",
                            "3D000": "the database does not exist"}


def misconfiguration(exc: BaseException, reached: bool) -> str | None:
    """Why a failed connect will fail again however long one waits (None: it may be an outage).

    A refused connection (nothing listens at the address, or no socket file) counts only
    while this Locker never reached the server (``reached``): after that it is the server
    restarting or going away, which a wait rides out."""
    cause = _MISCONFIGURED_SQLSTATES.get(getattr(exc, "sqlstate", None) or "")
    if cause is not None:
        return cause
    text = str(exc)
    for pattern, what in _MISCONFIGURED:
        if pattern.search(text):
            return what
    if not reached and _REFUSED.search(text):
        return "nothing listens there, and this Locker never reached it"
    return None


def _conninfo_args(cargs: Sequence[Any]) -> dict[str, Any]:
    # The psycopg dialect passes everything as keywords; a positional conninfo
    # string (should a dialect version pass one) is kept as psycopg's own.
    return {"conninfo": cargs[0]} if cargs else {}


def _host_attempts(params: dict[str, Any]) -> list[dict[str, Any]] | None:
    """One set of connection parameters per host of a multi-host conninfo (psycopg's own split,
    which also honours load_balance_hosts); None for a single host."""
    hosts = params.get("host") or params.get("hostaddr")
    if "conninfo" in params or not isinstance(hosts, str) or "," not in hosts:
        return None
    try:
        return [dict(a) for a in conninfo_attempts(params)]
    except psycopg.Error:
        return None  # e.g. no host name resolves: let psycopg's connect report it


def unavailable(message: str, exc: BaseException) -> DBLockError:
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):  # e.g. no CONNECT on the database
        return PermissionDenied(message, sqlstate=sqlstate)
    return DatabaseUnavailable(message, sqlstate=sqlstate)


# -- sending a statement through libpq ---------------------------------------------------
BINARY = pq.Format.BINARY
COMMAND_OK = ExecStatus.COMMAND_OK
SQLSTATE = pq.DiagnosticField.SQLSTATE
DUPLICATE_PREPARED = b"42P05"  # duplicate_prepared_statement


class _Plan:
    """A statement as libpq takes it: its text with ``$1``, ``$2``... for its ``%(key)s`` binds
    (each key one number), and the names it is prepared under, by its binds' types."""

    __slots__ = ("sql", "text", "keys", "formats", "_names")

    def __init__(self, sql: str) -> None:
        keys: dict[str, int] = {}

        def number(match: re.Match[str]) -> str:
            if match.group(0) == "%%":
                return "%"
            if match.group(1) is None:
                raise ValueError(f"a lone % in a lock statement (binds are %(key)s): {sql!r}")
            return f"${keys.setdefault(match.group(1), len(keys) + 1)}"

        self.sql = sql
        self.text = _BIND.sub(number, sql).encode()
        self.keys = tuple(keys)  # the bind of each $n, in order
        self.formats = [PyFormat.AUTO] * len(keys)  # psycopg's adapters choose, as for a cursor's %s
        self._names: dict[tuple[int, ...], bytes] = {}

    def name(self, types: tuple[int, ...]) -> bytes:
        """The name the statement is prepared under with binds of ``types``: a digest of its text
        and those types, so a name only ever stands for one statement (behind a transaction
        pooler, a session another client prepared it on runs the same text, never another)."""
        name = self._names.get(types)
        if name is None:
            digest = hashlib.blake2b(f"{self.sql}\0{types}".encode(), digest_size=10).hexdigest()
            name = self._names[types] = f"dblock_{digest}".encode()
        return name


_BIND = re.compile(r"%\((\w+)\)s|%%|%")


class Session:
    """A pooled connection as the lock statements use it: the psycopg connection (which
    opened it and closes it), its libpq connection, psycopg's adaptation of binds and rows
    with the connection's adapters, and the statements prepared on it."""

    __slots__ = ("raw", "pgconn", "tx", "prepared")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.pgconn = raw.pgconn
        self.tx = Transformer(raw)
        self.prepared: dict[tuple[str, tuple[int, ...]], bytes] = {}

    def rows(self, result: Any) -> list[Sequence[Any]]:
        """The rows of a statement's ``result`` (none for one that returns none: LOCK TABLE)."""
        status = result.status
        if status == TUPLES_OK:
            tx = self.tx
            tx.set_pgresult(result)
            return tx.load_rows(0, result.ntuples, tuple)
        if status == COMMAND_OK:
            return []
        raise self.error(result)

    def check(self, result: Any, key: tuple[str, tuple[int, ...]]) -> None:
        """Raise the error of a prepare's ``result`` (the statement ``key`` is then not taken
        for prepared), unless it prepared the statement or found it prepared already: its
        name is its text's digest, so the one there is the same (another client's, behind a
        transaction pooler)."""
        if result.status != COMMAND_OK and result.error_field(SQLSTATE) != DUPLICATE_PREPARED:
            self.prepared.pop(key, None)
            raise self.error(result)

    def error(self, result: Any) -> psycopg.Error:
        """psycopg's own error for a failed ``result``: its class by SQLSTATE, its diagnostics.
        A result with no SQLSTATE is libpq's own (the server did not answer: it closed the
        connection, or the socket failed): an ``OperationalError``, as psycopg raises then."""
        if not result.error_field(SQLSTATE):
            return psycopg.OperationalError(result.get_error_message(self.raw.info.encoding))
        return error_from_result(result, encoding=self.raw.info.encoding)

    def failed(self, exc: psycopg.OperationalError) -> None:
        """A call failed with ``exc``. One that is libpq's own (no SQLSTATE) means the
        connection is lost or out of step, though libpq may not have marked it so yet (a
        write to a socket the server closed): it is closed now, so that the driver throws
        it away and sends the statement once more on a new one. A server's error leaves the
        connection as it is."""
        if exc.sqlstate is None:
            self.pgconn.finish()


async def _result(pgconn: Any) -> Any:
    """The result of the statement just sent on ``pgconn`` (non-blocking, as psycopg connects
    it), waiting on the event loop for its socket. A socket shut down under it (a statement
    cut at its deadline) or a lost server raises ``psycopg.OperationalError``."""
    loop = asyncio.get_running_loop()
    fd = pgconn.socket
    while pgconn.flush():
        await _ready(loop, fd, write=True)
    result = None
    while True:
        while pgconn.is_busy():  # (nothing is read before the socket says there is something)
            await _ready(loop, fd)
            pgconn.consume_input()
        got = pgconn.get_result()
        if got is None:
            break
        if result is None:
            result = got  # one statement: one result, then the end of it
    if result is None:
        raise psycopg.OperationalError("the server sent no result")
    return result


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, *, write: bool = False) -> None:
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    if write:
        loop.add_writer(fd, wake)
        try:
            await ready
        finally:
            loop.remove_writer(fd)
    else:
        loop.add_reader(fd, wake)
        try:
            await ready
        finally:
            loop.remove_reader(fd)


# -- the statements ---------------------------------------------------------------------
def _postgresql(
    t: str, seq: str, procs: str, enqueue_fn: str, cancel_fn: str, queue: str, missed_fn: str, hand_on_fn: str
) -> dict[str, str]:
    # A new expiry: from the moment it is computed, no earlier than the client's
    # send time, from which the client trusts the lease (G5).
    ttl = "clock_timestamp() + %(ttl)s * interval '1 second'"
    # acquire
    # binds: name, owner (this attempt's owner id, never the same twice), ttl (seconds, float),
    #   label (who asks, for operators; written with the grant, never compared)
    # returns one row (granted, token, expires_at, wait):
    #   granted: token and database expiry of the lease. If owner already holds
    #     the row (a retry after a lost reply, G6) the token is kept, not redrawn.
    #   not granted: wait = seconds until the current lease ends, by the
    #     database clock (<= 0 or NULL: it just ended; try again soon).
    # zero rows: the name had no row and a concurrent first acquire created it.
    # Shape: the conditional UPDATE is the common path; when the lock is held
    # it matches nothing and writes no WAL (a miss is read-only). nextval() runs
    # in UPDATE's SET, which PostgreSQL re-evaluates (EvalPlanQual) after it
    # waited for a competing grant's row lock, so a late grant never writes a
    # token drawn before an earlier grant's (G2). Only when it matched nothing
    # does the statement call the missed function (migration 0012): it reads
    # the row for the miss report, or, for a name with no row yet, INSERTs it
    # (ON CONFLICT DO NOTHING makes a racing first insert a miss). PostgreSQL
    # skips the call when the UPDATE granted, where CTEs for those branches
    # would each be started and run on every call.
    acquire = f"""
WITH upd AS (
    UPDATE {t} AS l SET
        token = CASE WHEN l.owner = %(owner)s THEN l.token ELSE nextval('{seq}') END,
        acquired_at = CASE WHEN l.owner = %(owner)s THEN l.acquired_at ELSE now() END,
        owner = %(owner)s,
        -- Ours already (a retry): never shorten it, see extend.
        expires_at = CASE WHEN l.owner = %(owner)s THEN greatest(l.expires_at, {ttl}) ELSE {ttl} END,
        label = %(label)s
    WHERE l.name = %(name)s
      AND (l.owner IS NULL OR l.expires_at <= now() OR l.owner = %(owner)s)
    RETURNING l.token, l.expires_at
)
SELECT true AS granted, token, expires_at, NULL::float8 AS wait FROM upd
UNION ALL
SELECT m.granted, m.token, m.expires_at, m.wait FROM {missed_fn}(%(name)s, %(owner)s, %(ttl)s, %(label)s) AS m
WHERE NOT EXISTS (SELECT FROM upd)"""
    # release
    # binds: name, owner, token
    # returns one row (token, handed) when this call ended the lease: nobody
    #   else had taken it since, even if its TTL had run out. token: the ended
    #   lease's; handed: whether the name went on to a waiter in this statement.
    # zero rows: already released, or taken over by another owner (G3).
    # The row stays (DESIGN.md §3): only the lease is cleared, by this one
    # UPDATE, which holds the row lock to the commit. Its RETURNING reads the
    # row as written, and when the row counts waiters (waiting, a column of
    # this row, so re-read after a wait for the row lock) it calls the
    # hand_on function (migration 0012) in the same statement: it grants the
    # first live waiter a fresh token under that row lock (G2) and NOTIFYs
    # exactly that waiter's listener; when readers or semaphore waiters are
    # first in line, each of them up to the next writer that fits, a token
    # each. handed: whether it granted anyone. With nobody waiting the
    # function is not called: the release costs what the UPDATE costs.
    release = f"""
UPDATE {t} SET owner = NULL, expires_at = NULL
WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s
RETURNING token, CASE WHEN waiting > 0 THEN {hand_on_fn}(name) ELSE false END"""
    # release_held (a release of a lease granted with min_hold > 0)
    # binds: name, owner, token, hold (seconds after the grant the lease is kept)
    # returns one row (token, handed, held_until) when (name, owner, token) still
    #   matched, as release does (zero rows: already released, or taken over):
    #   held_until NULL: the hold had passed (acquired_at + hold <= now()), so
    #     this call ended the lease exactly as release does, hand-off included.
    #   held_until set: the hold has not passed. The lease is kept (owner, token
    #     and label unchanged) and now ends at acquired_at + hold by the database
    #     clock, whatever its expiry was: sooner if its ttl or an extend reached
    #     past the hold (the work is done), later if the hold is longer than the
    #     ttl, or if the lease ran out while nobody took it. Nothing is handed
    #     over: a fair waiter gets the lease at that expiry, as after a holder
    #     that died (the first few in line look then). A late extend of the same
    #     lease would still push the expiry out; the Lease sends none after this.
    # One UPDATE, as release's: when the hold had passed and the row counts
    # waiters, its RETURNING hands the name on (held_until is then NULL: the
    # expiry the UPDATE wrote, read from its own row, before any grant).
    hold = "l.acquired_at + %(hold)s * interval '1 second'"
    release_held = f"""
UPDATE {t} AS l SET
    owner = CASE WHEN {hold} > now() THEN l.owner END,
    expires_at = CASE WHEN {hold} > now() THEN {hold} END
WHERE l.name = %(name)s AND l.owner = %(owner)s AND l.token = %(token)s
RETURNING l.token, CASE WHEN l.owner IS NULL AND l.waiting > 0 THEN {hand_on_fn}(l.name) ELSE false END, l.expires_at"""
    # released (only after a release whose reply was lost)
    # binds: name, owner, token
    # returns one row when the lease with this token ended and nobody took the
    # name since; zero rows: it was taken over (or the row pruned).
    released = f"""
SELECT token FROM {t} WHERE name = %(name)s AND token = %(token)s AND owner IS NULL"""
    # extend
    # binds: name, owner, token, ttl
    # returns one row (expires_at): the new expiry, now + ttl by the database clock,
    #   or the current one if that is later: an extend never shortens a lease.
    #   PostgreSQL computes the SET before it waits for a row lock, and a
    #   statement the client cut off may run on the server later still; were it
    #   to overwrite a later extend's expiry with its earlier one, the lease
    #   would end before its holder stopped trusting it (G5). greatest() reads
    #   the row as it is when written.
    # zero rows: the lease was released or another owner acquired since (G3).
    extend = f"""
UPDATE {t} SET expires_at = greatest(expires_at, {ttl})
WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s
RETURNING expires_at"""
    # extend_many (renewal: the leases due now, in one statement)
    # binds: names, owners, tokens, ttls: arrays of one length, a lease each
    #   (sorted by name, so concurrent batches take row locks in one order)
    # returns a row (name, token, expires_at) per lease extended, with the same
    #   contract as extend; a lease with no row was released or taken over.
    extend_many = f"""
UPDATE {t} AS l SET expires_at = greatest(l.expires_at, clock_timestamp() + b.ttl * interval '1 second')
FROM unnest(%(names)s::text[], %(owners)s::text[], %(tokens)s::bigint[], %(ttls)s::float8[])
    AS b(name, owner, token, ttl)
WHERE l.name = b.name AND l.owner = b.owner AND l.token = b.token
RETURNING l.name, l.token, l.expires_at"""
    # prune
    # binds: age (seconds)
    # deletes rows whose last grant and lease both ended more than age ago and
    # that nobody waits for; returns their names. The global sequence keeps
    # tokens growing for a name that comes back (G2). Also forgets processes
    # whose waiters' heartbeat stopped more than age ago.
    prune = f"""
WITH gone AS (DELETE FROM {procs} WHERE until < now() - %(age)s * interval '1 second')
DELETE FROM {t}
WHERE acquired_at < now() - %(age)s * interval '1 second'
  AND (owner IS NULL OR expires_at < now() - %(age)s * interval '1 second')
  AND waiting = 0
RETURNING name"""
    # prune_lock: a first insert draws its token before its unique check; were
    # the row it then collides with pruned meanwhile, it would insert a token
    # below that row's (G2). SHARE ROW EXCLUSIVE waits for acquires in flight
    # (they hold ROW EXCLUSIVE from before they draw) and holds new ones off
    # until the prune commits. Pruning is rare; acquires never wait on each other here.
    prune_lock = f"LOCK TABLE {t} IN SHARE ROW EXCLUSIVE MODE"
    # enqueue (fair waiting): one call of the enqueue function (migration 0005)
    # binds: name, owner, ttl, label; proc (this Locker process's liveness id)
    #   and lapse (seconds its heartbeat row stays fresh); pid and start (this
    #   process's listener session, or NULL when it polls); until (seconds
    #   left of the wait, NULL for ever); seq (our place in line from the last
    #   attempt, or NULL)
    # returns one row (granted, token, expires_at, wait, seq, ahead):
    #   granted when the lock is free (or expired) and no live waiter is ahead
    #   of owner, or when owner already holds it (a hand-off it has not heard
    #   of yet, or a retry after a lost reply: the token is kept, the expiry renewed).
    #   Not granted: owner waits in line as seq; wait tells when the current
    #   lease ends and ahead how many waiters are before owner (counted to 100).
    #   A look while another owner's lease runs and owner is in line writes nothing.
    enqueue = f"""
SELECT * FROM {enqueue_fn}(%(name)s, %(owner)s, %(ttl)s::float8, %(label)s, %(proc)s, %(lapse)s::float8,
    %(pid)s::int, %(start)s::timestamptz, %(until)s::float8, %(seq)s::bigint)"""
    # cancel (a fair waiter gives up, or the clean-up after a lost reply)
    # binds: name, owner, seq (NULL: every entry of owner)
    # returns one row (granted, token, expires_at): owner's entry is gone from
    #   the queue; granted means a release handed owner the lease first (the
    #   caller keeps it). Zero rows: the name has no row.
    cancel = f"SELECT * FROM {cancel_fn}(%(name)s, %(owner)s, %(seq)s::bigint)"
    # beat: this Locker process's waiters are alive for lapse more seconds
    # binds: proc, lapse. Returns one row. Needs no disk flush (see enqueue).
    beat = f"""
WITH b AS (
    INSERT INTO {procs} (id, until) VALUES (%(proc)s, now() + %(lapse)s::float8 * interval '1 second')
    ON CONFLICT (id) DO UPDATE SET until = excluded.until
    RETURNING id
)
SELECT set_config('synchronous_commit', 'off', true) FROM b"""
    # quit (a Locker's close, or its process's clean exit: its heartbeat row goes)
    # binds: proc. Deletes that one row (ids are random per Locker and process, so
    #   never another live process's); a waiter of it still in line is dead at once,
    #   as when the row lapses. Zero rows: there was none (never waited, or pruned).
    quit = f"DELETE FROM {procs} WHERE id = %(proc)s"
    # waiters (operators: dblock status)
    # binds: none
    # returns a row per name with live waiters: name, count. Live as the hand-off
    #   judges it, less the listener-session check: the waiter's own deadline has
    #   not passed and its process's heartbeat row is fresh. Reads only.
    #   Zero rows: nobody waits.
    waiters = f"""
SELECT w.name, count(*)::int FROM {queue} AS w JOIN {procs} AS p ON p.id = w.proc
WHERE p.until > now() AND (w.until IS NULL OR w.until > now())
GROUP BY w.name"""
    # relabel (an election's leader proclaims a value; base.Statements)
    # binds: name, owner, token, label, channel
    # One row (acquired_at) when the lease was still this owner's, and a NOTIFY on channel
    # with "token acquired_at(epoch) label", sent at commit, so a watcher of the election
    # hears each leader in commit order. Zero rows (and no NOTIFY): released or taken over.
    relabel = f"""
WITH r AS (
    UPDATE {t} SET label = %(label)s
    WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s
    RETURNING token, acquired_at
)
SELECT r.acquired_at, pg_notify(%(channel)s, r.token::text || ' ' || extract(epoch FROM r.acquired_at)::text || ' ' || %(label)s)
FROM r"""
    return dict(
        acquire=acquire, release=release, release_held=release_held, released=released, extend=extend,
        extend_many=extend_many, prune=prune, prune_lock=prune_lock, enqueue=enqueue, cancel=cancel,
        beat=beat, quit=quit, waiters=waiters, relabel=relabel,
    )


def _share_enqueue(fn: str) -> str:
    # share_enqueue (fair waiting for a shared lease, migration 0008)
    # binds: enqueue's, limit (NULL: a reader) and upgradeable (the upgradeable reader)
    # returns one row as enqueue does (granted, token, expires_at, wait, seq, ahead, at):
    #   readers, semaphore waiters and writers of a name wait in one line, in
    #   arrival order; each call first grants whoever of the line's head fits
    #   (this caller too). Not granted: wait is when the first live holder's
    #   lease ends. A look while a writer holds and owner is in line writes nothing.
    return f"""
SELECT * FROM {fn}(%(name)s, %(owner)s, %(ttl)s::float8, %(label)s, %(limit)s::int, %(proc)s, %(lapse)s::float8,
    %(pid)s::int, %(start)s::timestamptz, %(until)s::float8, %(seq)s::bigint,
    %(upgradeable)s::boolean)"""


# -- shared leases (read locks and semaphores, migration 0007; see base.SHARED) ----------


def _postgresql_shared(
    t: str, h: str, acquire_fn: str, release_fn: str, extend_fn: str, upgrade_fn: str, downgrade_fn: str
) -> dict[str, str]:
    # share_acquire
    # binds: name, owner, ttl, label, limit (NULL: a reader, no limit of its own), upgradeable
    #   (true: the upgradeable reader, of which one lives at a time; limit is then NULL)
    # returns one row (granted, token, expires_at, wait, free):
    #   granted: a fresh token drawn after the name's row lock (G2: larger than
    #     every earlier grant of the name, shared or exclusive) and the database
    #     expiry; owner already holding it (a retry, G6) keeps its token.
    #   not granted: a writer holds the name (wait: seconds until its lease
    #     ends), a live writer waits in the fair queue (wait NULL: readers let
    #     it go first), or as many live holders as the smallest limit of the
    #     caller and of every live holder (wait: until the first of them ends), or
    #     (migration 0010) an upgradeable reader asks to upgrade, or the caller is
    #     one and another lives (wait: until the first holder's lease ends).
    #   free: on a grant, the slots it left (the smallest live limit less the
    #     live holders; NULL when no limit binds), so a waiter next in line
    #     knows whether to look at once. NULL on a miss.
    #   Since migration 0008 readers and semaphore waiters queue too (share_enqueue):
    #   while any live waiter is in line a newcomer is refused (wait NULL), after
    #   the call has granted whoever of the line fits (a lease that ran out unreleased).
    # A miss behind a writer reads only; other misses lock the row.
    share_acquire = (
        f"SELECT * FROM {acquire_fn}(%(name)s, %(owner)s, %(ttl)s::float8, %(label)s, %(limit)s::int, "
        "%(upgradeable)s::boolean)"
    )
    # share_release
    # binds: name, owner, token
    # returns one row (token, notified) when this call ended the shared lease;
    #   the slot it frees (or the name, when it was the last holder) goes to
    #   the fair queue's head and each waiter after it that fits (NOTIFY), or
    #   the name is freed. Zero rows: already released, or the lease
    #   ran out and was forgotten or taken over (G3).
    share_release = f"SELECT * FROM {release_fn}(%(name)s, %(owner)s, %(token)s::bigint)"
    # share_released (after a release whose reply was lost)
    # binds: name, owner, token. One row: the shared lease is gone; zero rows: it is still there.
    share_released = f"""
SELECT %(token)s::bigint WHERE NOT EXISTS (
    SELECT FROM {h} WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s::bigint)"""
    # share_extend
    # binds: name, owner, token, ttl
    # returns one row (expires_at): now + ttl by the database clock, or the
    #   current expiry if later. Zero rows: released, or it ran out and another
    #   grant of the name came since (which forgets it, or a writer took over).
    share_extend = f"SELECT * FROM {extend_fn}(%(name)s, %(owner)s, %(token)s::bigint, %(ttl)s::float8)"
    # share_extend_many: extend_many's contract, for shared leases.
    share_extend_many = f"""
SELECT b.name, b.token, e.expires_at
FROM unnest(%(names)s::text[], %(owners)s::text[], %(tokens)s::bigint[], %(ttls)s::float8[])
    AS b(name, owner, token, ttl)
CROSS JOIN LATERAL {extend_fn}(b.name, b.owner, b.token, b.ttl) AS e"""
    # upgrade (the upgradeable read lock, migration 0010)
    # binds: name, owner, token (the upgradeable reader's lease), ttl
    # returns one row (granted, token, expires_at, wait):
    #   granted: the caller was the name's only live holder, and its read lease is now the
    #     name's exclusive (write) lease, with a token drawn after the row lock (larger than
    #     every earlier grant of the name) and the expiry now + ttl by the database clock.
    #     An owner that holds the write lease already (a retry after a lost reply) gets it
    #     back, its expiry renewed, never shortened.
    #   not granted: other holders are live (wait: seconds until the first of their leases
    #     ends). From now on no shared lease of the name is granted, in line or not, until
    #     the caller upgrades, withdraws (downgrade), or its lease ends.
    #   Zero rows: the read lease is gone (released, or it ran out and was forgotten), or
    #   it is not an upgradeable reader's.
    upgrade = f"SELECT * FROM {upgrade_fn}(%(name)s, %(owner)s, %(token)s::bigint, %(ttl)s::float8)"
    # downgrade
    # binds: name, owner, token, ttl
    # returns one row (token, expires_at):
    #   owner's write lease, even past its ttl while nobody took it over (and whatever its
    #     token: an upgrade whose reply was lost never told the caller), is now the
    #     upgradeable reader's lease of owner: a new token (drawn after the row lock),
    #     expiring at now + ttl; readers in the fair queue are admitted;
    #   or owner is the upgradeable reader and withdraws its ask to upgrade (or this is a
    #     retry after a lost reply): its lease as it stands, token unchanged, and shared
    #     leases are granted again.
    #   Zero rows: released, or taken over.
    downgrade = f"SELECT * FROM {downgrade_fn}(%(name)s, %(owner)s, %(token)s::bigint, %(ttl)s::float8)"
    return dict(
        upgrade=upgrade, downgrade=downgrade,
        share_acquire=share_acquire, share_release=share_release, share_released=share_released,
        share_extend=share_extend, share_extend_many=share_extend_many, leases=leases_statement(
            t, h, "now()", "EXTRACT(EPOCH FROM {0}.expires_at - now())::float8", "false", "true"
        ),
        leases_of=leases_statement(
            t, h, "now()", "EXTRACT(EPOCH FROM {0}.expires_at - now())::float8", "false", "true", "%(name)s"
        ),
        # share_prune: binds age (seconds); deletes the holders whose lease ended more than age
        #   ago (nothing live, and nothing an extend may still revive for long); returns a row each.
        share_prune=f"DELETE FROM {h} WHERE expires_at < now() - %(age)s * interval '1 second' RETURNING name",
    )
