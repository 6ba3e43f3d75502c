"""Several names at once (``acquire_all``, ``try_acquire_all``, ``lock_all``), written once for both
faces: this asyncio module is the source and ``tests/test_groups_faces.py`` is generated from it
(``python tools/async_to_sync.py``). Every case runs on each backend (the ``db`` fixture).
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from dblock import AsyncLeaseGroup, LeaseLost, LockNotAcquired
from dblock._acompat import ajoin, asleep, aspawn, running

from .conftest import ALL_BACKENDS, Db
from .test_faces_async import held, make, until
from .test_waiting_faces_async import count_statements

BACKENDS = ALL_BACKENDS

if True:  # ASYNC
    pytestmark = pytest.mark.asyncio

NAMES = ["ledger", "accounts", "audit"]


async def test_all_names_are_held_together_each_with_its_own_token(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        group = await locker.acquire_all(NAMES, ttl=30, timeout=5)
        assert isinstance(group, AsyncLeaseGroup)
        assert group.names == sorted(NAMES) and len(group) == 3  # one canonical order, whatever was given
        assert sorted(held(db)) == sorted(group.tokens.items())
        assert group["ledger"].token == group.tokens["ledger"] and not group.lost
        assert 0 < group.remaining() <= 30
        for name in NAMES:
            assert await other.try_acquire(name, ttl=30) is None  # each name is held
        await group.extend(60)
        assert group.remaining() > 30
        assert await group.release() is True
        assert await group.release() is False  # already ended: nothing ended twice
        assert held(db) == []
        again = await other.acquire_all(reversed(NAMES), ttl=30, timeout=5)
        for name in NAMES:
            assert again[name].token > group[name].token  # every name's tokens still grow
        await again.release()


async def test_a_group_of_free_names_costs_one_statement_per_name_each_way(db: Db) -> None:
    async with make(db) as locker:
        await (await locker.acquire_all(["warm-1", "warm-2"], timeout=5)).release()  # connections open
        sent = count_statements(locker)
        names = [f"n{i}" for i in range(5)]
        group = await locker.acquire_all(names, ttl=30, timeout=5)
        assert len(sent) == 5  # one grant each (an acquire, or PostgreSQL's enqueue, which grants a free name)
        await group.release()
        assert sent[5:] == [locker.backend.sql.release] * 5


async def test_try_acquire_all_gets_all_or_none(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        blocker = await other.try_acquire("audit", ttl=30)  # the middle name in the canonical order
        assert blocker is not None
        assert await locker.try_acquire_all(NAMES, ttl=30) is None
        assert held(db) == [("audit", blocker.token)]  # "accounts", taken first, was given back
        await blocker.release()
        group = await locker.try_acquire_all(NAMES, ttl=30)
        assert group is not None and group.names == sorted(NAMES)
        await group.release()


async def test_a_timeout_leaves_nothing_held_and_names_the_name_it_waited_for(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        blocker = await other.try_acquire("ledger", ttl=30)  # the last name in the canonical order
        assert blocker is not None
        with pytest.raises(LockNotAcquired, match="one of 3 names asked for together.*2 taken before it") as caught:
            await locker.acquire_all(NAMES, ttl=30, timeout=0.3)
        assert caught.value.name == "ledger" and caught.value.timeout == 0.3
        assert pickle.loads(pickle.dumps(caught.value)).name == "ledger"
        assert held(db) == [("ledger", blocker.token)]  # the two taken before it were released
        assert await locker.waiters() == {}
        await blocker.release()


async def test_lock_all_releases_on_exit_and_on_error(db: Db) -> None:
    async with make(db) as locker:
        async with locker.lock_all(NAMES, ttl=30, timeout=5) as group:
            assert sorted(held(db)) == sorted(group.tokens.items())
        assert held(db) == []
        with pytest.raises(ZeroDivisionError):
            async with locker.lock_all(NAMES, ttl=30, timeout=5):
                1 / 0
        assert held(db) == []


async def test_a_lease_lost_inside_lock_all_is_reported_at_its_end_and_the_rest_released(db: Db) -> None:
    async with make(db) as locker:
        with pytest.raises(LeaseLost, match="'audit'"):
            async with locker.lock_all(NAMES, ttl=30, timeout=5) as group:
                (info,) = [i for i in await locker.leases() if i.name == "audit"]
                assert await locker.force_release(info) is True  # an operator ends one of them
                assert not group.lost  # not known yet: no statement has said so
        assert held(db) == []  # the other two were released all the same


async def test_renewal_keeps_every_lease_of_the_group(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        # 1.5 s: renewed every 0.5 s, they survive a 1 s stall of renewal on a busy machine (a
        # 0.6 s ttl leaves 0.4 s, which such a machine took).
        ttl = 1.5
        group = await locker.acquire_all(NAMES, ttl=ttl, timeout=5, renew=True)
        marks = {name: lease.expires_at.timestamp() for name, lease in group.leases.items()}
        # Each renewed more than a ttl on: its first expiry passed, and only renewal kept it.
        await until(
            lambda: all(lease.expires_at.timestamp() > marks[name] + ttl for name, lease in group.leases.items()),
            "renewal of every lease past its first ttl",
        )
        for name in NAMES:
            assert await other.try_acquire(name, ttl=30) is None
        assert not group.lost
        assert await group.release() is True


async def test_callers_asking_in_opposite_orders_never_deadlock_nor_hold_part(db: Db) -> None:
    """Two callers (tasks, or threads), each with a Locker of its own, take the same three names in
    opposite orders, round after round. Taken in the order given, each would soon hold one name and
    wait for the other's; in the canonical order they take turns. At every moment the names are
    held by one caller or none."""
    rounds = 25
    holder: dict[str, str | None] = dict.fromkeys(NAMES)
    grants: dict[str, list[int]] = {name: [] for name in NAMES}
    errors: list[BaseException] = []

    async def caller(who: str, names: list[str]) -> None:
        async with make(db) as locker:
            try:
                for _ in range(rounds):
                    group = await locker.acquire_all(names, ttl=30, timeout=10)
                    assert all(holder[name] is None for name in NAMES), holder  # nobody else holds any
                    for name in NAMES:
                        holder[name] = who
                        grants[name].append(group[name].token)
                    await asleep(0.001)
                    for name in NAMES:
                        holder[name] = None
                    await group.release()
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                errors.append(exc)

    workers = [aspawn(lambda: caller("up", NAMES), "up"), aspawn(lambda: caller("down", NAMES[::-1]), "down")]
    for worker in workers:
        await ajoin(worker, 120)
        assert not running(worker), "a caller never finished"
    assert errors == []
    for name in NAMES:
        assert len(grants[name]) == 2 * rounds and grants[name] == sorted(set(grants[name]))  # tokens grow
    assert held(db) == []


async def test_bad_names_are_refused_before_any_statement(db: Db) -> None:
    async with make(db) as locker:
        bad: list[tuple[Any, type[Exception], str]] = [
            ("ledger", TypeError, "not one str"),
            ([], ValueError, "at least one lock name"),
            (["a", "b", "a"], ValueError, "distinct; given more than once: 'a'"),
            (["a", ""], ValueError, "must not be empty"),
            (["a", 3], TypeError, "lock name must be a str"),
            (None, TypeError, "collection of lock names"),
        ]
        for names, error, message in bad:
            for call in (locker.acquire_all, locker.try_acquire_all):
                with pytest.raises(error, match=message):
                    await call(names)
            with pytest.raises(error, match=message):
                locker.lock_all(names)
        with pytest.raises(ValueError, match="ttl must be"):
            await locker.acquire_all(NAMES, ttl=0)
        with pytest.raises(ValueError, match="timeout must be"):
            await locker.acquire_all(NAMES, timeout=-1)
        assert held(db) == [] and locker.open_connections() == 0  # nothing was sent


if True:  # ASYNC

    async def test_cancelling_acquire_all_releases_what_it_took(db: Db) -> None:
        import asyncio

        from .test_faces_async import until

        async with make(db) as locker, make(db) as other:
            blocker = await other.try_acquire("ledger", ttl=30)  # the last in the canonical order
            assert blocker is not None
            task = asyncio.ensure_future(locker.acquire_all(NAMES, ttl=30, timeout=30))
            await until(lambda: len(held(db)) == 3, "the first two names taken")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert held(db) == [("ledger", blocker.token)]
            await blocker.release()
