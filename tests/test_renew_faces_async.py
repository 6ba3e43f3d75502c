"""Automatic renewal, lost leases and owner labels, written once for both faces: this asyncio
module is the source and ``tests/test_renew_faces.py``, the same cases on the sync face, is
generated from it (``python tools/async_to_sync.py``).

One scheduler per Locker extends the renewing leases that fall due together in one statement
(``extend_many``; shared leases in a statement of their own, ``share_extend_many``), on real
PostgreSQL and SQLite. What only one face has (renewal's faults through a proxy, the connection
it leaves for releases) stays in ``test_renew.py``.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import time
from typing import Any

import pytest

from dblock import AsyncLease, AsyncLocker, LeaseLost
from dblock import _core as core
from dblock._acompat import aevent_wait, ajoin, asleep, running

from .conftest import ALL_BACKENDS, Db

BACKENDS = ALL_BACKENDS
from .pgproxy import PgProxy
from .test_faces_async import make, until

if True:  # ASYNC
    import asyncio

    pytestmark = pytest.mark.asyncio
else:
    import threading


@pytest.fixture
def short_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    """Renewal's idle workers end after 0.2 s (the sync face's threads linger 5 s)."""
    monkeypatch.setattr("dblock._arenew.LINGER", 0.2)


def _span(db: Db) -> str:
    """Seconds from a row's grant to its current expiry, as that database's SQL says it."""
    return "EXTRACT(EPOCH FROM expires_at - acquired_at)" if db.backend == "postgresql" else "expires_at - acquired_at"


def held_for(db: Db, name: str) -> float:
    """Seconds from the grant to the current expiry of ``name``, by the database clock."""
    ((seconds,),) = db.query(f"SELECT {_span(db)} FROM {db.table} WHERE name = %s", (name,))
    return float(seconds or 0)


def held(db: Db, shared: bool = False) -> list[tuple[str, float]]:
    """(name, ``held_for``) of every held lease in one query; ``shared``: of the shared leases' holders."""
    table = f"{db.table}_holders" if shared else f"{db.table} WHERE owner IS NOT NULL"
    return [(name, float(span)) for name, span in db.query(f"SELECT name, {_span(db)} FROM {table}")]


class Extends:
    """The extend statements a Locker sends from now on, each as the names of the leases in it.

    Wraps the locker's own driver (nothing is faked); a single-lease ``extend`` counts as a
    statement of one. ``delay``: each extend waits that long before it goes out, so a test
    can act while one is in flight (``in_flight``).
    """

    def __init__(self, locker: AsyncLocker, delay: float = 0.0) -> None:
        self.sent: list[list[str]] = []
        self.in_flight = 0
        sql = locker.backend.sql
        many, single = {sql.extend_many, sql.share_extend_many}, {sql.extend, sql.share_extend}
        execute = locker._driver._execute

        async def recorded(conn: Any, statement: str, params: dict[str, Any]) -> Any:
            if statement in many:
                names = params["names"] if "names" in params else [b[0] for b in json.loads(params["batch"])]
            elif statement in single:
                names = [params["name"]]
            else:
                return await execute(conn, statement, params)
            self.sent.append(sorted(names))
            self.in_flight += 1
            try:
                if delay:
                    await asleep(delay)
                return await execute(conn, statement, params)
            finally:
                self.in_flight -= 1

        locker._driver._execute = recorded  # type: ignore[method-assign]

    def together(self, names: list[str]) -> bool:
        """Whether one statement extended exactly ``names``."""
        return sorted(names) in self.sent


async def renewing(
    locker: AsyncLocker, kind: str, count: int, ttl: float, prefix: str = "job", **options: Any
) -> list[AsyncLease]:
    """``count`` renewing leases of ``locker`` (of names prefix-0, prefix-1...): exclusive ones, or
    semaphore slots (``kind`` "shared")."""
    leases = []
    for i in range(count):
        if kind == "shared":
            lease = await locker.semaphore(f"{prefix}-{i}", 2).try_acquire(ttl=ttl, renew=True, **options)
        else:
            lease = await locker.try_acquire(f"{prefix}-{i}", ttl=ttl, renew=True, **options)
        assert lease is not None
        leases.append(lease)
    return leases


async def extended_twice(leases: list[AsyncLease], what: str) -> None:
    """Until every lease's expiry (as the database answered its extends) moved on by two renewals."""
    start = {id(lease): lease.expires_at.timestamp() for lease in leases}
    step = 2 * leases[0].ttl / 3 - 0.1  # two renewals, each ttl/3 later, less what their replies' lag may eat
    await until(lambda: all(lease.expires_at.timestamp() > start[id(lease)] + step for lease in leases), what)


async def scheduler_ended(locker: AsyncLocker) -> None:
    await until(lambda: locker._renewer._scheduler is None, "the renewal worker to end with nothing left to renew")


# -- a lease held on, and let go ----------------------------------------------------------
async def test_renewal_keeps_a_short_lease_held(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        # 1 s: renewed every 0.33 s, it survives a 0.67 s stall of a busy machine (a CI run with
        # every core taken stalled a MariaDB renewal past 0.5 s).
        lease = await locker.try_acquire("job", ttl=1.0, renew=True)
        assert lease is not None and locker._renewer.renewing() == 1
        # Held continuously (one grant, same acquired_at) for several TTLs of database time.
        await until(lambda: held_for(db, "job") > 3.0, "renewal to push the expiry past 3 TTLs")
        assert await other.try_acquire("job") is None
        assert [(i.name, i.token) for i in await other.leases()] == [("job", lease.token)]
        assert lease.remaining() > 0 and not lease.lost.is_set()
        assert await lease.release() is True


async def test_release_stops_the_renewal(db: Db, short_linger: None) -> None:
    calls: list[AsyncLease] = []
    async with make(db) as locker:
        lease = await locker.acquire("job", ttl=60, renew=True, on_lost=calls.append)
        worker = locker._renewer._scheduler
        assert running(worker)
        assert await lease.release() is True
        assert locker._renewer.renewing() == 0  # at once, not at its next turn (20 s away)
        await ajoin(worker, 5)  # with nothing left to renew, the worker ends
        assert not running(worker)
        assert not lease.lost.is_set() and calls == []


async def test_a_collected_lease_leaves_the_schedule(db: Db, short_linger: None) -> None:
    async with make(db) as locker, make(db) as other:
        lease = await locker.try_acquire("job", ttl=0.6, renew=True)
        assert lease is not None and locker._renewer.renewing() == 1
        worker = locker._renewer._scheduler
        del lease
        gc.collect()
        # The schedule holds only a weak reference: the lease leaves it at its next turn.
        await until(lambda: locker._renewer.renewing() == 0, "the collected lease to leave the schedule")
        await ajoin(worker, 5)
        assert not running(worker)
        await scheduler_ended(locker)
        deadline = time.monotonic() + 10
        while (taken := await other.try_acquire("job")) is None:  # the unrenewed lease expires
            assert time.monotonic() < deadline, "the collected lease was still renewed"
            await asleep(0.05)
        await taken.release()


async def test_the_renewal_worker_starts_with_the_first_renewal_and_close_stops_it(db: Db) -> None:
    locker = make(db)
    lease = await locker.try_acquire("job", ttl=30)
    assert lease is not None and locker._renewer._scheduler is None  # nothing to renew: no worker
    lease.start_renewal()
    worker = locker._renewer._scheduler
    if True:  # ASYNC
        assert isinstance(worker, asyncio.Task) and worker.get_name() == "dblock-renew"
    else:
        assert isinstance(worker, threading.Thread) and worker.name == "dblock-renew"
    assert running(worker)
    await locker.aclose()
    assert not running(worker) and locker._renewer._scheduler is None
    assert not lease.lost.is_set()  # leases stay granted until released or expired
    async with make(db) as other:
        assert await other.try_acquire("job") is None


# -- losses ------------------------------------------------------------------------------
async def test_lost_when_another_owner_takes_over(db: Db) -> None:
    calls: list[AsyncLease] = []
    async with make(db) as locker, make(db) as operator:
        lease = await locker.try_acquire("job", ttl=0.5, renew=True, on_lost=calls.append)
        assert lease is not None
        (info,) = await operator.leases()
        assert await operator.force_release(info) is True
        assert await operator.force_release(info) is False  # compares (name, owner, token): that lease is over
        taker = await operator.try_acquire("job", ttl=30)
        assert taker is not None and taker.token > lease.token
        assert await aevent_wait(lease.lost, 10), "renewal did not notice the takeover"
        assert lease.remaining() == 0
        await until(lambda: calls == [lease], "on_lost (on a worker of its own, after lost is set)")
        with pytest.raises(LeaseLost):
            await lease.extend()
        assert await lease.release() is False
        assert [(i.name, i.token) for i in await operator.leases()] == [("job", taker.token)]
        await taker.release()


async def test_on_lost_errors_are_logged_not_raised(db: Db, caplog: pytest.LogCaptureFixture) -> None:
    def boom(lease: AsyncLease) -> None:
        raise RuntimeError("callback failed")

    async with make(db) as locker:
        lease = await locker.try_acquire("job", ttl=0.3, renew=True, on_lost=boom)
        # 2 s: a MariaDB on a machine whose cores other jobs kept busy took a renewal round past 0.67 s.
        other = await locker.try_acquire("other", ttl=2.0, renew=True)
        assert lease is not None and other is not None
        with caplog.at_level(logging.ERROR, logger="dblock.renew"):
            db.query(f"UPDATE {db.table} SET owner = NULL, expires_at = NULL WHERE name = 'job'")  # an operator
            assert await aevent_wait(lease.lost, 10)
            await until(lambda: any(r.exc_info and "callback failed" in str(r.exc_info[1]) for r in caplog.records),
                        "the callback's error in the log")
        # Renewal goes on for the Locker's other leases.
        assert running(locker._renewer._scheduler) and locker._renewer.renewing() == 1
        await until(lambda: held_for(db, "other") > 2.5, "the other lease to renew on")  # extended since its grant
        assert not other.lost.is_set()
        assert await other.release() is True


async def test_the_lock_block_with_renewal_outlives_its_ttl_and_reports_a_loss(db: Db) -> None:
    # 1.5 s: renewed every 0.5 s, a lease survives a 1 s stall of its renewal (a 0.3 s ttl was lost
    # on a machine whose cores other jobs kept busy). The block waits on the lease's own expiry,
    # moved by renewal, not on queries of its own: a query a loop (of the asyncio face's event
    # loop, or of a fresh connection each time) would hold renewal up meanwhile.
    ttl = 1.5
    async with make(db) as locker:
        async with locker.lock("job", ttl=ttl, timeout=0, renew=True) as lease:
            granted_expiry = lease.expires_at.timestamp()
            # Extended once its first ttl had passed: the block outlived the ttl it was granted.
            await until(lambda: lease.expires_at.timestamp() > granted_expiry + ttl, "renewal inside the block")
            assert held_for(db, "job") > 2 * ttl  # by the database's clock too
        assert lease.remaining() == 0 and not lease.lost.is_set()
        again = await locker.try_acquire("job")
        assert again is not None
        await again.release()

        with pytest.raises(LeaseLost):
            async with locker.lock("job2", ttl=ttl, timeout=0, renew=True) as lease:
                db.query(f"UPDATE {db.table} SET owner = NULL, expires_at = NULL WHERE name = 'job2'")
                assert await aevent_wait(lease.lost, 10)


# -- a warning before expiry -------------------------------------------------------------------
async def test_on_expiring_warns_before_the_lease_is_lost_when_renewal_cannot_extend(pg: Db) -> None:
    """The database stops answering (a proxy that holds every byte): renewal cannot extend, and
    on_expiring runs once the trust left falls to the margin, before on_lost, which runs when
    the trust is gone."""
    proxy = PgProxy(pg.url)
    events: list[tuple[str, float]] = []
    try:
        async with AsyncLocker(proxy.url, table=pg.table, op_timeout=5) as locker:
            lease = await locker.acquire(
                "job", ttl=1.5, renew=True, expiring_margin=0.6,
                on_expiring=lambda lease: events.append(("expiring", lease.remaining())),
                on_lost=lambda lease: events.append(("lost", lease.remaining())),
            )
            proxy.pause()  # from now on nothing reaches the server
            try:
                assert await aevent_wait(lease.lost, 10), "renewal never gave the lease up"
                await until(lambda: len(events) == 2, "both callbacks")
            finally:
                proxy.resume()
            (first, left), (second, _) = events
            assert (first, second) == ("expiring", "lost")
            assert 0 < left <= 0.6  # warned with at most the margin left, and some still left
    finally:
        proxy.close()


async def test_on_expiring_warns_again_only_after_an_extend_restored_the_lease(pg: Db) -> None:
    proxy = PgProxy(pg.url)
    warned: list[float] = []
    try:
        async with AsyncLocker(proxy.url, table=pg.table, op_timeout=5) as locker:
            lease = await locker.acquire(
                "job", ttl=2.0, renew=True, on_expiring=lambda lease: warned.append(lease.remaining())
            )
            for round_ in (1, 2):
                proxy.pause()
                await until(lambda: len(warned) == round_, f"warning {round_}")
                assert 0 < warned[-1] <= 2.0 / 3  # the default margin: a third of the ttl
                proxy.resume()
                await until(lambda: lease.remaining() > 1.0, "renewal to restore the lease")
            assert not lease.lost.is_set() and len(warned) == 2
            assert await lease.release() is True
    finally:
        proxy.close()


async def test_no_warning_while_renewal_keeps_up(db: Db) -> None:
    warned: list[AsyncLease] = []
    async with make(db) as locker:
        # 3 s: the warning's margin (a third) leaves a renewal 1 s to be late on a busy machine (with
        # 1.2 s, a MariaDB whose machine other jobs kept busy was 0.4 s late). The wait is on the
        # lease's own expiry, moved on by renewal past its first ttl: no queries of the test's own.
        ttl = 3.0
        lease = await locker.acquire("job", ttl=ttl, renew=True, on_expiring=warned.append)
        granted_expiry = lease.expires_at.timestamp()
        await until(lambda: lease.expires_at.timestamp() > granted_expiry + ttl, "renewal past its first ttl")
        assert warned == [] and not lease.lost.is_set()
        assert await lease.release() is True


# -- batches -------------------------------------------------------------------------------
N = 50


async def test_many_leases_renew_in_about_one_statement_a_round(db: Db, short_linger: None) -> None:
    """50 renewing leases of one Locker: about one extend a round, not one per lease (nor a worker each)."""
    ttl = 1.5  # a round every 0.5 s; a round may be 1 s late on a busy machine
    proxy = PgProxy(db.url) if db.backend == "postgresql" else None  # round trips on the wire
    try:
        async with AsyncLocker(db.url if proxy is None else proxy.url, table=db.table) as locker:
            leases = await renewing(locker, "exclusive", N, ttl)
            extends = Extends(locker)
            if proxy is not None:
                proxy.reset()
            start = dict(held(db))
            began = time.monotonic()
            await extended_twice(leases, "two renewals of every lease")
            rounds = (time.monotonic() - began) / (ttl / 3)
            statements, round_trips = len(extends.sent), proxy.round_trips if proxy is not None else None
            print(f"\n{db.backend}: {statements} extend statements ({round_trips} round trips) for {N} leases"
                  f" in {rounds:.1f} rounds: {statements / rounds:.1f} a round")
            # By the database clock too, every lease held on (at least a renewal past the start: an
            # extend may have committed before its reply came back, as the start was read).
            assert all(span > start[name] + ttl / 3 for name, span in held(db))
            # About one a round (two while the batch forms, on a busy machine), not one per lease.
            assert statements <= 2 * rounds + 2, f"{statements} extend statements in {rounds:.1f} rounds of {N} leases"
            if proxy is not None:  # each a round trip; a new connection's set-up may add a couple
                assert proxy.round_trips <= statements + 2, f"{proxy.round_trips} round trips for {statements} extends"
            # One scheduler, and a worker sending each batch in flight (at most 4): not one per lease.
            assert locker._renewer._workers <= 4, f"{locker._renewer._workers} workers renew {N} leases"
            if True:  # ASYNC
                assert [t.get_name() for t in asyncio.all_tasks()].count("dblock-renew") == 1
            assert all(lease.remaining() > 0 and not lease.lost.is_set() for lease in leases)
            for lease in leases:
                assert await lease.release() is True
            assert locker._renewer.renewing() == 0
            await scheduler_ended(locker)
    finally:
        if proxy is not None:
            proxy.close()


async def test_shared_and_exclusive_leases_renew_in_statements_of_their_own(db: Db, short_linger: None) -> None:
    async with make(db) as locker:
        exclusive = await renewing(locker, "exclusive", 5, 0.6)
        shared = await renewing(locker, "shared", 5, 0.6, prefix="slot")
        assert not any(lease.shared for lease in exclusive) and all(lease.shared for lease in shared)
        extends = Extends(locker)
        await extended_twice(exclusive + shared, "two renewals of each lease")
        kinds = [sorted(lease.name for lease in leases) for leases in (exclusive, shared)]
        assert all(extends.sent.count(names) >= 2 for names in kinds)  # each kind in a statement of its own
        assert all(set(names) <= set(kinds[0]) or set(names) <= set(kinds[1]) for names in extends.sent)
        assert len(extends.sent) <= 6  # two a round
        spans = held(db, shared=True)  # by the database clock, the shared leases held on past their ttl
        assert sorted(name for name, _ in spans) == kinds[1] and all(span > 0.6 for _, span in spans)
        for lease in exclusive + shared:
            assert await lease.release() is True
        await scheduler_ended(locker)


@pytest.mark.parametrize("kind", ["exclusive", "shared"])
async def test_a_lease_taken_over_in_a_batch_is_lost_and_the_others_renew_on(db: Db, kind: str, short_linger: None) -> None:
    lost: list[AsyncLease] = []
    async with make(db) as locker, make(db) as operator:
        # 1.5 s: renewed every 0.5 s, the others survive a 1 s stall of renewal (with 0.6 s, a
        # 0.4 s stall of a machine whose cores other jobs kept busy lost them too).
        leases = await renewing(locker, kind, 5, 1.5, on_lost=lost.append)
        names = [lease.name for lease in leases]
        extends = Extends(locker)
        await until(lambda: extends.together(names), "the five leases to be extended in one statement")
        victim, others = leases[2], leases[:2] + leases[3:]
        (info,) = [i for i in await operator.leases() if i.name == victim.name]
        assert await operator.force_release(info) is True
        if kind == "shared":  # the slot goes to another holder
            taker = await operator.semaphore(victim.name, 1).try_acquire(ttl=30)
        else:
            taker = await operator.try_acquire(victim.name, ttl=30)
        assert taker is not None and taker.token > victim.token
        assert await aevent_wait(victim.lost, 10)
        await until(lambda: lost == [victim], "on_lost")
        assert victim.remaining() == 0 and locker._renewer.renewing() == 4
        after = len(extends.sent)
        await extended_twice(others, "the others to renew on")
        assert all(victim.name not in names for names in extends.sent[after:])
        assert extends.together([lease.name for lease in others])  # still one batch
        assert lost == [victim] and not any(lease.lost.is_set() for lease in others)
        assert all(lease.remaining() > 0 for lease in others)
        assert await victim.release() is False
        assert await taker.release() is True  # untouched by the lost holder's renewal
        for lease in others:
            assert await lease.release() is True
        await scheduler_ended(locker)


@pytest.mark.parametrize("min_hold", [None, 1.0], ids=["plain", "min_hold"])
async def test_a_batch_renews_on_after_a_lease_in_it_is_released(
    db: Db, min_hold: float | None, short_linger: None
) -> None:
    """Released mid-batch, a lease leaves the schedule at once and its batch goes on. With a
    ``min_hold``, the release is kept until then (grant + 1 s, sooner than the expiry renewal
    would give it): an extend in flight as it goes out is waited for, and none lands after."""
    lost: list[AsyncLease] = []
    async with make(db) as locker:
        extends = Extends(locker, delay=0.05)
        leases = await renewing(locker, "exclusive", 4, 0.6, on_lost=lost.append)
        released = await locker.try_acquire("job-4", ttl=0.6, renew=True, on_lost=lost.append, min_hold=min_hold)
        assert released is not None
        leases.append(released)
        # The third batch goes out 0.6 s after the grants: an extend of it landing after the
        # release would push the expiry past the hold (grant + 1 s).
        await until(lambda: extends.in_flight > 0 and len(extends.sent) >= 3 and "job-4" in extends.sent[-1],
                    "the third extend of the batch to be in flight")
        assert await released.release() is True
        assert locker._renewer.renewing() == 4
        after = len(extends.sent)
        others = leases[:4]
        await extended_twice(others, "the others to renew on")
        assert all(released.name not in names for names in extends.sent[after:])
        assert extends.together([lease.name for lease in others])
        assert lost == [] and not any(lease.lost.is_set() for lease in leases)
        rows = db.query(f"SELECT owner, expires_at FROM {db.table} WHERE name = 'job-4'")
        if min_hold is None:
            assert rows[0][0] is None  # ended by the release, not revived by the extend in flight
        else:  # kept until its hold ends, no later
            assert rows[0][0] == released.owner and core.when(rows[0][1]) == released.held_until
        for lease in others:
            assert await lease.release() is True
        await scheduler_ended(locker)


# -- bad input, labels ----------------------------------------------------------------------
async def test_start_renewal_checks_its_arguments_and_state(db: Db) -> None:
    async with make(db) as locker:
        lease = await locker.try_acquire("job", ttl=30)
        assert lease is not None
        with pytest.raises(TypeError):
            lease.start_renewal(on_lost="print")  # type: ignore[arg-type]
        lease.start_renewal()
        with pytest.raises(RuntimeError, match="already renewing"):
            lease.start_renewal()
        await lease.release()
        with pytest.raises(LeaseLost):
            lease.start_renewal()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"renew": "yes"}, TypeError),
        ({"renew": 1}, TypeError),
        ({"on_lost": print}, ValueError),  # on_lost without renew=True
        ({"renew": True, "on_lost": "print"}, TypeError),
        ({"on_expiring": print}, ValueError),  # on_expiring without renew=True
        ({"renew": True, "on_expiring": 3}, TypeError),
        ({"renew": True, "on_expiring": print, "expiring_margin": 0}, ValueError),
        ({"renew": True, "on_expiring": print, "expiring_margin": "1"}, TypeError),
        ({"renew": True, "expiring_margin": 1.0}, ValueError),  # a margin for no callback
    ],
)
async def test_bad_renewal_options_change_nothing(db: Db, options: dict[str, object], error: type[Exception]) -> None:
    async with make(db) as locker:
        before = db.rows()
        with pytest.raises(error):
            await locker.try_acquire("job", **options)  # type: ignore[arg-type]
        with pytest.raises(error):
            await locker.acquire("job", timeout=0, **options)  # type: ignore[arg-type]
        with pytest.raises(error):
            locker.lock("job", **options)  # type: ignore[arg-type]
        assert db.rows() == before


async def test_labels_say_who_holds_a_lease(db: Db) -> None:
    async with make(db) as default, make(db, label="deploy@ci #42") as custom, make(db) as reader:
        a = await default.try_acquire("default")
        b = await custom.try_acquire("custom")
        assert a is not None and b is not None
        labels = {i.name: i.label for i in await reader.leases()}
        assert labels["custom"] == "deploy@ci #42"
        host, _, rest = labels["default"].partition(":")
        assert host == socket.gethostname() and rest.startswith(f"{os.getpid()} ")
        await a.release()
        await b.release()


@pytest.mark.parametrize(("label", "error"), [("", ValueError), ("x" * 256, ValueError), ("a\x00b", ValueError),
                                              (7, TypeError)])
async def test_bad_labels_are_refused(db: Db, label: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        AsyncLocker(db.url, table=db.table, label=label)  # type: ignore[arg-type]
