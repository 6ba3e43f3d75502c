"""Automatic renewal, lost leases and owner labels, in the library (the CLI has its own tests)."""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading

import pytest

from dblock import Lease, LeaseLost, Locker
from dblock.locker import describe_process

from .conftest import Db, wait_for
from .pgproxy import PgProxy


def renewal_thread(locker: Locker) -> threading.Thread:
    """The Locker's one renewal (scheduler) thread, whatever the number of leases it renews."""
    thread = locker._renewer._scheduler
    assert thread is not None and thread.is_alive()
    return thread


@pytest.fixture
def short_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    """Renewal's idle threads end after 0.2 s instead of 5 s."""
    monkeypatch.setattr("dblock.renew.LINGER", 0.2)


def _span(db: Db) -> str:
    """Seconds from a row's grant to its current expiry, as that database's SQL says it."""
    return "EXTRACT(EPOCH FROM expires_at - acquired_at)" if db.backend == "postgresql" else "expires_at - acquired_at"


def held_for(db: Db, name: str) -> float:
    """Seconds from the grant to the current expiry of ``name``, by the database clock."""
    ((seconds,),) = db.query(f"SELECT {_span(db)} FROM {db.table} WHERE name = %s", (name,))
    return float(seconds or 0)


def test_renewal_keeps_a_short_lease_held(db: Db) -> None:
    locker, other = db.locker(), db.locker()
    # 0.5 s: renewed every 0.17 s, it survives a 0.33 s stall of a busy machine.
    lease = locker.try_acquire("job", ttl=0.5, renew=True)
    assert lease is not None and locker._renewer.renewing() == 1
    # Held continuously (one grant, same acquired_at) for several TTLs of database time.
    wait_for(lambda: held_for(db, "job") > 2.0, what="renewal to push the expiry past 4 TTLs")
    assert other.try_acquire("job") is None
    assert [(i.name, i.token) for i in other.leases()] == [("job", lease.token)]
    assert lease.remaining() > 0 and not lease.lost.is_set()
    assert lease.release() is True


def test_release_stops_the_renewal(db: Db, short_linger: None) -> None:
    calls: list[Lease] = []
    locker = db.locker()
    lease = locker.acquire("job", ttl=60, renew=True, on_lost=calls.append)
    thread = renewal_thread(locker)
    assert lease.release() is True
    assert locker._renewer.renewing() == 0  # at once, not at its next turn (20 s away)
    thread.join(5)  # with nothing left to renew, the thread ends
    assert not thread.is_alive()
    assert not lease.lost.is_set() and calls == []


def test_a_collected_lease_stops_being_renewed(db: Db, short_linger: None) -> None:
    locker = db.locker()
    lease = locker.try_acquire("job", ttl=0.6, renew=True)
    assert lease is not None
    thread = renewal_thread(locker)
    del lease
    gc.collect()
    # The schedule holds only a weak reference: the lease leaves it at its next turn.
    wait_for(lambda: locker._renewer.renewing() == 0, what="the collected lease to leave the schedule")
    thread.join(5)
    assert not thread.is_alive()
    wait_for(lambda: db.locker().try_acquire("job") is not None, what="the unrenewed lease to expire")


def test_lost_when_another_owner_takes_over(db: Db) -> None:
    calls: list[Lease] = []
    lease = db.locker().try_acquire("job", ttl=0.5, renew=True, on_lost=calls.append)
    assert lease is not None
    operator = db.locker()
    (info,) = operator.leases()
    assert operator.force_release(info) is True
    assert operator.force_release(info) is False  # compares (name, owner, token): that lease is over
    taker = operator.try_acquire("job", ttl=30)
    assert taker is not None and taker.token > lease.token
    assert lease.lost.wait(10), "renewal did not notice the takeover"
    assert lease.remaining() == 0
    wait_for(lambda: calls == [lease], what="on_lost (on a thread of its own, after lost is set)")
    with pytest.raises(LeaseLost):
        lease.extend()
    assert lease.release() is False
    assert [(i.name, i.token) for i in operator.leases()] == [("job", taker.token)]


def test_many_leases_renew_in_few_statements(pg: Db) -> None:
    """Leases due together are extended by one statement, not one each (nor a thread each)."""
    proxy = PgProxy(pg.url)
    try:
        locker = Locker(proxy.url, table=pg.table)
        leases = [locker.try_acquire(f"job-{i}", ttl=0.9, renew=True) for i in range(40)]
        assert all(lease is not None for lease in leases)
        proxy.reset()
        start = {name: held for name, held in _held(pg)}
        # Every lease extended at least twice (renewal every 0.3 s): 80 extends.
        wait_for(lambda: all(held > start[name] + 0.5 for name, held in _held(pg)), what="two renewals of every lease")
        assert proxy.round_trips < len(leases), f"{proxy.round_trips} statements for 80+ extends of 40 leases"
        assert locker._renewer._workers == 1  # one scheduler and one worker thread, not a thread per lease
        assert all(lease.remaining() > 0 and not lease.lost.is_set() for lease in leases if lease is not None)
        for lease in leases:
            assert lease is not None and lease.release() is True
    finally:
        proxy.close()


def _held(db: Db, shared: bool = False) -> list[tuple[str, float]]:
    """(name, ``held_for``) of every held lease in one query; ``shared``: of the shared leases' holders."""
    table = f"{db.table}_holders" if shared else f"{db.table} WHERE owner IS NOT NULL"
    return [(name, float(held)) for name, held in db.query(f"SELECT name, {_span(db)} FROM {table}")]


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


def test_on_lost_errors_are_logged_not_raised(db: Db, caplog: pytest.LogCaptureFixture) -> None:
    def boom(lease: Lease) -> None:
        raise RuntimeError("callback failed")

    locker = db.locker()
    lease = locker.try_acquire("job", ttl=0.3, renew=True, on_lost=boom)
    assert lease is not None
    thread = renewal_thread(locker)
    with caplog.at_level(logging.ERROR, logger="dblock.renew"):
        db.query(f"UPDATE {db.table} SET owner = NULL, expires_at = NULL")  # an operator broke it
        assert lease.lost.wait(10)
        wait_for(lambda: any(r.exc_info and "callback failed" in str(r.exc_info[1]) for r in caplog.records),
                 what="the callback's error in the log")
    assert thread.is_alive()  # renewal goes on for the Locker's other leases


def test_lock_block_with_renewal_outlives_its_ttl_and_reports_a_loss(db: Db) -> None:
    locker = db.locker()
    with locker.lock("job", ttl=0.3, timeout=0, renew=True) as lease:
        wait_for(lambda: held_for(db, "job") > 1.0, what="renewal inside the with-block")
    assert lease.remaining() == 0 and not lease.lost.is_set()
    assert locker.try_acquire("job") is not None

    with pytest.raises(LeaseLost):
        with locker.lock("job2", ttl=0.3, timeout=0, renew=True) as lease:
            db.query(f"UPDATE {db.table} SET owner = NULL, expires_at = NULL WHERE name = 'job2'")
            assert lease.lost.wait(10)


def test_start_renewal_checks_its_arguments_and_state(db: Db) -> None:
    lease = db.locker().try_acquire("job", ttl=30)
    assert lease is not None
    with pytest.raises(TypeError):
        lease.start_renewal(on_lost="print")  # type: ignore[arg-type]
    lease.start_renewal()
    with pytest.raises(RuntimeError, match="already renewing"):
        lease.start_renewal()
    lease.release()
    with pytest.raises(LeaseLost):
        lease.start_renewal()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"renew": "yes"}, TypeError),
        ({"renew": 1}, TypeError),
        ({"on_lost": print}, ValueError),  # on_lost without renew=True
        ({"renew": True, "on_lost": "print"}, TypeError),
    ],
)
def test_bad_renewal_options_change_nothing(db: Db, options: dict[str, object], error: type[Exception]) -> None:
    locker = db.locker()
    before = db.rows()
    with pytest.raises(error):
        locker.try_acquire("job", **options)  # type: ignore[arg-type]
    with pytest.raises(error):
        locker.acquire("job", timeout=0, **options)  # type: ignore[arg-type]
    with pytest.raises(error):
        locker.lock("job", **options)  # type: ignore[arg-type]
    assert db.rows() == before


def test_labels_say_who_holds_a_lease(db: Db) -> None:
    db.locker().try_acquire("default")
    db.locker(label="deploy@ci #42").try_acquire("custom")
    labels = {i.name: i.label for i in db.locker().leases()}
    assert labels["custom"] == "deploy@ci #42"
    host, _, rest = labels["default"].partition(":")
    assert host == socket.gethostname() and rest.startswith(f"{os.getpid()} ")


@pytest.mark.parametrize(("label", "error"), [("", ValueError), ("x" * 256, ValueError), ("a\x00b", ValueError), (7, TypeError)])
def test_bad_labels_are_refused(db: Db, label: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        Locker(db.url, table=db.table, label=label)  # type: ignore[arg-type]


def test_describe_process_masks_passwords_and_fits_the_column() -> None:
    label = describe_process(["/usr/bin/psql", "postgresql://app:hunter2@db/app", "-c", "select 1"])
    assert label == f"{socket.gethostname()}:{os.getpid()} psql postgresql://app:***@db/app -c 'select 1'"
    long = describe_process(["job", "x" * 1000])
    assert len(long) == 255 and long.endswith("...")
