"""The databases dblock runs on, one module each, behind one seam (``base.Backend``).

This is the one place that maps a SQLAlchemy dialect to dblock's backend for
it. Adding a database: a module beside these with a ``Backend`` subclass
(statements, decoders, connections, capabilities), one line in ``_BACKENDS``,
its migrations' DDL (``migrations/``) and the backend contract test's fixture.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import URL

from .base import Backend, Capabilities, QueueStatements, Statements, Unsupported
from .mariadb import MariaDB
from .postgresql import PostgreSQL
from .sqlite import SQLite

__all__ = [
    "EMBEDDED", "Backend", "Capabilities", "MariaDB", "PostgreSQL", "QueueStatements", "SQLite", "Statements", "Unsupported",
    "named", "of",
]

_BACKENDS: dict[str, type[Backend]] = {PostgreSQL.name: PostgreSQL, SQLite.name: SQLite, MariaDB.name: MariaDB}
# SQLAlchemy reads postgres:// as its own backend name; a mysql:// URL or engine may reach a MariaDB
# server (a MySQL one is refused when dblock connects: its statements need MariaDB).
_ALIASES = {"postgres": PostgreSQL, "mysql": MariaDB}
EMBEDDED = SQLite  # the default when no URL is given: a per-user file, nothing to set up


def named(url: URL) -> type[Backend]:
    """The backend of a URL, by its backend name (``postgresql+asyncpg://`` is PostgreSQL's).

    ``ValueError`` naming the URLs dblock takes, for a database it has no backend for.
    """
    name = url.get_backend_name()
    backend = _BACKENDS.get(name) or _ALIASES.get(name)
    if backend is None:
        raise ValueError(
            "dblock supports postgresql+psycopg://, postgresql+psycopg2://, postgresql+asyncpg://, mariadb://"
            f" (and mysql://) and sqlite:/// URLs, not {url.drivername}://"
        )
    return backend


def of(bind: Any) -> type[Backend]:
    """The backend class of a SQLAlchemy ``Engine``, ``Connection``, ``Dialect``, ``Inspector`` or URL backend name.

    ``ValueError`` for a database dblock has no backend for.
    """
    name = bind if isinstance(bind, str) else getattr(getattr(bind, "dialect", bind), "name", None)
    backend = (_BACKENDS.get(name) or _ALIASES.get(name)) if isinstance(name, str) else None
    if backend is None:
        known = " and ".join(b.title for b in _BACKENDS.values())
        raise ValueError(f"dblock runs on {known}, not {name or bind!r}")
    return backend
