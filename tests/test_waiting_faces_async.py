"""Waiting, written once for both faces: this asyncio module is the source and
``tests/test_waiting_faces.py``, the same cases on the sync face, is generated from it
(``python tools/async_to_sync.py``).

The fair queue with NOTIFY hand-offs (PostgreSQL), the local line, timeouts and the
listener, as both faces promise them. Wake-ups are asserted by round trips and statement
counts and by who got which token, never by time: waiters that must not poll get a 60 s
backoff, so a poll would show in the count and a missed wake-up would hang the test
instead of passing it. What needs processes, forks or the statements' own races stays in
``test_waiting.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

from dblock import AsyncLease, AsyncLocker, LockNotAcquired, SchemaMissing, migrate
from dblock import _await
from dblock._acompat import Worker, ajoin, aspawn, asleep, running
from dblock.backends.postgresql import APPLICATION_NAME

from .conftest import ALL_BACKENDS, Db

BACKENDS = ALL_BACKENDS
from .pgproxy import PgProxy
from .test_faces_async import make, until

if True:  # ASYNC
    pytestmark = pytest.mark.asyncio

HERE = Path(__file__).resolve().parent
SLOW = {"poll_min": 60.0, "poll_max": 60.0}  # no poll or fallback wake-up within a test's life


def queue(db: Db, name: str) -> list[str]:
    """The owners of the name's waiters, in line."""
    return [o for (o,) in db.query(f"SELECT owner FROM {db.table}_waiters WHERE name = %s ORDER BY seq", (name,))]


def background(call: Callable[[], Awaitable[Any]], name: str = "waiter") -> tuple[Worker, dict[str, Any]]:
    """Run ``call()`` on a worker of its own (a task, or a thread on the sync face); its outcome in the dict."""
    out: dict[str, Any] = {}

    async def run() -> None:
        try:
            out["value"] = await call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    return aspawn(run, name), out


async def joined(worker: Worker, out: dict[str, Any]) -> Any:
    await ajoin(worker, 30)
    assert not running(worker), "the waiter never woke"
    if "error" in out:
        raise out["error"]
    return out["value"]


async def warm(db: Db, locker: AsyncLocker) -> None:
    """Open the pooled connection and, in fair mode, the listener, and prepare every
    statement a wait sends: one-time set-up that round trip counts leave out."""
    async with make(db) as other:
        await other.try_acquire("warm", ttl=0.05)
        await (await locker.acquire("warm", timeout=30)).release()  # the connection and the listener are open
        # Queued, then a look at the expiry: the enqueue with no place in line yet and with one
        # are two prepared statements (a NULL and an int differ in type).
        await other.try_acquire("warm", ttl=0.5)
        await (await locker.acquire("warm", timeout=30)).release()
        await other.try_acquire("warm", ttl=60)
        with pytest.raises(LockNotAcquired):
            await locker.acquire("warm", timeout=0.01)


def listener_pid(locker: AsyncLocker) -> int:
    """The backend pid of the locker's listener session (it must be up)."""
    assert locker._listener is not None and locker._listener.ident is not None
    return int(locker._listener.ident[0])


def session_gone(db: Db, pid: int) -> Callable[[], bool]:
    return lambda: not db.query("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,))


def count_statements(locker: AsyncLocker) -> list[str]:
    """Record every statement the Locker sends from now on (its own driver; nothing is faked)."""
    sent: list[str] = []
    execute = locker._driver._execute

    async def counted(conn: Any, sql: str, params: dict[str, Any]) -> Any:
        sent.append(sql)
        return await execute(conn, sql, params)

    locker._driver._execute = counted  # type: ignore[method-assign]
    return sent


# -- wake on release -----------------------------------------------------------------------
async def test_release_hands_the_lease_to_the_queued_waiter_and_wakes_it(pg: Db, proxy: PgProxy) -> None:
    async with make(pg) as holder, AsyncLocker(proxy.url, table=pg.table, **SLOW) as waiter:
        await warm(pg, waiter)
        held = await holder.try_acquire("n", ttl=60)
        assert held is not None
        proxy.reset()
        worker, out = background(lambda: waiter.acquire("n", timeout=120))
        await until(lambda: len(queue(pg, "n")) == 1, "the waiter to join the queue")
        assert await held.release() is True
        lease: AsyncLease = await joined(worker, out)
        # The release granted it (a fresh token, the waiter's owner id) and woke it:
        # the waiter sent its one enqueue and nothing after.
        assert proxy.round_trips == 1
        assert lease.token > held.token
        [(owner, token, expires_at)] = pg.query(f"SELECT owner, token, expires_at FROM {pg.table} WHERE name = 'n'")
        assert (owner, token) == (lease.owner, lease.token)
        # Its expiry, sent in the notification, reads as the row's (timezone-aware, to the microsecond).
        assert lease.expires_at.tzinfo is not None
        assert abs((lease.expires_at - expires_at).total_seconds()) <= 1e-6
        assert queue(pg, "n") == []
        assert 0 < lease.remaining() <= lease.ttl
        assert await lease.release() is True


# -- lost wake-ups -----------------------------------------------------------------------------
async def test_a_holder_that_never_releases_is_followed_at_its_expiry(pg: Db, proxy: PgProxy) -> None:
    """No release, so no notification: the waiter wakes at the expiry it learned, polls once, wins."""
    async with AsyncLocker(proxy.url, table=pg.table, **SLOW) as waiter:
        holder = subprocess.Popen(
            [sys.executable, str(HERE / "holder_worker.py"), pg.url, pg.table, "crash", "4"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        dead_token = int(holder.stdout.readline())  # type: ignore[union-attr]
        holder.kill()
        holder.wait()
        # Warmed after the holder started (a process start can outlast the listener's idle
        # second, and a new listener's set-up would count below), well within its 4 s ttl.
        await warm(pg, waiter)
        proxy.reset()
        lease = await waiter.acquire("crash", timeout=30)
        assert lease.token > dead_token
        assert proxy.round_trips == 2  # queue (learning the expiry), then the poll at the expiry
        await lease.release()


async def test_a_hand_off_whose_notification_is_lost_is_found_by_polling(pg: Db) -> None:
    """The listener's connection dies while the waiter is queued: it polls instead, and gets the lease."""
    async with make(pg) as holder, make(pg, poll_min=0.01, poll_max=0.05) as waiter:
        await warm(pg, waiter)
        held = await holder.try_acquire("lost", ttl=60)
        assert held is not None
        worker, out = background(lambda: waiter.acquire("lost", timeout=60))
        await until(lambda: len(queue(pg, "lost")) == 1, "the waiter to queue")
        pg.query("SELECT pg_terminate_backend(%s)", (listener_pid(waiter),))
        assert await held.release() is True
        lease = await joined(worker, out)
        assert lease.token > held.token
        await lease.release()


# -- timeouts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"notify": False}, {"fair": False}], ids=["fair", "fair-poll", "line"])
async def test_a_timeout_with_no_wake_up_leaves_nothing_behind(db: Db, options: dict[str, bool]) -> None:
    async with make(db) as holder, make(db, **options, **SLOW) as waiter:
        held = await holder.try_acquire("t", ttl=60)
        assert held is not None
        with pytest.raises(LockNotAcquired):
            await waiter.acquire("t", timeout=0.3)
        if db.backend == "postgresql":
            assert queue(db, "t") == []
        assert len(waiter._acquirer.hot) == 0
        assert waiter._listener is None or waiter._listener.waiting() == 0
        assert await held.release() is True
        assert await waiter.try_acquire("t") is not None  # nobody was handed it


async def test_a_hand_off_at_the_deadline_is_kept(pg: Db) -> None:
    """The release hands over just before the waiter gives up: leaving the queue finds the lease its own."""
    async with make(pg) as holder, make(pg, notify=False, **SLOW) as waiter:  # it sleeps to its deadline
        held = await holder.try_acquire("edge", ttl=60)
        assert held is not None
        worker, out = background(lambda: waiter.acquire("edge", timeout=1.0))
        await until(lambda: len(queue(pg, "edge")) == 1, "the waiter to queue")
        assert await held.release() is True
        lease = await joined(worker, out)
        assert lease.token > held.token
        assert await lease.release() is True


# -- the listener ---------------------------------------------------------------------------
async def test_one_listener_connection_however_many_waits(pg: Db) -> None:
    sessions: set[int] = set()
    async with make(pg) as holder, make(pg) as waiter:

        async def contend() -> None:
            for _ in range(10):
                lease = await waiter.acquire("many", timeout=30)
                sessions.add(listener_pid(waiter))
                await lease.release()

        held = await holder.try_acquire("many", ttl=60)
        assert held is not None
        workers = [background(contend, f"contender-{i}") for i in range(4)]
        await until(lambda: len(queue(pg, "many")) == 4, "all four to queue")
        await held.release()
        for worker, out in workers:
            await joined(worker, out)
        assert len(sessions) == 1, "more than one listener connection"
        (pid,) = sessions
        # Idle for IDLE_CLOSE (a second): the listener closes its connection by itself, so an idle
        # process is not signalled by every other process's hand-offs.
        assert _await.IDLE_CLOSE <= 1.0
        await until(session_gone(pg, pid), "the idle listener to close", timeout=_await.IDLE_CLOSE + 5)
        assert waiter._listener is not None and waiter._listener.waiting() == 0


async def test_waiters_on_names_of_their_own_are_each_woken_by_their_hand_off(pg: Db) -> None:
    """Four waiters of one Locker, each on a name of its own, share its listener. On the sync
    face one of them reads the listener's connection for all and hands the reading over as it
    leaves: each release wakes its waiter, in whatever order, and nobody polls."""
    names = [f"own{i}" for i in range(4)]
    async with make(pg) as holder, make(pg, **SLOW) as waiter:
        await warm(pg, waiter)
        held = [await holder.try_acquire(name, ttl=60) for name in names]
        sent = count_statements(waiter)
        workers = [background(lambda name=name: waiter.acquire(name, timeout=120), name) for name in names]
        await until(lambda: all(len(queue(pg, name)) == 1 for name in names), "every waiter to queue")
        # The last to queue first, then two at once: a hand-off may reach the reader for another.
        order = [3, 0, 1, 2]
        assert await held[3].release() is True
        lease = await joined(*workers[3])
        assert lease.token > held[3].token
        assert await held[0].release() is True and await held[1].release() is True
        for i in order[1:3]:
            got = await joined(*workers[i])
            assert got.token > held[i].token
            await got.release()
        assert await held[2].release() is True
        last = await joined(*workers[2])
        assert last.token > held[2].token
        await lease.release()
        await last.release()
        assert len(sent) == 2 * len(names), sent  # an enqueue and a release each: no polls
        assert waiter._listener is not None and waiter._listener.waiting() == 0


async def test_close_ends_the_listener(pg: Db) -> None:
    waiter = make(pg)
    await warm(pg, waiter)
    pid = listener_pid(waiter)
    assert pg.query("SELECT application_name FROM pg_stat_activity WHERE pid = %s", (pid,)) == [(APPLICATION_NAME,)]
    await waiter.aclose()
    await until(session_gone(pg, pid), "the listener to close")


@pytest.mark.parametrize("options", [{}, {"fair": False}], ids=["fair", "line"])
async def test_waiting_on_many_names_keeps_no_state(db: Db, options: dict[str, bool]) -> None:
    async with make(db) as holder, make(db, **options) as waiter:
        for i in range(200):
            name = f"k{i}"
            if i % 20 == 0:  # now and then a contended one that times out
                held = await holder.try_acquire(name, ttl=60)
                assert held is not None
                with pytest.raises(LockNotAcquired):
                    await waiter.acquire(name, timeout=0.01)
                await held.release()
            await (await waiter.acquire(name, timeout=5)).release()
        assert len(waiter._acquirer.hot) == 0
        assert waiter._listener is None or waiter._listener.waiting() == 0


# -- the local line ------------------------------------------------------------------------
async def test_waiters_of_one_process_take_turns_and_only_the_head_polls(db: Db) -> None:
    """fair=False (and every backend without a queue): four waiters (tasks, or threads) in the local
    line; a release in this process wakes the next at once, and a next head does not ask while the
    waiter before it still holds the lock."""
    async with make(db) as holder, make(db, fair=False, **SLOW) as local:
        await holder.try_acquire("line", ttl=0.3)
        sent = count_statements(local)
        tokens: list[int] = []

        async def take() -> None:
            lease = await local.acquire("line", timeout=30)
            tokens.append(lease.token)
            await asleep(0.005)
            await lease.release()

        workers = [background(take, f"taker-{i}") for i in range(4)]
        for worker, out in workers:  # a 60 s backoff: only the local wake-up gets them all through in time
            await joined(worker, out)
        assert len(tokens) == 4 and tokens == sorted(tokens)
        sql = local.backend.sql
        acquires = sent.count(sql.acquire)
        # The first head: a miss, and the grant at the holder's expiry (a second miss if it looked a
        # hair early); each next head only the grant after its predecessor's release, woken by it.
        assert 1 + 3 <= acquires <= 3 + 3, sent
        assert sent.count(sql.release) == 4, sent
        misses = acquires - 4
        # Where a miss is followed by a look at the holder (SQLite), one per miss; nothing else.
        assert len(sent) - acquires - 4 in ({0} if sql.holder is None else {misses}), sent


# -- options and an old table ----------------------------------------------------------------
async def test_waiting_options_are_checked(pg: Db) -> None:
    for bad in ({"fair": "yes"}, {"notify": 1}):
        with pytest.raises(TypeError):
            AsyncLocker(pg.url, table=pg.table, **bad)  # type: ignore[arg-type]


async def test_a_table_from_before_the_queue_asks_for_a_migration(pg: Db) -> None:
    async with make(pg) as locker:
        migrate.downgrade(locker.engine, pg.table, None, "dblock_0003")
        # Held, by a dblock of the table's time (this one's acquire needs 0012's function too).
        pg.query(f"INSERT INTO {pg.table} (name, owner, token, acquired_at, expires_at)"
                 " VALUES ('old', 'someone', 1, now(), now() + interval '1 hour')")
        with pytest.raises(SchemaMissing, match="older dblock.*dblock migrate"):
            await locker.acquire("old", timeout=1)
        await locker.create_schema()
        assert "waiting" in {c for (c,) in pg.query(
            "SELECT column_name FROM information_schema.columns WHERE table_name = %s", (pg.table,))}
