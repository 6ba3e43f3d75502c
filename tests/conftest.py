"""Fixtures: a real PostgreSQL (DBLOCK_TEST_URL, or a throwaway server) and a real SQLite file.

Every test gets its own freshly migrated table, so tests never see each
other's rows.
"""

from __future__ import annotations

import ast
import os
import secrets
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import psycopg
import pytest
from sqlalchemy.engine import make_url

import dblock
from dblock import Locker, migrate
from dblock.pytest_plugin import PostgreSQL, memory_dir

from . import ha
from . import pgbouncer as bouncer
from .pgbouncer import PgBouncer
from .pgproxy import PgProxy


@pytest.fixture(scope="session")
def pg_url(dblock_postgresql: PostgreSQL) -> str:
    """A SQLAlchemy URL of a PostgreSQL server the tests may create tables in.

    From dblock's own pytest plugin: DBLOCK_TEST_URL (or --dblock-url), else a
    throwaway pgserver for the session.
    """
    return dblock_postgresql.url


@pytest.fixture(scope="session")
def pg_server(dblock_postgresql: PostgreSQL) -> object:
    """The throwaway pgserver, or skip: a server given by DBLOCK_TEST_URL is not ours to restart."""
    if dblock_postgresql.server is None:
        pytest.skip("DBLOCK_TEST_URL points at a server the tests must not restart")
    return dblock_postgresql.server


@pytest.fixture(scope="session")
def pgbouncer(pg_url: str) -> Iterator[PgBouncer]:
    """A real PgBouncer in transaction mode, 4 server connections, before the session's PostgreSQL.

    Skips, naming the package, where pgbouncer is not installed.
    """
    if bouncer.binary() is None:
        pytest.skip(bouncer.MISSING)
    with bouncer.start(pg_url, pool_size=4) as running:
        yield running


@pytest.fixture(scope="session")
def ha_cluster() -> Iterator[ha.Cluster]:
    """A real Patroni + etcd cluster of three PostgreSQL nodes, synchronous_mode on, for the session.

    Skips, naming what is missing, where the parts are not installed
    (tests/install-ha.sh installs them). Everything it started is killed and
    reaped at the end of the session.
    """
    reason = ha.missing()
    if reason is not None:
        pytest.skip(reason)
    with ha.start(synchronous=True) as cluster:
        yield cluster


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The HA and partition scenarios' figures (failover windows, refused stale writes...), shown after every run."""
    if ha.FIGURES:
        terminalreporter.section("high availability: measured")
        for line in ha.FIGURES:
            terminalreporter.write_line(line)
    partitions = sys.modules.get(f"{__package__}.test_partitions")  # loaded only when its tests ran
    if partitions is not None and partitions.FIGURES:
        terminalreporter.section("network partitions: measured")
        for line in partitions.FIGURES:
            terminalreporter.write_line(line)


def mariadb_connect(url: str):  # noqa: ANN201 - a PyMySQL connection, autocommit, UTC
    import pymysql

    u = make_url(url)
    conn = pymysql.connect(
        host=u.host or "localhost", port=u.port or 3306, user=u.username or "", password=u.password or "",
        database=u.database, autocommit=True, unix_socket=u.query.get("unix_socket"),
    )
    conn.cursor().execute("SET time_zone = '+00:00'")
    return conn


def libpq_dsn(url: str) -> str:
    """The psycopg (libpq) connection string for a SQLAlchemy URL."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


# The backends a test of ``db`` (or ``backend``) runs on. A module lists MariaDB too with
# ``BACKENDS = ALL_BACKENDS``: the backend contract, both faces' verbs, the guarantees' race,
# fencing and shared leases run on every backend; the rest of the suite on PostgreSQL and
# SQLite, which keeps it within its time.
BACKENDS = ("postgresql", "sqlite")
ALL_BACKENDS = ("postgresql", "sqlite", "mariadb")


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, tried again after CPython 3.11's spurious ``SystemError: AST constructor
    recursion depth mismatch``: 3.11 keeps that depth per interpreter, not per thread, so a parse
    racing another thread's (a background thread formatting a traceback parses the line for its
    carets) can fail for nothing (python/cpython#106905). A CI run saw it once."""
    for attempt in range(5):
        try:
            return ast.parse(source, filename)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == 4:
                raise
    raise AssertionError("unreachable")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames:
        return
    if any("backend" in str(mark.args[0]) for mark in metafunc.definition.iter_markers("parametrize")):
        return  # the test names its backends itself
    metafunc.parametrize("backend", getattr(metafunc.module, "BACKENDS", BACKENDS), indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def mariadb_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A SQLAlchemy URL of a MariaDB database the tests may create tables in: DBLOCK_TEST_MARIADB_URL,
    else a throwaway server started for the session (skipped, saying why, where MariaDB is not installed)."""
    import os

    from dblock import _mariadb_server

    if not os.environ.get("DBLOCK_TEST_MARIADB_URL"):
        found = _mariadb_server.find()
        if isinstance(found, str):
            pytest.skip(found)
    # dblock's own plugin fixture: DBLOCK_TEST_MARIADB_URL, else a throwaway server for the session.
    yield request.getfixturevalue("dblock_mariadb_url")


class Db:
    """One backend, one fresh table; makes Lockers on it and reads it directly."""

    def __init__(self, backend: str, url: str, table: str) -> None:
        self.backend = backend
        self.url = url
        self.table = table
        self.lockers: list[Locker] = []

    @property
    def now(self) -> str:
        """The database's clock in SQL, as the table's times hold it (timestamptz, or Unix seconds)."""
        return {
            "postgresql": "now()",
            "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
            "mariadb": "UNIX_TIMESTAMP(NOW(6))",
        }[self.backend]

    def lock_waits(self, like: str) -> bool:
        """Whether a statement whose text is LIKE ``like`` waits for a row lock now (server databases)."""
        if self.backend == "postgresql":
            sql = "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s"
        elif self.backend == "mariadb":
            # A statement that has run for 200 ms: these tests' statements finish in a few ms unless a
            # row lock holds them (information_schema.innodb_trx does not always list the waiter).
            sql = "SELECT 1 FROM information_schema.processlist WHERE command = 'Query' AND time_ms > 200 AND info LIKE %s"
        else:
            raise ValueError(f"{self.backend} has no row locks")
        return bool(self.query(sql, (like,)))

    def seconds(self, n: float) -> str:
        """``n`` seconds in SQL, to add to or take from the table's times."""
        return f"interval '{n} seconds'" if self.backend == "postgresql" else repr(float(n))

    def locker(self, **options: object) -> Locker:
        options.setdefault("table", self.table)
        locker = Locker(self.url, **options)  # type: ignore[arg-type]
        self.lockers.append(locker)
        return locker

    def connect(self):  # a direct driver connection, autocommit
        if self.backend == "postgresql":
            return psycopg.connect(libpq_dsn(self.url), autocommit=True)
        if self.backend == "mariadb":
            return mariadb_connect(self.url)
        import sqlite3

        conn = sqlite3.connect(make_url(self.url).database, isolation_level=None, timeout=30)
        return conn

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        conn = self.connect()
        try:
            if self.backend == "sqlite":
                sql = sql.replace("%s", "?")
            if self.backend == "mariadb":
                cur = conn.cursor()
                cur.execute(sql, params or None)
                return [tuple(r) for r in cur.fetchall()] if cur.description is not None else []
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description is not None else []
        finally:
            conn.close()

    def rows(self) -> list[tuple]:
        """The whole table, for 'nothing changed' checks."""
        return self.query(f"SELECT name, owner, token, acquired_at, expires_at FROM {self.table} ORDER BY name")

    def create(self) -> None:
        """The table, freshly migrated to dblock's head: on the servers by running the DDL the
        migrations give offline (``migrate.sql``, made once per server for a template name),
        where ``create_schema`` takes about ten times as long to reach the same tables
        (tests/test_migrations.py checks that they are the same); on SQLite by ``create_schema``."""
        if self.backend == "sqlite":  # a file of its own, and quick: the real thing
            Locker(self.url, table=self.table).create_schema()
            return
        script = _MIGRATED.get(self.url)
        if script is None:
            script = _MIGRATED[self.url] = migrate.sql(self.url, TEMPLATE_TABLE, None)
        script = script.replace(TEMPLATE_TABLE, self.table)
        if self.backend == "postgresql":
            with self.connect() as conn:
                conn.execute(script)
            return
        # MariaDB: one statement at a time (the offline text ends each with ";" and a blank line).
        conn = self.connect()
        try:
            cur = conn.cursor()
            for statement in script.split(";\n\n"):
                lines = [line for line in statement.splitlines() if line.strip() and not line.startswith("--")]
                if lines:
                    cur.execute("\n".join(lines))
        finally:
            conn.close()

    def drop(self) -> None:
        for locker in self.lockers:
            locker.close()
        if self.backend == "postgresql":  # everything named for the table, on one connection: what dblock
            t = self.table  # made for it, the audits, and tables a test named from it (``{t}_cli``) with theirs
            with self.connect() as conn:
                tables = [r for (r,) in conn.execute(
                    "SELECT oid::regclass::text FROM pg_class WHERE relkind IN ('r', 'p') AND (relname = %s"
                    " OR starts_with(relname, %s) OR starts_with(relname, %s))",
                    (t, t + "_", "alembic_version_dblock_" + t),
                )]
                if tables:
                    conn.execute(f"DROP TABLE IF EXISTS {', '.join(tables)} CASCADE")
                sequences = [q for (q,) in conn.execute(  # the token's, and any a test made; a column's went with its table
                    "SELECT oid::regclass::text FROM pg_class WHERE relkind = 'S' AND starts_with(relname, %s)", (t + "_",)
                )]
                if sequences:
                    conn.execute(f"DROP SEQUENCE IF EXISTS {', '.join(sequences)} CASCADE")
                functions = [f for (f,) in conn.execute(
                    "SELECT oid::regprocedure::text FROM pg_proc WHERE starts_with(proname, %s)", (t + "_",)
                )]
                if functions:
                    conn.execute(f"DROP FUNCTION IF EXISTS {', '.join(functions)} CASCADE")
        elif self.backend == "mariadb":
            t = self.table
            self.query(f"DROP TABLE IF EXISTS {t}_audit, {t}, {t}_fences, {t}_holders, alembic_version_dblock_{t}")


# The offline DDL of dblock's migrations for TEMPLATE_TABLE, by server URL (Db.create). The name
# occurs in that text only as the table's name and the prefix of every name derived from it.
TEMPLATE_TABLE = "t_fixture_template"
_MIGRATED: dict[str, str] = {}


@pytest.fixture
def memory_path(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory in memory where the machine allows (else tmp_path): SQLite
    commits there cost no disk flush, so a slow disk does not slow the suite."""
    if memory_dir() is None:
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="dblock-test-", dir=memory_dir()))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def db(backend: str, request: pytest.FixtureRequest, memory_path: Path) -> Iterator[Db]:
    table = "t_" + secrets.token_hex(6)
    if backend == "postgresql":
        url = request.getfixturevalue("pg_url")
    elif backend == "mariadb":
        url = request.getfixturevalue("mariadb_url")
    else:
        url = f"sqlite:///{memory_path / 'locks.sqlite3'}"
    d = Db(backend, url, table)
    d.create()
    yield d
    d.drop()


@pytest.fixture
def pg(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    """PostgreSQL only."""
    table = "t_" + secrets.token_hex(6)
    d = Db("postgresql", request.getfixturevalue("pg_url"), table)
    d.create()
    yield d
    d.drop()


@pytest.fixture
def locker(db: Db) -> Locker:
    return db.locker()


def warm_waiting(db: Db, locker: Locker) -> None:
    """Open the pooled connection and, in fair mode, the listener, and prepare every
    statement a wait sends: one-time set-up that statement counts leave out."""
    other = db.locker()
    other.try_acquire("warm", ttl=0.05)
    locker.acquire("warm", timeout=30).release()  # the connection and the listener are open
    # Queued, then a look at the expiry: the enqueue with no place in line yet and with one
    # are two prepared statements (a NULL and an int differ in type).
    other.try_acquire("warm", ttl=0.5)
    locker.acquire("warm", timeout=30).release()
    other.try_acquire("warm", ttl=60)
    with pytest.raises(dblock.LockNotAcquired):
        locker.acquire("warm", timeout=0.01)


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of a fresh virtualenv with dblock installed from its built wheel (not editable).

    Built once per run: the wheel and the install are the slow part (25-33 s here). Under
    pytest-xdist the workers share one, in the run's own base directory: the first to ask
    builds it under a file lock, the others wait and use it (the tests only run it).
    """
    import fcntl
    import subprocess
    import sys
    import venv

    root = Path(__file__).resolve().parent.parent
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's directory, above each worker's own
    where = base / "dblock-wheel"
    bin_dir = where / "venv" / "bin"
    with open(base / "dblock-wheel.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (where / "ready").exists():
            return bin_dir
        shutil.rmtree(where, ignore_errors=True)  # a build that failed half-way
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(where / "dist"), str(root)],
            check=True,
        )
        (wheel,) = (where / "dist").glob("dblock-*.whl")
        venv.create(where / "venv", with_pip=True)
        # With the binary extra, as the README's first command installs it (no libpq needed on the machine).
        subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", f"{wheel}[binary]"], check=True)
        (where / "ready").touch()
    return bin_dir


@contextmanager
def scratch_database(pg_url: str, prefix: str) -> Iterator[str]:
    """The URL of a new, empty database on the server of ``pg_url`` (for tests that compare a whole
    database, as autogenerate does), dropped afterwards."""
    name = prefix + secrets.token_hex(4)
    with psycopg.connect(libpq_dsn(pg_url), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
        try:
            yield make_url(pg_url).set(database=name).render_as_string(hide_password=False)
        finally:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


def lock_once(url: str, table: str, schema: str | None) -> int:
    """Acquire and release a lock on dblock's tables there: they work. Returns the grant's token."""
    with Locker(url, table=table, schema=schema) as locker:
        lease = locker.try_acquire("app-job")
        assert lease is not None
        lease.release()
        return lease.token


@pytest.fixture
def proxy(pg: Db) -> Iterator[PgProxy]:
    """A proxy in front of the test PostgreSQL that counts round trips (and can pause or cut them)."""
    p = PgProxy(pg.url)
    yield p
    p.close()


def trusted(ttl: float) -> float:
    """The most a fresh lease of ``ttl`` is trusted for (its ``remaining()`` right after the grant) with
    the default clock allowance: 1% of the ttl and 2 ms less."""
    return ttl - ttl * 0.01 - 0.002


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll for an event that must happen; fail if it does not within `timeout`."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


__all__ = ["Db", "dblock", "libpq_dsn", "lock_once", "scratch_database", "wait_for", "warm_waiting"]
