"""The upgradeable read lock (``upgradeable_lock``, ``lease.upgrade``, ``lease.downgrade``), written once for
both faces: this asyncio module is the source and ``tests/test_upgradeable_faces.py`` is generated from it
(``python tools/async_to_sync.py``). Every case runs on each backend (the ``db`` fixture).
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from dblock import AsyncUpgradeableLease, LeaseLost, LockNotAcquired
from dblock._acompat import AMutex, ajoin, asleep, aspawn, running

from .conftest import ALL_BACKENDS, Db
from .test_faces_async import held, make, until
from .test_waiting_faces_async import count_statements

BACKENDS = ALL_BACKENDS

if True:  # ASYNC
    pytestmark = pytest.mark.asyncio


async def test_upgrade_waits_for_the_readers_and_holds_new_ones_off(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        async with locker.upgradeable_lock("catalog", ttl=30) as lease:
            assert isinstance(lease, AsyncUpgradeableLease) and lease.shared
            reader = await other.readers("catalog").try_acquire(ttl=30)
            assert reader is not None  # readers share the name with the upgradeable reader
            assert await other.upgradeable("catalog").try_acquire(ttl=30) is None  # one at a time
            assert await other.try_acquire("catalog", ttl=30) is None  # it is a reader: no writer
            read_token, upgraded = lease.token, []

            async def upgrade() -> None:
                upgraded.append(await lease.upgrade(timeout=30))

            worker = aspawn(upgrade, "upgrade")
            await asleep(0.3)
            assert upgraded == [] and lease.shared  # waiting for the reader
            assert await other.readers("catalog").try_acquire(ttl=30) is None  # no new reader meanwhile
            assert await reader.release() is True
            await ajoin(worker, 30)
            assert not running(worker) and upgraded == [lease]
            assert not lease.shared and lease.token > reader.token > read_token  # the write lease's own token
            assert held(db) == [("catalog", lease.token)]  # the name's exclusive lease, by the database
            assert await other.readers("catalog").try_acquire(ttl=30) is None
            write_token = lease.token
            assert await lease.downgrade() is lease
            assert lease.shared and lease.token > write_token
            again = await other.readers("catalog").try_acquire(ttl=30)
            assert again is not None and again.token > lease.token  # readers welcome again
            await again.release()
        assert held(db) == [] and await other.try_acquire("catalog", ttl=30) is not None  # the exit released it


async def test_upgrade_and_downgrade_send_one_statement_each(db: Db) -> None:
    async with make(db) as locker:
        await (await locker.upgradeable("warm").acquire(ttl=30, timeout=5)).release()  # connections open
        sent = count_statements(locker)
        lease = await locker.upgradeable("one").acquire(ttl=30, timeout=5)
        await lease.upgrade(timeout=5)
        await lease.downgrade()
        await lease.release()
        sql = locker.backend.sql
        first = locker.backend.queue.share_enqueue if locker.backend.caps.fair_queue else sql.share_acquire
        assert sent == [first, sql.upgrade, sql.downgrade, sql.share_release]


async def test_an_upgrade_that_times_out_stays_the_upgradeable_read_and_lets_readers_in(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        lease = await locker.upgradeable("catalog").acquire(ttl=30, timeout=5)
        reader = await other.readers("catalog").acquire(ttl=30, timeout=5)
        token = lease.token
        with pytest.raises(LockNotAcquired, match="other readers still hold it") as caught:
            await lease.upgrade(timeout=0.3)
        assert caught.value.name == "catalog" and pickle.loads(pickle.dumps(caught.value)).timeout == 0.3
        assert lease.shared and lease.token == token and lease.remaining() > 0
        joined = await other.readers("catalog").try_acquire(ttl=30)  # the ask to upgrade was withdrawn
        assert joined is not None
        await joined.release()
        await reader.release()
        assert await lease.upgrade(timeout=5) is lease and not lease.shared
        await lease.release()


async def test_renewal_follows_the_lease_through_upgrade_and_downgrade(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        # 1.5 s: renewed every 0.5 s, it survives a 1 s stall of renewal on a busy machine (a 0.3 s
        # ttl leaves 0.2 s). Each step waits until renewal moved the expiry more than a ttl on: by
        # then the expiry it had would have passed, and only renewal kept it.
        ttl = 1.5
        async with locker.upgradeable_lock("catalog", ttl=ttl, renew=True) as lease:
            await lease.upgrade(timeout=5)
            assert lease.renewing
            mark = lease.expires_at.timestamp()
            await until(lambda: lease.expires_at.timestamp() > mark + ttl, "renewal of the write lease")
            assert not lease.lost.is_set() and await other.try_acquire("catalog", ttl=30) is None
            await lease.downgrade()
            assert lease.renewing
            mark = lease.expires_at.timestamp()
            await until(lambda: lease.expires_at.timestamp() > mark + ttl, "renewal of the read lease")
            assert not lease.lost.is_set() and await other.try_acquire("catalog", ttl=30) is None
            assert await other.upgradeable("catalog").try_acquire(ttl=30) is None


async def test_a_lease_that_ran_out_cannot_upgrade(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        lease = await locker.upgradeable("catalog").acquire(ttl=0.2, timeout=5)
        await asleep(0.4)
        writer = await other.try_acquire("catalog", ttl=30)  # the name's next grant forgets it
        assert writer is not None
        with pytest.raises(LeaseLost):
            await lease.upgrade(timeout=1)
        assert lease.lost.is_set() and held(db) == [("catalog", writer.token)]
        await writer.release()


async def test_bad_input_is_refused_before_any_statement(db: Db) -> None:
    async with make(db) as locker:
        lease = await locker.upgradeable("catalog").acquire(ttl=30, timeout=5)
        sent = count_statements(locker)
        with pytest.raises(ValueError, match="timeout"):
            await lease.upgrade(timeout=-1)
        with pytest.raises(ValueError):
            locker.upgradeable("")
        assert sent == []
        await lease.release()
        with pytest.raises(LeaseLost, match="nothing to upgrade"):
            await lease.upgrade(timeout=1)
        assert sent == [locker.backend.sql.share_release]


async def test_upgraders_readers_and_writers_never_overlap(db: Db) -> None:
    """Three callers each take the upgradeable read, read, upgrade, write, come back down and leave; three
    readers and a writer run beside them. Whoever writes is alone, by the leases' own word (long ttls:
    nothing runs out), and every write lease's token is larger than every grant before it."""
    inside = {"readers": 0, "writers": 0}
    errors: list[BaseException] = []
    writes: list[int] = []

    guard = AMutex()  # the counts change under it (threads, on the sync face)

    def enter(kind: str) -> None:
        with guard:
            inside[kind] += 1
            if inside["writers"] > 1 or (inside["writers"] and inside["readers"]):
                errors.append(AssertionError(f"overlap: {inside}"))

    def leave(kind: str) -> None:
        with guard:
            inside[kind] -= 1

    async def upgrader(locker: Any) -> None:
        try:
            for _ in range(4):
                async with locker.upgradeable_lock("doc", ttl=30, timeout=60) as lease:
                    enter("readers")
                    await asleep(0.005)
                    leave("readers")
                    await lease.upgrade(timeout=60)
                    enter("writers")
                    writes.append(lease.token)
                    await asleep(0.005)
                    leave("writers")
                    await lease.downgrade()
                    enter("readers")
                    leave("readers")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    async def reader(locker: Any) -> None:
        try:
            for _ in range(6):
                async with locker.read_lock("doc", ttl=30, timeout=60):
                    enter("readers")
                    await asleep(0.005)
                    leave("readers")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    async def writer(locker: Any) -> None:
        try:
            for _ in range(4):
                async with locker.lock("doc", ttl=30, timeout=60) as lease:
                    enter("writers")
                    writes.append(lease.token)
                    await asleep(0.005)
                    leave("writers")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    lockers = [make(db) for _ in range(4)]
    try:
        workers = [aspawn(lambda i=i: upgrader(lockers[i % 2]), f"up{i}") for i in range(3)]
        workers += [aspawn(lambda i=i: reader(lockers[2 + i % 2]), f"r{i}") for i in range(3)]
        workers.append(aspawn(lambda: writer(lockers[3]), "w"))
        for worker in workers:
            await ajoin(worker, 120)
            assert not running(worker), "a caller never finished"
    finally:
        for locker in lockers:
            await locker.aclose()
    assert errors == []
    assert len(writes) == 3 * 4 + 4 and writes == sorted(set(writes))  # write tokens grow in write order
    assert held(db) == []
