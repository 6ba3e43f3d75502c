"""The database a Locker talks to: its URL or Engine, checked and made ready by its backend.

Which URLs and engines a database takes is its backend's to say
(``Backend.engine_for_url``, ``Backend.adopt``): PostgreSQL's statements always
run on psycopg 3 connections dblock opens itself, so a psycopg2 or asyncpg URL
or engine (the app's own) is accepted by converting its URL.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError

from . import backends
from ._redact import check_userinfo
from .backends.postgresql import CONVERTED as CONVERTED, psycopg_url as psycopg_url  # importable here as before
from .backends.sqlite import use_wal as use_wal  # importable here as before
from .schema import prepare_default_sqlite_path


def engine_for(url: Any) -> tuple[Engine, bool, bool]:
    """An engine for ``url`` (None: ``$DBLOCK_URL``, else the embedded default); whether dblock owns
    the schema (the embedded default);
    whether dblock made the engine (so ``Locker.close`` disposes of it).

    ``url`` may also be an ``AsyncEngine``: its URL is what counts.
    """
    if url is None and os.environ.get("DBLOCK_URL"):
        url = os.environ["DBLOCK_URL"]  # as the dblock command reads it
    if url is None:
        path = prepare_default_sqlite_path()
        return backends.EMBEDDED.engine_for_url(URL.create("sqlite", database=str(path))), True, True
    if not isinstance(url, Engine) and isinstance(getattr(url, "sync_engine", None), Engine):
        url = url.sync_engine  # an AsyncEngine (asyncpg, psycopg's async mode): dblock reads its URL
    if isinstance(url, Engine) and url.dialect.is_async:
        # Its connections need SQLAlchemy's greenlet context, which dblock's own
        # calls (and create_schema's Alembic) do not run in: dblock makes its own engine.
        url = url.url
    if isinstance(url, Engine):
        engine, made = backends.named(url.url).adopt(url)
        return engine, False, made
    if not isinstance(url, (str, URL)):
        raise TypeError(f"url must be a str, a sqlalchemy URL or Engine, or None; not {type(url).__name__}")
    if isinstance(url, str):
        check_userinfo(url)
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: e.g. libpq's host list "a:5432,b:5432"
        raise ValueError(
            "not a database URL; expected e.g. postgresql+psycopg://user@host/db or sqlite:///path/to/locks.db"
            " (several hosts: postgresql+psycopg://user@/db?host=a:5432&host=b:5432&target_session_attrs=read-write)"
        ) from None
    return backends.named(parsed).engine_for_url(parsed), False, True
