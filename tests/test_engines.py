"""Any PostgreSQL engine: psycopg2 and asyncpg engines and URLs, dblock on its own psycopg 3 connections."""

from __future__ import annotations

import time

import psycopg
import pytest
from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, create_engine, text, update
from sqlalchemy.engine import make_url

from dblock import Locker, fenced_update
from dblock._engine import psycopg_url

from .conftest import Db

PASSWORD = "s3 cr@t:/?"  # every character a URL must escape; a trust-auth server accepts any password


def _url(pg: Db, driver: str, password: str | None = None) -> str:
    url = make_url(pg.url).set(drivername=f"postgresql+{driver}")
    if password is not None:
        url = url.set(password=password)
    return url.render_as_string(hide_password=False)


def _fresh_table(pg: Db) -> str:
    """A table name create_schema has not made yet (dropped with pg's own by its prefix)."""
    return pg.table + "_e"


def test_a_psycopg2_engine_works_and_creates_the_schema(pg: Db) -> None:
    pytest.importorskip("psycopg2", reason="psycopg2-binary is in the test extra")
    engine = create_engine(_url(pg, "psycopg2", PASSWORD))
    table = _fresh_table(pg)
    locker = Locker(engine, table=table)
    try:
        assert locker.engine is not engine and locker.engine.dialect.driver == "psycopg"
        locker.create_schema()
        lease = locker.acquire("p2", ttl=30, timeout=5)
        assert lease.token >= 1 and [i.name for i in locker.leases()] == ["p2"]
        # The app's psycopg2 engine does the fenced writes, as it would in the app.
        accounts = Table(
            table + "_accounts", MetaData(),
            Column("id", Integer, primary_key=True),
            Column("balance", Integer, nullable=False),
            Column("fence_token", BigInteger, nullable=False, server_default="0"),
        )
        accounts.create(engine)
        with engine.begin() as conn:
            conn.execute(accounts.insert().values(id=1, balance=10))
            fenced_update(conn, update(accounts).where(accounts.c.id == 1).values(balance=20), lease)
        assert lease.release()
        with engine.connect() as conn:  # the caller's engine is still the caller's, and usable
            assert conn.execute(text(f"SELECT balance, fence_token FROM {accounts.name}")).all() == [(20, lease.token)]
        # dblock's own connections and its schema engine both carry the password.
        raw = locker._driver.connect(time.monotonic() + 5)
        try:
            assert isinstance(raw, psycopg.Connection) and raw.info.password == PASSWORD
        finally:
            raw.close()
        with locker.engine.connect() as conn:
            assert conn.connection.driver_connection.info.password == PASSWORD  # type: ignore[union-attr]
        assert "s3" not in repr(locker)
    finally:
        locker.close()
        made = pg.query("SELECT tablename FROM pg_tables WHERE tablename LIKE %s", (f"%{table}%",))
        pg.query(f"DROP TABLE IF EXISTS {', '.join(t for (t,) in made) or table} CASCADE")
        pg.query(f"DROP SEQUENCE IF EXISTS {table}_token_seq")
        engine.dispose()


def test_a_psycopg2_url_string_works(pg: Db) -> None:
    locker = Locker(_url(pg, "psycopg2"), table=pg.table)
    try:
        assert locker.engine.dialect.driver == "psycopg"
        with locker.lock("p2-url", ttl=30, timeout=5) as lease:
            assert lease.token >= 1
    finally:
        locker.close()


def test_an_asyncpg_engine_works(pg: Db) -> None:
    pytest.importorskip("asyncpg", reason="asyncpg is in the test extra")
    pytest.importorskip("greenlet", reason="SQLAlchemy's asyncio extension needs greenlet (in the test extra)")
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(_url(pg, "asyncpg", PASSWORD) + "&prepared_statement_cache_size=0")
    locker = Locker(engine, table=pg.table)
    try:
        assert locker.engine.dialect.driver == "psycopg"
        assert locker.engine.url.password == PASSWORD and "prepared_statement_cache_size" not in locker.engine.url.query
        with locker.lock("apg", ttl=30, timeout=5) as lease:
            assert lease.token >= 1
        locker.create_schema()  # already current: reads only, through the psycopg 3 engine
    finally:
        locker.close()


def test_asyncpg_url_arguments_become_libpq_ones() -> None:
    url = psycopg_url(make_url("postgresql+asyncpg://app:pw@db/app?ssl=require&prepared_statement_cache_size=0"))
    assert url.drivername == "postgresql+psycopg" and url.password == "pw"
    assert dict(url.query) == {"sslmode": "require"}
    hosts = psycopg_url(make_url("postgresql+asyncpg://app@/app?host=a:5432&host=b:5433&target_session_attrs=read-write"))
    assert hosts.query["host"] == ("a:5432", "b:5433") and hosts.query["target_session_attrs"] == "read-write"


@pytest.mark.parametrize(
    "url, words",
    [
        ("postgresql+asyncpg://app:pw@db.invalid/app?command_timeout=5", ["command_timeout", "postgresql+psycopg://"]),
        ("postgresql+asyncpg://app:pw@db.invalid/app?ssl=yes-please", ["ssl='yes-please'", "verify-full"]),
        ("postgresql+psycopg2://app:pw@db.invalid/app?sslmod=require", ["sslmod", "invalid connection option"]),
        # the same typo on dblock's own driver, and with no driver named: refused alike, at construction
        ("postgresql+psycopg://app:pw@db.invalid/app?sslmod=require", ["sslmod", "invalid connection option"]),
        ("postgresql://app:pw@db.invalid/app?application_nam=x", ["application_nam", "invalid connection option"]),
        ("postgresql+asyncpg://app@db.invalid/app?password=pw&timeout=3", ["'timeout'", "password=***"]),
        ("postgresql+pg8000://app:pw@db.invalid/app", ["postgresql+psycopg2://", "pg8000"]),
    ],
)
def test_arguments_without_a_libpq_meaning_are_refused_before_connecting(url: str, words: list[str]) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError) as info:
        Locker(url)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert ":pw@" not in str(info.value) and "=pw" not in str(info.value)
    assert time.monotonic() - started < 1  # no connection was tried (db.invalid would take longer to fail)
