"""dblock's tables made by Django's `migrate` are the ones dblock's Alembic migrations make (drift test).

The Django migration runs dblock's own Alembic migrations, so the two should
agree by construction; these tests check it on the database itself (the
catalog: columns, types, defaults, constraints, indexes, sequences, functions'
source, the recorded revision), show that the comparison sees each kind of
difference, and that the app's latest migration pins dblock's Alembic head.
"""

from __future__ import annotations

import importlib
import pkgutil
import sqlite3
from pathlib import Path
from typing import Any, Callable, Iterator

import psycopg
import pytest
from alembic.script import ScriptDirectory
from sqlalchemy.engine import make_url

from dblock import Locker, migrate

from .conftest import libpq_dsn
from .django_support import DjangoEnv, django_env, drop_database, manage, scratch_database  # noqa: F401

pytest.importorskip("django")

# Django's own bookkeeping, which only the Django side has.
_DJANGO = ("django_migrations", "django_migrations_id_seq", "sqlite_sequence")

_PG_CATALOG = {
    "relations": """
        SELECT c.relname, c.relkind, c.relpersistence FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' ORDER BY 1""",
    "columns": """
        SELECT table_name, column_name, ordinal_position, data_type, character_maximum_length, is_nullable,
               column_default, is_identity, identity_generation, identity_start, identity_increment, identity_cycle
        FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1, 3""",
    "constraints": """
        SELECT c.conrelid::regclass::text, c.conname, c.contype, pg_get_constraintdef(c.oid)
        FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace WHERE n.nspname = 'public' ORDER BY 1, 2""",
    "indexes": "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1, 2",
    "sequences": """
        SELECT sequencename, data_type::text, start_value, min_value, max_value, increment_by, cycle, cache_size
        FROM pg_sequences WHERE schemaname = 'public' ORDER BY 1""",
    "sequence_owners": """
        SELECT s.relname, t.relname, a.attname, d.deptype FROM pg_depend d
        JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S' JOIN pg_namespace n ON n.oid = s.relnamespace
        JOIN pg_class t ON t.oid = d.refobjid JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = d.refobjsubid
        WHERE n.nspname = 'public' ORDER BY 1""",
    "functions": """
        SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'public' ORDER BY 1, 2""",
}


def _pg_snapshot(conn: psycopg.Connection[Any]) -> dict[str, list[tuple[Any, ...]]]:
    shot = {key: conn.execute(sql).fetchall() for key, sql in _PG_CATALOG.items()}
    shot = {key: [row for row in rows if not str(row[0]).startswith(_DJANGO)] for key, rows in shot.items()}
    return {**shot, "versions": _versions(conn, shot["relations"])}


def _sqlite_snapshot(conn: sqlite3.Connection) -> dict[str, list[tuple[Any, ...]]]:
    shot = {
        # SQLite keeps each object's DDL as written: the whole schema, to the character.
        "objects": conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY 1, 2").fetchall(),
        "columns": [
            (table, *column)
            for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY 1").fetchall()
            for column in conn.execute(f'PRAGMA table_info("{table}")').fetchall()
        ],
    }
    shot = {key: [row for row in rows if not any(str(v).startswith(_DJANGO) for v in row[:3])] for key, rows in shot.items()}
    return {**shot, "versions": _versions(conn, shot["objects"])}


def _versions(conn: Any, relations: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    if not any("alembic_version_dblock" in row[:3] for row in relations):
        return []
    return list(conn.execute("SELECT version_num FROM alembic_version_dblock").fetchall())


class Side:
    """One fresh database: connect to it, and read its schema."""

    def __init__(self, backend: str, url: str) -> None:
        self.backend, self.url = backend, url

    def connect(self) -> Any:
        if self.backend == "postgresql":
            return psycopg.connect(libpq_dsn(self.url), autocommit=True)
        return sqlite3.connect(make_url(self.url).database or "", isolation_level=None)

    def snapshot(self, conn: Any = None) -> dict[str, list[tuple[Any, ...]]]:
        own = conn is None
        conn = self.connect() if own else conn
        try:
            return _pg_snapshot(conn) if self.backend == "postgresql" else _sqlite_snapshot(conn)
        finally:
            if own:
                conn.close()


@pytest.fixture
def fresh(backend: str, pg_url: str, tmp_path: Path) -> Iterator[Callable[[], Side]]:
    """``fresh()``: a new empty database of ``backend``, dropped after the test."""
    made: list[str] = []

    def make() -> Side:
        if backend == "postgresql":
            made.append(scratch_database(pg_url))
            return Side(backend, made[-1])
        made.append(f"sqlite:///{tmp_path / f'db{len(made)}.sqlite3'}")
        return Side(backend, made[-1])

    yield make
    if backend == "postgresql":
        for url in made:
            drop_database(pg_url, url)


def _django_migrate(env: DjangoEnv, side: Side, *args: str) -> None:
    """`manage.py migrate dblock ...` with the "default" or "sqlite" database set to ``side``."""
    alias = "default" if side.backend == "postgresql" else "sqlite"
    where = {"DBLOCK_DJANGO_PG": side.url} if alias == "default" else {"DBLOCK_DJANGO_SQLITE": make_url(side.url).database}
    out = manage(env, "migrate", "dblock", *args, "--database", alias, "-v", "0", **where)
    assert out.returncode == 0, out.stdout + out.stderr


def _alembic(side: Side) -> None:
    locker = Locker(side.url)
    locker.create_schema()
    locker.close()


def _diff(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> set[str]:
    return {key for key in a.keys() | b.keys() if a.get(key) != b.get(key)}


def test_django_migrate_makes_the_schema_alembic_makes(
    backend: str, fresh: Callable[[], Side], django_env: DjangoEnv  # noqa: F811
) -> None:
    by_django, by_alembic = fresh(), fresh()
    _django_migrate(django_env, by_django)
    _alembic(by_alembic)
    made = by_alembic.snapshot()
    assert made == by_django.snapshot()
    # ...and that schema is dblock's whole schema, not two empty ones.
    assert made["versions"] == [("dblock_0013",)]
    names = {row[1] for row in made["objects"]} if backend == "sqlite" else {row[0] for row in made["relations"]}
    expected = {"locks", "fences", "alembic_version_dblock", "locks_holders"}
    if backend == "postgresql":
        expected |= {"locks_token_seq", "locks_waiters", "locks_procs"}
        assert [row[0] for row in made["functions"]] == [
            "locks_admit", "locks_cancel", "locks_downgrade", "locks_enqueue", "locks_hand_on", "locks_handoff",
            "locks_missed", "locks_share_acquire",
            "locks_share_acquire", "locks_share_enqueue", "locks_share_enqueue", "locks_share_extend",
            "locks_share_release", "locks_upgrade",
        ]  # share_acquire and share_enqueue twice: 0010's signatures, and the earlier ones beside them
    else:
        expected |= {"ix_locks_token"}
    assert expected <= names


# Each changes one thing the comparison must see; run in a transaction that is rolled back.
_PG_DRIFTS = {
    "a column's type": ("ALTER TABLE locks ALTER COLUMN label TYPE varchar(254)", "columns"),
    "a column's nullability": ("ALTER TABLE fences ALTER COLUMN last_token DROP NOT NULL", "columns"),
    "a column's default": ("ALTER TABLE locks ALTER COLUMN waiting SET DEFAULT 1", "columns"),
    "an index": ("CREATE INDEX locks_owner ON locks (owner)", "indexes"),
    "a constraint": ("ALTER TABLE locks ADD CONSTRAINT positive CHECK (token > 0)", "constraints"),
    "the sequence": ("ALTER SEQUENCE locks_token_seq CACHE 20", "sequences"),
    "a function's source": (
        "CREATE OR REPLACE FUNCTION locks_cancel(p_name text, p_owner text, p_seq bigint) RETURNS TABLE "
        "(granted boolean, token bigint, expires_at timestamptz) LANGUAGE sql AS $$ SELECT false, 0::bigint, now() $$",
        "functions",
    ),
    "the revision": ("UPDATE alembic_version_dblock SET version_num = 'dblock_0005'", "versions"),
}
_SQLITE_DRIFTS = {
    "a column": ("ALTER TABLE locks ADD COLUMN extra INTEGER", "columns"),
    "a column's name": ("ALTER TABLE fences RENAME COLUMN last_token TO newest", "columns"),
    "an index": ("CREATE INDEX locks_owner ON locks (owner)", "objects"),
    "a dropped index": ("DROP INDEX ix_locks_token", "objects"),
    "the revision": ("UPDATE alembic_version_dblock SET version_num = 'dblock_0005'", "versions"),
}


def test_the_comparison_sees_each_kind_of_drift(backend: str, fresh: Callable[[], Side]) -> None:
    """The drift test can fail: one change of each kind makes the snapshots differ where it should."""
    side = fresh()
    _alembic(side)
    baseline = side.snapshot()
    drifts = _PG_DRIFTS if backend == "postgresql" else _SQLITE_DRIFTS
    conn = side.connect()
    try:
        for what, (ddl, where) in drifts.items():
            conn.execute("BEGIN")
            conn.execute(ddl)
            changed = _diff(baseline, side.snapshot(conn))
            conn.execute("ROLLBACK")
            assert where in changed, what
    finally:
        conn.close()
    assert side.snapshot() == baseline


def test_migrate_dblock_zero_removes_dblocks_tables_and_migrate_brings_them_back(
    backend: str, fresh: Callable[[], Side], django_env: DjangoEnv  # noqa: F811
) -> None:
    side, reference = fresh(), fresh()
    _django_migrate(django_env, side)
    _django_migrate(django_env, side, "zero")
    assert all(rows == [] for rows in side.snapshot().values()), side.snapshot()
    _django_migrate(django_env, side)
    _alembic(reference)
    assert side.snapshot() == reference.snapshot()


def test_django_migrate_leaves_tables_dblock_migrate_made(
    backend: str, fresh: Callable[[], Side], django_env: DjangoEnv  # noqa: F811
) -> None:
    """Made first by `dblock migrate` (or create_schema): Django's migration finds them current."""
    side = fresh()
    _alembic(side)
    locker = Locker(side.url)
    lease = locker.acquire("kept", ttl=60)
    before = side.snapshot()
    _django_migrate(django_env, side)
    assert side.snapshot() == before
    assert [i.token for i in locker.leases()] == [lease.token]
    lease.release()
    locker.close()


def test_the_latest_django_migration_pins_dblocks_alembic_head() -> None:
    """When dblock adds an Alembic revision, this app needs a migration that upgrades to it,
    whose reverse goes back to the one before."""
    import dblock.contrib.django.migrations as package

    chain = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        (operation,) = importlib.import_module(f"{package.__name__}.{info.name}").Migration.operations
        chain.append((operation.previous, operation.revision))
    script = ScriptDirectory.from_config(migrate.alembic_config("locks", None))
    assert chain[-1][1] in script.get_heads()
    assert [previous for previous, _ in chain] == [None, *[revision for _, revision in chain[:-1]]]


def test_sqlmigrate_prints_dblocks_ddl(django_env: DjangoEnv, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    from django.core.management import call_command

    call_command("sqlmigrate", "dblock", "0001", database="default")
    ddl = capsys.readouterr().out
    assert "CREATE TABLE locks" in ddl and "CREATE SEQUENCE locks_token_seq" in ddl
    assert "CREATE FUNCTION locks_enqueue" in ddl and "INSERT INTO alembic_version_dblock" in ddl
    call_command("sqlmigrate", "dblock", "0001", database="memory")  # only prints: no file is needed
    ddl = capsys.readouterr().out
    assert "CREATE TABLE locks" in ddl and "CREATE INDEX ix_locks_token" in ddl and "FUNCTION" not in ddl


def test_migrate_on_an_in_memory_sqlite_database_says_what_to_do(django_env: DjangoEnv) -> None:  # noqa: F811
    """Django's test runner gives SQLite an in-memory database; dblock's connections cannot open it."""
    from django.core.management import call_command

    with pytest.raises(ValueError, match=r"in-memory SQLite.*\['TEST'\]\['NAME'\]"):
        call_command("migrate", "dblock", database="memory", verbosity=0)
