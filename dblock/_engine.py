"""The database a Locker talks to: its URL or Engine checked and made ready, and SQLite's WAL."""

from __future__ import annotations

import random
import sqlite3
import time

from sqlalchemy import create_engine
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.pool import NullPool

from ._driver import SQLITE_BUSY_TIMEOUT_MS
from .schema import prepare_default_sqlite_path


def engine_for(url: str | URL | Engine | None) -> tuple[Engine, bool]:
    """An engine for ``url``, and whether dblock owns the schema (the embedded default)."""
    if url is None:
        path = prepare_default_sqlite_path()
        return _sqlite_engine(URL.create("sqlite", database=str(path))), True
    if isinstance(url, Engine):
        if url.dialect.name == "sqlite":
            _check_sqlite(url.url)
            return _sqlite_engine(url.url), False
        _check_driver(url.url)
        return url, False
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
        _check_sqlite(parsed)
        return _sqlite_engine(parsed), False
    _check_driver(parsed)
    try:
        return create_engine(parsed, poolclass=NullPool), False
    except (NoSuchModuleError, ArgumentError) as exc:
        raise ValueError(f"cannot use {parsed.render_as_string(hide_password=True)}: {exc}") from None


def use_wal(engine: Engine) -> None:
    """Switch a SQLite database to WAL, which lets readers and the one writer work at the same time.

    Switching needs an exclusive lock; when another process is migrating the
    new file, SQLite reports a deadlock at once instead of waiting, so retry.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA journal_mode=WAL")
            return
        except OperationalError as exc:
            if "locked" not in str(exc.orig) or time.monotonic() > deadline:
                raise
            time.sleep(0.005 + random.random() * 0.02)


def _check_driver(url: URL) -> None:
    if url.get_backend_name() != "postgresql" or url.get_driver_name() not in ("psycopg", ""):
        raise ValueError(
            f"dblock supports postgresql+psycopg:// and sqlite:/// URLs, not {url.drivername}://"
        )


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
