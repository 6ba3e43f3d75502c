"""A with-block whose lease was lost while it ran raises LeaseLost at its end, written once for both
faces: this asyncio module is the source and ``tests/test_lost_block_faces.py`` is generated from it
(``python tools/async_to_sync.py``).

Renewal is blocked for real, by another connection of the database's own: on SQLite a
``BEGIN EXCLUSIVE`` on the file, on PostgreSQL ``LOCK TABLE ... IN ACCESS EXCLUSIVE MODE`` on the
lock tables, on MariaDB ``LOCK TABLES ... WRITE``. The block waits until renewal gives the lease up
(``lease.lost``), the blocker lets go, and the block's end must raise LeaseLost, saying what
happened, and still release the lease (it is still this holder's: nobody was granted it meanwhile).
Every lock kind: exclusive, reader, semaphore slot, upgradeable reader (and upgraded), several names
at once, an election's leadership, a ``synchronized`` call; on every backend.
"""

from __future__ import annotations

import sqlite3
import sys
from typing import Any, Callable

import pytest
from sqlalchemy.engine import make_url

from dblock import AsyncLease, AsyncLocker, LeaseLost, current_lease
from dblock._acompat import aevent_wait

from .conftest import ALL_BACKENDS, Db
from .test_faces_async import make, until

BACKENDS = ALL_BACKENDS

if True:  # ASYNC
    import asyncio

    pytestmark = pytest.mark.asyncio

# Renewal extends every ttl/3, so a machine may stall 2/3 of a ttl before the lease is lost unblocked;
# blocked, the lease is given up about a ttl later.
TTL = 2.0
LOST_WITHIN = 60.0  # a generous bound for renewal to give the lease up on a loaded machine


async def off_loop(work: Callable[[], Any]) -> Any:
    """Run a blocking call of the test's own connection (off the event loop on asyncio, whose
    renewal must go on meanwhile)."""
    if True:  # ASYNC
        return await asyncio.to_thread(work)
    else:
        return work()


class Blocker:
    """Another connection that stops every write to the lock tables until ``let_go``: the
    database's own locks, nothing faked."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self.conn: Any = None

    def block(self) -> None:
        db, t = self.db, self.db.table
        if db.backend == "sqlite":
            self.conn = sqlite3.connect(
                str(make_url(db.url).database), isolation_level=None, timeout=30, check_same_thread=False
            )
            self.conn.execute("BEGIN EXCLUSIVE")
        elif db.backend == "postgresql":
            self.conn = db.connect()
            self.conn.execute("BEGIN")
            self.conn.execute(f"LOCK TABLE {t}, {t}_holders IN ACCESS EXCLUSIVE MODE")
        else:
            self.conn = db.connect()
            self.conn.cursor().execute(f"LOCK TABLES {t} WRITE, {t}_holders WRITE")

    def let_go(self) -> None:
        if self.conn is None:
            return
        conn, self.conn = self.conn, None
        try:
            if self.db.backend == "mariadb":
                conn.cursor().execute("UNLOCK TABLES")
            else:
                conn.execute("ROLLBACK")
        finally:
            conn.close()


async def blocked_until_lost(db: Db, *leases: AsyncLease) -> None:
    """Block renewal until every one of ``leases`` is given up (``lost`` set), then let go."""
    blocker = Blocker(db)
    try:
        await off_loop(blocker.block)
        for lease in leases:
            assert await aevent_wait(lease.lost, LOST_WITHIN), f"renewal did not give up {lease.name!r}"
            assert lease.remaining() == 0
    finally:
        await off_loop(blocker.let_go)


def left_behind(db: Db, *owners: str) -> int:
    """Rows of the lock tables still held by ``owners`` (0: every lease was released)."""
    marks = ", ".join(["%s"] * len(owners))
    t = db.table
    return sum(
        int(db.query(f"SELECT count(*) FROM {table} WHERE owner IN ({marks})", owners)[0][0])
        for table in (t, f"{t}_holders")
    )


def kind_lock(locker: AsyncLocker, kind: str, **options: Any) -> Any:
    """``locker``'s with-block of lock kind ``kind`` on the name "job"."""
    if kind == "exclusive":
        return locker.lock("job", **options)
    if kind == "reader":
        return locker.read_lock("job", **options)
    if kind == "semaphore":
        return locker.semaphore("job", 2).lock(**options)
    return locker.upgradeable_lock("job", **options)  # "upgradeable", "upgraded"


KINDS = ["exclusive", "reader", "semaphore", "upgradeable", "upgraded"]

RENEWAL_GAVE_UP = r"was lost before the with-block ended: renewal gave it up: .*; nobody else was granted it meanwhile"


@pytest.mark.parametrize("kind", KINDS)
async def test_a_block_whose_renewal_was_blocked_raises_lease_lost_at_its_end(db: Db, kind: str) -> None:
    lost: list[AsyncLease] = []
    async with make(db) as locker:
        with pytest.raises(LeaseLost, match=RENEWAL_GAVE_UP) as caught:
            async with kind_lock(locker, kind, ttl=TTL, renew=True, on_lost=lost.append) as lease:
                if kind == "upgraded":
                    await lease.upgrade()
                    assert not lease.shared
                await blocked_until_lost(db, lease)
                await until(lambda: lost == [lease], "on_lost")
        assert f"lease on 'job' (token {lease.token})" in str(caught.value)
        assert left_behind(db, lease.owner) == 0  # still ours at the end: released, nothing left behind
        again = await locker.try_acquire("job", ttl=30)  # the name is free again
        assert again is not None and again.token > lease.token
        await again.release()


async def test_a_group_block_whose_renewal_was_blocked_raises_lease_lost_for_each_lease(db: Db) -> None:
    async with make(db) as locker:
        with pytest.raises(LeaseLost, match="2 of the group's 2 leases were lost before the with-block ended") as caught:
            async with locker.lock_all(["audit", "ledger"], ttl=TTL, renew=True) as group:
                await blocked_until_lost(db, *group)
                assert group.lost
        for name, token in group.tokens.items():
            assert f"lease on {name!r} (token {token}) was lost before the with-block ended: renewal gave it up" in str(
                caught.value
            )
        assert left_behind(db, *(lease.owner for lease in group)) == 0


async def test_a_group_block_raises_lease_lost_when_one_of_its_leases_was_lost(db: Db) -> None:
    """One lease of the group given up by renewal (the other released by the block before): the
    group's block ends with that lease's LeaseLost."""
    async with make(db) as locker:
        with pytest.raises(LeaseLost, match=r"lease on 'ledger' \(token \d+\) was lost before the with-block ended"):
            async with locker.lock_all(["audit", "ledger"], ttl=TTL, renew=True) as group:
                assert await group["audit"].release() is True  # the block's own release: not a loss
                await blocked_until_lost(db, group["ledger"])
        assert left_behind(db, *(lease.owner for lease in group)) == 0


async def test_a_leadership_block_whose_renewal_was_blocked_raises_lease_lost_at_its_end(db: Db) -> None:
    async with make(db) as locker:
        election = locker.election("primary")
        with pytest.raises(LeaseLost, match=r"the leadership of 'primary' \(term \d+\) was lost before the with-block ended: "
                           "renewal gave it up") as caught:
            async with await election.campaign(value="node-a", ttl=TTL) as leadership:
                await blocked_until_lost(db, leadership.lease)
                assert leadership.lost.is_set()
        assert f"(term {leadership.term})" in str(caught.value)
        assert left_behind(db, leadership.owner) == 0
        assert await election.leader() is None


async def test_a_synchronized_call_whose_renewal_was_blocked_raises_lease_lost_after_it(db: Db) -> None:
    async with make(db) as locker:
        seen: list[AsyncLease] = []

        @locker.synchronized("job", ttl=TTL, renew=True)
        async def work() -> str:
            lease = current_lease()
            assert isinstance(lease, AsyncLease)
            seen.append(lease)
            await blocked_until_lost(db, lease)
            return "done"

        with pytest.raises(LeaseLost, match=RENEWAL_GAVE_UP):
            await work()
        assert left_behind(db, seen[0].owner) == 0


async def test_a_failing_block_keeps_its_error_and_notes_the_loss(db: Db) -> None:
    async with make(db) as locker:
        with pytest.raises(KeyError) as caught:
            async with locker.lock("job", ttl=TTL, renew=True) as lease:
                await blocked_until_lost(db, lease)
                raise KeyError("the block's own error")
        if sys.version_info >= (3, 11):  # exceptions take notes from 3.11 on
            (note,) = caught.value.__notes__
            assert "dblock: lease on 'job'" in note and "was lost before the with-block ended" in note
        assert left_behind(db, lease.owner) == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_a_block_that_outlived_its_ttl_unrenewed_raises_lease_lost_though_nobody_took_it(
    db: Db, kind: str
) -> None:
    """No renewal, nobody else asks: the block ran on after its holder's trust ran out, so its work
    was unprotected by then, even though the name was never granted to anyone else."""
    async with make(db) as locker:
        pattern = r"its trusted time ran out at .* UTC, [\d.]+ s before the block ended \(ttl 2 s, not renewed\); " \
                  r"nobody else was granted it meanwhile"
        with pytest.raises(LeaseLost, match=pattern):
            async with kind_lock(locker, kind, ttl=TTL) as lease:  # time to upgrade on a stalled machine
                if kind == "upgraded":
                    await lease.upgrade(timeout=5)
                await until(lambda: lease.remaining() == 0, "the lease's trust to run out")
                assert not lease.lost.is_set()  # nobody told it: no renewal
        assert left_behind(db, lease.owner) == 0

        # Extended in time by hand: protected to its end, no error.
        async with kind_lock(locker, kind, ttl=30) as lease:
            await lease.extend()
        assert left_behind(db, lease.owner) == 0


@pytest.mark.parametrize("kind", ["exclusive", "reader"])
async def test_a_block_whose_lease_was_taken_over_says_who_holds_the_name_now(db: Db, kind: str) -> None:
    async with make(db) as locker, make(db) as operator:
        taker: AsyncLease | None = None
        with pytest.raises(LeaseLost, match="the release found it released or taken over") as caught:
            async with kind_lock(locker, kind, ttl=30) as lease:
                (info,) = await operator.leases("job")
                assert await operator.force_release(info) is True
                taker = await operator.try_acquire("job", ttl=30)
        assert taker is not None
        assert f"the name is held now by token {taker.token}" in str(caught.value)
        await taker.release()

        with pytest.raises(LeaseLost, match="the release found it released or taken over: nobody holds the name now"):
            async with kind_lock(locker, kind, ttl=30) as lease:
                (info,) = await operator.leases("job")
                assert await operator.force_release(info) is True


async def test_a_block_that_released_its_lease_after_losing_it_still_raises_lease_lost(db: Db) -> None:
    """Lost while the block ran, before the block's own release: the end of the block says so (the
    release's True says only that nobody else was granted it). Released in time, nothing is raised."""
    async with make(db) as locker:
        with pytest.raises(LeaseLost, match=RENEWAL_GAVE_UP + ", and it is released"):
            async with locker.lock("job", ttl=TTL, renew=True) as lease:
                await blocked_until_lost(db, lease)
                assert await lease.release() is True  # still ours: nobody was granted it
        assert left_behind(db, lease.owner) == 0

        async with locker.lock("job", ttl=TTL, renew=True) as lease:
            assert await lease.release() is True
        assert not lease.lost.is_set()
