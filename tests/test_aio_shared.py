"""Shared leases (read locks, counting semaphores) on the asyncio face, on real PostgreSQL and SQLite.

The twin of test_shared.py for ``AsyncLocker.readers`` / ``semaphore`` / ``read_lock``:
the same grant rule, the fair line on PostgreSQL (readers and writers in arrival order,
a writer's release admitting the readers queued behind it in its own statement), and
what only asyncio has: cancelling a waiting task leaves the line and ends a shared
lease granted meanwhile.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Awaitable, Callable

import pytest

from dblock import AsyncLease, AsyncLocker, DatabaseUnavailable, Locker
from dblock import _core as core

from .conftest import ALL_BACKENDS, Db

BACKENDS = ALL_BACKENDS
from .workers import race_cancel_with_hand_off
from .test_waiting_faces_async import count_statements

pytestmark = pytest.mark.asyncio



def alocker(db: Db, **options: Any) -> AsyncLocker:
    options.setdefault("table", db.table)
    return AsyncLocker(db.url, **options)


def holding(db: Db, name: str) -> int:
    """Live shared leases of ``name``, by the database's clock."""
    now = db.now
    return db.query(f"SELECT count(*) FROM {db.table}_holders WHERE name = %s AND expires_at > {now}", (name,))[0][0]


def in_line(db: Db, name: str) -> int:
    if db.backend != "postgresql":
        return 0
    return db.query(f"SELECT count(*) FROM {db.table}_waiters WHERE name = %s", (name,))[0][0]


def writer_of(db: Db, name: str) -> list[tuple]:
    """The exclusive (write) lease of ``name``, if one is held: [(owner, token)]."""
    return db.query(
        f"SELECT owner, token FROM {db.table} WHERE name = %s AND owner IS NOT NULL AND owner <> '*shared'", (name,)
    )


async def until(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for something that must happen; fail if it does not within ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_more_waiting_tasks_than_slots_get_one_slot_per_release(db: Db) -> None:
    """A semaphore of 3, full; 5 tasks wait. None is granted while it is full, and each
    release lets exactly one of them in."""
    async with alocker(db) as holder, alocker(db) as locker:
        sem = holder.semaphore("slots", 3)
        held = [await sem.try_acquire(ttl=60) for _ in range(3)]
        waiting = [asyncio.create_task(locker.semaphore("slots", 3).acquire(ttl=60, timeout=60)) for _ in range(5)]
        if db.backend == "postgresql":
            await until(lambda: in_line(db, "slots") == 5, "five tasks to queue")
        await asyncio.sleep(0.3)  # time for a wrong grant to happen
        assert not any(t.done() for t in waiting) and holding(db, "slots") == 3
        got: list[AsyncLease] = []
        for n, lease in enumerate(held, 1):
            assert lease is not None and await lease.release()
            await until(lambda: sum(t.done() for t in waiting) >= n, f"release {n} to let a waiter in")
            await asyncio.sleep(0.2)  # and no more than one
            assert sum(t.done() for t in waiting) == n and holding(db, "slots") == 3
        got = [t.result() for t in waiting if t.done()]
        assert all(lease.shared for lease in got)
        for lease in got:  # two left waiting: they get the freed slots
            await lease.release()
        rest = await asyncio.wait_for(asyncio.gather(*waiting), 60)
        for lease in rest:
            if lease not in got:
                await lease.release()
        assert holding(db, "slots") == 0 and in_line(db, "slots") == 0


@pytest.mark.parametrize("variant", ["dblock", "broken: the acquire sends no limit"])
async def test_concurrent_tasks_never_hold_more_than_the_limit(
    db: Db, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10 tasks (each on an AsyncLocker of its own) take a semaphore of 3 twice each. Each counts
    the holders when it gets in, by its own count and by the database's: never above 3. The
    broken variant sends every acquire without its limit: the same checks must fail."""
    if variant != "dblock":
        monkeypatch.setattr(core, "limit_bind", lambda limit: None)
    lockers = [alocker(db) for _ in range(10)]
    now_holding, seen, db_seen = [0], [0], [0]

    async def work(locker: AsyncLocker) -> None:
        for _ in range(2):
            async with locker.semaphore("many", 3).lock(ttl=30, timeout=60) as lease:
                assert lease.shared
                now_holding[0] += 1
                seen[0] = max(seen[0], now_holding[0])
                live = [info for info in await locker.leases() if info.name == "many"]
                db_seen[0] = max(db_seen[0], len(live))
                await asyncio.sleep(0.1)
                now_holding[0] -= 1

    try:
        await asyncio.wait_for(asyncio.gather(*(work(locker) for locker in lockers)), 120)
    finally:
        for locker in lockers:
            await locker.aclose()
    if variant == "dblock":
        assert seen[0] == db_seen[0] == 3  # the limit held, and was reached
    else:
        assert seen[0] > 3 and db_seen[0] > 3
    assert holding(db, "many") == 0


# -- the fair line (PostgreSQL) -------------------------------------------------------------
async def test_a_writers_release_admits_the_queued_readers_in_its_own_statement(pg: Db) -> None:
    """Four reader tasks wait behind a writer, looking once a minute at most; a writer task waits
    behind them. The release admits the four (the holders table says so as soon as it returns),
    not the writer, and its NOTIFY wakes them: each sent its one enqueue and nothing after."""
    slow = {"poll_min": 60.0, "poll_max": 60.0}
    async with alocker(pg, **slow) as readers, alocker(pg, **slow) as late, alocker(pg) as other:
        held = await other.acquire("n", ttl=60)
        sent = count_statements(readers)
        waits = []
        for n in range(1, 5):
            waits.append(asyncio.create_task(readers.readers("n").acquire(timeout=120)))
            await until(lambda: in_line(pg, "n") == n, f"reader {n} to queue")
        writer = asyncio.create_task(late.acquire("n", timeout=120))
        await until(lambda: in_line(pg, "n") == 5, "the writer to queue")
        assert await held.release()
        assert (holding(pg, "n"), in_line(pg, "n")) == (4, 1)
        leases = await asyncio.wait_for(asyncio.gather(*waits), 30)
        assert sent == [readers.backend.queue.share_enqueue] * 4  # one enqueue each: woken, never looking again
        assert all(lease.shared for lease in leases) and min(lease.token for lease in leases) > held.token
        assert not writer.done()
        for lease in leases:
            assert await lease.release()
        w = await asyncio.wait_for(writer, 30)  # the last reader out handed it the name
        assert not w.shared and w.token > max(lease.token for lease in leases)
        await w.release()


async def test_readers_and_a_writer_are_served_in_arrival_order(pg: Db) -> None:
    """Behind a writer: reader, writer, reader. The first reader goes in alone (the second is
    behind the writer); its release hands the name to the writer; the writer's, to the reader."""
    async with alocker(pg) as locker, alocker(pg) as other:
        w0 = await other.acquire("f", ttl=60)
        kinds = ["read", "write", "read"]
        tasks: list[asyncio.Task[AsyncLease]] = []
        for kind in kinds:
            waiting: Awaitable[AsyncLease] = (
                locker.readers("f").acquire(ttl=60, timeout=60) if kind == "read" else locker.acquire("f", ttl=60, timeout=60)
            )
            tasks.append(asyncio.create_task(waiting))  # type: ignore[arg-type]
            await until(lambda: in_line(pg, "f") == len(tasks), f"{kind} {len(tasks)} to queue")
        r1, w2, r3 = tasks
        assert await w0.release()
        assert (holding(pg, "f"), in_line(pg, "f")) == (1, 2)  # R1 only: R3 is behind W2
        l1 = await asyncio.wait_for(r1, 30)
        assert l1.shared and not w2.done() and not r3.done()
        assert await l1.release()  # the last reader out hands the name to W2
        assert (holding(pg, "f"), in_line(pg, "f")) == (0, 1) and len(writer_of(pg, "f")) == 1
        l2 = await asyncio.wait_for(w2, 30)
        assert not l2.shared and writer_of(pg, "f") == [(l2.owner, l2.token)] and not r3.done()
        assert await l2.release()  # a writer's release admits R3
        assert (holding(pg, "f"), in_line(pg, "f")) == (1, 0)
        l3 = await asyncio.wait_for(r3, 30)
        assert w0.token < l1.token < l2.token < l3.token, "grants did not follow the line"
        await l3.release()


async def test_a_waiting_async_writer_holds_off_new_readers(pg: Db) -> None:
    async with alocker(pg) as locker:
        first = await locker.readers("q").try_acquire(ttl=30)
        assert first is not None
        writer = asyncio.create_task(locker.acquire("q", ttl=30, timeout=30))
        await until(lambda: in_line(pg, "q") == 1, "the writer to queue")
        assert await locker.readers("q").try_acquire(ttl=30) is None  # held off: the writer waits
        with Locker(pg.url, table=pg.table) as sync:  # the sync face sees the same line
            assert sync.readers("q").try_acquire(ttl=30) is None
        assert await first.release()
        w = await asyncio.wait_for(writer, 30)
        assert w.token > first.token and await w.release()


# -- cancellation ------------------------------------------------------------------------
async def test_a_cancelled_waiting_reader_leaves_the_line_and_holds_nothing(db: Db) -> None:
    async with alocker(db) as holder, alocker(db) as locker:
        w = await holder.acquire("cancel", ttl=30)
        reader = asyncio.create_task(locker.readers("cancel").acquire(ttl=30, timeout=30))
        if db.backend == "postgresql":
            await until(lambda: in_line(db, "cancel") == 1, "the reader to queue")
        else:
            await asyncio.sleep(0.2)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert in_line(db, "cancel") == 0
        assert await w.release()
        assert holding(db, "cancel") == 0 and writer_of(db, "cancel") == []  # nothing handed to it


async def test_cancelling_a_reader_after_a_release_admitted_it_ends_that_lease(pg: Db) -> None:
    """The writer's release admits the waiting reader in the database, but the reader's task
    (polling once a minute, no NOTIFY) has not looked yet when it is cancelled: the
    cancellation leaves the line and ends the shared lease it was handed."""
    async with alocker(pg) as holder, alocker(pg, notify=False, poll_min=60.0, poll_max=60.0) as locker:
        w = await holder.acquire("handed", ttl=60)
        reader = asyncio.create_task(locker.readers("handed").acquire(ttl=60, timeout=120))
        await until(lambda: in_line(pg, "handed") == 1, "the reader to queue")
        assert await w.release()
        assert (holding(pg, "handed"), in_line(pg, "handed")) == (1, 0)  # admitted by the release
        assert not reader.done()
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert holding(pg, "handed") == 0 and writer_of(pg, "handed") == []
        assert await locker.try_acquire("handed", ttl=30) is not None  # free for a writer at once


@pytest.mark.parametrize("options", [{}, {"notify": False}, {"fair": False}], ids=["fair", "fair-poll", "line"])
async def test_cancellation_racing_a_hand_off_never_leaks_a_shared_lease(db: Db, options: dict) -> None:
    """A writer releases while the reader waiting behind it is being cancelled, at many offsets:
    after the cancellation no shared lease is left to the cancelled task and the line is empty."""
    if db.backend == "sqlite" and options:
        pytest.skip("SQLite waits in the local line only: covered by the default case")
    async with alocker(db, poll_min=0.001, poll_max=0.01, **options) as holder, alocker(db, **options) as locker:

        async def check(i: int) -> None:
            await until(lambda: holding(db, "race") == 0, f"round {i}: the shared lease to be ended")
            assert in_line(db, "race") == 0 and writer_of(db, "race") == []

        await race_cancel_with_hand_off(
            holder, lambda: locker.semaphore("race", 2).acquire(ttl=30, timeout=10), 20, check
        )


async def test_asyncio_timeout_around_a_reader_leaves_nothing_behind(db: Db) -> None:
    async with alocker(db) as holder, alocker(db) as locker:
        w = await holder.acquire("to", ttl=30)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(locker.read_lock("to", ttl=30).__aenter__(), 0.3)
        assert in_line(db, "to") == 0
        assert await w.release()
        assert holding(db, "to") == 0


async def test_a_lost_reply_to_a_shared_grant_is_ended_in_the_background(db: Db) -> None:
    """The database grants a semaphore slot but its answer never arrives: the call raises, and
    the clean-up ends that shared lease (with the shared statements) instead of leaving it to
    its TTL."""
    async with alocker(db) as locker:
        await locker.leases()  # connected
        run = locker._driver.run
        grants: list[Any] = []

        async def lose_the_grant(sql: str, params: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            result = await run(sql, params, *args, **kwargs)
            if sql == locker.backend.sql.share_acquire:
                grants.append(result)
                raise DatabaseUnavailable("the reply was lost (test)")
            return result

        locker._driver.run = lose_the_grant  # type: ignore[method-assign]
        with pytest.raises(DatabaseUnavailable):
            await locker.semaphore("doubt", 2).try_acquire(ttl=60)
        (result,) = grants
        assert locker.backend.share_acquired(result.rows, result.extra)[0].token > 0  # it was granted
        await until(lambda: holding(db, "doubt") == 0, "the clean-up to end the unanswered grant")
        assert in_line(db, "doubt") == 0


# -- the docs --------------------------------------------------------------------------------
async def test_readme_async_shared_example_runs(db: Db, capsys: pytest.CaptureFixture[str]) -> None:
    from .docs import samples

    url = 'AsyncLocker("postgresql://app@db/reports")'
    (block,) = [b for tested, b in samples("asyncio.md") if url in b]
    assert block.endswith("asyncio.run(shared())\n")
    namespace: dict[str, Any] = {}
    code = block.replace(url, f"AsyncLocker({db.url!r}, table={db.table!r})").removesuffix("asyncio.run(shared())\n")
    exec(compile(code, "docs/asyncio.md", "exec"), namespace)
    await namespace["shared"]()
    out = capsys.readouterr().out.splitlines()
    assert [re.sub(r"\d+", "N", line) for line in out] == ["reading, token N", "one of N slots, token N"]
    assert holding(db, "catalog") == holding(db, "api-quota") == 0
