"""MariaDB (10.6 and later, and Galera clusters of it): PyMySQL, aiomysql for asyncio, no fair queue.

Everything dblock knows about MariaDB lives here: every lock statement with
its contract comment, the row decoders, how a connection is opened (dblock's
own, in autocommit, out of the engine's pool) and how a driver error becomes
dblock's own. MariaDB has no LISTEN/NOTIFY and dblock keeps no queue there:
waiters poll with backoff, sleeping until the current lease is known to end,
and threads of one process take turns (``_wait.Hotspot``), as on SQLite.

How the statements keep the guarantees:

- Times are Unix seconds (DOUBLE), computed by the server: ``NOW(6)`` (the
  statement's start) to compare, ``SYSDATE(6)`` (the moment it is read) for
  a new expiry, in a session whose time zone is UTC, so no daylight-saving
  hour is read twice. In a ``BEGIN NOT ATOMIC`` block each statement has its
  own start, so a block that compares in several statements reads ``NOW(6)``
  once into a variable and compares with that.
- A name's row is locked by the statement that grants it (an ``UPDATE`` locks
  the row, then computes the new values from its latest committed version),
  and its token is the row's own token plus one: drawn after the row lock, so
  a late grant never writes a token drawn before an earlier grant's. A per-row counter is certified with the
  row on a Galera cluster, where a sequence or auto-increment is per node.
- A name's first grant (or its first after ``prune`` forgot it) takes the
  table's largest committed token plus one. prune never deletes the row
  holding the largest token, so that number never goes down; and it forgets
  only names nobody was granted for ``PRUNE_FLOOR`` seconds, longer than any
  statement may run (``STATEMENT_LIFE``), so the largest token a first grant
  reads, as its statement began, is above every token the name it brings
  back was ever given.
- Statements that change rows and report them run as one transaction in one
  round trip (``BEGIN; ...; COMMIT`` as a multi-statement text, or a ``BEGIN NOT
  ATOMIC`` block where a step depends on an earlier one): the rows the client
  receives are those its commit made. On Galera a commit that loses
  certification fails (error 1213) and nothing is reported as granted. The
  server's own rerun of an aborted autocommit statement (a whole block is one)
  is turned off for dblock's sessions: its first run's rows may already have
  reached the client.
- A statement that lost a deadlock or a certification conflict was rolled back
  whole, so it is sent again (every statement here may be).
"""

from __future__ import annotations

import asyncio
import random
import re
import socket
import time
from typing import Any, ClassVar, Sequence

from sqlalchemy import create_engine, func, literal_column, select, text
from sqlalchemy.dialects.mysql import insert as mysql_insert
from sqlalchemy.engine import URL, Dialect, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from .. import _core as core
from .._core import Grant, Miss, Rows
from .._faults import OutOfTime, first_line, no_table, outdated
from .._redact import display_url
from ..errors import DatabaseUnavailable, DBLockError, Misconfigured, PermissionDenied
from ..schema import holders_table_name
from .base import SHARED as _SHARED
from .base import Backend, Capabilities, Statements, json_batch, leases_statement, owned_token, shared_grant

# The server's clock as Unix seconds: NOW(6) is fixed for the statement (compare
# with it), SYSDATE(6) is read when evaluated (a new expiry counts from then: the
# client trusts a lease from before it sent the statement, so never too late).
NOW = "UNIX_TIMESTAMP(NOW(6))"
CLOCK = "UNIX_TIMESTAMP(SYSDATE(6))"
EXPIRES = f"({CLOCK} + %(ttl)s)"
# Tables: every string compared byte for byte, trailing spaces included ('job' and
# 'job ' are two locks, as on PostgreSQL and SQLite); InnoDB for row locks.
TABLE_OPTIONS = {"mariadb_engine": "InnoDB", "mariadb_charset": "utf8mb4", "mariadb_collate": "utf8mb4_nopad_bin"}
# Errors of a statement that the server rolled back whole: sent again, a few times, after a
# random pause that grows (on a Galera cluster, grants of one name from several nodes lose
# certification often; sent again at once, they would collide again).
_RETRIED = {1213, 1205}  # deadlock or certification conflict; lock wait timeout
_RETRIES = 20


def _backoff(attempt: int) -> float:
    return random.uniform(0, min(0.05, 0.001 * 2**attempt))
# Errors of a server going away, starting or out of room.
_OUTAGE = {1040, 1053, 1077, 1152, 1158, 1159, 1160, 1161, 2002, 2003, 2006, 2013, 2055, 1927, 1213, 1205, 1047}
_PRIVILEGE = {1044, 1045, 1142, 1143, 1227, 1370}
_NO_TABLE = {1146}
_NO_COLUMN = {1054, 1305}
_REFUSED_LOGIN = {1045, 1698}  # access denied for user (using password: ...), and for a socket-only user
_UNKNOWN_DATABASE = 1049
_UNKNOWN_HOST = 2005  # the C client's; PyMySQL says 2003 with the resolver's error under it
_CANNOT_CONNECT = 2003
MIN_VERSION = (10, 6)
# The driver's connect keywords a URL's query may carry (anything else is a typo, refused up front).
_CONNECT_KEYWORDS = {
    "charset", "unix_socket", "ssl", "ssl_ca", "ssl_cert", "ssl_key", "ssl_disabled", "ssl_verify_cert",
    "ssl_verify_identity", "connect_timeout", "local_infile", "init_command", "program_name", "server_public_key",
    "read_default_file", "read_default_group", "auth_plugin_map", "binary_prefix", "ssl_key_password",
}
# The longest any statement of dblock's may run on the server, whatever became of its client
# (cut off at its deadline, its connection gone): a lock wait ends sooner, and the server
# aborts a statement that runs past it. prune forgets no name granted within twice this.
STATEMENT_LIFE = 60
PRUNE_FLOOR = 2 * STATEMENT_LIFE  # MariaDB.caps.prune_floor
# A wait for a row lock (one of dblock's own statements holds it for a moment; an app's
# transaction after check_lease, until it commits) gives up after this many seconds, and the
# statement is sent again (error 1205): a statement whose client was cut off at its deadline
# does not linger on the server holding its place for longer.
LOCK_WAIT = 5
# READ COMMITTED: a new name's first token reads the largest committed token without locking
# that row (under REPEATABLE READ the read takes a shared lock on it, and two grants of the
# name that holds it, each holding that lock and waiting for the other's, deadlock).
_SESSION = (
    "SET SESSION time_zone = '+00:00', SESSION sql_mode = 'STRICT_ALL_TABLES,NO_ENGINE_SUBSTITUTION',"
    f" SESSION max_statement_time = {STATEMENT_LIFE}, SESSION innodb_lock_wait_timeout = {LOCK_WAIT};"
    " SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"
)

# On a Galera cluster the server runs an autocommit statement again, by default once, when a
# replicated write aborted it; a BEGIN NOT ATOMIC block is one such statement, and the rows its
# aborted run sent may already have reached the client. In 10.11 the rerun's rows even arrive
# without their column metadata, and the client misreads the reply (PyMySQL: struct.error).
# Off for dblock's sessions: a conflict is an error 1213, and execute sends the statement again.
_NO_SERVER_RETRY = "SET SESSION wsrep_retry_autocommit = 0"
_UNKNOWN_VARIABLE = 1193  # a server built without Galera has no such variable


def _no_server_retry(cursor: Any) -> None:
    import pymysql  # noqa: PLC0415

    try:
        cursor.execute(_NO_SERVER_RETRY)
    except pymysql.MySQLError as exc:
        if _code(exc) != _UNKNOWN_VARIABLE:
            raise


class MariaDB(Backend):
    name = "mariadb"
    title = "MariaDB"
    caps = Capabilities(
        fair_queue=False, notify=False, schemas=False, cut_statements=True, batch_binds="json",
        server_prepare=False, token_sequence=False, advisory_lock=True, replication=False,
        global_tokens=False, prune_floor=120.0,
    )
    errors: ClassVar[tuple[type[BaseException], ...]] = ()  # set below, once the driver is imported

    def __init__(self, engine: Engine, table: str, schema: str | None, where: str, *, prepare: bool = True) -> None:
        super().__init__(engine, table, schema, where, prepare=prepare)
        self._params = connect_params(engine.url)

    # -- statements ------------------------------------------------------------
    @classmethod
    def statements(cls, dialect: Dialect, table: str, schema: str | None) -> Statements:
        quote = dialect.identifier_preparer.quote
        t, h = quote(table), quote(holders_table_name(table))
        return Statements(**_exclusive(t), **_shared(t, h), prune_lock=None)

    # -- rows into outcomes ----------------------------------------------------
    @staticmethod
    def acquired(rows: Rows, holder: Rows) -> Grant | Miss:
        granted, token, expires_at, wait = rows[0]
        if not granted:
            return Miss(wait)
        return Grant(token, core.when(expires_at))

    share_acquired = staticmethod(shared_grant)
    owned = staticmethod(owned_token)
    batch = staticmethod(json_batch)

    # -- connections -----------------------------------------------------------
    def connect(self, deadline: float) -> Any:
        import pymysql  # noqa: PLC0415 - dblock[mariadb]

        left = deadline - time.monotonic()
        if left <= 0:
            raise OutOfTime(f"no time left to connect to {self.where}")
        try:
            # Until the session is set up, every read and write is bounded by the connect's time (a
            # server that accepts and then stays silent, frozen say, would hold the greeting for
            # ever); after that, dblock's watchdog bounds each statement by its own deadline.
            bound = max(0.001, left)
            raw = _Connection(
                **self._params, connect_timeout=bound, read_timeout=bound, write_timeout=bound, defer_connect=False
            )
            with raw.cursor() as cursor:
                cursor.execute(_SESSION)
                while cursor.nextset():
                    pass
                _no_server_retry(cursor)
            raw.unbounded()
        except pymysql.MySQLError as exc:
            raise unavailable(f"cannot connect to {self.where}: {first_line(exc)}", exc, self.reached) from exc
        self.reached = True
        check_server(raw.get_server_info(), self.where)
        return raw

    def execute(self, cursor: Any, sql: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        import pymysql  # noqa: PLC0415

        for attempt in range(_RETRIES):
            try:
                cursor.execute(sql, params)
                rows: list[Sequence[Any]] = []
                while True:  # a text's rows are those of its last statement that returns rows
                    if cursor.description is not None:
                        rows = list(cursor.fetchall())
                    if not cursor.nextset():
                        return rows
            except pymysql.MySQLError as exc:
                _abandon(cursor)
                if _code(exc) not in _RETRIED or attempt == _RETRIES - 1:
                    raise
                time.sleep(_backoff(attempt))
        raise AssertionError("unreachable")

    async def aconnect(self, deadline: float) -> Any:
        import aiomysql  # noqa: PLC0415 - dblock[mariadb]
        import pymysql  # noqa: PLC0415

        left = deadline - time.monotonic()
        if left <= 0:
            raise OutOfTime(f"no time left to connect to {self.where}")
        params = dict(self._params)
        params["db"] = params.pop("database", None)
        params.pop("ssl_disabled", None)
        try:
            raw = await asyncio.wait_for(
                aiomysql.connect(**params, connect_timeout=max(0.001, left)), max(0.001, left)
            )
        except (pymysql.MySQLError, OSError) as exc:
            raise unavailable(f"cannot connect to {self.where}: {first_line(exc)}", exc, self.reached) from exc
        except asyncio.TimeoutError:
            raise DatabaseUnavailable(f"cannot connect to {self.where}: no answer within {left:.3g} s") from None
        raw.__class__ = _AsyncConnection

        async def session() -> None:
            async with raw.cursor() as cursor:
                await cursor.execute(_SESSION)
                while await cursor.nextset():
                    pass
                try:
                    await cursor.execute(_NO_SERVER_RETRY)
                except pymysql.MySQLError as exc:
                    if _code(exc) != _UNKNOWN_VARIABLE:
                        raise

        try:
            await asyncio.wait_for(session(), max(0.001, deadline - time.monotonic()))
        except (pymysql.MySQLError, OSError) as exc:
            raw.close()
            raise unavailable(f"cannot connect to {self.where}: {first_line(exc)}", exc, self.reached) from exc
        except asyncio.TimeoutError:
            raw.close()
            raise DatabaseUnavailable(f"cannot connect to {self.where}: no answer within the call's time") from None
        self.reached = True
        check_server(raw.get_server_info(), self.where)
        return raw

    async def acursor(self, raw: Any) -> Any:
        return await raw.cursor()

    async def aexecute(self, cursor: Any, sql: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        import pymysql  # noqa: PLC0415

        for attempt in range(_RETRIES):
            try:
                await cursor.execute(sql, params)
                rows: list[Sequence[Any]] = []
                while True:
                    if cursor.description is not None:
                        rows = list(await cursor.fetchall())
                    if not await cursor.nextset():
                        return rows
            except pymysql.MySQLError as exc:
                await _aabandon(cursor)
                if _code(exc) not in _RETRIED or attempt == _RETRIES - 1:
                    raise
                await asyncio.sleep(_backoff(attempt))
        raise AssertionError("unreachable")

    def is_broken(self, raw: Any) -> bool:
        return not raw.open

    def table_check(self) -> tuple[str, dict[str, Any]]:
        return (
            "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %(t)s",
            {"t": self.table},
        )

    def translate(self, exc: BaseException) -> DBLockError:
        return translate(exc, self.where, self.table, self.schema)

    # -- fencing -------------------------------------------------------------
    @classmethod
    def lease_check(cls, t: str) -> str:
        # binds name, owner, token. One row: the lease is live and its row now locked
        # against a takeover (an acquire waits for the lock) until the caller's
        # transaction ends. Zero rows: expired, released or taken over. SYSDATE, not NOW:
        # the time of the check, and a UTC session for this statement whatever the
        # app's connection has set.
        return (
            "SET STATEMENT time_zone = '+00:00' FOR "
            f"SELECT token FROM {t} WHERE name = :name AND owner = :owner AND token = :token"
            f" AND expires_at > {CLOCK} LOCK IN SHARE MODE"
        )

    @classmethod
    def shared_check(cls, t: str, h: str) -> str:
        return (
            "SET STATEMENT time_zone = '+00:00' FOR "
            f"SELECT x.token FROM {h} AS x JOIN {t} AS l ON l.name = x.name AND l.owner = {_SHARED}"
            " WHERE x.name = :name AND x.owner = :owner AND x.token = :token"
            f" AND x.expires_at > {CLOCK} LOCK IN SHARE MODE"
        )

    @staticmethod
    def denied(orig: BaseException | None) -> bool:
        return orig is not None and _code(orig) in _PRIVILEGE

    @staticmethod
    def missing_table(orig: BaseException | None) -> bool:
        return orig is not None and _code(orig) in _NO_TABLE

    @classmethod
    def insert(cls) -> Any:
        return mysql_insert

    update_returning = False  # MariaDB's UPDATE has no RETURNING

    @classmethod
    def fenced_upsert(
        cls, dialect: Dialect, table: Any, values: dict[str, Any], keys: list[str], column: str, token: int, strict: bool
    ) -> tuple[Any, Any, Any]:
        # INSERT ... ON DUPLICATE KEY UPDATE has no WHERE: each column keeps its value unless the
        # fence lets the token through, decided once from the row's old values into @dblock_f
        # (assignments run left to right, each seeing those before it), the fence itself
        # assigned last. RETURNING gives the stored fence: the token when the row was written,
        # a newer one when the fence refused it. (It cannot give @dblock_f: MariaDB reads a
        # user variable there as it was before the statement.) In strict mode an equal token
        # refuses too, which the stored fence cannot tell from a write: a locking read of the
        # row's fence goes first, and an equal or newer one refuses before the upsert is sent.
        quote = dialect.identifier_preparer.quote
        fence = table.c[column]
        decide: Any = literal_column(f"(@dblock_f := ({quote(column)} {'<' if strict else '<='} {int(token)}))")
        stmt: Any = mysql_insert(table).values({**values, column: token})
        changed = [k for k in values if k not in keys]
        update: list[tuple[str, Any]] = []  # in this order (names: as the compiler looks them up)
        for i, k in enumerate(changed):
            flag = decide if i == 0 else literal_column("@dblock_f")
            update.append((k, func.IF(flag, stmt.inserted[k], table.c[k])))
        flag = decide if not changed else literal_column("@dblock_f")
        update.append((column, func.IF(flag, int(token), fence)))
        stmt = stmt.on_duplicate_key_update(update).returning(fence)
        first = None
        if strict and all(k in values for k in keys):
            first = select(fence).where(*[table.c[k] == values[k] for k in keys]).with_for_update()
        return first, stmt, lambda row: row is not None and row[0] == token

    # -- engines -----------------------------------------------------------------------
    @classmethod
    def engine_for_url(cls, url: URL) -> Engine:
        return _engine(pymysql_url(url))

    @classmethod
    def adopt(cls, engine: Engine) -> tuple[Engine, bool]:
        if engine.url.get_driver_name() == "pymysql" and not engine.dialect.is_async:
            check_query(engine.url)
            return engine, False
        return _engine(pymysql_url(engine.url)), True

    table_options = TABLE_OPTIONS

    @classmethod
    def serialise(cls, conn: Any, key: int) -> None:
        # A session's lock: DDL commits implicitly here, so it cannot end with a transaction.
        got = conn.execute(text("SELECT GET_LOCK(:k, 600)"), {"k": f"dblock:{key}"}).scalar()
        if got != 1:
            raise DBLockError("another migration of dblock's tables held its lock for 10 minutes: nothing was changed")

    @classmethod
    def unserialise(cls, conn: Any, key: int) -> None:
        conn.execute(text("SELECT RELEASE_LOCK(:k)"), {"k": f"dblock:{key}"})

    @classmethod
    def schema_error(
        cls, exc: BaseException, orig: BaseException, reason: str, where: str, table: str, path: str
    ) -> DBLockError:
        code = _code(orig)
        if (isinstance(exc, DBAPIError) and exc.connection_invalidated) or code in _OUTAGE:
            return DatabaseUnavailable(f"cannot reach {where}: {reason}")
        return DBLockError(f"cannot create or upgrade dblock's table {table!r} in {where}: {reason}")


# -- connections ---------------------------------------------------------------------------
# The driver's connection classes with ``fileno()``, which dblock's watchdog uses to cut a
# statement off at its deadline (it shuts the socket down).
try:
    import pymysql
    from pymysql.constants import CLIENT

    class _Connection(pymysql.connections.Connection):  # type: ignore[misc]
        def unbounded(self) -> None:
            """No socket timeout from now on (it applies at the next read or write)."""
            self._read_timeout = self._write_timeout = None

        def fileno(self) -> int:
            if self._sock is None:
                raise OSError("closed")
            return int(self._sock.fileno())

    MariaDB.errors = (pymysql.MySQLError,)
    _FLAGS = CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS
except ImportError:  # pragma: no cover - dblock[mariadb] not installed: refused when a URL asks for it
    _Connection = None  # type: ignore[assignment,misc]
    _FLAGS = 0

try:
    import aiomysql

    class _AsyncConnection(aiomysql.Connection):  # type: ignore[misc]
        @property
        def open(self) -> bool:
            return not self.closed

        def fileno(self) -> int:
            writer = self._writer
            sock = writer.transport.get_extra_info("socket") if writer is not None else None
            if sock is None:
                raise OSError("closed")
            return int(sock.fileno())
except ImportError:  # pragma: no cover
    _AsyncConnection = None  # type: ignore[assignment,misc]


def connect_params(url: URL) -> dict[str, Any]:
    """PyMySQL's connect keywords for a MariaDB URL: dblock's own connections, in autocommit,
    several statements to a text (one round trip for a transaction), affected rows counting
    the rows matched."""
    query = {key: value for key, value in url.query.items() if isinstance(value, str)}
    params: dict[str, Any] = {
        "host": url.host or "localhost",
        "port": url.port or 3306,
        "user": url.username or "",
        "password": url.password or "",
        "database": url.database or None,
        "charset": "utf8mb4",
        "autocommit": True,
        "client_flag": _FLAGS,
    }
    for key, value in query.items():
        if key == "connect_timeout":
            continue  # dblock sets it from each call's deadline
        params[key] = value
    return params


def check_query(url: URL) -> None:
    """Every argument of the URL's query must be one the driver knows: a typo (``?chraset=``)
    is a ValueError now, not a failed connection at the first call."""
    unknown = sorted(set(url.query) - _CONNECT_KEYWORDS)
    if unknown:
        raise ValueError(
            f"{display_url(url)}: unknown connection argument {unknown[0]!r} (dblock passes the query to"
            f" PyMySQL, which takes {', '.join(sorted(_CONNECT_KEYWORDS))})"
        )


def pymysql_url(url: URL) -> URL:
    """The ``mariadb+pymysql`` URL (dblock's driver) of any MariaDB or MySQL URL, checked."""
    if _Connection is None:
        raise ValueError(
            f"{display_url(url)} needs dblock's MariaDB extra: pip install 'dblock[mariadb]' (PyMySQL and aiomysql)"
        )
    check_query(url)
    return url.set(drivername="mariadb+pymysql")


def check_server(version: str, where: str) -> None:
    """dblock's MariaDB statements (RETURNING, JSON_TABLE, SET STATEMENT) need MariaDB 10.6 or newer."""
    if "mariadb" not in version.lower():
        raise DBLockError(f"{where} is MySQL {version}: dblock runs on MariaDB 10.6 or newer, not on MySQL")
    # Servers before MariaDB 11 prefix the handshake's version with "5.5.5-" for old clients.
    match = re.search(r"(\d+)\.(\d+)\.\d+-MariaDB", version, re.I)
    if match is None:
        return
    if (int(match.group(1)), int(match.group(2))) < MIN_VERSION:
        raise DBLockError(f"{where} runs MariaDB {version}: dblock needs MariaDB 10.6 or newer")


def _engine(url: URL) -> Engine:
    """An engine dblock makes for a MariaDB URL (used by ``create_schema``)."""
    connect_args = {} if "connect_timeout" in url.query else {"connect_timeout": 10}
    return create_engine(url, poolclass=NullPool, connect_args=connect_args)


def _code(exc: BaseException | None) -> int | None:
    args = getattr(exc, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _abandon(cursor: Any) -> None:
    """After an error inside a text's transaction: roll it back, so the connection is not left
    inside it holding locks (a connection the error broke is discarded by the pool)."""
    try:
        while cursor.nextset():
            pass
    except Exception:  # noqa: BLE001
        pass
    try:
        if cursor.connection is not None and cursor.connection.open:
            cursor.connection.rollback()
    except Exception:  # noqa: BLE001
        pass


async def _aabandon(cursor: Any) -> None:
    try:
        while await cursor.nextset():
            pass
    except Exception:  # noqa: BLE001
        pass
    try:
        if cursor.connection is not None and not cursor.connection.closed:
            await cursor.connection.rollback()
    except Exception:  # noqa: BLE001
        pass


def unavailable(message: str, exc: BaseException, reached: bool = True) -> DBLockError:
    """The error of a failed connect; ``reached``: a connect of this Locker's succeeded before
    (a refused connection is then the server away, not the URL)."""
    cause = misconfiguration(exc, reached)
    if cause is not None:
        under = getattr(exc, "original_exception", None) or exc.__cause__  # aiomysql's message omits it
        if under is not None and str(under) not in message:
            message = f"{message} ({under})"
        return Misconfigured(f"{message} ({cause}: not retried)")
    if _code(exc) in _PRIVILEGE:
        return PermissionDenied(message)
    return DatabaseUnavailable(message)


def misconfiguration(exc: BaseException, reached: bool) -> str | None:
    """Why a failed connect will fail again however long one waits (None: it may be an outage)."""
    code = _code(exc)
    if code in _REFUSED_LOGIN:
        return "the server refused the user or password"
    if code == _UNKNOWN_DATABASE:
        return "the database does not exist"
    if code == _UNKNOWN_HOST:
        return "the host name does not resolve"
    if code == _CANNOT_CONNECT:
        under = getattr(exc, "original_exception", None) or exc.__cause__
        if isinstance(under, socket.gaierror):
            return "the host name does not resolve"
        if isinstance(under, (ConnectionRefusedError, FileNotFoundError)) and not reached:
            return "nothing listens there, and this Locker never reached it"
    return None


def translate(exc: BaseException, where: str, table: str, schema: str | None = None) -> DBLockError:
    """A PyMySQL error of a lock statement as dblock's own."""
    code = _code(exc)
    if code in _NO_TABLE:
        return no_table(where, table, schema)
    if code in _NO_COLUMN:
        return outdated(where, table, schema, first_line(exc))  # or no table at all: the driver asks
    if code in _PRIVILEGE:
        return PermissionDenied(
            f"{where}: {first_line(exc)} (grant the privileges listed at "
            "https://dblock.readthedocs.io/en/latest/least-privilege/)"
        )
    if code in _OUTAGE or code is None:
        return DatabaseUnavailable(f"{where}: {first_line(exc)}")
    return DBLockError(f"{where}: {first_line(exc)}")


# -- the statements ---------------------------------------------------------------------
# A renewal batch's leases (bind: batch, a JSON array of [name, owner, token, ttl] arrays).
_BATCH = """JSON_TABLE(%(batch)s, '$[*]' COLUMNS (
    b_name VARCHAR(255) PATH '$[0]', b_owner VARCHAR(32) PATH '$[1]',
    b_token BIGINT PATH '$[2]', b_ttl DOUBLE PATH '$[3]')) AS b"""


def _exclusive(t: str) -> dict[str, Any]:
    # acquire
    # binds: name, owner, ttl, label
    # returns one row (granted, token, expires_at, wait): granted with this
    #   grant's token and expiry; or not, with wait = seconds until the current
    #   lease ends (<= 0 or NULL: it just ended; look again soon). A retry by the
    #   owner that holds it (after a lost reply) keeps its token and never shortens it.
    # One block, one transaction: the UPDATE locks the name's row and decides from
    # its latest committed values. Its assignments run left to right, each seeing
    # the columns assigned before it, so whether the grant is made is decided once,
    # from the old values, into @dblock_g, and owner, which the decision reads, is
    # assigned last. A miss changes nothing (no redo is written). Only a name with no
    # row reads the table's largest token (a locking read: never on the common path,
    # where two grants of the name holding it would each hold that read's lock and
    # wait for the other's). The SELECT reads the row this transaction holds locked.
    acquire = f"""BEGIN NOT ATOMIC
START TRANSACTION;
UPDATE {t} SET
    token = IF(@dblock_g := (owner IS NULL OR expires_at <= {NOW} OR owner = %(owner)s),
               IF(owner <=> %(owner)s, token, token + 1), token),
    acquired_at = IF(@dblock_g AND NOT owner <=> %(owner)s, {NOW}, acquired_at),
    label = IF(@dblock_g, %(label)s, label),
    expires_at = IF(@dblock_g, IF(owner <=> %(owner)s, GREATEST(expires_at, {EXPIRES}), {EXPIRES}), expires_at),
    owner = IF(@dblock_g, %(owner)s, owner)
WHERE name = %(name)s;
IF ROW_COUNT() = 0 THEN
    INSERT INTO {t} (name, owner, token, acquired_at, expires_at, label)
    SELECT %(name)s, %(owner)s, COALESCE(MAX(x.token), 0) + 1, {NOW}, {EXPIRES}, %(label)s FROM {t} AS x
    ON DUPLICATE KEY UPDATE name = name;
END IF;
SELECT owner <=> %(owner)s, token, expires_at, expires_at - {NOW} FROM {t} WHERE name = %(name)s;
COMMIT;
END"""
    # release
    # binds: name, owner, token
    # returns one row (token, handed) when this call ended the lease: nobody else
    #   had taken it since, even if its TTL had run out. Zero rows: already
    #   released, or taken over by another owner. The row stays; the lease is cleared.
    # ROW_COUNT() counts the rows matched (the connection's FOUND_ROWS flag).
    release = f"""UPDATE {t} SET owner = NULL, expires_at = NULL
WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s;
SELECT %(token)s, 0 FROM DUAL WHERE ROW_COUNT() > 0"""
    # release_held: a release of a lease granted with min_hold > 0
    # binds: name, owner, token, hold
    # returns one row (token, handed, held_until) when (name, owner, token) still
    #   matched: held_until is the kept lease's end (grant + hold) while that is
    #   ahead of the database's now, else NULL and the lease was ended.
    release_held = f"""UPDATE {t} SET
    expires_at = (@dblock_h := IF(acquired_at + %(hold)s > {NOW}, acquired_at + %(hold)s, NULL)),
    owner = IF(@dblock_h IS NULL, NULL, owner)
WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s;
SELECT %(token)s, 0, @dblock_h FROM DUAL WHERE ROW_COUNT() > 0"""
    # released: one row when the lease (name, token) was released and nobody holds the name.
    released = f"SELECT token FROM {t} WHERE name = %(name)s AND token = %(token)s AND owner IS NULL"
    # extend: binds name, owner, token, ttl. One row (expires_at) when the lease was still
    #   this owner's: its expiry is now the later of the old one and now + ttl (never
    #   shortened). Zero rows: released or taken over.
    extend = f"""UPDATE {t} SET expires_at = (@dblock_e := GREATEST(expires_at, {EXPIRES}))
WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s;
SELECT @dblock_e FROM DUAL WHERE ROW_COUNT() > 0"""
    # extend_many: binds batch. A row (name, token, expires_at) per lease extended, as
    #   extend; a lease without a row was released or taken over. One transaction: the
    #   rows read back are the ones this statement extended, still locked by it.
    extend_many = f"""BEGIN;
UPDATE {t} JOIN {_BATCH} ON {t}.name = b.b_name AND {t}.owner = b.b_owner AND {t}.token = b.b_token
SET {t}.expires_at = GREATEST({t}.expires_at, {CLOCK} + b.b_ttl);
SELECT {t}.name, {t}.token, {t}.expires_at FROM {t} JOIN {_BATCH}
    ON {t}.name = b.b_name AND {t}.owner = b.b_owner AND {t}.token = b.b_token;
COMMIT"""
    # prune: binds age. A row (name) per name forgotten: nobody held it for age seconds
    #   (and none was granted it for PRUNE_FLOOR seconds, whatever age says). The row holding
    #   the table's largest token is kept (a new name's first token counts from it), so
    #   tokens keep growing across prune.
    prune = f"""BEGIN;
DELETE FROM {t}
WHERE acquired_at < {NOW} - GREATEST(%(age)s, {PRUNE_FLOOR})
  AND (owner IS NULL OR expires_at < {NOW} - %(age)s)
  AND token < (SELECT m.top FROM (SELECT MAX(token) AS top FROM {t}) AS m)
RETURNING name;
COMMIT"""
    # owned (after an acquire whose reply was lost): binds name, owner. One row (token)
    #   when owner holds the name; zero rows: it does not.
    owned = f"SELECT token FROM {t} WHERE name = %(name)s AND owner = %(owner)s"
    # relabel (base.Statements): binds name, owner, token, label (channel unused: no NOTIFY
    #   here). One transaction: the row read back is the one updated, still locked by it
    #   (ROW_COUNT() would say 0 for a label set to the value it had).
    relabel = f"""BEGIN;
UPDATE {t} SET label = %(label)s WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s;
SELECT acquired_at FROM {t} WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s;
COMMIT"""
    return dict(
        acquire=acquire, holder=None, release=release, release_held=release_held, released=released, extend=extend,
        extend_many=extend_many, prune=prune, owned=owned, relabel=relabel,
    )


def _shared(t: str, h: str) -> dict[str, str]:
    live = f"name = %(name)s AND expires_at > {NOW}"
    # Inside a BEGIN NOT ATOMIC block NOW(6) is each statement's own start, not the block's:
    # a block that decides in several statements reads the time once (after the row lock).
    live_then = "name = %(name)s AND expires_at > @dblock_now"
    # share_acquire
    # binds: name, owner, ttl, label, limit, upgradeable (1: the upgradeable reader)
    # returns one row (token, expires_at, free) when granted: free is the slots the
    #   smallest live limit leaves (NULL: no limit binds). Zero rows when not (then
    #   share_holder tells how long to wait). Granted while no live writer holds the
    #   name, and fewer live holders hold it than the caller's limit and every live
    #   holder's, and no live upgradeable reader asks to upgrade (nor, for an upgradeable
    #   reader, is another live). One transaction that locks the name's row first (made if it is
    #   missing), as every statement that changes a name's holders does: the row's
    #   token plus one is the grant's, written back into the row (owner '*shared', an
    #   expiry no earlier than every live holder's), so the next grant of any kind
    #   draws above it. Holders that ran out are forgotten here, by the same moment the
    #   live ones are counted at (read once, after the row lock): a holder counted as
    #   gone is gone, and its extend can no longer bring it back beside the new grant.
    #   A second attempt with the same owner is a miss (not a retry-safe upsert), as on SQLite.
    share_acquire = f"""BEGIN NOT ATOMIC
START TRANSACTION;
SET @dblock_o = NULL, @dblock_t = NULL, @dblock_x = NULL;
SELECT owner, token, expires_at INTO @dblock_o, @dblock_t, @dblock_x FROM {t} WHERE name = %(name)s FOR UPDATE;
IF @dblock_t IS NULL THEN
    INSERT INTO {t} (name, owner, token, acquired_at, expires_at, label)
    SELECT %(name)s, NULL, COALESCE(MAX(x.token), 0) + 1, {NOW}, NULL, NULL FROM {t} AS x
    ON DUPLICATE KEY UPDATE name = name;
    SELECT owner, token, expires_at INTO @dblock_o, @dblock_t, @dblock_x FROM {t} WHERE name = %(name)s FOR UPDATE;
END IF;
SET @dblock_now = {NOW};
DELETE FROM {h} WHERE name = %(name)s AND expires_at <= @dblock_now;
SELECT COUNT(*), MIN(lim) INTO @dblock_n, @dblock_m FROM {h} WHERE {live_then};
SET @dblock_ok = (@dblock_o IS NULL OR @dblock_o = {_SHARED} OR @dblock_x <= @dblock_now)
    AND (%(limit)s IS NULL OR @dblock_n < %(limit)s) AND (@dblock_m IS NULL OR @dblock_n < @dblock_m)
    AND NOT EXISTS (SELECT 1 FROM {h} WHERE {live_then} AND upgradeable >= 2 - %(upgradeable)s),
    @dblock_e = {EXPIRES};
INSERT IGNORE INTO {h} (name, owner, token, acquired_at, expires_at, label, lim, upgradeable)
SELECT %(name)s, %(owner)s, @dblock_t + 1, @dblock_now, @dblock_e, %(label)s, %(limit)s, %(upgradeable)s
FROM DUAL WHERE @dblock_ok;
SET @dblock_ok = @dblock_ok AND ROW_COUNT() > 0;
UPDATE {t} SET owner = {_SHARED}, token = @dblock_t + 1, acquired_at = @dblock_now, label = NULL,
    expires_at = IF(@dblock_o = {_SHARED} AND @dblock_x > @dblock_e, @dblock_x, @dblock_e)
WHERE name = %(name)s AND @dblock_ok;
SELECT @dblock_t + 1, @dblock_e, LEAST(COALESCE(@dblock_m, %(limit)s), COALESCE(%(limit)s, @dblock_m)) - @dblock_n - 1
FROM DUAL WHERE @dblock_ok;
COMMIT;
END"""
    # share_holder: binds name. One row (wait): seconds until a live writer's lease
    #   ends, or else until the first live holder's ends; NULL when nothing holds it.
    share_holder = f"""SELECT COALESCE(
    (SELECT expires_at FROM {t} WHERE name = %(name)s AND owner <> {_SHARED} AND expires_at > {NOW}),
    (SELECT MIN(expires_at) FROM {h} WHERE {live})) - {NOW}"""
    # share_release: binds name, owner, token. One row (token) when this call ended the
    #   shared lease; zero rows: already released, or forgotten once it ran out. The
    #   name's row keeps the latest live holder's expiry, or is free when none is left.
    share_release = f"""BEGIN;
SELECT owner INTO @dblock_o FROM {t} WHERE name = %(name)s FOR UPDATE;
DELETE FROM {h} WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s AND @dblock_o = {_SHARED};
SET @dblock_ok = ROW_COUNT() > 0;
SELECT MAX(expires_at) INTO @dblock_x FROM {h} WHERE {live};
UPDATE {t} SET owner = IF(@dblock_x IS NULL, NULL, owner), expires_at = @dblock_x
WHERE name = %(name)s AND owner = {_SHARED} AND @dblock_ok;
SELECT %(token)s FROM DUAL WHERE @dblock_ok;
COMMIT"""
    share_released = f"""SELECT %(token)s FROM DUAL
WHERE NOT EXISTS (SELECT 1 FROM {h} WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s)"""
    # share_extend: binds name, owner, token, ttl. One row (expires_at) when the shared
    #   lease was still held (never shortened); the name's row keeps up with it.
    share_extend = f"""BEGIN;
SELECT owner INTO @dblock_o FROM {t} WHERE name = %(name)s FOR UPDATE;
UPDATE {h} SET expires_at = (@dblock_e := GREATEST(expires_at, {EXPIRES}))
WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s AND @dblock_o = {_SHARED};
SET @dblock_ok = ROW_COUNT() > 0;
UPDATE {t} SET expires_at = GREATEST(expires_at, @dblock_e) WHERE name = %(name)s AND owner = {_SHARED} AND @dblock_ok;
SELECT @dblock_e FROM DUAL WHERE @dblock_ok;
COMMIT"""
    # share_extend_many: binds batch; as extend_many, for shared leases.
    share_extend_many = f"""BEGIN;
SELECT l.name FROM {t} AS l JOIN {_BATCH} ON l.name = b.b_name WHERE l.owner = {_SHARED} FOR UPDATE;
UPDATE {h} JOIN {_BATCH} ON {h}.name = b.b_name AND {h}.owner = b.b_owner AND {h}.token = b.b_token
    JOIN {t} AS l ON l.name = {h}.name AND l.owner = {_SHARED}
SET {h}.expires_at = GREATEST({h}.expires_at, {CLOCK} + b.b_ttl),
    l.expires_at = GREATEST(l.expires_at, {CLOCK} + b.b_ttl);
SELECT {h}.name, {h}.token, {h}.expires_at FROM {h} JOIN {_BATCH}
    ON {h}.name = b.b_name AND {h}.owner = b.b_owner AND {h}.token = b.b_token
    JOIN {t} AS l ON l.name = {h}.name AND l.owner = {_SHARED};
COMMIT"""
    # upgrade, downgrade: PostgreSQL's contracts (backends/postgresql.py). One transaction
    #   each, the name's row locked first; the write lease's token is the row's plus one,
    #   as every grant of the name draws.
    upgrade = f"""BEGIN NOT ATOMIC
START TRANSACTION;
SET @dblock_o = NULL, @dblock_t = NULL, @dblock_g = NULL, @dblock_e = NULL, @dblock_w = NULL;
SELECT owner, token INTO @dblock_o, @dblock_t FROM {t} WHERE name = %(name)s FOR UPDATE;
IF @dblock_o = %(owner)s THEN
    UPDATE {t} SET expires_at = (@dblock_e := GREATEST(expires_at, {EXPIRES})) WHERE name = %(name)s;
    SET @dblock_g = 1;
ELSEIF @dblock_o = {_SHARED} THEN
    DELETE FROM {h} WHERE name = %(name)s AND expires_at <= {NOW};
    IF EXISTS (SELECT 1 FROM {h} WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s
               AND upgradeable > 0) THEN
        SELECT COUNT(*), MIN(expires_at) INTO @dblock_n, @dblock_x FROM {h}
        WHERE name = %(name)s AND owner <> %(owner)s;
        IF @dblock_n > 0 THEN
            UPDATE {h} SET upgradeable = 2 WHERE name = %(name)s AND owner = %(owner)s AND upgradeable = 1;
            SET @dblock_g = 0, @dblock_w = @dblock_x - {NOW};
        ELSE
            SELECT label INTO @dblock_l FROM {h} WHERE name = %(name)s AND owner = %(owner)s;
            DELETE FROM {h} WHERE name = %(name)s AND owner = %(owner)s;
            SET @dblock_t = @dblock_t + 1, @dblock_e = {EXPIRES}, @dblock_g = 1;
            UPDATE {t} SET owner = %(owner)s, token = @dblock_t, acquired_at = {NOW}, expires_at = @dblock_e,
                label = @dblock_l
            WHERE name = %(name)s;
        END IF;
    END IF;
END IF;
SELECT @dblock_g, IF(@dblock_g, @dblock_t, NULL), @dblock_e, @dblock_w FROM DUAL WHERE @dblock_g IS NOT NULL;
COMMIT;
END"""
    downgrade = f"""BEGIN NOT ATOMIC
START TRANSACTION;
SET @dblock_o = NULL, @dblock_t = NULL, @dblock_l = NULL, @dblock_r = NULL, @dblock_e = NULL;
SELECT owner, token, label INTO @dblock_o, @dblock_t, @dblock_l FROM {t} WHERE name = %(name)s FOR UPDATE;
IF @dblock_o = %(owner)s THEN
    SET @dblock_r = @dblock_t + 1, @dblock_e = {EXPIRES};
    UPDATE {t} SET owner = {_SHARED}, token = @dblock_r, acquired_at = {NOW}, expires_at = @dblock_e, label = NULL
    WHERE name = %(name)s;
    INSERT INTO {h} (name, owner, token, acquired_at, expires_at, label, lim, upgradeable)
    VALUES (%(name)s, %(owner)s, @dblock_r, {NOW}, @dblock_e, @dblock_l, NULL, 1)
    ON DUPLICATE KEY UPDATE token = VALUES(token), acquired_at = VALUES(acquired_at),
        expires_at = VALUES(expires_at), label = VALUES(label), lim = NULL, upgradeable = 1;
ELSEIF @dblock_o = {_SHARED} THEN
    SELECT token, expires_at INTO @dblock_r, @dblock_e FROM {h}
    WHERE name = %(name)s AND owner = %(owner)s AND upgradeable > 0 AND expires_at > {NOW};
    UPDATE {h} SET upgradeable = 1
    WHERE name = %(name)s AND owner = %(owner)s AND upgradeable > 0 AND expires_at > {NOW};
END IF;
SELECT @dblock_r, @dblock_e FROM DUAL WHERE @dblock_r IS NOT NULL;
COMMIT;
END"""
    remaining = "{0}.expires_at - " + NOW
    return dict(
        upgrade=upgrade, downgrade=downgrade,
        share_acquire=share_acquire, share_release=share_release, share_released=share_released,
        share_extend=share_extend, share_extend_many=share_extend_many,
        leases=leases_statement(t, h, NOW, remaining, "0", "1"),
        leases_of=leases_statement(t, h, NOW, remaining, "0", "1", "%(name)s"),
        share_holder=share_holder,
        share_owned=f"SELECT token FROM {h} WHERE name = %(name)s AND owner = %(owner)s",
        share_prune=f"DELETE FROM {h} WHERE expires_at < {NOW} - %(age)s RETURNING name",
    )

