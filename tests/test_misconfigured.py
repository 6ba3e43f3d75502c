"""A database that cannot be reached as configured fails every call at once; an outage is waited out.

A host name that does not resolve, nothing listening at an address this Locker never
reached, a refused login, a database that does not exist, an SQLite path that cannot be
opened: waiting would not mend any of them, so every call raises ``Misconfigured`` (a
``DatabaseUnavailable``) within ``op_timeout``, whatever its own timeout, naming the cause
with the password masked. Each call runs in a thread joined with a bound, so a call that
waits for ever fails the test instead of hanging it. A server this Locker reached before
and that then refuses connections is an outage: a wait rides it out until its timeout,
telling it once in the log, not at every retry.

Both faces, every backend; a wrong password is refused for real by a PgBouncer that checks
it (SCRAM) in front of PostgreSQL, and by MariaDB itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import psycopg
import pytest
from sqlalchemy.engine import make_url

import dblock
from dblock import AsyncLocker, DatabaseUnavailable, Locker, Misconfigured, SchemaMissing

from . import pgbouncer
from .conftest import Db, libpq_dsn

OP_TIMEOUT = 3.0
# How long past op_timeout a call may take to come back on a machine under load: a call that
# waited for the misconfiguration to pass would never come back at all.
MARGIN = 15.0
PASSWORD = "s3cret-pw"
INF = math.inf


def _free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _case(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(URL, what the message must say) of one misconfiguration, made for real."""
    if name == "pg-unresolved":
        yield f"postgresql://app:{PASSWORD}@no-such-host.invalid/app", "host name does not resolve"
    elif name == "pg-refused":
        yield f"postgresql://app:{PASSWORD}@127.0.0.1:{_free_port()}/app", "nothing listens there"
    elif name == "pg-no-database":
        url = make_url(request.getfixturevalue("pg_url"))
        yield url.set(password=PASSWORD, database="nosuch_" + secrets.token_hex(4)).render_as_string(
            hide_password=False
        ), "database does not exist"
    elif name == "pg-cannot-log-in":
        url = request.getfixturevalue("pg_url")
        role = "dblock_nologin_" + secrets.token_hex(4)
        with psycopg.connect(libpq_dsn(url), autocommit=True) as admin:
            admin.execute(f"CREATE ROLE {role} NOLOGIN PASSWORD '{PASSWORD}'")
            try:
                yield make_url(url).set(username=role, password=PASSWORD).render_as_string(
                    hide_password=False
                ), "refused the user or password"
            finally:
                admin.execute(f"DROP ROLE {role}")
    elif name == "pg-wrong-password":
        if pgbouncer.binary() is None:
            pytest.skip(pgbouncer.MISSING)
        with pgbouncer.start(request.getfixturevalue("pg_url"), password="the-right-one") as bouncer:
            yield make_url(bouncer.url).set(password=PASSWORD).render_as_string(
                hide_password=False
            ), "refused the user or password"
    elif name == "mariadb-wrong-password":
        url = make_url(request.getfixturevalue("mariadb_url"))
        yield url.set(password=PASSWORD).render_as_string(hide_password=False), "refused the user or password"
    elif name == "mariadb-no-database":
        url = make_url(request.getfixturevalue("mariadb_url"))
        yield url.set(database="nosuch_" + secrets.token_hex(4)).render_as_string(
            hide_password=False
        ), "database does not exist"
    elif name == "mariadb-unresolved":
        yield f"mysql+pymysql://app:{PASSWORD}@no-such-host.invalid/app", "host name does not resolve"
    elif name == "mariadb-refused":
        yield f"mysql+pymysql://app:{PASSWORD}@127.0.0.1:{_free_port()}/app", "nothing listens there"
    elif name == "sqlite-directory":
        yield f"sqlite:///{tmp_path}", "cannot open"
    else:
        raise AssertionError(name)


CASES = [
    "pg-unresolved", "pg-refused", "pg-no-database", "pg-cannot-log-in", "pg-wrong-password",
    "mariadb-wrong-password", "mariadb-no-database", "mariadb-unresolved", "mariadb-refused",
    "sqlite-directory",
]


def _bounded(call: Callable[[], Any], bound: float) -> tuple[BaseException | None, float]:
    """What ``call`` raised (None: it returned) and how long it took; fails if it outlived ``bound``."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    started = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(bound)
    took = time.monotonic() - started
    assert not worker.is_alive(), f"the call had not come back after {bound:g} s"
    return outcome[0], took


def _sync_calls(locker: Locker) -> dict[str, Callable[[], Any]]:
    def lock() -> None:
        with locker.lock("job", ttl=30):  # the default timeout: for ever
            raise AssertionError("granted")

    return {
        "try_acquire": lambda: locker.try_acquire("job"),
        "lock": lock,
        "acquire": lambda: locker.acquire("job", timeout=INF),
        "readers": lambda: locker.readers("job").acquire(timeout=INF),
        "semaphore": lambda: locker.semaphore("job", 2).acquire(timeout=INF),
        "upgradeable": lambda: locker.upgradeable("job").acquire(timeout=INF),
        "acquire_all": lambda: locker.acquire_all(["a", "b"], timeout=INF),
        "campaign": lambda: locker.election("leader").campaign(timeout=INF),
        "observe": lambda: next(iter(locker.election("leader").observe())),
        "leases": lambda: locker.leases(),
        "is_held": lambda: locker.is_held("job"),
    }


def _async_calls(url: str) -> dict[str, Callable[[], Any]]:
    """Each call on a fresh AsyncLocker, in an event loop of its own (run in the worker thread)."""

    def on(use: Callable[[AsyncLocker], Any]) -> Callable[[], Any]:
        async def main() -> None:
            locker = AsyncLocker(url, op_timeout=OP_TIMEOUT)
            try:
                await use(locker)
            finally:
                await locker.aclose()

        return lambda: asyncio.run(main())

    async def lock(locker: AsyncLocker) -> None:
        async with locker.lock("job", ttl=30):
            raise AssertionError("granted")

    async def observe(locker: AsyncLocker) -> None:
        async for _ in locker.election("leader").observe():
            raise AssertionError("looked")

    return {
        "try_acquire": on(lambda locker: locker.try_acquire("job")),
        "lock": on(lock),
        "acquire": on(lambda locker: locker.acquire("job", timeout=INF)),
        "readers": on(lambda locker: locker.readers("job").acquire(timeout=INF)),
        "semaphore": on(lambda locker: locker.semaphore("job", 2).acquire(timeout=INF)),
        "upgradeable": on(lambda locker: locker.upgradeable("job").acquire(timeout=INF)),
        "acquire_all": on(lambda locker: locker.acquire_all(["a", "b"], timeout=INF)),
        "campaign": on(lambda locker: locker.election("leader").campaign(timeout=INF)),
        "observe": on(observe),
        "leases": on(lambda locker: locker.leases()),
        "is_held": on(lambda locker: locker.is_held("job")),
    }


def _check(what: str, exc: BaseException | None, took: float, cause: str) -> None:
    assert isinstance(exc, Misconfigured), f"{what}: {exc!r}"
    assert isinstance(exc, DatabaseUnavailable)  # existing `except DatabaseUnavailable` still catches it
    assert cause in str(exc), f"{what}: {exc}"
    assert PASSWORD not in str(exc), f"{what}: {exc}"
    assert took < OP_TIMEOUT + MARGIN, f"{what} took {took:.1f} s"


@pytest.mark.parametrize("case", CASES)
def test_every_call_fails_fast_on_a_misconfigured_database(
    case: str, request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="dblock")
    with _case(case, request, tmp_path) as (url, cause):
        with Locker(url, op_timeout=OP_TIMEOUT) as locker:
            for what, call in _sync_calls(locker).items():
                exc, took = _bounded(call, OP_TIMEOUT + MARGIN)
                _check(what, exc, took, cause)
            where = locker.backend.where
    _quiet(caplog, where)


def _quiet(caplog: pytest.LogCaptureFixture, where: str) -> None:
    """Nothing logged at WARNING about the database at ``where`` (the caller got the error itself),
    and nothing left retrying in the background (there is nothing an unsent statement could have
    granted). Records of other tests' Lockers, still ending their own work, are not looked at."""
    ours = [r for r in caplog.records if where in r.getMessage()]
    assert [r.getMessage() for r in ours if r.levelno >= logging.WARNING] == []
    assert [r.getMessage() for r in ours if r.name == "dblock.cleanup"] == []
    assert all(PASSWORD not in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("case", CASES)
def test_every_asyncio_call_fails_fast_on_a_misconfigured_database(
    case: str, request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="dblock")
    with _case(case, request, tmp_path) as (url, cause):
        for what, call in _async_calls(url).items():
            exc, took = _bounded(call, OP_TIMEOUT + MARGIN)
            _check(what, exc, took, cause)
        where = AsyncLocker(url).backend.where
    _quiet(caplog, where)


@pytest.mark.parametrize("url", [f"postgresql://app:{PASSWORD}@no-such-host.invalid/app", "sqlite-directory"])
def test_dblock_run_waiting_for_ever_exits_78_with_one_line(url: str, tmp_path: Path) -> None:
    if url == "sqlite-directory":
        url = f"sqlite:///{tmp_path}"
    env = {**os.environ, "PYTHONPATH": str(Path(dblock.__file__).parent.parent)}
    done = subprocess.run(
        [sys.executable, "-m", "dblock", "run", "--url", url, "--wait", "inf", "job", "--", "true"],
        capture_output=True, text=True, timeout=OP_TIMEOUT + 5 + MARGIN, env=env,
    )
    assert done.returncode == 78, done
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dblock: "), done.stderr
    assert re.search("does not resolve|cannot open", lines[0]) and PASSWORD not in lines[0]


# -- an outage is not a misconfiguration ---------------------------------------------------
def _outage_logs(caplog: pytest.LogCaptureFixture, where: str) -> tuple[list[str], list[str]]:
    records = [r for r in caplog.records if r.name.startswith("dblock") and where in r.getMessage()]
    told = [r.getMessage() for r in records if r.levelno >= logging.INFO and "unavailable while waiting" in r.getMessage()]
    listen = [r.getMessage() for r in records if r.levelno >= logging.WARNING and "cannot LISTEN" in r.getMessage()]
    return told, listen


def test_a_server_reached_before_that_refuses_is_waited_out_and_told_once(
    pg: Db, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="dblock")
    timeout = 4.0
    with Locker(proxy.url, table=pg.table, op_timeout=OP_TIMEOUT) as locker:
        assert locker.try_acquire("reached") is not None  # this Locker reached the server
        proxy.close()  # from now on its port refuses connections: the server went away
        exc, took = _bounded(lambda: locker.acquire("job", timeout=timeout), timeout + OP_TIMEOUT + MARGIN)
        where = locker.backend.where
    assert isinstance(exc, DatabaseUnavailable) and not isinstance(exc, Misconfigured), repr(exc)
    assert "Connection refused" in str(exc)
    assert took >= timeout  # it waited the outage out, retrying until its timeout
    told, listen = _outage_logs(caplog, where)
    retries = [r for r in caplog.records if "unavailable while waiting" in r.getMessage()]
    assert len(retries) > 2  # it did retry, many times...
    assert len(told) == 1, told  # ...and said so once
    assert len(listen) <= 1, listen


@pytest.mark.asyncio
async def test_an_asyncio_wait_rides_out_an_outage_and_tells_it_once(
    pg: Db, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="dblock")
    timeout = 4.0
    locker = AsyncLocker(proxy.url, table=pg.table, op_timeout=OP_TIMEOUT)
    try:
        assert await locker.try_acquire("reached") is not None
        proxy.close()
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable) as caught:
            await asyncio.wait_for(locker.acquire("job", timeout=timeout), timeout + OP_TIMEOUT + MARGIN)
        took = time.monotonic() - started
    finally:
        await locker.aclose()
    assert not isinstance(caught.value, Misconfigured), repr(caught.value)
    assert took >= timeout
    told, listen = _outage_logs(caplog, locker.backend.where)
    assert len([r for r in caplog.records if "unavailable while waiting" in r.getMessage()]) > 2
    assert len(told) == 1, told
    assert len(listen) <= 1, listen


# -- one missing-schema message --------------------------------------------------------------
def _schema_calls(locker: Locker) -> dict[str, Callable[[], Any]]:
    return {
        "try_acquire": lambda: locker.try_acquire("job"),
        "acquire": lambda: locker.acquire("job", timeout=1),
        "readers": lambda: locker.readers("job").acquire(timeout=1),
        "semaphore": lambda: locker.semaphore("job", 2).acquire(timeout=1),
        "acquire_all": lambda: locker.acquire_all(["a", "b"], timeout=1),
        "campaign": lambda: locker.election("leader").campaign(timeout=1),
        "is_held": lambda: locker.is_held("job"),
        "leases": lambda: locker.leases(),
    }


def _missing(what: str, exc: BaseException | None, table: str) -> None:
    assert isinstance(exc, SchemaMissing), f"{what}: {exc!r}"
    text = str(exc)
    assert f"dblock's table {table!r} does not exist" in text, f"{what}: {text}"
    assert "dblock migrate" in text and "older dblock" not in text, f"{what}: {text}"


def test_a_missing_table_is_called_missing_on_every_path(db: Db) -> None:
    table = "nosuch_" + secrets.token_hex(4)
    with Locker(db.url, table=table, op_timeout=OP_TIMEOUT) as locker:
        for what, call in _schema_calls(locker).items():
            exc, _ = _bounded(call, OP_TIMEOUT + MARGIN)
            _missing(what, exc, table)


@pytest.mark.asyncio
async def test_a_missing_table_is_called_missing_on_every_asyncio_path(db: Db) -> None:
    table = "nosuch_" + secrets.token_hex(4)
    locker = AsyncLocker(db.url, table=table, op_timeout=OP_TIMEOUT)
    calls = {
        "try_acquire": lambda: locker.try_acquire("job"),
        "acquire": lambda: locker.acquire("job", timeout=1),
        "readers": lambda: locker.readers("job").acquire(timeout=1),
        "semaphore": lambda: locker.semaphore("job", 2).acquire(timeout=1),
        "acquire_all": lambda: locker.acquire_all(["a", "b"], timeout=1),
        "campaign": lambda: locker.election("leader").campaign(timeout=1),
        "is_held": lambda: locker.is_held("job"),
        "leases": lambda: locker.leases(),
    }
    try:
        for what, call in calls.items():
            with pytest.raises(SchemaMissing) as caught:
                await asyncio.wait_for(call(), OP_TIMEOUT + MARGIN)
            _missing(what, caught.value, table)
    finally:
        await locker.aclose()
