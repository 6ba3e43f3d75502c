"""Run dblock's Alembic migrations (the one source of its schema), alone or with an app's.

Two ways to run them (the documentation's "Adding dblock to an existing app"), both recorded in
dblock's own version table, never in the app's ``alembic_version``:

- alone: ``Locker.create_schema()`` or ``dblock migrate`` (``upgrade``);
- with the app's: ``run_with(context)`` in the app's Alembic env.py, so that the
  app's ``alembic upgrade head`` brings dblock's tables up first, on its connection.

The app's history never holds dblock's revisions, so it keeps one head. (Apps once
listed ``dblock:_migrations/versions`` in their ``version_locations`` instead; the
databases they made record dblock's revision in the app's ``alembic_version``, which
``upgrade`` recognises and ``run_with`` moves to dblock's table.) Autogenerate must
not see dblock's tables: ``exclude_dblock``, which ``run_with`` puts in place.
``upgrade`` reads first and changes nothing when the tables are already at dblock's
head, whichever history made them, so a role without CREATE can call it then.
"""

from __future__ import annotations

import io
import logging
import warnings
import zlib
from contextlib import ExitStack, contextmanager
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Column, MetaData, String, Table, delete, inspect, select, text
from sqlalchemy.engine import Connection, Engine, Inspector
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from . import backends
from ._redact import display_url
from ._validate import check_identifier
from .errors import DBLockError, PermissionDenied, ReplicationWarning
from .schema import (
    DEFAULT_TABLE,
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
    """The ``migrations`` folder: inside the installed wheel (as ``_alembic``), or beside the package in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_alembic", here.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(f"dblock's migrations are missing (looked in {here / '_alembic'})")


def target() -> tuple[str, str | None]:
    """For dblock's migration scripts: the (table, schema) being migrated, which dblock's env.py
    puts in ``config.attributes``. Any other env.py running them is refused."""
    from alembic import context

    attributes = context.config.attributes
    if "dblock_table" not in attributes:
        raise CommandError(
            "dblock's revisions run only through dblock: dblock.migrate.run_with(context) in your env.py, "
            "`dblock migrate` or Locker.create_schema(), never from your app's version_locations"
        )
    return attributes["dblock_table"], attributes["dblock_schema"]


def backend() -> type[backends.Backend]:
    """For dblock's migration scripts: the backend of the database being migrated (online or
    offline), whose ``caps`` say which parts of a revision apply to it. A database dblock
    does not run on is refused with a ValueError naming the ones it does."""
    from alembic import context

    return backends.of(context.get_context().dialect)


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


def revisions() -> list[str]:
    """dblock's revisions, oldest first (``base`` comes before the first)."""
    script = ScriptDirectory.from_config(alembic_config(DEFAULT_TABLE, None))
    return [revision.revision for revision in reversed(list(script.walk_revisions()))]


def _revisions(cfg: Config) -> tuple[frozenset[str], frozenset[str]]:
    """dblock's head revisions, and all its revisions."""
    script = ScriptDirectory.from_config(cfg)
    return frozenset(script.get_heads()), frozenset(revision.revision for revision in script.walk_revisions())


@contextmanager
def _turn(conn: Connection, table: str, schema: str | None) -> Iterator[None]:
    """Wait for other migrations of these tables (the backend's advisory lock); this one's turn
    lasts until the block ends (PostgreSQL: until the transaction ends)."""
    backend = backends.of(conn)
    key = zlib.crc32(f"dblock:{schema}.{table}".encode())
    backend.serialise(conn, key)
    try:
        yield
    finally:
        backend.unserialise(conn, key)


@dataclass(frozen=True)
class Migrated:
    """What ``create_schema()`` (``dblock migrate``) did to the tables of lock table ``table``.

    ``before``: dblock's revision they were at (None: there were none; ``"unrecorded"``: made
    by another history, the app's own migrations, and at dblock's head). ``after``: the
    revision they are at now. ``str()`` says it in a sentence.
    """

    table: str
    before: str | None
    after: str

    @property
    def created(self) -> bool:
        return self.before is None

    @property
    def changed(self) -> bool:
        """Whether this call changed anything (created or upgraded the tables)."""
        return self.before != self.after and self.before != "unrecorded"

    def __str__(self) -> str:
        if self.before is None:
            return f"created the tables of {self.table!r} (revision {self.after})"
        if self.before == "unrecorded":
            return f"the tables of {self.table!r} were already current (made by another history); nothing changed"
        if self.before == self.after:
            return f"the tables of {self.table!r} were already current (revision {self.after}); nothing changed"
        return f"upgraded the tables of {self.table!r} from revision {self.before} to {self.after}"


def upgrade(engine: Engine, table: str, schema: str | None, revision: str = "heads") -> Migrated:
    """Bring dblock's tables to ``revision``, safely when several processes race to do it;
    what it did.

    To the head, it first looks without writing: tables already there, made by
    dblock's history or by the app's own (the documentation's "Adding dblock to an existing
    app"), are left as they are.
    """
    caps = backends.of(engine).caps
    if caps.replication:
        check_replication(engine)
    cfg = alembic_config(table, schema)
    heads, _ = _revisions(cfg)
    head = max(heads)
    if revision == "heads":
        state, recorded = _where(engine, table, schema)
        if state in ("current", "complete"):
            before = max(recorded) if state == "current" and recorded else "unrecorded"
            return Migrated(table, before, head)
    outcome = _Outcome(table, head if revision == "heads" else revision)
    if not caps.advisory_lock:
        # SQLite's DDL is transactional; BEGIN IMMEDIATE takes the write lock up
        # front so a racing create_schema waits and then finds the tables made.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                cfg.attributes["connection"] = conn
                outcome.look(conn, schema)
                command.upgrade(cfg, revision)
            except BaseException:
                conn.exec_driver_sql("ROLLBACK")
                raise
            conn.exec_driver_sql("COMMIT")
        return outcome.migrated()
    with engine.begin() as conn, _turn(conn, table, schema):
        cfg.attributes["connection"] = conn
        outcome.look(conn, schema)
        command.upgrade(cfg, revision)
    return outcome.migrated()


class _Outcome:
    """The revision dblock's tables were at when this migration's turn came (another process
    may have moved them meanwhile), for ``Migrated``."""

    def __init__(self, table: str, target: str) -> None:
        self.table = table
        self.target = target
        self.before: str | None = None

    def look(self, conn: Connection, schema: str | None) -> None:
        context = MigrationContext.configure(
            conn, opts={"version_table": version_table_name(self.table), "version_table_schema": schema}
        )
        self.before = context.get_current_revision()

    def migrated(self) -> Migrated:
        return Migrated(self.table, self.before, self.target)


# What the server tells about its replication, readable by any role: the physical WAL
# senders (one per streaming standby; a logical one is connected to a database), the
# synchronous standby names, and the synchronous_commit its sessions get.
_REPLICATION = """
SELECT pg_is_in_recovery(),
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender' AND datname IS NULL),
       current_setting('synchronous_standby_names'),
       current_setting('synchronous_commit')"""


def check_replication(bind: Engine | Connection, *, stacklevel: int = 4) -> str | None:
    """Warn (``ReplicationWarning``, and on the ``dblock.migrate`` logger) when the server
    streams to standbys that do not confirm commits: after a failover to one of them, a token
    could be handed out again. Returns the warning's text, or None when there is nothing to say."""
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            recovery, standbys, names, commit = conn.execute(text(_REPLICATION)).one()
    else:
        recovery, standbys, names, commit = bind.execute(text(_REPLICATION)).one()
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
        f"{display_url(bind.engine.url)} streams to {standbys} standby(s) asynchronously ({why}): after a "
        "failover the promoted standby may lack grants and hand out a fencing token again. dblock's "
        "guarantees across a failover need synchronous replication: https://dblock.readthedocs.io/en/latest/high-availability/"
    )
    log.warning("%s", message)
    warnings.warn(message, ReplicationWarning, stacklevel=stacklevel)  # by default at create_schema()'s caller
    return message


def downgrade(engine: Engine, table: str, schema: str | None, revision: str = "base") -> None:
    """Take dblock's tables down to ``revision`` of its history; ``base`` removes them, and dblock's
    version table with them. Nothing there: nothing to do. Tables that dblock's own history does not
    record (the app's, or a newer dblock's) are refused with ``DBLockError``, nothing changed."""
    known = revisions()
    if revision != "base" and revision not in known:
        raise ValueError(f"revision must be base or one of dblock's ({', '.join(known)}), not {revision!r}")
    cfg = alembic_config(table, schema)
    ours = frozenset(known)
    with engine.begin() as conn, ExitStack() as turn:
        if backends.of(engine).caps.advisory_lock:
            turn.enter_context(_turn(conn, table, schema))
        insp = inspect(conn)
        recorded = _versions(conn, insp, version_table_name(table), schema)
        if not recorded and not insp.has_table(table, schema=schema):
            if recorded is not None and revision == "base":
                _version_table(version_table_name(table), schema).drop(conn)
            return
        if not recorded or recorded is _UNREADABLE or not recorded <= ours:
            in_app = frozenset() if recorded is _UNREADABLE else _in_alembic_version(conn, schema, ours)
            raise _refusal(engine, table, schema, recorded, ours, in_app, downgrading=True)
        (current,) = recorded
        if revision != "base" and known.index(revision) > known.index(current):
            raise DBLockError(
                f"dblock's tables {_qualified(table, schema)!r} in {display_url(engine.url)} are at {current}, "
                f"below {revision}: nothing to downgrade; nothing was changed"
            )
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
        if revision == "base":
            _version_table(version_table_name(table), schema).drop(conn)


def sql(url: str, table: str, schema: str | None, revision: str = "heads") -> str:
    """The DDL that ``upgrade`` would run, as text (offline mode)."""
    out = io.StringIO()
    cfg = alembic_config(table, schema)
    cfg.stdout = out
    cfg.output_buffer = out
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # ini values interpolate %
    command.upgrade(cfg, revision, sql=True)
    return out.getvalue()


# -- with an app's own Alembic run ---------------------------------------------------
_PLACE = (
    "call dblock.migrate.run_with(context) in your env.py after context.configure(...), inside "
    "`with context.begin_transaction():`, just before context.run_migrations()"
)


def run_with(context: Any, *, table: str = DEFAULT_TABLE, schema: str | None = None) -> None:
    """Run dblock's migrations with an app's own Alembic run: one call in the app's env.py.

    Call it after ``context.configure(...)``, inside ``with context.begin_transaction():``,
    just before ``context.run_migrations()``, in the online and the offline function alike::

        with context.begin_transaction():
            run_with(context)  # table=..., schema=... where dblock's are not the defaults
            context.run_migrations()

    - ``alembic upgrade`` (to any target; ``--sql`` too) first brings dblock's tables to
      dblock's latest revision, on the app's connection and in its transaction, recorded in
      dblock's own version table (``alembic_version_dblock``). The app's history and its
      ``alembic_version`` never hold dblock's revisions, so the app keeps one head.
    - Every other command (``downgrade``, ``stamp``, ``revision``, ``check``, ``current``)
      leaves dblock's tables alone; ``dblock migrate --downgrade base`` removes them.
    - Autogenerate ignores dblock's tables: the app's ``include_object`` is wrapped in
      ``exclude_dblock(table, schema=schema)``.

    A database made the old way (dblock's revisions listed in the app's ``version_locations``)
    records dblock's revision in the app's ``alembic_version``: the next ``alembic upgrade``
    moves it to dblock's table; other commands refuse until then. An offline upgrade from a
    starting revision (``alembic upgrade START:END --sql``) cannot know which of dblock's
    revisions that database has: ``-x dblock_start=REV`` says it (or ``base``).

    Bad arguments raise ``ValueError``; a misplaced call or a bad ``dblock_start`` Alembic's
    ``CommandError``, before any SQL; database trouble a ``DBLockError``.
    """
    if not callable(getattr(context, "get_context", None)):
        raise TypeError(f"run_with takes Alembic's context (from alembic import context), not {context!r}")
    table = check_identifier(table, "table")
    schema = None if schema is None else check_identifier(schema, "schema")
    try:
        app: MigrationContext = context.get_context()
    except Exception as exc:  # noqa: BLE001 - Alembic raises a bare Exception: "No context has been configured yet."
        raise CommandError(_PLACE) from exc
    if app.script is not None:
        app.script.get_heads()  # loads the app's revisions: one that cannot load (the old branch) fails before any SQL
    app.opts["include_object"] = exclude_dblock(table, schema=schema, include_object=app.opts.get("include_object"))
    running = _alembic_command(app)
    if running is None:
        log.warning("run_with cannot tell which Alembic command runs: dblock's tables are left as they are")
    cfg = alembic_config(table, schema)
    with _app_context_kept(app):
        if app.as_sql:
            if running == "upgrade":
                _upgrade_offline(context, app, cfg)
            return
        conn = app.connection
        if conn is None:
            raise CommandError(_PLACE)
        started = not conn.in_transaction()  # else the app's: dblock's work commits or rolls back with it
        with database_errors(conn.engine, table):
            try:
                if running == "upgrade":
                    _upgrade_online(conn, app, cfg, table, schema)
                else:
                    _refuse_old_setup(conn, app, cfg)
            except BaseException:
                if started and conn.in_transaction():
                    conn.rollback()
                raise
            if started and conn.in_transaction():
                conn.commit()


def _alembic_command(app: MigrationContext) -> str | None:
    """Which Alembic command runs (``"upgrade"``, ``"downgrade"``, ``"stamp"``, ``"revision"``...), or None.

    Alembic does not tell env.py. Each command of ``alembic.command`` hands the migration
    context a step function defined inside itself (``upgrade.<locals>.upgrade``), whose
    qualified name says which. The end-to-end tests (tests/test_alembic_app.py) fail if
    that stops holding.
    """
    fn = app.opts.get("fn")
    if getattr(fn, "__module__", None) != "alembic.command":
        return None
    return str(getattr(fn, "__qualname__", "")).split(".", 1)[0] or None


@contextmanager
def _app_context_kept(app: MigrationContext) -> Iterator[None]:
    """dblock's env.py runs in an EnvironmentContext of its own, and leaving one empties
    ``alembic.context`` for everyone: put the app's back, for its ``run_migrations()``."""
    try:
        yield
    finally:
        if app.environment_context is not None:
            app.environment_context.__enter__()  # what installs it as alembic.context


def _upgrade_online(conn: Connection, app: MigrationContext, cfg: Config, table: str, schema: str | None) -> None:
    heads, ours = _revisions(cfg)
    caps = backends.of(conn).caps
    if caps.replication:
        check_replication(conn, stacklevel=4)  # at the env.py line that calls run_with
    old = _old_setup(conn, app, ours)
    state, recorded = _look(conn, table, schema, heads, ours)
    if not old and (state == "current" or (state == "complete" and recorded)):
        return  # at dblock's head, or a newer dblock's tables that have what this one needs
    with ExitStack() as turn:
        if caps.advisory_lock:
            # a create_schema() racing this waits until the app's run is done
            turn.enter_context(_turn(conn, table, schema))
            old = _old_setup(conn, app, ours)
            state, recorded = _look(conn, table, schema, heads, ours)
        if recorded is _UNREADABLE:
            raise _refusal(conn.engine, table, schema, recorded, ours, frozenset())
        cfg.attributes["connection"] = conn
        if old:
            version = _version_table(app.version_table, app.version_table_schema)
            conn.execute(delete(version).where(version.c.version_num.in_(sorted(old))))
            log.info("moved dblock's revision %s from %s to dblock's own version table", ", ".join(sorted(old)),
                     app.version_table)
            if not recorded:
                command.stamp(cfg, sorted(old))
                state, recorded = "behind", old
        if state == "complete" and not recorded:
            # At dblock's head, but no history records it (the old set-up, merged into the app's
            # history): record it, so that dblock's next revision knows where to start.
            command.stamp(cfg, "heads")
        elif state == "incomplete":
            raise _refusal(conn.engine, table, schema, recorded, ours, frozenset())
        elif state in ("behind", "absent"):
            command.upgrade(cfg, "heads")


def _refuse_old_setup(conn: Connection, app: MigrationContext, cfg: Config) -> None:
    """Commands other than upgrade change nothing of dblock's: if the app's alembic_version still
    holds dblock's revision, Alembic would fail on it without saying why; say it first."""
    old = _old_setup(conn, app, _revisions(cfg)[1])
    if old:
        raise DBLockError(
            f"your {app.version_table} records dblock's revision {', '.join(sorted(old))}, from when dblock's "
            "revisions were part of your app's history: run `alembic upgrade head` once, which moves it to "
            "dblock's own version table; nothing was changed"
        )


def _old_setup(conn: Connection, app: MigrationContext, ours: frozenset[str]) -> frozenset[str]:
    """dblock's revisions in the app's own version table: what listing them in version_locations left."""
    found = _versions(conn, inspect(conn), app.version_table, app.version_table_schema)
    return frozenset() if found is None or found is _UNREADABLE else found & ours


def _upgrade_offline(context: Any, app: MigrationContext, cfg: Config) -> None:
    start = context.get_x_argument(as_dictionary=True).get("dblock_start")
    if start is None and context.get_starting_revision_argument() is not None:
        raise CommandError(
            "an offline upgrade from a starting revision cannot know which of dblock's revisions that database "
            "has: add -x dblock_start=REV, REV being what its alembic_version_dblock records (or base)"
        )
    known = revisions()
    if start not in (None, "base") and start not in known:
        raise CommandError(f"-x dblock_start must be base or one of dblock's revisions ({', '.join(known)}), "
                           f"not {start!r}")
    cfg.output_buffer = app.output_buffer
    cfg.attributes["dialect_name"] = app.dialect.name  # dblock's env.py: no BEGIN/COMMIT of its own
    command.upgrade(cfg, "heads" if start in (None, "base") else f"{start}:heads", sql=True)


# -- is there anything to do? ----------------------------------------------------
_UNREADABLE = frozenset({"<unreadable>"})  # a version table this role may not SELECT from


def _where(engine: Engine, table: str, schema: str | None) -> tuple[str, frozenset[str] | None]:
    """Where dblock's tables are (``_look``'s state) and what its version table records.

    Only reads (the catalog, and version tables where the role may), so the
    least-privilege role of the documentation can call ``create_schema()`` on a current
    database. ``behind`` or ``absent`` when dblock's own history should run: nothing
    is there yet, or dblock's version table records an older revision. Raises when the tables
    exist but dblock's history cannot bring them up: running it would fail
    half-way on objects that already exist (``locks_token_seq already exists``).
    """
    heads, ours = _revisions(alembic_config(table, schema))
    # Autocommit: on PostgreSQL a refused SELECT would otherwise abort the rest.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        state, recorded = _look(conn, table, schema, heads, ours)
        if state in ("current", "complete", "behind", "absent"):
            return state, recorded
        in_app = _in_alembic_version(conn, schema, ours)
    raise _refusal(engine, table, schema, recorded, ours, in_app)


def _look(
    conn: Connection, table: str, schema: str | None, heads: frozenset[str], ours: frozenset[str]
) -> tuple[str, frozenset[str] | None]:
    """Where dblock's tables are, and what dblock's version table records (None: no such table).

    ``current``: at dblock's head. ``behind``: at an older revision of dblock's own
    history, which upgrades itself. ``absent``: nothing there yet. ``complete``: no
    usable record, but every object of the head is there. ``incomplete``: none of
    these; ``_refusal`` says why.
    """
    insp = inspect(conn)
    recorded = _versions(conn, insp, version_table_name(table), schema)
    if recorded == heads:
        return "current", recorded
    if recorded and recorded is not _UNREADABLE and recorded <= ours:
        return "behind", recorded
    if not recorded and not insp.has_table(table, schema=schema):
        return "absent", recorded
    if _has_head_objects(insp, table, schema):
        return "complete", recorded
    return "incomplete", recorded


def _in_alembic_version(conn: Connection, schema: str | None, ours: frozenset[str]) -> frozenset[str]:
    """dblock's revisions in an app's alembic_version (default schema, or dblock's): the old set-up's."""
    insp = inspect(conn)
    in_app: set[str] = set()
    for app_schema in {None, schema}:
        found = _versions(conn, insp, "alembic_version", app_schema)
        if found is not None and found is not _UNREADABLE:
            in_app |= found & ours
    return frozenset(in_app)


def _refusal(
    engine: Engine,
    table: str,
    schema: str | None,
    recorded: frozenset[str] | None,
    ours: frozenset[str],
    in_app: frozenset[str],
    *,
    downgrading: bool = False,
) -> DBLockError:
    """Why dblock's own history cannot run on these tables (``_look`` found them ``incomplete``)."""
    where = display_url(engine.url)
    name = _qualified(table, schema)
    if in_app:
        return DBLockError(
            f"dblock's table {name!r} in {where} was created by your app's Alembic history, which records "
            f"{', '.join(sorted(in_app))} in alembic_version; call dblock.migrate.run_with(context) in your env.py "
            "and run `alembic upgrade head`, which moves that to dblock's own version table and "
            f"{'brings the tables up' if not downgrading else 'then lets dblock migrate --downgrade remove them'} "
            "(https://dblock.readthedocs.io/en/latest/alembic/#adding-dblock-to-an-existing-app); nothing was changed"
        )
    if recorded is _UNREADABLE:
        return PermissionDenied(
            f"dblock's table {name!r} in {where} needs {'upgrading' if not downgrading else 'downgrading'}, and "
            f"role {engine.url.username or '(default)'!r} may not even read its version table "
            f"{version_table_name(table)!r}: run `dblock migrate` as the role that owns the schema; nothing was changed",
            sqlstate="42501",
        )
    if recorded:
        newer = ", ".join(sorted(recorded - ours))
        return DBLockError(
            f"dblock's table {name!r} in {where} was migrated by a newer dblock (revision {newer}) and "
            + ("lacks what this one needs; upgrade dblock" if not downgrading else "only that dblock can downgrade it")
            + "; nothing was changed"
        )
    return DBLockError(
        f"a table {name!r} exists in {where} but no dblock history made it (no dblock revision in "
        f"{version_table_name(table)!r} or alembic_version) and it is not dblock's current schema; "
        + ("give dblock another table name (table=...), or upgrade it through the history that made it"
           if not downgrading else "dblock leaves it alone")
        + "; nothing was changed"
    )


def _qualified(table: str, schema: str | None) -> str:
    return table if schema is None else f"{schema}.{table}"


def _version_table(name: str, schema: str | None) -> Table:
    """An Alembic version table, as much of it as dblock reads, writes and drops."""
    return Table(name, MetaData(), Column("version_num", String(32), primary_key=True), schema=schema)


def _versions(conn: Connection, insp: Inspector, name: str, schema: str | None) -> frozenset[str] | None:
    """The revisions an Alembic version table records; None if it does not exist."""
    try:
        if not insp.has_table(name, schema=schema):
            return None
    except DBAPIError as exc:  # MariaDB: a table the user may not read may not be described either
        if backends.of(conn).denied(exc.orig):
            return _UNREADABLE
        raise
    version_table = _version_table(name, schema)
    try:
        return frozenset(conn.execute(select(version_table.c.version_num)).scalars())
    except DBAPIError as exc:
        if backends.of(conn).denied(exc.orig):
            return _UNREADABLE
        raise


def _has_head_objects(insp: Inspector, table: str, schema: str | None) -> bool:
    """Whether every object of dblock's head is there: dblock.schema declares them (the drift test
    in tests/test_migrations.py checks that the migrations make exactly those)."""
    declared_tables = [locks_table(table, schema), fences_table(table, schema), holders_table(table, schema)]
    caps = backends.of(insp).caps
    if caps.fair_queue:  # the fair queue's tables (without one, waiters poll)
        declared_tables += [waiters_table(table, schema), procs_table(table, schema)]
    for declared in declared_tables:
        if not insp.has_table(declared.name, schema=schema):
            return False
        present = {c["name"] for c in insp.get_columns(declared.name, schema=schema)}
        if not {c.name for c in declared.columns} <= present:
            return False
    if caps.token_sequence:
        return token_sequence_name(table) in insp.get_sequence_names(schema=schema)
    return token_index_name(table) in {i["name"] for i in insp.get_indexes(table, schema=schema)}


# -- errors ------------------------------------------------------------------------
@contextmanager
def database_errors(engine: Engine, table: str) -> Iterator[None]:
    """Turn the database errors of making the schema into dblock's, keeping the sqlstate."""
    errors: tuple[type[BaseException], ...] = (SQLAlchemyError, *backends.of(engine).errors)
    try:
        yield
    except errors as exc:
        raise _translate(exc, engine, table) from exc


def _translate(exc: BaseException, engine: Engine, table: str) -> DBLockError:
    orig: BaseException = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    lines = str(orig).strip().splitlines()
    reason = lines[0] if lines else type(orig).__name__
    sqlstate = getattr(orig, "sqlstate", None)
    where = engine.url.render_as_string(hide_password=True)
    if backends.of(engine).denied(orig):
        statement = getattr(exc, "statement", None) or ""
        role = engine.url.username or "(default)"
        return PermissionDenied(
            f"role {role!r} may not create or upgrade dblock's tables in {where}: {reason}"
            f"{_needed(statement)}. Run `dblock migrate` (or create_schema()) once as the role that owns "
            "the schema; the app's own role then needs only the grants at https://dblock.readthedocs.io/en/latest/least-privilege/, "
            "and create_schema() changes nothing while the tables are current",
            sqlstate=sqlstate,
        )
    return backends.of(engine).schema_error(exc, orig, reason, where, table, engine.url.database or "")


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
