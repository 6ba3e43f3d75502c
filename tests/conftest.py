"""Fixtures: a real PostgreSQL (DBLOCK_TEST_URL, or a throwaway server) and a real SQLite file.

Every test gets its own freshly migrated table, so tests never see each
other's rows.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Callable, Iterator

import psycopg
import pytest
from sqlalchemy.engine import make_url

import dblock
from dblock import Locker


def _throwaway_postgresql(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object]:
    try:
        import pgserver
    except ImportError:  # pragma: no cover - the message is the point
        pytest.exit(
            "no PostgreSQL for the tests: set DBLOCK_TEST_URL=postgresql+psycopg://... "
            "or install the test extras (pip install -e '.[test]'), which bring pgserver",
            returncode=3,
        )
    server = pgserver.get_server(tmp_path_factory.mktemp("pg"), cleanup_mode="delete")
    return server.get_uri().replace("postgresql://", "postgresql+psycopg://", 1), server


@pytest.fixture(scope="session")
def _postgresql(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object]]:
    url = os.environ.get("DBLOCK_TEST_URL")
    if url:
        yield make_url(url).set(drivername="postgresql+psycopg").render_as_string(hide_password=False), None
        return
    url, server = _throwaway_postgresql(tmp_path_factory)
    yield url, server
    server.cleanup()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def pg_url(_postgresql: tuple[str, object]) -> str:
    """A SQLAlchemy URL of a PostgreSQL server the tests may create tables in."""
    return _postgresql[0]


@pytest.fixture(scope="session")
def pg_server(_postgresql: tuple[str, object]) -> object:
    """The throwaway pgserver, or skip: a server given by DBLOCK_TEST_URL is not ours to restart."""
    if _postgresql[1] is None:
        pytest.skip("DBLOCK_TEST_URL points at a server the tests must not restart")
    return _postgresql[1]


def libpq_dsn(url: str) -> str:
    """The psycopg (libpq) connection string for a SQLAlchemy URL."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(params=["postgresql", "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


class Db:
    """One backend, one fresh table; makes Lockers on it and reads it directly."""

    def __init__(self, backend: str, url: str, table: str) -> None:
        self.backend = backend
        self.url = url
        self.table = table
        self.lockers: list[Locker] = []

    def locker(self, **options: object) -> Locker:
        options.setdefault("table", self.table)
        locker = Locker(self.url, **options)  # type: ignore[arg-type]
        self.lockers.append(locker)
        return locker

    def connect(self):  # a direct driver connection, autocommit
        if self.backend == "postgresql":
            return psycopg.connect(libpq_dsn(self.url), autocommit=True)
        import sqlite3

        conn = sqlite3.connect(make_url(self.url).database, isolation_level=None, timeout=30)
        return conn

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        conn = self.connect()
        try:
            if self.backend == "sqlite":
                sql = sql.replace("%s", "?")
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description is not None else []
        finally:
            conn.close()

    def rows(self) -> list[tuple]:
        """The whole table, for 'nothing changed' checks."""
        return self.query(f"SELECT name, owner, token, acquired_at, expires_at FROM {self.table} ORDER BY name")

    def drop(self) -> None:
        for locker in self.lockers:
            locker.close()
        if self.backend == "postgresql":
            self.query(
                f"DROP TABLE IF EXISTS {self.table}_audit, {self.table}, {self.table}_fences, "
                f"alembic_version_dblock_{self.table} CASCADE"
            )
            self.query(f"DROP SEQUENCE IF EXISTS {self.table}_token_seq")


@pytest.fixture
def db(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    table = "t_" + secrets.token_hex(6)
    if backend == "postgresql":
        url = request.getfixturevalue("pg_url")
    else:
        url = f"sqlite:///{tmp_path / 'locks.sqlite3'}"
    d = Db(backend, url, table)
    Locker(url, table=table).create_schema()
    yield d
    d.drop()


@pytest.fixture
def pg(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    """PostgreSQL only."""
    table = "t_" + secrets.token_hex(6)
    d = Db("postgresql", request.getfixturevalue("pg_url"), table)
    Locker(d.url, table=table).create_schema()
    yield d
    d.drop()


@pytest.fixture
def locker(db: Db) -> Locker:
    return db.locker()


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll for an event that must happen; fail if it does not within `timeout`."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


__all__ = ["Db", "dblock", "libpq_dsn", "wait_for"]
