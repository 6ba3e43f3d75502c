"""Renewal on the sync face alone: the connection it leaves for releases, and its faults (a
database that falls silent or stays unreachable, through a real proxy).

What both faces promise about renewal, lost leases and labels is written once in
``test_renew_faces_async.py`` (and generated as ``test_renew_faces.py``); the CLI has its own tests.
"""

from __future__ import annotations

import logging
import os
import socket

import pytest

from dblock import Lease, Locker
from dblock.locker import describe_process

from .conftest import Db, wait_for
from .pgproxy import PgProxy
from .test_renew_faces import held_for


def test_renewal_leaves_a_connection_for_releases(pg: Db) -> None:
    """Renewal's extends, stuck behind a row lock, use at most max_connections - 1 connections."""
    locker = Locker(pg.url, table=pg.table, max_connections=2, label="renewing")
    stuck = [locker.try_acquire(f"stuck-{i}", ttl=3, renew=True) for i in range(6)]
    other = locker.try_acquire("other", ttl=30)
    assert other is not None and all(lease is not None for lease in stuck)
    blocker = pg.connect()
    blocker.autocommit = False
    try:
        # An operator's transaction holds the rows: every extend of them waits.
        blocker.execute(f"SELECT * FROM {pg.table} WHERE name LIKE 'stuck-%' FOR UPDATE")
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            f"AND query LIKE '%{pg.table}%expires_at%' AND pid <> pg_backend_pid()"
        )
        probe = pg.connect()
        wait_for(lambda: probe.execute(waiting).fetchone()[0] >= 1, what="renewal to wait for the row locks")
        # While renewal waits, the release still has a connection of its own.
        assert other.release() is True
        assert probe.execute(waiting).fetchone()[0] <= 1
        probe.close()
    finally:
        blocker.rollback()
        blocker.close()
    for lease in stuck:
        assert lease is not None
        lease.release()


def test_lost_when_the_database_falls_silent(pg: Db) -> None:
    """A database that answers nothing (not even an error): lost when the trusted time runs out."""
    proxy = PgProxy(pg.url)
    try:
        calls: list[Lease] = []
        lease = Locker(proxy.url, table=pg.table).acquire("job", ttl=0.6, renew=True, on_lost=calls.append)
        wait_for(lambda: held_for(pg, "job") > 1.2, what="a few renewals through the proxy")
        proxy.pause()
        assert lease.lost.wait(10), "renewal waited on the silent database past the trusted time"
        wait_for(lambda: calls == [lease], what="on_lost")
        assert lease.remaining() == 0
        ((expires_before,),) = pg.query(f"SELECT expires_at FROM {pg.table}")
        proxy.resume()
        # The extend that was stuck now lands; it must not make the lease trusted again.
        wait_for(lambda: pg.query(f"SELECT expires_at FROM {pg.table}")[0][0] > expires_before, what="the late extend")
        assert lease.lost.is_set() and lease.remaining() == 0
    finally:
        proxy.close()


def test_lost_when_the_database_stays_unreachable(pg: Db, caplog: pytest.LogCaptureFixture) -> None:
    """Refused connections are retried while the lease is trusted, then it is lost."""
    proxy = PgProxy(pg.url)
    calls: list[Lease] = []
    with caplog.at_level(logging.WARNING, logger="dblock.renew"):
        lease = Locker(proxy.url, table=pg.table).acquire("job", ttl=0.9, renew=True, on_lost=calls.append)
        proxy.close()
        assert lease.lost.wait(10)
        wait_for(lambda: calls == [lease], what="on_lost")
    assert lease.remaining() == 0
    retries = [r for r in caplog.records if r.name == "dblock.renew" and "could not extend" in r.getMessage()]
    assert retries, "no retry was logged before the lease was given up"
    assert any("lost the lease" in r.getMessage() for r in caplog.records)


def test_describe_process_masks_passwords_and_fits_the_column() -> None:
    label = describe_process(["/usr/bin/psql", "postgresql://app:hunter2@db/app", "-c", "select 1"])
    assert label == f"{socket.gethostname()}:{os.getpid()} psql postgresql://app:***@db/app -c 'select 1'"
    long = describe_process(["job", "x" * 1000])
    assert len(long) == 255 and long.endswith("...")
