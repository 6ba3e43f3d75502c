"""dblock's pytest plugin: fixtures for testing your own code that uses dblock.

Loaded automatically once dblock is installed (the ``pytest11`` entry point
``dblock``; ``-p no:dblock`` turns it off). Every fixture is named ``dblock_*``
so it never shadows a fixture of your own.

- ``dblock_url`` (session): a PostgreSQL URL; ``dblock_postgresql`` also gives
  the throwaway server, if one was started;
- ``dblock_locker``: a Locker on a fresh PostgreSQL schema, dropped after the test;
- ``dblock_expire(lease)``: end a lease (exclusive or shared) now, by the database's clock, as if its
  holder had paused past its TTL;
- ``dblock_compete(name, fn)``: run ``fn(lease)`` as another client holding ``name``.

For asyncio tests (with pytest-asyncio, or anyio's pytest plugin):

- ``dblock_async_locker``: an ``AsyncLocker`` on a fresh PostgreSQL schema, closed
  and dropped after the test (an async fixture);
- ``dblock_acompete(name, fn)``: ``await`` it; ``fn(lease)`` (plain or async) as
  another asyncio client holding ``name``;
- ``dblock_expire`` takes an ``AsyncLease`` too.

On MariaDB:

- ``dblock_mariadb_url`` (session): a MariaDB URL (``--dblock-mariadb-url``,
  ``$DBLOCK_TEST_MARIADB_URL`` or the ``dblock_mariadb_url`` ini option; else a throwaway
  server the plugin starts with the machine's ``mariadbd``, ``apt-get install mariadb-server``);
- ``dblock_mariadb_locker``: a Locker on a fresh MariaDB database, dropped after the test.

Settings, each a command-line flag and an ini option (the flag wins):
``--dblock-url`` / ``dblock_url`` (also ``$DBLOCK_TEST_URL``, which beats the ini
file; with none of them a throwaway server from the ``pgserver`` package,
``pip install 'dblock[testing]'``) and ``--dblock-ttl`` / ``dblock_ttl``.
"""

from __future__ import annotations

import importlib
import os
import secrets
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, TypeVar

import pytest

if TYPE_CHECKING:  # dblock (and SQLAlchemy) load when a fixture is used, not on every pytest start
    from dblock import AsyncLease, AsyncLocker, Lease, Locker

_async_fixture: Callable[[Callable[..., Any]], Callable[..., Any]]
try:  # async fixtures need an async plugin: pytest-asyncio's decorator, or plain (anyio's plugin)
    from pytest_asyncio import fixture as _async_fixture
except ImportError:  # pragma: no cover - without pytest-asyncio
    _async_fixture = pytest.fixture

T = TypeVar("T")
ENV_URL = "DBLOCK_TEST_URL"
ENV_MARIADB_URL = "DBLOCK_TEST_MARIADB_URL"


class PostgreSQL(NamedTuple):
    """The session's server: ``url`` for SQLAlchemy; ``server`` the pgserver started for it, or None."""

    url: str
    server: Any


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dblock", "dblock fixtures")
    url_help = (
        f"PostgreSQL URL for the dblock_* fixtures (default: ${ENV_URL}, else the dblock_url ini "
        "option, else a throwaway server started with pgserver)"
    )
    ttl_help = "default lease length, in seconds, of the dblock_locker fixture's Locker (default: 30)"
    group.addoption("--dblock-url", dest="dblock_url", metavar="URL", help=url_help)
    group.addoption("--dblock-ttl", dest="dblock_ttl", metavar="SECONDS", help=ttl_help)
    maria_help = (
        f"MariaDB URL for the dblock_mariadb_* fixtures (default: ${ENV_MARIADB_URL}, else the "
        "dblock_mariadb_url ini option, else a throwaway server started with the machine's mariadbd)"
    )
    group.addoption("--dblock-mariadb-url", dest="dblock_mariadb_url", metavar="URL", help=maria_help)
    parser.addini("dblock_url", url_help)
    parser.addini("dblock_ttl", ttl_help)
    parser.addini("dblock_mariadb_url", maria_help)


def _setting(config: pytest.Config, name: str, env: str | None = None) -> str | None:
    """The flag, else the environment variable, else the ini option; None if none is set."""
    value: str | None = config.getoption(name)
    if value is None and env is not None:
        value = os.environ.get(env) or None
    if value is None:
        value = str(config.getini(name)) or None
    return value


def _postgresql_url(url: str) -> str:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        pytest.fail(f"dblock_url is not a database URL: {url!r}", pytrace=False)
    from dblock import backends  # noqa: PLC0415 - the plugin loads dblock's modules only when used

    try:
        backend: type[backends.Backend] | None = backends.named(parsed)
    except ValueError:
        backend = None
    if backend is not backends.PostgreSQL:
        pytest.fail(f"dblock_url must be a PostgreSQL URL (postgresql://user@host/db), not {parsed.drivername}://", pytrace=False)
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def memory_dir() -> str | None:
    """``/dev/shm`` where the machine has it writable, else None (the usual temp dir).

    A throwaway server's files live there: its commits then cost no disk
    flush, so the tests run at the same speed on a machine whose disk is slow
    today. Nothing is lost that a test relies on: the data outlive a crash of
    the server's processes, only not a crash of the machine.
    """
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def _system_user_once(name: str = "pgserver") -> None:
    """As root, pgserver runs PostgreSQL as the system user ``pgserver`` (``name``), which it makes with
    ``useradd`` the first time: made here, one process at a time. Test processes that start
    together on a fresh machine (pytest-xdist's workers) each found no such user and each ran
    ``useradd``; one server's directory was then given to a user id that was no longer the
    user's, and its ``initdb`` could not enter it (Permission denied)."""
    if os.name != "posix" or os.geteuid() != 0:
        return  # pgserver runs PostgreSQL as the current user
    import fcntl  # noqa: PLC0415 - POSIX only

    utils = importlib.import_module("pgserver.utils")
    with open(os.path.join(tempfile.gettempdir(), f"dblock-user-{name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        utils.ensure_user_exists(name)


def _throwaway_server() -> PostgreSQL:
    with warnings.catch_warnings():
        # pgserver asks platformdirs for a runtime dir, which CI machines often lack.
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        try:
            pgserver = importlib.import_module("pgserver")  # an optional dependency: dblock[testing]
        except ImportError:
            pytest.fail(
                "the dblock fixtures need a PostgreSQL: pass --dblock-url=postgresql://user@host/db "
                f"(or set ${ENV_URL}), or pip install 'dblock[testing]' for a throwaway server",
                pytrace=False,
            )
        _system_user_once()
        # Not under pytest's basetemp: as root, pgserver runs PostgreSQL as another
        # system user that must traverse the path, and every pytest session started
        # meanwhile by the same user resets /tmp/pytest-of-<user> to mode 0700.
        pgdata = Path(tempfile.mkdtemp(prefix="dblock-pg-", dir=memory_dir()))
        server = pgserver.get_server(pgdata, cleanup_mode="delete")  # cleanup() deletes pgdata
    return PostgreSQL(_postgresql_url(server.get_uri()), server)


@pytest.fixture(scope="session")
def dblock_postgresql(request: pytest.FixtureRequest) -> Iterator[PostgreSQL]:
    """The session's PostgreSQL: the configured URL, or a throwaway server stopped after the session."""
    url = _setting(request.config, "dblock_url", ENV_URL)
    if url is not None:
        yield PostgreSQL(_postgresql_url(url), None)
        return
    started = _throwaway_server()
    yield started
    # A test may have restarted the server (dblock's own suite does): read its
    # postmaster pid again, so that clean-up stops the running one, not a dead one.
    started.server.ensure_postgres_running()
    started.server.cleanup()


@pytest.fixture(scope="session")
def dblock_url(dblock_postgresql: PostgreSQL) -> str:
    """A SQLAlchemy URL (``postgresql+psycopg://``) of a server the tests may create schemas in."""
    return dblock_postgresql.url


@pytest.fixture
def dblock_locker(dblock_url: str, request: pytest.FixtureRequest) -> Iterator[Locker]:
    """A Locker with its tables migrated in a fresh schema (``locker.schema``), dropped after the test."""
    from dblock import Locker

    locker = Locker(dblock_url, schema="dblock_test_" + secrets.token_hex(5), ttl=_ttl(request))
    try:
        locker.create_schema()
        yield locker
    finally:
        locker.close()
        _drop_schema(locker)


@_async_fixture
async def dblock_async_locker(dblock_url: str, request: pytest.FixtureRequest) -> Any:
    """An AsyncLocker with its tables migrated in a fresh schema (``locker.schema``), dropped after the test."""
    import asyncio

    from dblock import AsyncLocker

    locker = AsyncLocker(dblock_url, schema="dblock_test_" + secrets.token_hex(5), ttl=_ttl(request))
    try:
        await locker.create_schema()
        yield locker
    finally:
        await locker.aclose()
        await asyncio.to_thread(_drop_schema, locker)


@pytest.fixture(scope="session")
def dblock_mariadb_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A SQLAlchemy URL (``mariadb+pymysql://``) of a MariaDB server the tests may create databases on:
    the configured one, or a throwaway server stopped after the session."""
    url = _setting(request.config, "dblock_mariadb_url", ENV_MARIADB_URL)
    if url is not None:
        yield url
        return
    from dblock import _mariadb_server  # noqa: PLC0415

    found = _mariadb_server.find()
    if isinstance(found, str):
        pytest.fail(f"the dblock_mariadb fixtures need a MariaDB: pass --dblock-mariadb-url, or {found}", pytrace=False)
    server = _mariadb_server.MariaDBServer.start()  # in /dev/shm where it can, in a directory of its own
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def dblock_mariadb_locker(dblock_mariadb_url: str, request: pytest.FixtureRequest) -> Iterator[Locker]:
    """A Locker with its tables migrated in a fresh MariaDB database, dropped after the test."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from dblock import Locker
    from dblock.backends.mariadb import pymysql_url

    server = pymysql_url(make_url(dblock_mariadb_url))
    database = "dblock_test_" + secrets.token_hex(5)
    admin = create_engine(server)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE DATABASE {database}"))
    locker = Locker(server.set(database=database), ttl=_ttl(request))
    try:
        locker.create_schema()
        yield locker
    finally:
        locker.close()
        with admin.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {database}"))
        admin.dispose()


def _ttl(request: pytest.FixtureRequest) -> float:
    from dblock.locker import DEFAULT_TTL

    ttl = _setting(request.config, "dblock_ttl")
    return DEFAULT_TTL if ttl is None else _seconds(ttl)


def _drop_schema(locker: Locker | AsyncLocker) -> None:
    from sqlalchemy import text

    with locker.engine.begin() as conn:
        # A connection of the test's own still using the schema would make this wait for ever.
        conn.execute(text("SET LOCAL lock_timeout = '10s'"))
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{locker.schema}" CASCADE'))
    locker.engine.dispose()


def _seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        pytest.fail(f"dblock_ttl must be a number of seconds, not {value!r}", pytrace=False)


def expire_now(lease: Lease | AsyncLease) -> None:
    """End ``lease`` now by the database's clock, as if its holder had paused past its TTL.

    Another client can then acquire the lock. The holder is not told:
    ``lease.remaining()`` still counts down, as it would during a real pause.
    Raises LeaseLost if the lease was already released or taken over.
    """
    from sqlalchemy import func, select, update

    from dblock import AsyncLease, Lease, LeaseLost
    from dblock.schema import SHARED_OWNER, holders_table, locks_table

    if not isinstance(lease, (Lease, AsyncLease)):
        raise TypeError(f"dblock_expire takes a Lease or an AsyncLease, not {type(lease).__name__}")
    locker = lease.locker
    t = locks_table(locker.table, locker.schema)
    h = holders_table(locker.table, locker.schema)
    # acquired_at is in the past on every backend's clock: an expiry there has passed.
    shared = lease.shared
    if shared:  # a reader's or semaphore holder's: its holder row, and the name's row after it
        stmt = (
            update(h)
            .where(h.c.name == lease.name, h.c.owner == lease.owner, h.c.token == lease.token)
            .values(expires_at=h.c.acquired_at)
        )
    else:
        stmt = (
            update(t)
            .where(t.c.name == lease.name, t.c.owner == lease.owner, t.c.token == lease.token)
            .values(expires_at=t.c.acquired_at)
        )
    with locker.engine.begin() as conn:
        if conn.execute(stmt).rowcount != 1:
            raise LeaseLost(f"cannot expire the lease on {lease.name!r} (token {lease.token}): it already ended")
        if shared:
            # The name's row ends with its last holder (the latest expiry, now maybe past).
            latest = select(func.max(h.c.expires_at)).where(h.c.name == lease.name).scalar_subquery()
            conn.execute(update(t).where(t.c.name == lease.name, t.c.owner == SHARED_OWNER).values(expires_at=latest))


@pytest.fixture
def dblock_expire() -> Callable[[Lease], None]:
    """``dblock_expire(lease)``: see ``expire_now``."""
    return expire_now


@pytest.fixture
def dblock_compete(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``dblock_compete(name, fn, *, locker=None, ttl=None, timeout=0)``: ``fn(lease)`` as another client.

    A second Locker on the same database and table as ``locker`` (default: the
    ``dblock_locker`` fixture) acquires ``name``, waiting up to ``timeout``
    seconds (LockNotAcquired if it cannot: expire the first holder's lease
    with ``dblock_expire``), calls ``fn`` with its lease, releases it and
    returns what ``fn`` returned.
    """
    from dblock import Locker

    others: dict[int, Locker] = {}

    def compete(
        name: str,
        fn: Callable[[Lease], T],
        *,
        locker: Locker | AsyncLocker | None = None,
        ttl: float | None = None,
        timeout: float = 0,
    ) -> T:
        if not callable(fn):
            raise TypeError(f"dblock_compete runs a callable with the competing lease, not {type(fn).__name__}")
        # An AsyncLocker's engine, table and schema name the same locks: a sync competitor works on it too.
        base = request.getfixturevalue("dblock_locker") if locker is None else locker
        other = others.get(id(base))
        if other is None:
            other = others[id(base)] = Locker(base.engine, table=base.table, schema=base.schema, label="dblock_compete")
        with other.lock(name, ttl=ttl, timeout=timeout) as lease:
            return fn(lease)

    yield compete
    for other in others.values():
        other.close()


@_async_fixture
async def dblock_acompete(request: pytest.FixtureRequest) -> Any:
    """``await dblock_acompete(name, fn, *, locker=None, ttl=None, timeout=0)``: ``dblock_compete``
    for asyncio tests. ``fn(lease)`` may be a plain or an async callable; ``locker`` (default:
    the ``dblock_async_locker`` fixture) an AsyncLocker or a Locker."""
    import inspect

    from dblock import AsyncLocker

    others: dict[int, AsyncLocker] = {}

    async def compete(
        name: str,
        fn: Callable[[AsyncLease], Any],
        *,
        locker: Locker | AsyncLocker | None = None,
        ttl: float | None = None,
        timeout: float = 0,
    ) -> Any:
        if not callable(fn):
            raise TypeError(f"dblock_acompete runs a callable with the competing lease, not {type(fn).__name__}")
        if locker is None:
            if "dblock_async_locker" not in request.fixturenames:
                raise TypeError("dblock_acompete needs locker=..., or the dblock_async_locker fixture in this test")
            base = request.getfixturevalue("dblock_async_locker")  # set up already: the test asked for it
        else:
            base = locker
        other = others.get(id(base))
        if other is None:
            other = others[id(base)] = AsyncLocker(
                base.engine, table=base.table, schema=base.schema, label="dblock_compete"
            )
        async with other.lock(name, ttl=ttl, timeout=timeout) as lease:
            result = fn(lease)
            return await result if inspect.isawaitable(result) else result

    yield compete
    for other in others.values():
        await other.aclose()
