"""The database of a ``settings.DATABASES`` alias as dblock sees it: its URL, and a Locker on it.

dblock opens connections of its own (never Django's), so it needs the alias's
settings as a SQLAlchemy URL: PostgreSQL becomes ``postgresql+psycopg://``
with NAME, USER, PASSWORD, HOST, PORT and the OPTIONS libpq understands;
MariaDB (the ``mysql`` ENGINE) ``mariadb+pymysql://``; SQLite ``sqlite:///NAME``.
Anything else is refused with ValueError before any connection is made.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections
from psycopg.conninfo import make_conninfo
from sqlalchemy.engine import URL

if TYPE_CHECKING:
    from dblock import Locker

# ENGINEs known without loading their backend (a MySQL one needs its driver to
# load). Other ENGINEs are asked their vendor.
_ENGINES = {
    "django.db.backends.postgresql": "postgresql",
    "django.contrib.gis.db.backends.postgis": "postgresql",
    "django.db.backends.sqlite3": "sqlite",
    "django.contrib.gis.db.backends.spatialite": "sqlite",
    "django.db.backends.mysql": "mysql",
    "django.contrib.gis.db.backends.mysql": "mysql",
    "django.db.backends.oracle": "oracle",
    "django.contrib.gis.db.backends.oracle": "oracle",
    "django.db.backends.dummy": "dummy",
}
# OPTIONS for Django's own connections or psycopg's Python side, not libpq's:
# dblock's connections (autocommit, its own prepare setting) do without them.
_NOT_LIBPQ = {
    "isolation_level",
    "server_side_binding",
    "pool",
    "cursor_factory",
    "row_factory",
    "prepare_threshold",
    "context",
    "autocommit",
}


def vendor(alias: str = DEFAULT_DB_ALIAS) -> str:
    """``"postgresql"`` or ``"sqlite"``: the kind of database ``alias`` is; ValueError for any other."""
    settings = _settings(alias)
    engine = settings.get("ENGINE") or ""
    kind = _ENGINES.get(engine)
    if kind is None:
        try:
            kind = connections[alias].vendor  # a third-party backend (e.g. a wrapper around PostgreSQL's)
        except Exception:  # noqa: BLE001 - a backend that cannot even load is not one dblock supports
            kind = None
    if kind not in ("postgresql", "sqlite", "mysql"):
        what = f" (a {kind} database)" if kind and kind != "dummy" else ""
        raise ValueError(
            f"dblock supports PostgreSQL, MariaDB and SQLite databases; DATABASES[{alias!r}] has ENGINE {engine!r}{what}"
        )
    return kind


def database_url(alias: str = DEFAULT_DB_ALIAS) -> URL:
    """The SQLAlchemy URL of ``settings.DATABASES[alias]`` (the test database's, under Django's test runner).

    Raises ValueError, before any connection, for an unknown alias, an engine
    other than PostgreSQL or SQLite, an in-memory SQLite database (dblock's own
    connections cannot see it) or an OPTION libpq does not know.
    """
    kind = vendor(alias)
    settings = _settings(alias)
    if kind == "mysql":
        return _mariadb_url(settings, alias)
    return _postgresql_url(settings, alias) if kind == "postgresql" else _sqlite_url(settings, alias)


def _settings(alias: str) -> dict[str, Any]:
    if not isinstance(alias, str):
        raise TypeError(f"alias must be a str naming a database of settings.DATABASES, not {type(alias).__name__}")
    configured: dict[str, dict[str, Any]] = connections.settings
    if alias not in configured:
        have = ", ".join(repr(a) for a in configured) or "none"
        raise ValueError(f"settings.DATABASES has no database {alias!r} (it has {have})")
    return configured[alias]


def _sqlite_url(settings: dict[str, Any], alias: str) -> URL:
    name = os.fspath(settings.get("NAME") or "")
    # Django's test runner gives SQLite an in-memory database unless TEST's NAME is set.
    if name in ("", ":memory:") or "mode=memory" in name:
        raise ValueError(
            f"DATABASES[{alias!r}] is an in-memory SQLite database ({name or 'no NAME'}), which dblock's own "
            "connections cannot open; give it a file as NAME (for tests: DATABASES[alias]['TEST']['NAME'] = "
            "a file path)"
        )
    return URL.create("sqlite", database=name)


def _postgresql_url(settings: dict[str, Any], alias: str) -> URL:
    """The URL of the connections Django would open, as Django builds their parameters:
    OPTIONS first, then NAME, USER, PASSWORD, HOST and PORT over them where set."""
    params: dict[str, Any] = dict(settings.get("OPTIONS") or {})
    role = params.pop("assume_role", None)
    for key in _NOT_LIBPQ:
        params.pop(key, None)
    if role:
        # Django runs SET ROLE after connecting; libpq does the same at connect time.
        escaped = str(role).replace("\\", "\\\\").replace(" ", "\\ ")
        params["options"] = f"{params.get('options', '')} -c role={escaped}".strip()
    name = settings.get("NAME")
    if name is None:
        params["dbname"] = "postgres"  # Django's meaning of NAME None
    elif name:
        params["dbname"] = name
    for setting, key in (("USER", "user"), ("PASSWORD", "password"), ("HOST", "host"), ("PORT", "port")):
        if settings.get(setting):
            params[key] = settings[setting]
    query = {key: str(value) for key, value in params.items()}
    try:
        make_conninfo(**query)  # libpq parses it: an unknown keyword is refused here, not at the first acquire
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"DATABASES[{alias!r}]['OPTIONS']: {exc}") from None
    database, user, password = query.pop("dbname", None), query.pop("user", None), query.pop("password", None)
    host, port = query.get("host", ""), query.get("port", "")
    if host and "," not in host and not host.startswith("/") and "," not in port:
        # One host by name or address: in the URL's own place. A Unix socket
        # directory or a list of hosts stays in the query, as libpq takes it.
        del query["host"]
        query.pop("port", None)
        return URL.create(
            "postgresql+psycopg", username=user, password=password, host=host, port=int(port) if port else None,
            database=database, query=query,
        )
    return URL.create("postgresql+psycopg", username=user, password=password, database=database, query=query)


# OPTIONS of Django's MySQL backend that dblock's own connections pass on (the rest, such as
# init_command, isolation_level or autocommit, are for Django's connections).
_MARIADB_OPTIONS = {"charset", "unix_socket", "ssl", "ssl_ca", "ssl_cert", "ssl_key", "read_default_file", "read_default_group"}


def _mariadb_url(settings: dict[str, Any], alias: str) -> URL:
    """A MariaDB alias (Django's ``mysql`` ENGINE) as dblock's ``mariadb+pymysql://`` URL: NAME, USER,
    PASSWORD, HOST (or a socket path), PORT, and the OPTIONS that name the connection (charset, ssl...)."""
    options = dict(settings.get("OPTIONS") or {})
    query = {key: str(value) for key, value in options.items() if key in _MARIADB_OPTIONS and not isinstance(value, dict)}
    host = str(settings.get("HOST") or "")
    if host.startswith("/"):
        query["unix_socket"], host = host, "localhost"
    port = settings.get("PORT")
    return URL.create(
        "mariadb+pymysql", username=settings.get("USER") or None, password=settings.get("PASSWORD") or None,
        host=host or None, port=int(port) if port else None, database=settings.get("NAME") or None, query=query,
    )


# -- one Locker per database (and options) per process ------------------------------
_lockers: dict[tuple[int, str, tuple[tuple[str, Any], ...]], Locker] = {}
_guard = threading.Lock()


def locker(alias: str = DEFAULT_DB_ALIAS, **options: Any) -> Locker:
    """The Locker on ``settings.DATABASES[alias]``, made on first use and shared by the process's threads.

    ``options`` are the Locker's (``ttl``, ``timeout``, ``label``, ...); each
    different set gets a Locker of its own. The settings are read at every
    call: after Django's test runner points the alias at the test database,
    this is a Locker on that one. A forked child (a prefork worker) makes its
    own and leaves its parent's alone. Bad settings raise ValueError before
    any connection.
    """
    url = database_url(alias)
    key = (os.getpid(), url.render_as_string(hide_password=False), tuple(sorted(options.items())))
    with _guard:
        found = _lockers.get(key)
        if found is None:
            from dblock import Locker  # SQLAlchemy's engine loads when a Locker is first wanted, not with the app

            found = _lockers[key] = Locker(url, **options)
        return found


def close_lockers() -> None:
    """Close and forget this process's Lockers from ``locker()`` (a later call makes new ones)."""
    with _guard:
        mine = [key for key in _lockers if key[0] == os.getpid()]
        closing = [_lockers.pop(key) for key in mine]
    for each in closing:
        each.close()
