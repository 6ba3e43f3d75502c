"""Async renewal in batches (issue 23): the twin of test_renew.py's batching tests, for ``AsyncLocker``.

One scheduler task per AsyncLocker extends the renewing leases that fall due
together in one statement (``extend_many``; shared leases in a statement of
their own, ``share_extend_many``), as the sync face's ``renew.Renewer`` does;
on real PostgreSQL and SQLite.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from dblock import AsyncLease, AsyncLocker
from dblock import _core as core

from .conftest import Db
from .pgproxy import PgProxy
from .test_aio import alocker
from .test_aio_shared import until
from .test_renew import _held

pytestmark = pytest.mark.asyncio


class Extends:
    """The extend statements an AsyncLocker sends from now on, each as the names of the leases in it.

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
                await asyncio.sleep(delay)
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
    await until(lambda: locker._renewer._scheduler is None, "the renewal task to end with nothing left to renew")


# -- one statement a round ---------------------------------------------------------------
N = 50


async def test_many_async_leases_renew_in_about_one_statement_a_round(db: Db) -> None:
    """50 renewing leases of one AsyncLocker: about one extend a round, not one per lease (nor a task each)."""
    ttl = 0.9  # a round every 0.3 s
    proxy = PgProxy(db.url) if db.backend == "postgresql" else None  # round trips on the wire, as test_renew counts
    try:
        async with AsyncLocker(db.url if proxy is None else proxy.url, table=db.table) as locker:
            leases = await renewing(locker, "exclusive", N, ttl)
            extends = Extends(locker)
            if proxy is not None:
                proxy.reset()
            start = dict(_held(db))
            began = time.monotonic()
            await extended_twice(leases, "two renewals of every lease")
            rounds = (time.monotonic() - began) / (ttl / 3)
            statements, round_trips = len(extends.sent), proxy.round_trips if proxy is not None else None
            print(f"\n{db.backend}: {statements} extend statements ({round_trips} round trips) for {N} leases"
                  f" in {rounds:.1f} rounds: {statements / rounds:.1f} a round")
            # By the database clock too, every lease held on (at least a renewal past the start: an
            # extend may have committed before its reply came back, as the start was read).
            assert all(held > start[name] + ttl / 3 for name, held in _held(db))
            # About one a round (two while the batch forms, on a busy machine), not one per lease.
            assert statements <= 2 * rounds + 2, f"{statements} extend statements in {rounds:.1f} rounds of {N} leases"
            if proxy is not None:  # each a round trip; a new connection's set-up may add a couple
                assert proxy.round_trips <= statements + 2, f"{proxy.round_trips} round trips for {statements} extends"
            # One scheduler task, and a task sending each batch in flight (at most 4): not a task per lease.
            tasks = locker._renewer._tasks  # the scheduler, the senders and on_lost callbacks
            assert len(tasks) <= 5, f"{len(tasks)} background tasks renew {N} leases"
            assert [t.get_name() for t in asyncio.all_tasks()].count("dblock-renew") == 1
            assert all(lease.remaining() > 0 and not lease.lost.is_set() for lease in leases)
            for lease in leases:
                assert await lease.release() is True
            assert locker._renewer.renewing() == 0
            await scheduler_ended(locker)
    finally:
        if proxy is not None:
            proxy.close()


async def test_shared_and_exclusive_leases_renew_in_statements_of_their_own(db: Db) -> None:
    """As the sync face's Keeper and SharedKeeper: one batch of each kind a round, with its own statement."""
    async with alocker(db) as locker:
        exclusive = await renewing(locker, "exclusive", 5, 0.6)
        shared = await renewing(locker, "shared", 5, 0.6, prefix="slot")
        assert not any(lease.shared for lease in exclusive) and all(lease.shared for lease in shared)
        extends = Extends(locker)
        await extended_twice(exclusive + shared, "two renewals of each lease")
        kinds = [sorted(lease.name for lease in leases) for leases in (exclusive, shared)]
        assert all(extends.sent.count(names) >= 2 for names in kinds)  # each kind in a statement of its own
        assert all(set(names) <= set(kinds[0]) or set(names) <= set(kinds[1]) for names in extends.sent)
        assert len(extends.sent) <= 6  # two a round
        held = _held(db, shared=True)  # by the database clock, the shared leases held on past their ttl
        assert sorted(name for name, _ in held) == kinds[1] and all(span > 0.6 for _, span in held)
        for lease in exclusive + shared:
            assert await lease.release() is True
        await scheduler_ended(locker)


# -- a loss, a release, inside a batch ----------------------------------------------------
@pytest.mark.parametrize("kind", ["exclusive", "shared"])
async def test_a_lease_taken_over_in_a_batch_is_lost_and_the_others_renew_on(db: Db, kind: str) -> None:
    lost: list[AsyncLease] = []
    async with alocker(db) as locker, alocker(db) as operator:
        leases = await renewing(locker, kind, 5, 0.6, on_lost=lost.append)
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
        await asyncio.wait_for(victim.lost.wait(), 10)
        await until(lambda: lost == [victim], "on_lost, on the event loop")
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
async def test_a_batch_renews_on_after_a_lease_in_it_is_released(db: Db, min_hold: float | None) -> None:
    """Released mid-batch, a lease leaves the schedule at once and its batch goes on. With a
    ``min_hold``, the release is kept until then (grant + 1 s, sooner than the expiry renewal
    would give it): an extend in flight as it goes out is waited for, and none lands after."""
    lost: list[AsyncLease] = []
    async with alocker(db) as locker:
        extends = Extends(locker, delay=0.05)
        leases = await renewing(locker, "exclusive", 4, 0.6, on_lost=lost.append)
        released = await locker.try_acquire("job-4", ttl=0.6, renew=True, on_lost=lost.append, min_hold=min_hold)
        assert released is not None
        leases.append(released)
        names = [lease.name for lease in leases]
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


# -- the task's life ------------------------------------------------------------------------
async def test_the_renewal_task_starts_with_the_first_renewal_and_aclose_stops_it(db: Db) -> None:
    locker = alocker(db)
    lease = await locker.try_acquire("job", ttl=30)
    assert lease is not None and locker._renewer._scheduler is None  # nothing to renew: no task
    lease.start_renewal()
    task = locker._renewer._scheduler
    assert task is not None and not task.done() and task.get_name() == "dblock-renew"
    await locker.aclose()
    assert task.done() and locker._renewer._scheduler is None
    assert not lease.lost.is_set()  # leases stay granted until released or expired


async def test_a_collected_lease_leaves_the_schedule(db: Db) -> None:
    import gc

    async with alocker(db) as locker:
        lease = await locker.try_acquire("job", ttl=0.6, renew=True)
        assert lease is not None and locker._renewer.renewing() == 1
        del lease
        gc.collect()
        # The schedule holds only a weak reference: the lease leaves it at its next turn.
        await until(lambda: locker._renewer.renewing() == 0, "the collected lease to leave the schedule")
        await scheduler_ended(locker)
