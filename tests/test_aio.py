"""What only the asyncio API (``AsyncLocker``, ``AsyncLease``) has, on real PostgreSQL and SQLite.

What both faces promise is tested once, on both, in test_faces_async.py (and the
test_faces.py generated from it); the guarantee race (G1/G2, audited) runs against
this API in test_guarantees.py (its ``async-*`` modes) and the fenced pause in
test_fencing.py. Here: engines and URLs, on_lost on the loop, tasks instead of
threads (the event loop never blocked), cancellation, faults and the decorator.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from typing import Any

import pytest

import dblock
from dblock import AsyncLease, AsyncLocker, DatabaseUnavailable, LockNotAcquired

from .conftest import Db
from .pgproxy import PgProxy
from .test_faults import SLACK, SilentServer, silent  # noqa: F401 - the fixture
from .workers import race_cancel_with_hand_off

pytestmark = pytest.mark.asyncio


def alocker(db: Db, **options: Any) -> AsyncLocker:
    options.setdefault("table", db.table)
    return AsyncLocker(db.url, **options)


def held(db: Db) -> list[tuple]:
    return db.query(f"SELECT name, token FROM {db.table} WHERE owner IS NOT NULL ORDER BY name")


def queued(db: Db) -> int:
    if db.backend != "postgresql":
        return 0
    return db.query(f"SELECT count(*) FROM {db.table}_waiters")[0][0]


async def test_the_embedded_default_works_without_set_up(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBLOCK_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    async with AsyncLocker() as locker:
        async with locker.lock("embedded") as lease:
            assert lease.token > 0
            assert await locker.try_acquire("embedded") is None


async def test_it_takes_an_async_engine(pg: Db) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(pg.url)
    try:
        with dblock.Locker(engine, table=pg.table) as sync:
            sync.create_schema()  # Alembic, on an engine of dblock's own: not the app's async one
        async with AsyncLocker(engine, table=pg.table) as locker:
            await locker.create_schema()
            async with locker.lock("engine") as lease:
                assert held(pg) == [("engine", lease.token)]
    finally:
        await engine.dispose()


async def test_sqlite_aiosqlite_urls_name_the_same_file(tmp_path: Any) -> None:
    path = tmp_path / "locks.sqlite3"
    async with AsyncLocker(f"sqlite+aiosqlite:///{path}") as locker:
        await locker.create_schema()
        lease = await locker.acquire("file")
        with dblock.Locker(f"sqlite:///{path}") as sync:
            assert sync.try_acquire("file") is None  # the same lock, seen from the sync API
        await lease.release()


@pytest.mark.parametrize("kind", ["plain", "async"])
async def test_a_lost_lease_sets_lost_and_runs_on_lost_on_the_loop(db: Db, kind: str) -> None:
    calls: list[tuple[AsyncLease, bool]] = []
    loop_thread = threading.get_ident()

    def plain(lease: AsyncLease) -> None:
        calls.append((lease, threading.get_ident() == loop_thread))

    async def coroutine(lease: AsyncLease) -> None:
        await asyncio.sleep(0)
        calls.append((lease, threading.get_ident() == loop_thread))

    async with alocker(db) as locker:
        lease = await locker.acquire("lost", ttl=0.3, renew=True, on_lost=plain if kind == "plain" else coroutine)
        (info,) = await locker.leases()
        assert await locker.force_release(info)
        await asyncio.wait_for(lease.lost.wait(), 5)
        for _ in range(100):
            if calls:
                break
            await asyncio.sleep(0.01)
        assert calls == [(lease, True)] and lease.remaining() == 0


# -- tasks, not threads -------------------------------------------------------------
async def test_waiting_never_blocks_the_event_loop(db: Db) -> None:
    async with alocker(db) as holder, alocker(db) as locker:
        lease = await holder.acquire("loop", ttl=30)
        waiters = [asyncio.create_task(locker.acquire("loop", timeout=1.5)) for _ in range(20)]
        ticks = 0
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            await asyncio.sleep(0.01)
            ticks += 1
        # Blocking calls would starve this loop (a sync acquire in async code: 1 tick a second).
        assert ticks > 20, f"the event loop ran {ticks} times in a second while 20 tasks waited"
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(r, LockNotAcquired) for r in results)
        await lease.release()


@pytest.mark.slow
async def test_1000_tasks_wait_on_one_name_in_order_on_bounded_connections(pg: Db) -> None:
    """1,000 tasks queue for one name in one process: each is granted in the order it joined,
    on at most max_connections statement connections plus one listener, with no thread per waiter."""
    n = 1000
    async with alocker(pg, max_connections=4) as locker:
        first = await locker.acquire("crowd", ttl=60)
        order: list[int] = []
        threads_before = threading.active_count()

        async def wait(i: int) -> None:
            async with locker.lock("crowd", ttl=60, timeout=300):
                order.append(i)

        tasks = []
        for i in range(n):  # each joins the line before the next starts: the order to keep
            tasks.append(asyncio.create_task(wait(i)))
            while (await locker.waiters()).get("crowd", 0) < i + 1:
                await asyncio.sleep(0.001)
        sessions = pg.query("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")[0][0]
        assert locker.open_connections() <= 4
        assert threading.active_count() <= threads_before + 2, "a thread per waiter?"
        await first.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 240)
        assert order == list(range(n))
        assert sessions < 50, f"{sessions} sessions for 1,000 waiting tasks"


# -- cancellation -------------------------------------------------------------------
async def test_a_cancelled_waiter_leaves_the_queue(db: Db) -> None:
    async with alocker(db) as holder, alocker(db) as locker:
        lease = await holder.acquire("cancel", ttl=30)
        waiter = asyncio.create_task(locker.acquire("cancel", timeout=30))
        await asyncio.sleep(0.3)
        assert queued(db) == (1 if db.backend == "postgresql" else 0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert queued(db) == 0
        await lease.release()
        assert held(db) == []  # not handed to the cancelled waiter


async def test_asyncio_timeout_around_acquire_leaves_nothing_behind(db: Db) -> None:
    async with alocker(db) as holder, alocker(db) as locker:
        lease = await holder.acquire("timeout", ttl=30)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(locker.acquire("timeout"), 0.3)
        assert queued(db) == 0
        await lease.release()
        assert held(db) == []


@pytest.mark.parametrize("options", [{}, {"notify": False}, {"fair": False}], ids=["fair", "fair-poll", "line"])
async def test_cancellation_racing_a_hand_off_never_leaks_the_lease(db: Db, options: dict) -> None:
    """A holder releases while its waiter is being cancelled, at many offsets: after the
    cancellation the lock is free (or held by nobody but a live lease), never left granted
    to the cancelled task until its TTL."""
    if db.backend == "sqlite" and options:
        pytest.skip("SQLite waits in the local line only: covered by the default case")
    async with alocker(db, poll_min=0.001, poll_max=0.01, **options) as holder, alocker(db, **options) as locker:

        async def check(i: int) -> None:
            assert held(db) == [], f"round {i}: the lease was left granted after the cancellation"
            assert queued(db) == 0

        await race_cancel_with_hand_off(holder, lambda: locker.acquire("race", ttl=30, timeout=10), 30, check)


# -- faults ---------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"fair": False}], ids=["fair", "line"])
async def test_a_silent_server_gets_a_bounded_answer(silent: SilentServer, options: dict) -> None:  # noqa: F811
    async with AsyncLocker(silent.url, op_timeout=1, **options) as locker:
        for call in (lambda: locker.try_acquire("x"), locker.leases, lambda: locker.acquire("x", timeout=0.5)):
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable) as info:
                await call()
            took = time.monotonic() - started
            # asyncio bounds a connect to its share of the time exactly (libpq: whole seconds, at least 2)
            assert took <= 1 + 1 + SLACK, f"a call took {took:.1f} s against a silent server"
            assert "secret" not in str(info.value)
            assert pickle.loads(pickle.dumps(info.value)).args == info.value.args


async def test_a_statement_that_gets_no_answer_is_cut_off_at_its_deadline(pg: Db) -> None:
    proxy = PgProxy(pg.url)
    try:
        async with AsyncLocker(proxy.url, table=pg.table, op_timeout=1) as locker:
            lease = await locker.acquire("cut", ttl=30)
            proxy.pause()  # the network drops everything from now on
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable, match="did not answer in time|cannot connect"):
                await lease.extend()
            assert time.monotonic() - started <= 1 + SLACK
            proxy.resume()
            assert await locker.try_acquire("cut") is None  # the lease still holds: the extend was merely cut off
            assert await lease.release() is True
    finally:
        proxy.close()
    assert held(pg) == []


async def test_an_immediate_restart_costs_one_retry_not_an_error(pg: Db, pg_server: Any) -> None:
    """An immediate (crash) restart of PostgreSQL under an AsyncLocker: its pooled connection
    died with the server, which libpq sees only when a statement is sent on it. The call
    throws that connection away and sends the statement again on a new one; the lease
    granted before the crash survived, and tokens never go back."""
    from pgserver._commands import pg_ctl

    async with alocker(pg) as locker:
        held = await locker.try_acquire("held", ttl=120)
        last = await locker.try_acquire("churn")
        assert held is not None and last is not None and await last.release()
        await asyncio.to_thread(
            pg_ctl, ["-m", "immediate", "-w", "restart"], pgdata=pg_server.pgdata, user=pg_server.system_user
        )
        after = await locker.try_acquire("churn")
        assert after is not None and after.token > last.token
        assert await locker.try_acquire("held") is None  # the committed grant survived
        assert await held.release() is True and await after.release() is True


async def test_a_lost_reply_leaves_no_lease_behind(pg: Db) -> None:
    """The acquire commits but its reply is lost and the retry's connection is refused:
    the call raises, and the lease it was granted is ended in the background."""
    proxy = PgProxy(pg.url)
    try:
        async with AsyncLocker(proxy.url, table=pg.table, op_timeout=1) as locker:
            await locker.leases()  # connected
            proxy.drop_next_reply()
            lease = await locker.try_acquire("doubt", ttl=30)  # retried once on a new connection (G6)
            assert lease is not None and held(pg) == [("doubt", lease.token)]
            await lease.release()
            assert proxy.dropped.is_set()
    finally:
        proxy.close()
    assert held(pg) == []


async def test_one_locker_belongs_to_one_event_loop(db: Db) -> None:
    locker = alocker(db)
    await locker.leases()

    def elsewhere() -> None:
        async def use() -> None:
            await locker.leases()

        with pytest.raises(RuntimeError, match="event loop"):
            asyncio.run(use())

    await asyncio.to_thread(elsewhere)
    await locker.aclose()


# -- the decorator --------------------------------------------------------------------
async def test_locked_runs_each_call_holding_its_own_name(db: Db) -> None:
    async with alocker(db) as locker:
        seen: list[tuple[str, int]] = []

        @locker.synchronized("report-{customer}", ttl=5, timeout=0)
        async def report(customer: str) -> str:
            lease = dblock.current_lease()
            assert isinstance(lease, AsyncLease)
            seen.append((lease.name, lease.token))
            assert (f"report-{customer}", lease.token) in held(db)
            await asyncio.sleep(0.2)
            return customer

        first = asyncio.create_task(report("acme"))
        await asyncio.sleep(0.05)
        with pytest.raises(LockNotAcquired):  # the same customer: held by the first call
            await report("acme")
        assert await report("globex") == "globex"
        assert await first == "acme"
        assert sorted(n for n, _ in seen) == ["report-acme", "report-globex"]
        assert held(db) == [] and dblock.current_lease() is None


async def test_locked_refuses_a_plain_function(db: Db) -> None:
    async with alocker(db) as locker:
        with pytest.raises(TypeError, match="coroutine"):
            locker.synchronized("x")(lambda: None)


async def test_locked_with_min_hold_runs_once_per_period(db: Db) -> None:
    async with alocker(db) as locker, alocker(db) as elsewhere:
        runs: list[str] = []

        def job(where: str, on: AsyncLocker) -> Any:
            @on.synchronized("nightly", ttl=5, timeout=0, min_hold=60)
            async def run() -> None:
                runs.append(where)

            return run

        await job("here", locker)()
        with pytest.raises(LockNotAcquired):  # the job finished, but its period has not
            await job("there", elsewhere)()
        assert runs == ["here"]
