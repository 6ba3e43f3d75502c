"""dblock inside an existing app: a scratch app with its own Alembic env and migration.

dblock is installed from its built wheel into a fresh virtualenv (``wheel_venv``),
and the app runs the ``alembic`` and ``dblock`` commands from there, as a user would.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import psycopg
import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, create_engine, inspect, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.pool import NullPool

from dblock import (
    FencedOut,
    Lease,
    Locker,
    LockNotAcquired,
    PermissionDenied,
    cli,
    commit_guard,
    fence,
    fenced_update,
    migrate,
)
from dblock.schema import (
    DEFAULT_TABLE,
    fences_table_name,
    holders_table_name,
    procs_table_name,
    token_sequence_name,
    version_table_name,
    waiters_table_name,
)

from .conftest import libpq_dsn, lock_once, scratch_database, wait_for
from .docs import blocks, page

APP_ENV = '''
from alembic import context
from sqlalchemy import Column, Integer, MetaData, Table, Text, engine_from_config, pool

from dblock.migrate import exclude_dblock

config = context.config
metadata = MetaData()
Table("notes", metadata, Column("id", Integer, primary_key=True), Column("body", Text))

# The scratch app's switch, so the test can show what autogenerate does without the filter.
unfiltered = context.get_x_argument(as_dictionary=True).get("dblock_filter") == "off"
include = None if unfiltered else exclude_dblock(
    config.get_main_option("dblock_table", "locks"), schema=config.get_main_option("dblock_schema")
)
engine = engine_from_config(config.get_section(config.config_ini_section), prefix="sqlalchemy.", poolclass=pool.NullPool)
with engine.connect() as connection:
    context.configure(
        connection=connection, target_metadata=metadata, include_object=include, include_schemas=True
    )
    with context.begin_transaction():
        context.run_migrations()
'''

APP_MIGRATION = '''
"""The app's own first revision: a notes table."""
import sqlalchemy as sa
from alembic import op

revision = "app_0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table("notes", sa.Column("id", sa.Integer, primary_key=True), sa.Column("body", sa.Text))


def downgrade():
    op.drop_table("notes")
'''

DBLOCK_HEAD = ScriptDirectory(str(migrate.migrations_dir())).get_current_head()


class App:
    """A scratch app on its own database: alembic.ini, env.py, one migration of its own."""

    def __init__(self, path: Path, bin_dir: Path, url: str, table: str, schema: str | None) -> None:
        self.path, self.bin, self.url, self.table, self.schema = path, bin_dir, url, table, schema
        (path / "migrations" / "versions").mkdir(parents=True)
        (path / "migrations" / "env.py").write_text(APP_ENV)
        (path / "migrations" / "versions" / "app_0001_notes.py").write_text(APP_MIGRATION)
        self.write_ini()

    def write_ini(self) -> None:
        lines = [
            "[alembic]",
            "script_location = %(here)s/migrations",
            "path_separator = space",
            "sqlalchemy.url = " + self.url.replace("%", "%%"),
        ]
        if self.table != DEFAULT_TABLE:
            lines.append(f"dblock_table = {self.table}")
        if self.schema is not None:
            lines.append(f"dblock_schema = {self.schema}")
        (self.path / "alembic.ini").write_text("\n".join(lines) + "\n")

    def run(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / args[0]), *args[1:]]
        done = subprocess.run(command, cwd=self.path, capture_output=True, text=True, timeout=120)
        assert (done.returncode == 0) == ok, (command, done.stdout, done.stderr)
        return done

    def alembic(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("alembic", "-c", str(self.path / "alembic.ini"), *args, ok=ok)

    def dblock_migrate(self) -> None:
        options = ["--table", self.table] + ([] if self.schema is None else ["--schema", self.schema])
        self.run("dblock", "--url", self.url, "migrate", *options)

    def tables(self, schema: str | None = None) -> set[str]:
        engine = create_engine(self.url)
        try:
            return set(inspect(engine).get_table_names(schema=schema))
        finally:
            engine.dispose()

    def versions(self, table: str = "alembic_version") -> set[str]:
        engine = create_engine(self.url)
        try:
            with engine.connect() as conn:
                schema = self.schema if table != "alembic_version" else None
                qualified = f'"{schema}"."{table}"' if schema else f'"{table}"'
                return set(conn.exec_driver_sql(f"SELECT version_num FROM {qualified}").scalars())
        finally:
            engine.dispose()

    def catalog(self) -> list[tuple[str, ...]]:
        """Every schema object, column and recorded revision: 'nothing changed' checks."""
        engine = create_engine(self.url)
        try:
            insp = inspect(engine)
            seen: list[tuple[str, ...]] = []
            for schema in (None, self.schema) if self.schema else (None,):
                for name in sorted(insp.get_table_names(schema=schema)):
                    seen += [(str(schema), name, c["name"]) for c in insp.get_columns(name, schema=schema)]
                    if name.startswith("alembic_version"):
                        seen += [(str(schema), name, v) for v in sorted(self.versions(name))]
                if engine.dialect.name == "postgresql":
                    seen += [(str(schema), s) for s in sorted(insp.get_sequence_names(schema=schema))]
            return seen
        finally:
            engine.dispose()

    def check_autogenerate(self, *dblock_tables: str) -> None:
        """With exclude_dblock autogenerate finds nothing to do; without it, it would drop ``dblock_tables``."""
        assert "No new upgrade operations detected" in self.alembic("check").stdout
        if dblock_tables:
            done = self.alembic("-x", "dblock_filter=off", "check", ok=False)
            removed = re.findall(r"\('remove_table', Table\('(\w+)'", done.stdout + done.stderr)
            assert sorted(removed) == sorted(dblock_tables), done

    def lock_once(self) -> int:
        return lock_once(self.url, self.table, self.schema)


@pytest.fixture(params=["postgresql", "sqlite"])
def app(request: pytest.FixtureRequest, wheel_venv: Path, tmp_path: Path) -> Iterator[App]:
    """On PostgreSQL a scratch database (autogenerate compares all of it) with dblock in a schema of its own."""
    if request.param == "sqlite":
        yield App(tmp_path / "app", wheel_venv, f"sqlite:///{tmp_path / 'app.db'}", DEFAULT_TABLE, None)
        return
    with scratch_database(request.getfixturevalue("pg_url"), "app_") as url:
        yield App(tmp_path / "app", wheel_venv, url, "app_locks", "dblock")


def test_separate_histories_never_touch_the_apps_alembic_version(app: App) -> None:
    app.alembic("upgrade", "head")
    assert app.versions() == {"app_0001"}
    app.dblock_migrate()
    assert app.versions() == {"app_0001"}  # the app's history, untouched
    assert app.versions(version_table_name(app.table)) == {DBLOCK_HEAD}
    queue_tables = [waiters_table_name(app.table), procs_table_name(app.table)] if app.schema is not None else []
    queue_tables.append(holders_table_name(app.table))  # shared leases (0007), on both backends
    app.check_autogenerate(app.table, fences_table_name(app.table), version_table_name(app.table), *queue_tables)
    assert app.lock_once() >= 1


def readme_grants() -> str:
    (block,) = blocks(page("least-privilege.md"), "sql")
    return block


def test_least_privilege_role_can_do_everything_the_app_needs(pg_url: str) -> None:
    """`dblock migrate --schema --table` as the owner; then the grants of docs/least-privilege.md, and nothing more, suffice."""
    schema, table, role = ("lp_" + secrets.token_hex(4) for _ in range(3))
    assert cli.main(["--url", pg_url, "migrate", "--schema", schema, "--table", table]) == 0
    grants = readme_grants()
    for name, ours in (("app_user", role), ("locks_token_seq", token_sequence_name(table)),
                       ("locks_waiters", waiters_table_name(table)), ("locks_procs", procs_table_name(table)),
                       ("locks_holders", holders_table_name(table)),
                       ("fences", fences_table_name(table)), ("locks", table), ("app", schema)):
        grants = re.sub(rf"\b{name}\b", ours, grants)
    admin = psycopg.connect(libpq_dsn(pg_url), autocommit=True)
    role_url = make_url(pg_url).set(username=role, password=None)
    lockers: list[Locker] = []
    try:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(grants)
        # The app's own table, fenced by a token column; the role may update it.
        admin.execute(f"CREATE TABLE {schema}.accounts (id int PRIMARY KEY, balance int, fence_token bigint NOT NULL)")
        admin.execute(f"INSERT INTO {schema}.accounts VALUES (1, 100, 0)")
        admin.execute(f"GRANT SELECT, UPDATE ON {schema}.accounts TO {role}")

        first, second = (Locker(role_url, schema=schema, table=table, ttl=5) for _ in range(2))
        lockers += [first, second]
        catalog = (
            "SELECT c.relname::text, a.attname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
            f"WHERE n.nspname = '{schema}' ORDER BY 1, 2"
        )
        before = admin.execute(catalog).fetchall()
        first.create_schema()  # the tables are current: it looks, needing no CREATE, and changes nothing
        assert admin.execute(catalog).fetchall() == before
        # The role really is limited: where an upgrade is needed it cannot migrate, and is told why.
        with pytest.raises(PermissionDenied, match=f"permission denied for schema {schema} .*CREATE on the schema.*"
                                                   "dblock migrate` .*as the role that owns") as denied:
            Locker(role_url, schema=schema, table=table + "_new").create_schema()
        assert denied.value.sqlstate == "42501" and isinstance(denied.value.__cause__, ProgrammingError)
        assert admin.execute(catalog).fetchall() == before
        admin_engine = create_engine(pg_url, poolclass=NullPool)
        migrate.downgrade(admin_engine, table, schema, "dblock_0003")
        older = admin.execute(catalog).fetchall()
        with pytest.raises(PermissionDenied, match=f"needs upgrading.*{version_table_name(table)}.*dblock migrate"):
            first.create_schema()  # it may not read dblock's version table, and 0004's and 0005's columns are missing
        assert admin.execute(catalog).fetchall() == older
        migrate.upgrade(admin_engine, table, schema)
        admin_engine.dispose()
        admin.execute(grants)  # as the page says: tables an upgrade creates need the grants again
        assert admin.execute(catalog).fetchall() == before
        lease = first.acquire("job", timeout=1)
        assert second.try_acquire("job") is None
        with pytest.raises(LockNotAcquired):
            second.acquire("job", timeout=0.2)  # contended, waiting
        lease.extend()
        assert [(i.name, i.token) for i in first.leases()] == [("job", lease.token)]

        accounts = Table("accounts", MetaData(schema=schema), Column("id", Integer, primary_key=True),
                         Column("balance", Integer), Column("fence_token", BigInteger, nullable=False))
        with first.engine.connect() as conn:
            with commit_guard(conn, lease):
                fenced_update(conn, update(accounts).where(accounts.c.id == 1).values(balance=90), lease)
                fence(conn, lease)
        assert admin.execute(f"SELECT balance, fence_token FROM {schema}.accounts").fetchone() == (90, lease.token)
        # A waiter queues in the row; release hands the lease over (it reads pg_stat_get_activity).
        queue = f"SELECT waiting FROM {schema}.{table}"
        assert not admin.execute(queue).fetchone()[0]  # the waiter that timed out left the queue
        waited: list[Lease] = []
        waiter = threading.Thread(target=lambda: waited.append(second.acquire("job", timeout=10)))
        waiter.start()
        wait_for(lambda: admin.execute(queue).fetchone()[0], what="a queued waiter")
        assert lease.release()
        waiter.join(10)
        (later,) = waited
        assert later.token > lease.token
        with second.engine.begin() as conn:
            fence(conn, later)
        with first.engine.begin() as conn, pytest.raises(FencedOut):
            fence(conn, lease)
        later.release()
        time.sleep(0.01)
        assert second.prune(older_than=0.001) == 1
    finally:
        for locker in lockers:
            locker.close()
            locker.engine.dispose()
        admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE IF EXISTS {role}")
        admin.close()


def test_the_role_that_owns_the_schema_migrates_it(pg_url: str) -> None:
    """docs/least-privilege.md: "Migrate as the role that owns the schema". Owning the schema is enough: no CREATE on the database."""
    schema, table, role = ("own_" + secrets.token_hex(4) for _ in range(3))
    admin = psycopg.connect(libpq_dsn(pg_url), autocommit=True)
    role_url = make_url(pg_url).set(username=role, password=None).render_as_string(hide_password=False)
    try:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"CREATE SCHEMA {schema} AUTHORIZATION {role}")
        may_create = "SELECT has_database_privilege(%s, current_database(), 'CREATE')"
        assert admin.execute(may_create, (role,)).fetchone() == (False,)
        assert cli.main(["--url", role_url, "migrate", "--schema", schema, "--table", table]) == 0
        with Locker(role_url, schema=schema, table=table) as locker:
            locker.create_schema()
            assert locker.try_acquire("job") is not None
        (version,) = admin.execute(f"SELECT version_num FROM {schema}.{version_table_name(table)}").fetchone()
        assert version == DBLOCK_HEAD
    finally:
        admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        admin.execute(f"DROP ROLE IF EXISTS {role}")
        admin.close()
