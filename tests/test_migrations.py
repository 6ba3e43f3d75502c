"""dblock's Alembic migrations: the one source of the schema."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
from sqlalchemy import BigInteger, DateTime, Float, MetaData, String, Table, create_engine, inspect

from dblock import Locker, migrate
from dblock.schema import (
    LABEL_LENGTH,
    fences_table,
    fences_table_name,
    locks_table,
    token_index_name,
    token_sequence_name,
    version_table_name,
)

from .conftest import Db

ROOT = Path(__file__).resolve().parent.parent


def test_migrated_table_matches_the_code(db: Db) -> None:
    """Drift test: the migrated columns are the ones dblock.schema declares."""
    engine = create_engine(db.url)
    insp = inspect(engine)
    reflected = {c["name"]: c for c in insp.get_columns(db.table)}
    declared = locks_table(db.table)
    assert list(reflected) == [c.name for c in declared.columns]
    assert list(reflected) == ["name", "owner", "token", "acquired_at", "expires_at", "label", "queue"]
    assert reflected["label"]["nullable"] and reflected["label"]["type"].length == LABEL_LENGTH == 255
    for column in declared.columns:
        got = reflected[column.name]
        assert got["nullable"] == column.nullable, column.name
        expected = column.type.dialect_impl(engine.dialect)
        if column.name in ("acquired_at", "expires_at"):
            wanted = Float if db.backend == "sqlite" else DateTime
            assert isinstance(got["type"], wanted), (column.name, got["type"])
            if db.backend == "postgresql":
                assert got["type"].timezone
        elif column.name == "queue":
            assert type(got["type"]).__name__ == ("JSONB" if db.backend == "postgresql" else "JSON"), got["type"]
        elif isinstance(expected, String):
            assert isinstance(got["type"], String) and got["type"].length == expected.length, column.name
        else:
            assert isinstance(got["type"], BigInteger), column.name
    assert insp.get_pk_constraint(db.table)["constrained_columns"] == ["name"]
    indexes = {i["name"] for i in insp.get_indexes(db.table)}
    if db.backend == "postgresql":
        assert indexes == set()  # only the primary key: grants stay HOT updates
        assert token_sequence_name(db.table) in insp.get_sequence_names()
        ((cache, cycle),) = db.query(
            "SELECT cache_size, cycle FROM pg_sequences WHERE sequencename = %s", (token_sequence_name(db.table),)
        )
        assert (cache, cycle) == (1, False)
    else:
        assert indexes == {token_index_name(db.table)}
    engine.dispose()


def test_migrated_fences_table_matches_the_code(db: Db) -> None:
    engine = create_engine(db.url)
    insp = inspect(engine)
    declared = fences_table(db.table)
    assert declared.name == f"{db.table}_fences" == fences_table_name(db.table)
    reflected = {c["name"]: c for c in insp.get_columns(declared.name)}
    assert list(reflected) == ["resource", "last_token"]
    assert isinstance(reflected["resource"]["type"], String) and reflected["resource"]["type"].length == 255
    assert isinstance(reflected["last_token"]["type"], BigInteger)
    assert not reflected["last_token"]["nullable"]
    assert insp.get_pk_constraint(declared.name)["constrained_columns"] == ["resource"]
    engine.dispose()


def test_0003_adds_the_label_to_a_table_with_leases_in_it(db: Db) -> None:
    """Upgrading a live 0002 table keeps its leases (label NULL until re-granted); downgrading drops the column."""
    locker = db.locker(label="worker-7")
    migrate.downgrade(locker.engine, db.table, None, "dblock_0002")
    assert "label" not in {c["name"] for c in inspect(locker.engine).get_columns(db.table)}
    db.query(
        f"INSERT INTO {db.table} (name, owner, token, acquired_at, expires_at) VALUES "
        + ("('old', 'o1', 5, now(), now() + interval '1 hour')" if db.backend == "postgresql" else
           "('old', 'o1', 5, (julianday('now') - 2440587.5) * 86400.0, (julianday('now') - 2440587.5) * 86400.0 + 3600)")
    )
    locker.create_schema()
    ((version,),) = db.query(f"SELECT version_num FROM {version_table_name(db.table)}")
    assert version == "dblock_0004"
    (old,) = locker.leases()
    assert (old.name, old.owner, old.token, old.label) == ("old", "o1", 5, None)
    lease = locker.try_acquire("new")
    assert [(i.name, i.label) for i in locker.leases()] == [("new", "worker-7"), ("old", None)]
    migrate.downgrade(locker.engine, db.table, None, "dblock_0002")
    assert db.query(f"SELECT name, owner, token FROM {db.table} ORDER BY name") == [
        ("new", lease.owner, lease.token),
        ("old", "o1", 5),
    ]
    locker.create_schema()


def test_create_schema_is_idempotent_and_uses_its_own_version_table(db: Db) -> None:
    locker = db.locker()
    locker.create_schema()
    locker.create_schema()
    engine = create_engine(db.url)
    tables = inspect(engine).get_table_names()
    engine.dispose()
    assert version_table_name(db.table) in tables
    assert "alembic_version" not in tables


def test_downgrade_then_upgrade(db: Db) -> None:
    locker = db.locker()
    locker.try_acquire("x")
    migrate.downgrade(locker.engine, db.table, None)
    engine = create_engine(db.url)
    assert db.table not in inspect(engine).get_table_names()
    assert fences_table_name(db.table) not in inspect(engine).get_table_names()
    if db.backend == "postgresql":
        assert token_sequence_name(db.table) not in inspect(engine).get_sequence_names()
    engine.dispose()
    locker.create_schema()
    assert locker.try_acquire("x") is not None


def test_racing_create_schema_calls_agree(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    url = request.getfixturevalue("pg_url") if backend == "postgresql" else f"sqlite:///{tmp_path / 'r.db'}"
    table = "race_" + os.urandom(4).hex()
    errors: list[BaseException] = []

    def create() -> None:
        try:
            Locker(url, table=table).create_schema()
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    locker = Locker(url, table=table)
    assert locker.try_acquire("x") is not None
    locker.close()
    if backend == "postgresql":
        migrate.downgrade(locker.engine, table, None)


def test_offline_sql_shows_the_ddl() -> None:
    ddl = migrate.sql("postgresql+psycopg://u@h/db", "locks", None)
    assert "CREATE SEQUENCE" in ddl and "CREATE TABLE locks" in ddl and "CREATE TABLE fences" in ddl
    assert "ALTER TABLE locks ADD COLUMN label VARCHAR(255)" in ddl
    assert "alembic_version_dblock" in ddl


def test_exclude_dblock_hides_only_dblocks_tables() -> None:
    """The autogenerate filter (end to end in test_app_integration); here its edges and its checks."""
    md = MetaData()
    mine = Table("notes", md)
    hook = migrate.exclude_dblock("jobs", schema="ops", include_object=lambda o, *rest: o is not mine)
    for name in ("jobs", "jobs_fences", "alembic_version_dblock_jobs"):
        assert not hook(Table(name, md, schema="ops"), name, "table", True, None)
        assert hook(Table(name, md), name, "table", True, None)  # same name, another schema: not ours
    assert hook(Table("locks", md, schema="ops"), "locks", "table", True, None)  # not named: not hidden
    assert not hook(mine, "notes", "table", False, None)  # the app's own filter still decides the rest
    default = migrate.exclude_dblock()
    assert [default(Table(n, md), n, "table", True, None) for n in ("locks", "fences", "alembic_version_dblock")] == [
        False, False, False
    ]
    with pytest.raises(ValueError, match="table"):
        migrate.exclude_dblock("jobs; DROP")
    with pytest.raises(ValueError, match="schema"):
        migrate.exclude_dblock(schema="")


def test_built_wheel_in_a_fresh_virtualenv(pg: Db, wheel_venv: Path, tmp_path: Path) -> None:
    """The wheel carries the migrations: installed (not editable) it can create its table and lock."""
    script = (
        "import sys, dblock, dblock.migrate as m\n"
        "assert 'site-packages' in m.migrations_dir().as_posix(), m.migrations_dir()\n"
        "locker = dblock.Locker(sys.argv[1], table=sys.argv[2])\n"
        "locker.create_schema()\n"
        "lease = locker.try_acquire('from-wheel')\n"
        "print(lease.token)\n"
    )
    out = subprocess.run(
        [str(wheel_venv / "python"), "-c", script, pg.url, pg.table + "_w"],
        check=True, capture_output=True, text=True, cwd=tmp_path,
    )
    assert int(out.stdout) >= 1
    pg.query(f"DROP TABLE {pg.table}_w, {pg.table}_w_fences, alembic_version_dblock_{pg.table}_w")
    pg.query(f"DROP SEQUENCE IF EXISTS {pg.table}_w_token_seq")
