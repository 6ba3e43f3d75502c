"""Multi-host URLs (the form that finds a new primary after a failover) without a cluster:
bad forms are refused up front, and silent hosts cost the call's time, not that time per host.
The failovers themselves are in test_ha.py."""

from __future__ import annotations

import socket
import time
from typing import Iterator

import pytest

import dblock
from dblock import Locker


@pytest.fixture
def silent_hosts() -> Iterator[list[int]]:
    """Three loopback ports that complete the TCP handshake and then never answer (nobody accepts)."""
    socks = []
    for _ in range(3):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        socks.append(s)
    yield [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()


def test_silent_hosts_take_the_calls_time_not_that_time_per_host(silent_hosts: list[int]) -> None:
    """psycopg gives each host of a list the whole connect_timeout; dblock gives the hosts what is
    left of the call's time, so a call with op_timeout=1 over three silent hosts returns within
    its bound (op_timeout, at least 2 s to open a connection, and slack), not after 3 x 2 s."""
    hosts = "&".join(f"host=127.0.0.1:{p}" for p in silent_hosts)
    locker = Locker(f"postgresql+psycopg://nobody@/db?{hosts}&target_session_attrs=read-write", op_timeout=1)
    started = time.monotonic()
    with pytest.raises(dblock.DatabaseUnavailable, match="cannot connect"):
        locker.try_acquire("x")
    assert time.monotonic() - started < 2 + 1 + 1.5
    locker.close()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app@db1:5432,db2:5432/app",  # libpq's own URI form: SQLAlchemy cannot parse it
        "postgresql+psycopg://app@db1:5432,db2:5432/app?target_session_attrs=read-write",
    ],
)
def test_libpq_host_list_in_the_authority_is_refused_with_the_form_to_use(url: str) -> None:
    with pytest.raises(ValueError, match=r"host=a:5432&host=b:5432"):
        Locker(url)


def test_multi_host_url_is_accepted_and_shown(silent_hosts: list[int]) -> None:
    hosts = "&".join(f"host=127.0.0.1:{p}" for p in silent_hosts)
    locker = Locker(f"postgresql+psycopg://app:secret@/app?{hosts}&target_session_attrs=read-write")
    shown = repr(locker)
    assert "secret" not in shown and "target_session_attrs=read-write" in shown
    locker.close()


def test_a_silent_first_host_leaves_time_for_the_next(silent_hosts: list[int], pg_url: str) -> None:
    """After a failover the first host of the list may be the old primary, gone silent: it gets
    its share of the call's time, not all of it, and the next host (here the suite's server) is
    reached within the same call."""
    from sqlalchemy.engine import make_url

    real = make_url(pg_url)
    where = real.query.get("host") or real.host or "localhost"
    if isinstance(where, tuple):
        where = where[0]
    server = f"{where}:{real.port or 5432}"
    url = real.set(
        drivername="postgresql+psycopg", host=None, port=None,
        query={"host": [f"127.0.0.1:{silent_hosts[0]}", server], "target_session_attrs": "read-write"},
    )
    owner = Locker(pg_url, table="multihost")
    owner.create_schema()  # create_schema's own connection is not bounded by op_timeout
    locker = Locker(url, table="multihost", op_timeout=5)
    try:
        lease = locker.try_acquire("x")
        assert lease is not None and lease.release() is True
    finally:
        locker.close()
        dblock.migrate.downgrade(owner.engine, "multihost", None)
        owner.close()


@pytest.mark.slow
def test_create_schema_gives_up_on_a_silent_host(silent_hosts: list[int]) -> None:
    """create_schema's own connection (not the statement driver's) gives up on a host that
    accepts and then says nothing, instead of waiting for ever: 10 s unless the URL says."""
    import threading

    locker = Locker(f"postgresql+psycopg://nobody@127.0.0.1:{silent_hosts[0]}/db")
    errors: list[BaseException] = []

    def make() -> None:
        try:
            locker.create_schema()
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=make, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "create_schema still waiting on a silent host after 60 s"
    assert len(errors) == 1 and isinstance(errors[0], dblock.DatabaseUnavailable), errors
    locker.close()
