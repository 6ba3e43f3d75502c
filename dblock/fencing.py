"""Fenced writes: the guarded resource refuses a token older than the newest it accepted.

Everything here runs on the *caller's* connection or Session, inside the
caller's transaction, so the fence and the protected write commit or roll back
together. Three tools, from the cheapest:

- ``fenced_update`` / ``fenced_upsert``: the guarded table has a token column
  (``fence_token BIGINT NOT NULL DEFAULT 0``); the check and the write are one
  statement. ``fenced_read`` stamps the rows a read-modify-write reads, in the
  statement that reads them.
- ``fence``: a row of dblock's fences table guards a resource that has no
  column to spare; checked and bumped in the caller's transaction.
- ``check_lease`` / ``commit_guard``: fail closed at commit time. The lease
  itself must still be the live one, and stays so until the commit.

Each helper is a thin shell: its checks, statements and decisions are a plan
(``update_plan``, ``read_plan``, ``upsert_plan``, ``fence_plan``,
``check_plan``; see ``dblock._plan``) that this module runs on a Connection or
Session, and ``dblock.aio_fencing`` on an AsyncConnection or AsyncSession.
One source for the SQL of both faces.

A lease here is dblock's ``Lease``, its asyncio ``AsyncLease``, or any object
with their attributes (``LeaseLike``): nothing but those attributes is used.
"""

from __future__ import annotations

import functools
import sqlite3
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, NamedTuple, Protocol, TypeGuard, Union

import psycopg
from sqlalchemy import Column, Table, case, event, inspect, literal, select, text, update
from sqlalchemy.engine import Connection, Dialect, Result
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Update
from sqlalchemy.sql.selectable import Select

from . import backends, metrics
from ._plan import Plan, Probe, Run, run
from ._validate import check_identifier, check_name, check_text, check_token
from .errors import FencedOut, LeaseLost, SchemaMissing
from .schema import DEFAULT_TABLE, fences_table, holders_table_name

Target = Union[Connection, Session]
DEFAULT_COLUMN = "fence_token"


class LockerLike(Protocol):
    """Where a lease lives: its Locker's (or AsyncLocker's) lock table and schema."""

    @property
    def table(self) -> str: ...

    @property
    def schema(self) -> str | None: ...


class LeaseLike(Protocol):
    """A lease as fencing sees it: a ``Lease``, an ``AsyncLease``, or any object with these attributes."""

    @property
    def name(self) -> str: ...

    @property
    def owner(self) -> str: ...

    @property
    def token(self) -> int: ...

    @property
    def locker(self) -> LockerLike: ...


TokenLike = Union[LeaseLike, int]


def is_lease(value: object) -> TypeGuard[LeaseLike]:
    """Whether ``value`` is lease-like: ``name``, ``owner``, ``token``, a ``locker`` with ``table`` and ``schema``."""
    if isinstance(value, int):
        return False
    locker = getattr(value, "locker", None)
    return all(hasattr(value, a) for a in ("name", "owner", "token")) and all(
        hasattr(locker, a) for a in ("table", "schema")
    )


def token_of(lease: TokenLike) -> int:
    """The fencing token of a lease, or a token passed as an int (e.g. ``$DBLOCK_TOKEN``)."""
    return check_token(lease.token if is_lease(lease) else lease)


class LeaseRef(NamedTuple):
    """A lease's identity and the lock table it lives in, checked (what ``check_plan`` compares)."""

    name: str
    owner: str
    token: int
    table: str
    schema: str | None
    shared: bool = False  # a reader's or semaphore holder's lease (a row of the holders table)


def lease_ref(lease: object, what: str) -> LeaseRef:
    """``lease``'s LeaseRef, or TypeError/ValueError before any SQL (``what`` names the caller)."""
    if not is_lease(lease):
        raise TypeError(f"{what} needs a Lease, not {type(lease).__name__}")
    locker = lease.locker
    return LeaseRef(
        check_name(lease.name),
        check_text(lease.owner, "lease owner"),
        check_token(lease.token),
        check_identifier(locker.table, "table"),
        None if locker.schema is None else check_identifier(locker.schema, "schema"),
        bool(getattr(lease, "shared", False)),
    )


# -- a token column on the guarded table ----------------------------------------
def fenced(stmt: Update, lease: TokenLike, *, column: str = DEFAULT_COLUMN, strict: bool = False) -> Update:
    """``stmt`` with the fence added: ``AND <column> <= :token`` and ``SET <column> = :token``.

    With ``strict=True`` the predicate is ``<`` (``WHERE token > last_token``):
    each grant may write a row once. Works on Core ``update(table)`` and on
    ORM ``update(Model)``. Execute it with ``fenced_update`` to learn about a
    refusal, or yourself and read ``rowcount``.
    """
    token = token_of(lease)
    col = _token_column(stmt, column)
    return stmt.where(col < token if strict else col <= token).values({col: token})


def fenced_update(
    conn: Target, stmt: Update, lease: TokenLike, *, column: str = DEFAULT_COLUMN, strict: bool = False
) -> Result[Any]:
    """Run ``fenced(stmt, lease)`` in the caller's transaction; raise FencedOut if the fence refused it.

    One statement when it writes. When it wrote nothing, one more SELECT tells
    a refusal (a row your WHERE matches carries a newer token: FencedOut) from
    no rows at all (returned as is, rowcount 0: not a fence failure). With
    ``.returning(...)`` the result holds the returned rows (already fetched).
    """
    return run(conn, update_plan(stmt, lease, column, strict))


def update_plan(stmt: Update, lease: TokenLike, column: str, strict: bool) -> Plan[Result[Any]]:
    """``fenced_update``'s plan, for either face."""
    token = token_of(lease)
    col = _token_column(stmt, column)
    result: Result[Any] = yield Run(fenced(stmt, token, column=column, strict=strict))
    if stmt._returning:
        # SQLite reports no rowcount for UPDATE ... RETURNING: count the rows.
        frozen = result.freeze()
        written = len(frozen.data)
        result = frozen()
    else:
        written = result.rowcount  # type: ignore[attr-defined]
    if written == 0:
        # Under READ COMMITTED this is a new snapshot: it sees the newer write
        # that made the UPDATE skip a row it had waited for.
        newer = col >= token if strict else col > token
        query = select(col).where(newer).order_by(col.desc()).limit(1)
        if stmt.whereclause is not None:
            query = query.where(stmt.whereclause)
        winner = (yield Run(query)).scalar()
        if winner is not None:
            raise refused(lease, f"table {col.table.name!r}", winner, strict)
    return result


def fenced_read(conn: Target, stmt: Select[Any], lease: TokenLike, *, column: str = DEFAULT_COLUMN) -> Result[Any]:
    """Stamp the lease's token on the rows ``stmt`` selects and return them, in one ``UPDATE ... RETURNING``.

    The read of a read-modify-write. A fence orders writes, not reads: a newer
    holder that reads a row before an older holder's late write lands would
    overwrite that write, and both writes pass their fence. Read through the
    stamp instead: once this token is on the rows, an older holder's write to
    them is refused, and a newer holder's stamp waits until this transaction
    ends (the UPDATE locks the rows), so it reads what this one wrote. Then
    write with ``fenced_update`` (default mode: ``strict=True`` would refuse
    the stamp you just made) in the same transaction.

    ``stmt`` is a ``select()`` of one table's columns, the table or a mapped
    class, with any WHERE: ``select(t.c.n).where(t.c.id == 1)``,
    ``select(Account).where(Account.id == 1)``. It runs as ``UPDATE <table> SET
    <column> = <token> (where lower) WHERE ... RETURNING ...``, and the result
    reads like the select's (through a Session, mapped objects come back
    refreshed from the row). A token is never lowered; if a row it matches
    carries a newer token, FencedOut is raised: roll back. Rows that do not
    exist yet are not stamped (none are returned).
    """
    return run(conn, read_plan(conn, stmt, lease, column))


def read_plan(conn: Target, stmt: Select[Any], lease: TokenLike, column: str) -> Plan[Result[Any]]:
    """``fenced_read``'s plan, for either face (``conn``: the sync Connection or Session, not executed on)."""
    token = token_of(lease)
    if not isinstance(conn, (Connection, Session)):
        raise TypeError(f"fenced_read needs a SQLAlchemy Connection or Session, not {type(conn).__name__}")
    target, table, returning = _read_target(stmt, column)
    col = table.c[column]
    _check_not_null(col)
    # A CASE rather than "AND fence_token <= :token": a row with a newer token
    # must be seen (and refused), not silently left out of what was read.
    bound = literal(token, col.type)
    stamp = update(target).values({col: case((col < bound, bound), else_=col)})
    if stmt.whereclause is not None:
        stamp = stamp.where(stmt.whereclause)
    # Through a Session, objects come back refreshed from the stamped row;
    # nothing else in the session is touched (a stale copy elsewhere fails its own flush).
    options = {"synchronize_session": False, "populate_existing": True} if isinstance(conn, Session) else {}
    stamped: Result[Any]
    if _backend_for(_dialect(conn)).update_returning:
        # The stored token comes back after the caller's columns, under a name of its own.
        stamp = stamp.returning(*returning, col.label("dblock_fence_token"))
        stamped = yield Run(stamp, options=options)
    else:
        # No UPDATE ... RETURNING (MariaDB): stamp, then read the rows the stamp matched, which it
        # holds locked until the transaction ends (a locking read, so the latest rows).
        yield Run(stamp, options={"synchronize_session": False} if isinstance(conn, Session) else {})
        read = select(*returning, col.label("dblock_fence_token")).with_for_update()
        if stmt.whereclause is not None:
            read = read.where(stmt.whereclause)
        read_options = {"populate_existing": True} if isinstance(conn, Session) else {}
        stamped = yield Run(read, options=read_options)
    frozen = stamped.freeze()
    newest = max((row[-1] for row in frozen.data), default=None)
    if newest is not None and newest > token:
        raise refused(
            lease, f"table {table.name!r}", newest, False, verb="read-modify-write these rows", outcome="roll back"
        )
    return frozen().columns(*range(len(returning)))


# What fenced_read may find in a select: the columns and the WHERE; the rest
# (ORDER BY, LIMIT, joins, DISTINCT, FOR UPDATE, ...) an UPDATE cannot keep.
_PLAIN_SELECT = {"_raw_columns", "_where_criteria", "_label_style", "_propagate_attrs", "_annotations"}
_CLAUSE_NAMES = {
    "_order_by_clauses": "ORDER BY",
    "_group_by_clauses": "GROUP BY",
    "_having_criteria": "HAVING",
    "_limit_clause": "LIMIT",
    "_offset_clause": "OFFSET",
    "_fetch_clause": "FETCH",
    "_for_update_arg": "FOR UPDATE",
    "_distinct": "DISTINCT",
    "_distinct_on": "DISTINCT ON",
    "_setup_joins": "a join",
    "_from_obj": "select_from()",
    "_with_options": "loader options",
    "_independent_ctes": "a CTE",
    "_params": "params()",
}


def _read_target(stmt: Any, column: str) -> tuple[Any, Table, list[Any]]:
    """For fenced_read: (what to UPDATE, its table, what to RETURN), or an error before any SQL."""
    if not isinstance(stmt, Select):
        raise TypeError(f"fenced_read needs a select() statement, not {type(stmt).__name__}")
    hint = "stamp the rows with a plain fenced_read first, then run your query in the same transaction"
    for name, _ in Select._traverse_internals:
        if name not in _PLAIN_SELECT and _is_set(getattr(stmt, name, None)):
            what = _CLAUSE_NAMES.get(name, name.strip("_").replace("_", " "))
            raise ValueError(f"fenced_read takes a select of one table and a WHERE, not one with {what}: {hint}")
    froms = stmt.get_final_froms()
    if len(froms) != 1 or not isinstance(froms[0], Table):
        raise ValueError(f"fenced_read reads from exactly one table, not {len(froms)} FROM items: {hint}")
    table = froms[0]
    if column not in table.c:
        raise ValueError(f"table {table.name!r} has no {column!r} column to fence with (see dblock.orm.Fenced)")
    for selected in stmt.selected_columns:
        if not isinstance(selected, Column) or selected.table is not table:
            raise ValueError(f"fenced_read returns the table's own columns, not {selected}: {hint}")
    descriptions = stmt.column_descriptions
    entity = next((d["entity"] for d in descriptions if d.get("entity") is not None), None)
    return (table if entity is None else entity), table, [d["expr"] for d in descriptions]


def _is_set(value: Any) -> bool:
    # Not bool(value): a SQL clause refuses to be a truth value.
    if value is None or value is False:
        return False
    if isinstance(value, (tuple, list, Mapping)):
        return len(value) > 0
    return True


def fenced_upsert(
    conn: Target,
    table: Any,
    values: Mapping[str, Any],
    lease: TokenLike,
    *,
    index_elements: list[str] | None = None,
    column: str = DEFAULT_COLUMN,
    strict: bool = False,
) -> None:
    """Insert a row, or update it if the fence lets this token through (one statement).

    ``INSERT ... ON CONFLICT (index_elements) DO UPDATE SET ... WHERE <column> <= :token``;
    a new row is stamped with the token. ``table`` is a Table or a mapped class,
    ``values`` one row by column name, ``index_elements`` the conflict target
    (default: the primary key). Raises FencedOut when the row exists with a
    newer token; nothing is written then.
    """
    run(conn, upsert_plan(conn, table, values, lease, index_elements, column, strict))


def upsert_plan(
    conn: Target,
    table: Any,
    values: Mapping[str, Any],
    lease: TokenLike,
    index_elements: list[str] | None,
    column: str,
    strict: bool,
) -> Plan[None]:
    """``fenced_upsert``'s plan, for either face (``conn``: the sync Connection or Session, not executed on)."""
    token = token_of(lease)
    t = _table(table)
    if column not in t.c:
        raise ValueError(f"table {t.name!r} has no {column!r} column to fence with (see dblock.orm.Fenced)")
    _check_not_null(t.c[column])
    if not isinstance(values, Mapping) or not values:
        raise ValueError("values must be a non-empty mapping of column name to value")
    unknown = [k for k in values if k not in t.c]
    if unknown:
        raise ValueError(f"table {t.name!r} has no column {unknown[0]!r}")
    if column in values:
        raise ValueError(f"do not set {column!r} yourself: the fence stamps it with the lease's token")
    keys = list(index_elements) if index_elements is not None else [c.name for c in t.primary_key.columns]
    if not keys or any(k not in t.c for k in keys):
        raise ValueError(f"index_elements must name columns of {t.name!r} with a unique index, not {keys!r}")
    dialect = _dialect(conn)
    fence_col = t.c[column]
    first, stmt, passed = _backend_for(dialect).fenced_upsert(dialect, t, dict(values), keys, column, token, strict)
    stored = None if first is None else (yield Run(first)).scalar()
    if (stored is not None and (stored >= token if strict else stored > token)) or not passed(
        (yield Run(stmt)).first()
    ):  # the row exists and the fence refused this token
        key = {k: values[k] for k in keys if k in values}
        winner = None
        if len(key) == len(keys):
            winner = (yield Run(select(fence_col).where(*[t.c[k] == v for k, v in key.items()]))).scalar()
        raise refused(lease, f"table {t.name!r}", winner, strict)


# -- the fences table -----------------------------------------------------------
def fence(
    conn: Target,
    lease: TokenLike,
    resource: str | None = None,
    *,
    strict: bool = False,
    table: str | None = None,
    schema: str | None = None,
) -> None:
    """Check and bump the fence of ``resource`` (default: the lease's name) in the caller's transaction.

    Raises FencedOut if the resource already accepted a newer token (``strict``:
    this token or a newer one). Otherwise records the token; the row stays
    locked until the transaction ends, so the caller's other writes in that
    transaction commit only together with a passed fence. ``table``/``schema``
    name dblock's lock table (default: the lease's Locker's; ``locks``).
    """
    run(conn, fence_plan(conn, lease, resource, strict, table, schema))


def fence_plan(
    conn: Target, lease: TokenLike, resource: str | None, strict: bool, table: str | None, schema: str | None
) -> Plan[None]:
    """``fence``'s plan, for either face (``conn``: the sync Connection or Session, not executed on)."""
    token = token_of(lease)
    if resource is None:
        if not is_lease(lease):
            raise TypeError("pass resource= when fencing with a bare token")
        resource = lease.name
    check_name(resource)
    if table is None:
        table = lease.locker.table if is_lease(lease) else DEFAULT_TABLE
    if schema is None and is_lease(lease):
        schema = lease.locker.schema
    t = _fences(check_identifier(table, "table"), None if schema is None else check_identifier(schema, "schema"))
    dialect = _dialect(conn)
    first, stmt, passed = _backend_for(dialect).fenced_upsert(
        dialect, t, {"resource": resource}, ["resource"], "last_token", token, strict
    )
    with _schema_hint(t.name, dialect):
        stored = None if first is None else (yield Run(first)).scalar()
        refused_first = stored is not None and (stored >= token if strict else stored > token)
        row = None if refused_first else (yield Run(stmt)).first()
    if refused_first or not passed(row):
        winner = (yield Run(select(t.c.last_token).where(t.c.resource == resource))).scalar()
        raise refused(lease, f"resource {resource!r}", winner, strict)


# -- commit-time lease check (fail closed) ----------------------------------------
def check_lease(conn: Target, lease: LeaseLike) -> None:
    """In the caller's transaction: raise LeaseLost unless ``lease`` is the live lease now (database time).

    On success the lease cannot be taken over until this transaction ends: the
    lock row is held ``FOR SHARE`` on PostgreSQL; on SQLite the check is a
    write, so the transaction holds the database's write lock. Call it as the
    last statement before commit, or use ``commit_guard``. Do not release or
    extend the lease from the same thread before that commit: both wait for it.
    """
    run(conn, check_plan(conn, lease_ref(lease, "check_lease")))


def check_plan(conn: Target, lease: LeaseRef) -> Plan[None]:
    """``check_lease``'s plan, for either face (``conn``: the sync Connection or Session, not executed on)."""
    dialect = _dialect(conn)
    if (yield Probe(_in_autocommit)):
        raise ValueError("check_lease needs a transaction: on an AUTOCOMMIT connection its lock would end at once")
    quote = dialect.identifier_preparer.quote
    prefix = quote(lease.schema) + "." if lease.schema else ""
    backend = backends.of(dialect)  # its statement keeps the lease from a takeover until the commit
    if lease.shared:
        sql = backend.shared_check(prefix + quote(lease.table), prefix + quote(holders_table_name(lease.table)))
    else:
        sql = backend.lease_check(prefix + quote(lease.table))
    with _schema_hint(lease.table, dialect):
        row = (yield Run(text(sql), {"name": lease.name, "owner": lease.owner, "token": lease.token})).first()
    if row is None:
        raise LeaseLost(
            f"lease on {lease.name!r} (token {lease.token}) is no longer the live lease: "
            "it expired, was released, or another owner took it; roll back"
        )


@contextmanager
def commit_guard(conn: Target, lease: LeaseLike) -> Iterator[Target]:
    """``with commit_guard(session_or_conn, lease):`` commits at the end only if the lease is still live.

    On a clean exit it commits, and every commit inside the block (yours
    included) first runs ``check_lease`` as the transaction's last statement
    (after a Session's final flush). When the check fails the transaction is
    rolled back and LeaseLost raised; on any other error the block rolls back.
    An AUTOCOMMIT connection is refused with ValueError on entering, before
    the block runs.
    """
    ref = lease_ref(lease, "commit_guard")
    if not isinstance(conn, (Connection, Session)):
        raise TypeError(f"commit_guard needs a SQLAlchemy Connection or Session, not {type(conn).__name__}")
    refuse_autocommit(conn, "commit_guard")
    with checked_commits(conn, ref):
        try:
            yield conn
            conn.commit()
        except BaseException:
            conn.rollback()
            raise


@contextmanager
def checked_commits(conn: Target, lease: LeaseRef) -> Iterator[None]:
    """While the block lasts, every commit of ``conn`` first runs ``check_plan`` as its last statement.

    Shared by both faces' ``commit_guard``. These are SQLAlchemy's sync
    events, on the Session or Connection itself; for an AsyncSession or
    AsyncConnection pass its ``sync_session`` or ``sync_connection``: its
    commit runs them in SQLAlchemy's greenlet, where the check's statement
    goes through the asyncio driver like any other.
    """

    def before_commit(session: Session) -> None:
        session.flush()  # the check must come after the last write
        run(session, check_plan(session, lease))

    def on_commit(connection: Connection) -> None:
        try:
            run(connection, check_plan(connection, lease))
        except BaseException:
            # SQLAlchemy calls this just before the driver's COMMIT: roll the
            # driver's transaction back first, so nothing of it can commit.
            connection.connection.dbapi_connection.rollback()  # type: ignore[union-attr]
            raise

    if isinstance(conn, Session):
        event.listen(conn, "before_commit", before_commit)
    else:
        event.listen(conn, "commit", on_commit)
    try:
        yield
    finally:
        if isinstance(conn, Session):
            event.remove(conn, "before_commit", before_commit)
        else:
            event.remove(conn, "commit", on_commit)


# -- helpers --------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _fences(table: str, schema: str | None) -> Table:
    # One Table object per name: SQLAlchemy caches compiled statements per
    # Table, so a fresh one per call would compile the upsert every time.
    return fences_table(table, schema)


def _dialect(conn: Target) -> Dialect:
    if isinstance(conn, Session):
        return conn.get_bind().dialect
    if isinstance(conn, Connection):
        return conn.dialect
    raise TypeError(f"expected a SQLAlchemy Connection or Session, not {type(conn).__name__}")


def _backend_for(dialect: Dialect) -> type[backends.Backend]:
    try:
        return backends.of(dialect)
    except ValueError:
        raise ValueError(f"dblock's fenced upserts support PostgreSQL, MariaDB and SQLite, not {dialect.name}") from None


def _table(table: Any) -> Table:
    if isinstance(table, Table):
        return table
    try:
        found = inspect(table).local_table  # a mapped class
    except Exception:  # noqa: BLE001 - any failure means "not a table"
        found = None
    if not isinstance(found, Table):
        raise TypeError(f"expected a Table or a mapped class, not {table!r}")
    return found


def _token_column(stmt: Update, column: str) -> Column[Any]:
    if not isinstance(stmt, Update):
        raise TypeError(f"expected an update() statement, not {type(stmt).__name__}")
    table = stmt.table
    columns = getattr(table, "c", None)
    if columns is None or column not in columns:
        name = getattr(table, "name", table)
        raise ValueError(f"table {name!r} has no {column!r} column to fence with (see dblock.orm.Fenced)")
    col: Column[Any] = columns[column]
    _check_not_null(col)
    if any(getattr(k, "key", k) == column for k in (stmt._values or {})):
        raise ValueError(f"do not set {column!r} yourself: the fence stamps it with the lease's token")
    return col


def _check_not_null(col: Column[Any]) -> None:
    if col.nullable:
        # NULL <= :token is not true: a NULL fence would refuse every write, silently.
        raise ValueError(f"fence column {col.name!r} must be NOT NULL DEFAULT 0, not nullable")


def refuse_autocommit(conn: Target, what: str) -> None:
    """Raise ValueError, before anything runs, if ``conn`` would commit each statement on its own.

    On an AUTOCOMMIT connection every write in a guarded block would commit
    at once, unchecked; finding out at the block's end is too late.
    """
    # A Session has no connection before its first statement: take the one it
    # will use, and give it back untouched if we refuse (close, not rollback:
    # a rollback would expire every loaded object).
    fresh = isinstance(conn, Session) and not conn.in_transaction()
    if not _in_autocommit(conn):
        return
    if fresh and isinstance(conn, Session):
        transaction = conn.get_transaction()
        if transaction is not None:
            transaction.close()
    raise ValueError(
        f"{what} needs a transaction: on an AUTOCOMMIT connection each write would commit at once, "
        "unchecked; use a connection in a transaction (the default)"
    )


def _in_autocommit(conn: Target) -> bool:
    # The driver's own connection: psycopg's, sqlite3's or PyMySQL's, or under SQLAlchemy's
    # asyncio extension psycopg's AsyncConnection or aiosqlite's Connection
    # (loaded by whoever made it: dblock does not import aiosqlite).
    connection = conn.connection() if isinstance(conn, Session) else conn
    driver = connection.connection.driver_connection
    if isinstance(driver, (psycopg.Connection, psycopg.AsyncConnection)):
        return bool(driver.autocommit)
    aiosqlite = sys.modules.get("aiosqlite")
    if isinstance(driver, sqlite3.Connection) or (aiosqlite is not None and isinstance(driver, aiosqlite.Connection)):
        return driver.isolation_level is None
    get_autocommit = getattr(driver, "get_autocommit", None)  # PyMySQL's and aiomysql's
    if callable(get_autocommit):
        return bool(get_autocommit())
    return False


def refused(
    lease: TokenLike,
    what: str,
    winner: int | None,
    strict: bool,
    *,
    verb: str = "write",
    outcome: str = "nothing was written",
) -> FencedOut:
    """The FencedOut for ``lease``'s token refused by ``what``, which accepted ``winner`` (None: unknown).

    Shared with ``dblock.orm``, whose flushes are refused the same way. Every
    refusal comes through here, so here it is counted (``dblock.metrics``).
    """
    token = token_of(lease)
    metrics.recorder.fenced_out(lease.name if is_lease(lease) else None)
    if winner is None:
        accepted = "this token or a newer one (strict: one write per grant)" if strict else "a newer token"
    elif winner == token:
        accepted = f"token {winner} once already (strict: one write per grant)"
    else:
        accepted = f"newer token {winner}"
    return FencedOut(
        f"fenced out: {what} already accepted {accepted}, so token {token} may not {verb}; "
        f"{outcome} (if your lease expired, another holder has taken over)",
        token=token,
        resource=what,
        newer=winner,
    )


@contextmanager
def _schema_hint(table: str, dialect: Dialect) -> Iterator[None]:
    try:
        yield
    except DBAPIError as exc:
        if backends.of(dialect).missing_table(exc.orig):
            raise SchemaMissing(
                f"dblock's table {table!r} is missing: run `dblock migrate` or call Locker.create_schema()"
            ) from exc
        raise
