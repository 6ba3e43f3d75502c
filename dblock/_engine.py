"""The database a Locker talks to: its URL or Engine checked and made ready, and SQLite's WAL.

dblock's statements always run on psycopg 3 connections it opens itself. A
psycopg2 or asyncpg URL or engine (the app's own) is accepted by converting its
URL: same user, password, host and database, query arguments made libpq's.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo
from sqlalchemy import create_engine
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.pool import NullPool

from ._redact import display_url  # a password in the query (?password=) is masked too
from .backends.sqlite import use_wal as use_wal  # importable here as before
from .schema import prepare_default_sqlite_path


# Drivers whose URLs dblock converts to psycopg 3 (its own connections), and
# asyncpg's URL arguments: the libpq keyword each one becomes, or None where it
# tunes asyncpg's own statement cache, which dblock's connections do not use.
CONVERTED = ("psycopg2", "asyncpg", "psycopg_async")
_ASYNCPG_ARGUMENTS: dict[str, str | None] = {
    "host": "host",  # SQLAlchemy's host list (host=a:5432&host=b:5432), read alike by both dialects
    "target_session_attrs": "target_session_attrs",
    "password": "password",
    "ssl": "sslmode",
    "sslmode": "sslmode",
    "prepared_statement_cache_size": None,
    "prepared_statement_name_func": None,
}
_SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def engine_for(url: Any) -> tuple[Engine, bool, bool]:
    """An engine for ``url``; whether dblock owns the schema (the embedded default);
    whether dblock made the engine (so ``Locker.close`` disposes of it).

    ``url`` may also be an ``AsyncEngine``: its URL is what counts.
    """
    if url is None:
        path = prepare_default_sqlite_path()
        return _sqlite_engine(URL.create("sqlite", database=str(path))), True, True
    if not isinstance(url, Engine) and isinstance(getattr(url, "sync_engine", None), Engine):
        url = url.sync_engine  # an AsyncEngine (asyncpg, psycopg's async mode): dblock reads its URL
    if isinstance(url, Engine) and url.dialect.is_async:
        # Its connections need SQLAlchemy's greenlet context, which dblock's own
        # calls (and create_schema's Alembic) do not run in: dblock makes its own engine.
        url = url.url
    if isinstance(url, Engine):
        if url.dialect.name == "sqlite":
            return _sqlite_engine(_pysqlite(url.url)), False, True
        if url.dialect.name == "postgresql" and url.url.get_driver_name() in CONVERTED:
            return _postgresql_engine(psycopg_url(url.url)), False, True
        _check_driver(url.url)
        return url, False, False
    if not isinstance(url, (str, URL)):
        raise TypeError(f"url must be a str, a sqlalchemy URL or Engine, or None; not {type(url).__name__}")
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: e.g. libpq's host list "a:5432,b:5432"
        raise ValueError(
            "not a database URL; expected e.g. postgresql+psycopg://user@host/db or sqlite:///path/to/locks.db"
            " (several hosts: postgresql+psycopg://user@/db?host=a:5432&host=b:5432&target_session_attrs=read-write)"
        ) from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")  # psycopg 3 is dblock's driver
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(_pysqlite(parsed)), False, True
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in CONVERTED:
        parsed = psycopg_url(parsed)
    _check_driver(parsed)
    try:
        return _postgresql_engine(parsed), False, True
    except (NoSuchModuleError, ArgumentError) as exc:
        raise ValueError(f"cannot use {display_url(parsed)}: {exc}") from None


# create_schema's connections (dblock's own statements bound theirs by op_timeout):
# without a timeout libpq waits for ever on a host that accepts and then stays silent.
SCHEMA_CONNECT_TIMEOUT = 10


def _postgresql_engine(url: URL) -> Engine:
    """An engine dblock makes for a PostgreSQL URL (used by ``create_schema``): its connections
    give up connecting after ``SCHEMA_CONNECT_TIMEOUT`` s per host, unless the URL says otherwise."""
    connect_args = {} if "connect_timeout" in url.query else {"connect_timeout": SCHEMA_CONNECT_TIMEOUT}
    return create_engine(url, poolclass=NullPool, connect_args=connect_args)


def psycopg_url(url: URL) -> URL:
    """The ``postgresql+psycopg`` URL of a psycopg2 or asyncpg one (password kept).

    psycopg2 passes its query arguments to libpq as they are; asyncpg's are
    renamed (``ssl`` is libpq's ``sslmode``) or dropped (its statement cache).
    Either way every argument left must be one libpq knows, checked here,
    before any connection: a typo fails now, not at the first acquire.
    """
    query: dict[str, Any] = dict(url.query)
    if url.get_driver_name() == "asyncpg":
        query = {}
        for key, value in url.query.items():
            if key not in _ASYNCPG_ARGUMENTS:
                raise ValueError(
                    f"dblock opens psycopg connections from the asyncpg URL {display_url(url)},"
                    f" and knows no libpq equivalent of its argument {key!r}: give dblock a postgresql+psycopg:// URL"
                )
            renamed = _ASYNCPG_ARGUMENTS[key]
            if renamed is None:
                continue
            if renamed == "sslmode" and value not in _SSL_MODES:
                raise ValueError(f"{key}={value!r} in the asyncpg URL: dblock understands the sslmode names {_SSL_MODES}")
            query[renamed] = value
    libpq = {key: value for key, value in query.items() if isinstance(value, str)}  # host=a&host=b: a list
    try:
        make_conninfo(**libpq)  # libpq parses it: an unknown keyword is refused here
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"{display_url(url)}: {exc}") from None
    return url.set(drivername="postgresql+psycopg", query=query)


def _check_driver(url: URL) -> None:
    if url.get_backend_name() != "postgresql" or url.get_driver_name() not in ("psycopg", ""):
        raise ValueError(
            f"dblock supports postgresql+psycopg://, postgresql+psycopg2://, postgresql+asyncpg:// and sqlite:///"
            f" URLs, not {url.drivername}://"
        )


def _pysqlite(url: URL) -> URL:
    """A SQLite URL checked, as the standard sqlite3 module's (an aiosqlite URL is the same file)."""
    if url.get_driver_name() == "aiosqlite":
        url = url.set(drivername="sqlite")
    _check_sqlite(url)
    return url


def _check_sqlite(url: URL) -> None:
    if url.get_driver_name() not in ("pysqlite", ""):
        raise ValueError(f"dblock supports SQLite through the standard sqlite3 module, not {url.drivername}")
    if url.database in (None, "", ":memory:"):
        raise ValueError("an in-memory SQLite database cannot be shared between connections; give a file path")
    if sqlite3.sqlite_version_info < (3, 35):
        raise ValueError(f"dblock needs SQLite 3.35 or newer (RETURNING); this Python has {sqlite3.sqlite_version}")


def _sqlite_engine(url: URL) -> Engine:
    # dblock's pool hands a connection to one thread at a time, but not always
    # the same thread.
    return create_engine(url, poolclass=NullPool, connect_args={"check_same_thread": False})
