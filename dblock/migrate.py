"""Run dblock's Alembic migrations (the one source of its schema), or fit them into an app's.

Two ways to create dblock's tables (README, "Adding dblock to an existing app"):

- dblock's own history: ``Locker.create_schema()`` or ``dblock migrate``, recorded
  in dblock's own version table, never the app's ``alembic_version``;
- the app's history: the app lists ``dblock:_migrations/versions`` in its
  ``version_locations`` and runs ``alembic upgrade heads`` (branch ``dblock``).

Either way the app's autogenerate must not see dblock's tables: ``exclude_dblock``.
``upgrade`` reads first and changes nothing when the tables are already at dblock's
head, whichever history made them, so a role without CREATE can call it then.
"""

from __future__ import annotations

import io
import logging
import os
import sqlite3
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import psycopg
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import column, inspect, select, text
from sqlalchemy import table as table_clause
from sqlalchemy.engine import Connection, Engine, Inspector
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from ._redact import display_url
from ._validate import check_identifier
from .errors import DatabaseUnavailable, DBLockError, PermissionDenied, ReplicationWarning
from .schema import (
    DEFAULT_TABLE,
    default_sqlite_path,
    fences_table,
    fences_table_name,
    locks_table,
    holders_table,
    holders_table_name,
    procs_table,
    procs_table_name,
    token_index_name,
    waiters_table,
    waiters_table_name,
    token_sequence_name,
    version_table_name,
)

log = logging.getLogger("dblock.migrate")

IncludeObject = Callable[[Any, "str | None", str, bool, Any], bool]


def migrations_dir() -> Path:
    """The ``migrations`` folder: inside the installed wheel, or beside the package in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_migrations", here.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(f"dblock's migrations are missing (looked in {here / '_migrations'})")


def target() -> tuple[str, str | None]:
    """For dblock's migration scripts: the (table, schema) being migrated.

    dblock's own env.py puts them in ``config.attributes``. Run from an app's
    history instead, they come from the app's ``alembic.ini`` main section
    (``dblock_table``, ``dblock_schema``), else the default table ``locks``.
    """
    from alembic import context

    config = context.config
    attributes = config.attributes
    if "dblock_table" in attributes:
        return attributes["dblock_table"], attributes["dblock_schema"]
    table = check_identifier(config.get_main_option("dblock_table", DEFAULT_TABLE), "dblock_table")
    schema = config.get_main_option("dblock_schema")
    return table, None if not schema else check_identifier(schema, "dblock_schema")


def exclude_dblock(
    *tables: str, schema: str | None = None, include_object: IncludeObject | None = None
) -> IncludeObject:
    """An ``include_object`` hook for an app's env.py: autogenerate leaves dblock's tables alone.

    It hides the lock tables named in ``tables`` (default ``locks``) in
    ``schema``, their fences tables and dblock's version tables, so that
    ``alembic revision --autogenerate`` never proposes dropping them. Other
    objects go to the app's own ``include_object``, if given.
    """
    names = [check_identifier(t, "table") for t in tables or (DEFAULT_TABLE,)]
    schema = None if schema is None else check_identifier(schema, "schema")
    hidden = {
        n
        for t in names
        for n in (
            t, fences_table_name(t), version_table_name(t), waiters_table_name(t), procs_table_name(t),
            holders_table_name(t),
        )
    }

    def include(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if type_ == "table" and name in hidden and obj.schema == schema:
            return False
        return include_object is None or include_object(obj, name, type_, reflected, compare_to)

    return include


def alembic_config(table: str, schema: str | None) -> Config:
    cfg = Config(stdout=io.StringIO())
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["dblock_table"] = table
    cfg.attributes["dblock_schema"] = schema
    return cfg


def upgrade(engine: Engine, table: str, schema: str | None, revision: str = "heads") -> None:
    """Bring dblock's tables to ``revision``, safely when several processes race to do it.

    To the head, it first looks without writing: tables already there, made by
    dblock's history or by the app's own (README, "Adding dblock to an existing
    app"), are left as they are.
    """
    if engine.dialect.name == "postgresql":
        check_replication(engine)
    if revision == "heads" and _at_head(engine, table, schema):
        return
    cfg = alembic_config(table, schema)
    if engine.dialect.name == "sqlite":
        # SQLite's DDL is transactional; BEGIN IMMEDIATE takes the write lock up
        # front so a racing create_schema waits and then finds the tables made.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
            except BaseException:
                conn.exec_driver_sql("ROLLBACK")
                raise
            conn.exec_driver_sql("COMMIT")
        return
    with engine.begin() as conn:
        # Serialise concurrent migrations of this table; released at commit.
        key = zlib.crc32(f"dblock:{schema}.{table}".encode())
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


# What the server tells about its replication, readable by any role: the physical WAL
# senders (one per streaming standby; a logical one is connected to a database), the
# synchronous standby names, and the synchronous_commit its sessions get.
_REPLICATION = """
SELECT pg_is_in_recovery(),
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender' AND datname IS NULL),
       current_setting('synchronous_standby_names'),
       current_setting('synchronous_commit')"""


def check_replication(engine: Engine) -> str | None:
    """Warn (``ReplicationWarning``, and on the ``dblock.migrate`` logger) when the server
    streams to standbys that do not confirm commits: after a failover to one of them, a token
    could be handed out again. Returns the warning's text, or None when there is nothing to say."""
    with engine.connect() as conn:
        recovery, standbys, names, commit = conn.execute(text(_REPLICATION)).one()
    if recovery or not standbys:
        return None  # a standby itself, or no standby to fail over to
    if names.strip() and commit not in ("off", "local"):
        return None
    why = (
        "synchronous_standby_names is empty"
        if not names.strip()
        else f"synchronous_commit is {commit!r} (commits do not wait for a standby)"
    )
    message = (
        f"{display_url(engine.url)} streams to {standbys} standby(s) asynchronously ({why}): after a "
        "failover the promoted standby may lack grants and hand out a fencing token again. dblock's "
        "guarantees across a failover need synchronous replication (README, High availability)"
    )
    log.warning("%s", message)
    warnings.warn(message, ReplicationWarning, stacklevel=4)  # at create_schema()'s caller
    return message


def downgrade(engine: Engine, table: str, schema: str | None, revision: str = "base") -> None:
    cfg = alembic_config(table, schema)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def sql(url: str, table: str, schema: str | None, revision: str = "heads") -> str:
    """The DDL that ``upgrade`` would run, as text (offline mode)."""
    out = io.StringIO()
    cfg = alembic_config(table, schema)
    cfg.stdout = out
    cfg.output_buffer = out
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # ini values interpolate %
    command.upgrade(cfg, revision, sql=True)
    return out.getvalue()


# -- is there anything to do? ----------------------------------------------------
_UNREADABLE = frozenset({"<unreadable>"})  # a version table this role may not SELECT from


def _at_head(engine: Engine, table: str, schema: str | None) -> bool:
    """True if dblock's tables are already at its head revision, whichever history made them.

    Only reads (the catalog, and version tables where the role may), so the
    README's least-privilege role can call ``create_schema()`` on a current
    database. False when dblock's own history should run: nothing is there yet,
    or dblock's version table records an older revision. Raises when the tables
    exist but dblock's history cannot bring them up: running it would fail
    half-way on objects that already exist (``locks_token_seq already exists``).
    """
    script = ScriptDirectory.from_config(alembic_config(table, schema))
    heads = frozenset(script.get_heads())
    ours = {revision.revision for revision in script.walk_revisions()}
    where = engine.url.render_as_string(hide_password=True)
    # Autocommit: on PostgreSQL a refused SELECT would otherwise abort the rest.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        insp = inspect(conn)
        recorded = _versions(conn, insp, version_table_name(table), schema)
        if recorded == heads:
            return True
        if recorded and recorded is not _UNREADABLE and recorded <= ours:
            return False  # dblock's own history, behind: it upgrades itself
        if not recorded and not insp.has_table(table, schema=schema):
            return False  # nothing there yet
        if _has_head_objects(insp, table, schema):
            return True  # the app's history, a newer dblock, or a role that may not read the version table
        in_app: set[str] = set()
        for app_schema in {None, schema}:
            found = _versions(conn, insp, "alembic_version", app_schema)
            if found is not None and found is not _UNREADABLE:
                in_app |= found & ours
    name = table if schema is None else f"{schema}.{table}"
    if in_app:
        raise DBLockError(
            f"dblock's table {name!r} in {where} was created by your app's Alembic history, which records "
            f"{', '.join(sorted(in_app))} in alembic_version; upgrade it there (`alembic upgrade heads`), "
            "not with create_schema() or `dblock migrate`; nothing was changed"
        )
    if recorded is _UNREADABLE:
        raise PermissionDenied(
            f"dblock's table {name!r} in {where} needs upgrading, and role {engine.url.username or '(default)'!r} "
            f"may not even read its version table {version_table_name(table)!r}: run `dblock migrate` as the role "
            "that owns the schema; nothing was changed",
            sqlstate="42501",
        )
    if recorded:
        raise DBLockError(
            f"dblock's table {name!r} in {where} was migrated by a newer dblock (revision "
            f"{', '.join(sorted(recorded - ours))}) and lacks what this one needs; upgrade dblock; nothing was changed"
        )
    raise DBLockError(
        f"a table {name!r} exists in {where} but no dblock history made it (no dblock revision in "
        f"{version_table_name(table)!r} or alembic_version) and it is not dblock's current schema; "
        "give dblock another table name (table=...), or upgrade it through the history that made it; "
        "nothing was changed"
    )


def _versions(conn: Connection, insp: Inspector, name: str, schema: str | None) -> frozenset[str] | None:
    """The revisions an Alembic version table records; None if it does not exist."""
    if not insp.has_table(name, schema=schema):
        return None
    version_table = table_clause(name, column("version_num"), schema=schema)
    try:
        return frozenset(conn.execute(select(version_table.c.version_num)).scalars())
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) == "42501":
            return _UNREADABLE
        raise


def _has_head_objects(insp: Inspector, table: str, schema: str | None) -> bool:
    """Whether every object of dblock's head is there: dblock.schema declares them (the drift test
    in tests/test_migrations.py checks that the migrations make exactly those)."""
    declared_tables = [locks_table(table, schema), fences_table(table, schema), holders_table(table, schema)]
    if insp.dialect.name == "postgresql":  # the fair queue (SQLite's waiters poll)
        declared_tables += [waiters_table(table, schema), procs_table(table, schema)]
    for declared in declared_tables:
        if not insp.has_table(declared.name, schema=schema):
            return False
        present = {c["name"] for c in insp.get_columns(declared.name, schema=schema)}
        if not {c.name for c in declared.columns} <= present:
            return False
    if insp.dialect.name == "postgresql":
        return token_sequence_name(table) in insp.get_sequence_names(schema=schema)
    return token_index_name(table) in {i["name"] for i in insp.get_indexes(table, schema=schema)}


# -- errors ------------------------------------------------------------------------
_UNAVAILABLE_SQLSTATES = {
    "53300",  # too_many_connections
    "57014",  # query_canceled: a statement outlived its time limit
    "57P01",  # admin_shutdown
    "57P02",  # crash_shutdown
    "57P03",  # cannot_connect_now
}


@contextmanager
def database_errors(engine: Engine, table: str) -> Iterator[None]:
    """Turn the database errors of making the schema into dblock's, keeping the sqlstate."""
    try:
        yield
    except (SQLAlchemyError, psycopg.Error, sqlite3.Error) as exc:
        raise _translate(exc, engine, table) from exc


def _translate(exc: Exception, engine: Engine, table: str) -> DBLockError:
    orig: BaseException = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    lines = str(orig).strip().splitlines()
    reason = lines[0] if lines else type(orig).__name__
    sqlstate = getattr(orig, "sqlstate", None)
    where = engine.url.render_as_string(hide_password=True)
    if sqlstate == "42501":
        statement = getattr(exc, "statement", None) or ""
        role = engine.url.username or "(default)"
        return PermissionDenied(
            f"role {role!r} may not create or upgrade dblock's tables in {where}: {reason}"
            f"{_needed(statement)}. Run `dblock migrate` (or create_schema()) once as the role that owns "
            "the schema; the app's own role then needs only the grants in the README's \"Least privilege\", "
            "and create_schema() changes nothing while the tables are current",
            sqlstate=sqlstate,
        )
    if engine.dialect.name == "sqlite":
        return _translate_sqlite(orig, reason, engine.url.database or "")
    if (isinstance(exc, DBAPIError) and exc.connection_invalidated) or (
        sqlstate is None and isinstance(orig, psycopg.OperationalError)  # no server reply: refused, lost, timed out
    ) or (sqlstate is not None and (sqlstate.startswith("08") or sqlstate in _UNAVAILABLE_SQLSTATES)):
        return DatabaseUnavailable(f"cannot reach {where}: {reason}", sqlstate=sqlstate)
    return DBLockError(f"cannot create or upgrade dblock's table {table!r} in {where}: {reason}", sqlstate=sqlstate)


def _needed(statement: str) -> str:
    """Which privilege the refused DDL needs, for the message."""
    words = statement.split()[:2]
    verb = " ".join(words).upper()
    if verb == "CREATE SCHEMA":
        return " (CREATE SCHEMA needs CREATE on the database)"
    if verb.startswith("CREATE"):
        return f" ({verb} needs CREATE on the schema)"
    if verb.startswith(("ALTER", "DROP")):
        return f" ({verb} needs to be run by the table's owner)"
    return ""


def _translate_sqlite(orig: BaseException, reason: str, path: str) -> DBLockError:
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
        return DatabaseUnavailable(f"cannot open {path}: {reason}")
    if code == "SQLITE_BUSY" or "locked" in reason:
        return DatabaseUnavailable(f"{path} stayed locked by another writer: {reason}")
    return DBLockError(f"cannot create or upgrade dblock's table in {path}: {reason}")
