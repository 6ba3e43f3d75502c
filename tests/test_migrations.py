"""dblock's Alembic migrations: the one source of the schema."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from sqlalchemy import BigInteger, DateTime, Float, Integer, MetaData, String, Table, create_engine, event, inspect
from sqlalchemy.exc import SQLAlchemyError

from dblock import DatabaseUnavailable, DBLockError, Locker, SchemaMissing, migrate
from dblock.schema import (
    LABEL_LENGTH,
    fences_table,
    fences_table_name,
    lean_function_names,
    locks_table,
    procs_table,
    shared_function_names,
    shared_queue_function_names,
    upgrade_function_names,
    queue_function_names,
    token_index_name,
    token_sequence_name,
    version_table_name,
    waiters_table,
    waiters_table_name,
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
    assert list(reflected) == ["name", "owner", "token", "acquired_at", "expires_at", "label", "waiting"]
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
        elif column.name == "waiting":
            assert isinstance(got["type"], Integer) and not isinstance(got["type"], BigInteger), got["type"]
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


def test_migrated_queue_tables_and_functions_match_the_code(db: Db) -> None:
    """PostgreSQL's fair queue (0005, 0008): the waiters and procs tables as declared, and the
    queue's, shared leases' and the acquire's and release's (0012) functions; SQLite, whose waiters poll, has none of them."""
    engine = create_engine(db.url)
    insp = inspect(engine)
    tables = (waiters_table(db.table), procs_table(db.table))
    if db.backend == "sqlite":
        assert not any(insp.has_table(t.name) for t in tables)
        engine.dispose()
        return
    for declared in tables:
        reflected = {c["name"]: c for c in insp.get_columns(declared.name)}
        assert list(reflected) == [c.name for c in declared.columns], declared.name
        for column in declared.columns:
            assert reflected[column.name]["nullable"] == column.nullable, (declared.name, column.name)
        assert insp.get_pk_constraint(declared.name)["constrained_columns"] == [c.name for c in declared.primary_key]
    assert {i["name"] for i in insp.get_indexes(waiters_table_name(db.table))} == set()  # the key is the index
    functions = {r[0] for r in db.query("SELECT proname FROM pg_proc WHERE proname LIKE %s", (db.table + "_%",))}
    assert functions == (
        set(queue_function_names(db.table)) | set(shared_function_names(db.table))
        | set(shared_queue_function_names(db.table)) | set(upgrade_function_names(db.table))
        | set(lean_function_names(db.table))
    )
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
    assert version == "dblock_0013"
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


def test_create_schema_says_what_it_did(db: Db, caplog: pytest.LogCaptureFixture) -> None:
    locker = db.locker()
    head = migrate.revisions()[-1]
    current = locker.create_schema()  # the fixture made the tables
    assert (current.before, current.after, current.changed) == (head, head, False)
    assert str(current) == f"the tables of {db.table!r} were already current (revision {head}); nothing changed"
    migrate.downgrade(locker.engine, db.table, None, "dblock_0007")
    with caplog.at_level(logging.INFO, logger="dblock.migrate"):
        upgraded = locker.create_schema()
    assert (upgraded.before, upgraded.after, upgraded.changed) == ("dblock_0007", head, True)
    assert str(upgraded) == f"upgraded the tables of {db.table!r} from revision dblock_0007 to {head}"
    assert any(str(upgraded) in r.getMessage() for r in caplog.records)  # told on the log too
    migrate.downgrade(locker.engine, db.table, None)
    created = locker.create_schema()
    assert created.created and created.changed and created.after == head
    assert str(created) == f"created the tables of {db.table!r} (revision {head})"
    locker.close()


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


def _made(db: Db, table: str) -> dict[str, list[tuple]]:
    """What dblock made for ``table`` (PostgreSQL or MariaDB), with the table's name written as T:
    columns, indexes and constraints, sequences and functions (PostgreSQL), and the recorded revision."""

    def named(rows: list[tuple]) -> list[tuple]:
        return sorted(tuple(str(v).replace(table, "T") for v in row) for row in rows)

    like = table.replace("_", "\\_") + "%"
    if db.backend == "mariadb":
        return {
            "columns": named(db.query(
                "SELECT table_name, column_name, column_type, is_nullable, column_default, collation_name, extra "
                "FROM information_schema.columns WHERE table_schema = DATABASE() AND table_name LIKE %s", (like,))),
            "indexes": named(db.query(
                "SELECT table_name, index_name, non_unique, seq_in_index, column_name FROM information_schema.statistics "
                "WHERE table_schema = DATABASE() AND table_name LIKE %s", (like,))),
            "tables": named(db.query(
                "SELECT table_name, engine, table_collation FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_name LIKE %s", (like,))),
            "revision": named(db.query(f"SELECT version_num FROM {version_table_name(table)}")),
        }
    return {
        "columns": named(db.query(
            "SELECT table_name, column_name, data_type, is_nullable, column_default, is_identity "
            "FROM information_schema.columns WHERE table_name LIKE %s", (like,))),
        "indexes": named(db.query("SELECT indexname, indexdef FROM pg_indexes WHERE tablename LIKE %s", (like,))),
        "constraints": named(db.query(
            "SELECT c.conname, pg_get_constraintdef(c.oid) FROM pg_constraint c JOIN pg_class r ON r.oid = c.conrelid "
            "WHERE r.relname LIKE %s", (like,))),
        "sequences": named(db.query(
            "SELECT sequencename, start_value, increment_by, cache_size, cycle FROM pg_sequences WHERE sequencename LIKE %s",
            (like,))),
        "functions": named(db.query(
            "SELECT oid::regprocedure::text, pg_get_functiondef(oid) FROM pg_proc WHERE starts_with(proname, %s)",
            (table + "_",))),
        "revision": named(db.query(f"SELECT version_num FROM {version_table_name(table)}")),
    }


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"])
def test_the_suites_tables_are_what_create_schema_makes(db: Db) -> None:
    """The suite makes each test's tables on the servers by running the migrations' offline DDL
    (conftest's Db.create), ten times faster than create_schema: the same objects (and on
    PostgreSQL the same function bodies), the same revision, and create_schema finds them current."""
    fixture_made = _made(db, db.table)
    other = Db(db.backend, db.url, db.table + "_cs")
    assert Locker(db.url, table=other.table).create_schema().before is None
    try:
        assert _made(db, other.table) == fixture_made
        assert all(fixture_made.values()), fixture_made  # every kind of object was there to compare
        assert Locker(db.url, table=db.table).create_schema().before == migrate.revisions()[-1]
    finally:
        other.drop()


# -- create_schema: what is already there, and database trouble -----------------------
def _catalog(db: Db) -> list[tuple]:
    """Every table, column and sequence of the database: 'nothing changed' checks of DDL."""
    if db.backend == "postgresql":
        return db.query(
            "SELECT c.relkind::text, n.nspname::text, c.relname::text, a.attname::text FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace LEFT JOIN pg_attribute a ON a.attrelid = c.oid "
            "AND a.attnum > 0 AND NOT a.attisdropped WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') "
            "AND n.nspname NOT LIKE 'pg_toast%%' ORDER BY 1, 2, 3, 4"
        )
    return db.query("SELECT type, name, sql FROM sqlite_master ORDER BY 1, 2")


def _statements(locker: Locker) -> list[str]:
    sent: list[str] = []
    event.listen(locker.engine, "before_cursor_execute", lambda conn, cur, sql, *rest: sent.append(sql))
    return sent


def test_create_schema_on_current_tables_only_reads(db: Db) -> None:
    """No DDL, no write, no lock: a role that may only read (docs/least-privilege.md) can call it."""
    locker = db.locker()
    sent = _statements(locker)
    before = (_catalog(db), db.query(f"SELECT version_num FROM {version_table_name(db.table)}"))
    locker.create_schema()
    assert sent, "create_schema sent nothing at all"
    for sql in sent:
        assert sql.lstrip().upper().startswith(("SELECT", "PRAGMA", "WITH")), sql
        assert "pg_advisory" not in sql, sql  # the lock that serialises migrations: not needed to look
    assert (_catalog(db), db.query(f"SELECT version_num FROM {version_table_name(db.table)}")) == before


def test_create_schema_leaves_tables_from_a_newer_dblock_alone(db: Db) -> None:
    """A newer dblock migrated the table (a revision this one does not know): it still has what this one needs."""
    db.query(f"UPDATE {version_table_name(db.table)} SET version_num = 'dblock_9999'")
    before = _catalog(db)
    locker = db.locker()
    locker.create_schema()
    assert _catalog(db) == before
    assert locker.try_acquire("x") is not None
    # Without what this dblock needs (0005's waiting column), it says so and changes nothing.
    db.query(f"ALTER TABLE {db.table} DROP COLUMN waiting")
    before = _catalog(db)
    with pytest.raises(DBLockError, match=r"newer dblock \(revision dblock_9999\).*upgrade dblock") as caught:
        locker.create_schema()
    assert type(caught.value) is DBLockError
    assert _catalog(db) == before


def test_create_schema_refuses_a_table_dblock_did_not_make(backend: str, request: pytest.FixtureRequest,
                                                          tmp_path: Path) -> None:
    """An app's own table with dblock's name: no CREATE half-way, no version table, a message that says why."""
    url = request.getfixturevalue("pg_url") if backend == "postgresql" else f"sqlite:///{tmp_path / 'app.db'}"
    db = Db(backend, url, "mine_" + os.urandom(4).hex())
    db.query(f"CREATE TABLE {db.table} (id integer PRIMARY KEY, body text)")
    try:
        before = _catalog(db)
        with pytest.raises(DBLockError, match=f"a table '{db.table}' exists .* no dblock history made it") as caught:
            db.locker().create_schema()
        assert type(caught.value) is DBLockError and "table=" in str(caught.value)
        assert _catalog(db) == before
    finally:
        db.query(f"DROP TABLE {db.table}")
        db.drop()


def test_create_schema_error_keeps_the_sqlstate(pg: Db) -> None:
    """A database error that is neither a privilege nor the connection: DBLockError, its sqlstate, rolled back."""
    table = pg.table + "_s"
    pg.query(f"CREATE SEQUENCE {token_sequence_name(table)}")  # in the way of dblock's first migration
    try:
        before = _catalog(pg)
        with pytest.raises(DBLockError, match=f"{token_sequence_name(table)}.* already exists") as caught:
            Locker(pg.url, table=table).create_schema()
        assert type(caught.value) is DBLockError and caught.value.sqlstate == "42P07"  # duplicate_table
        assert isinstance(caught.value.__cause__, SQLAlchemyError)
        assert _catalog(pg) == before
    finally:
        pg.query(f"DROP SEQUENCE {token_sequence_name(table)}")


def test_create_schema_on_an_unreachable_server() -> None:
    with socket.socket() as s:  # a port nobody listens on: connecting is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    locker = Locker(f"postgresql+psycopg://nobody:secret@127.0.0.1:{port}/db")
    with pytest.raises(DatabaseUnavailable, match=f"cannot reach .*127.0.0.1:{port}") as caught:
        locker.create_schema()
    assert "secret" not in str(caught.value)
    assert isinstance(caught.value.__cause__, SQLAlchemyError)



def test_0010_keeps_working_for_the_code_before_it_and_asks_the_code_after_it_to_upgrade(db: Db) -> None:
    """0010 adds the upgradeable read lock. On PostgreSQL the earlier signatures of share_acquire (which
    code of an earlier dblock, still running after the migration, calls) call the new functions, so such
    a reader is also kept out beside an upgrade; elsewhere the new column's default serves it. This
    dblock against tables at 0009 raises SchemaMissing for shared leases, naming the upgrade; its
    exclusive lock works there on SQLite and MariaDB, and asks for the upgrade on PostgreSQL too
    (its statements call 0012's functions)."""
    locker = db.locker()
    if db.backend == "postgresql":
        up = locker.upgradeable("u").acquire(ttl=30)
        reader = locker.readers("u").acquire(ttl=30)
        earlier = f"SELECT granted FROM {db.table}_share_acquire(%s, %s, 30.0::float8, 'old', NULL::int)"
        assert db.query(earlier, ("u", "a" * 32)) == [(True,)]  # a reader, by the earlier signature
        ask = f"SELECT granted FROM {db.table}_upgrade(%s, %s, %s, 30.0::float8)"
        assert db.query(ask, ("u", up.owner, up.token)) == [(False,)]  # others read: the ask stands
        assert db.query(earlier, ("u", "b" * 32)) == [(False,)]  # nobody joins beside it, old code neither
        reader.release()
        up.release()
    migrate.downgrade(locker.engine, db.table, None, "dblock_0009")
    fresh = db.locker()
    with pytest.raises(SchemaMissing, match="older dblock"):
        fresh.readers("r").try_acquire(ttl=30)
    if db.backend == "postgresql":
        with pytest.raises(SchemaMissing, match="older dblock"):
            fresh.try_acquire("w", ttl=30)
    else:
        lease = fresh.try_acquire("w", ttl=30)
        assert lease is not None
        lease.release()
    fresh.close()
    assert locker.create_schema().after == "dblock_0013"
    assert locker.readers("r").try_acquire(ttl=30) is not None
    locker.close()
