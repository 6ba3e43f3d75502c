"""What both faces promise, written once: this asyncio module is the source and
``tests/test_faces.py``, the same cases on the sync face, is generated from it
(``python tools/async_to_sync.py``), as the library's sync modules are.

Each case runs on PostgreSQL and SQLite (the ``db`` fixture). Face-only cases
(threads, forks, signals, cancellation) stay in the face's own files.
"""

from __future__ import annotations

import inspect
import logging
import pickle
import time
from datetime import datetime
from typing import Any, Callable

import pytest

from dblock import DBLockError, LeaseLost, LockNotAcquired
from dblock._acompat import ajoin, asleep, aspawn
from dblock import AsyncLease, AsyncLocker, AsyncShared
from dblock._core import when

from .conftest import ALL_BACKENDS, Db, trusted

BACKENDS = ALL_BACKENDS
from .test_guarantees import BAD_NAMES, BAD_TIMEOUTS, BAD_TTLS

if True:  # ASYNC
    pytestmark = pytest.mark.asyncio


async def until(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for something that must happen (the face's workers run meanwhile); fail if it does not."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asleep(0.01)


def make(db: Db, **options: Any) -> AsyncLocker:
    options.setdefault("table", db.table)
    return AsyncLocker(db.url, **options)


def queued(db: Db) -> int:
    """How many entries the fair queue holds (0 where there is none)."""
    if db.backend != "postgresql":
        return 0
    return int(db.query(f"SELECT count(*) FROM {db.table}_waiters")[0][0])


def held(db: Db) -> list[tuple[Any, ...]]:
    """(name, token) of each exclusive lease the table shows held, by the database."""
    return db.query(f"SELECT name, token FROM {db.table} WHERE owner IS NOT NULL ORDER BY name")


async def test_one_holder_and_tokens_grow_across_release(db: Db) -> None:
    async with make(db) as locker:
        first = await locker.try_acquire("job", ttl=30)
        assert first is not None
        assert await locker.try_acquire("job", ttl=30) is None  # held by another owner (G1)
        assert held(db) == [("job", first.token)]
        assert await first.release() is True
        assert await first.release() is False  # already released: nothing ended twice
        second = await locker.try_acquire("job", ttl=30)
        assert second is not None and second.token > first.token  # G2
        await second.release()
        assert held(db) == []


async def test_extend_never_shortens_and_a_takeover_is_told(db: Db) -> None:
    async with make(db) as locker:
        lease = await locker.try_acquire("ext", ttl=60)
        assert lease is not None
        before = lease.expires_at
        await lease.extend(1)  # a shorter ttl: the later expiry stays
        assert lease.expires_at >= before
        (info,) = await locker.leases()
        assert await locker.force_release(info) is True
        with pytest.raises(LeaseLost):
            await lease.extend(30)
        assert lease.lost.is_set() and lease.remaining() == 0.0
        assert await lease.release() is False  # someone else ended it (G3)


async def test_a_waiting_acquire_gets_an_expired_lease_with_a_larger_token(db: Db) -> None:
    async with make(db) as holder, make(db) as waiter:
        first = await holder.try_acquire("exp", ttl=0.3)  # never released: it runs out
        assert first is not None
        second = await waiter.acquire("exp", ttl=30, timeout=30)
        assert second.token > first.token
        assert await first.release() is False  # taken over after its expiry
        await second.release()


async def test_a_wait_that_runs_out_raises_and_leaves_nothing(db: Db) -> None:
    async with make(db) as holder, make(db) as waiter:
        lease = await holder.try_acquire("busy", ttl=60)
        assert lease is not None
        with pytest.raises(LockNotAcquired) as caught:
            await waiter.acquire("busy", timeout=0.2)
        assert caught.value.name == "busy" and caught.value.timeout == 0.2
        assert isinstance(caught.value, TimeoutError)  # as filelock's Timeout and asyncio's timeouts are
        assert pickle.loads(pickle.dumps(caught.value)).name == "busy"
        assert await waiter.waiters() == {}  # out of the fair queue too
        assert held(db) == [("busy", lease.token)]
        await lease.release()


async def test_blocking_false_tries_once_as_threadings_locks_do(db: Db) -> None:
    async with make(db) as holder, make(db, timeout=60) as other:
        lease = await holder.try_acquire("b", ttl=60)
        assert lease is not None
        with pytest.raises(LockNotAcquired) as caught:
            await other.acquire("b", blocking=False)  # at once, not after the Locker's 60 s
        assert caught.value.timeout == 0
        with pytest.raises(LockNotAcquired):
            async with other.lock("b", blocking=False):
                pass
        with pytest.raises(ValueError, match="blocking=False tries once"):
            await other.acquire("b", blocking=False, timeout=5)
        with pytest.raises(TypeError, match="blocking must be True or False"):
            await other.acquire("b", blocking="no")  # type: ignore[arg-type]
        assert held(db) == [("b", lease.token)] and queued(db) == 0
        await lease.release()
        got = await other.acquire("b", blocking=False)
        assert got.token > lease.token
        await got.release()


async def test_an_ended_lease_cannot_guard_a_block(db: Db) -> None:
    """Entering a released or lost lease raises before the block runs: it would run unprotected."""
    async with make(db) as locker:
        lease = await locker.try_acquire("ended", ttl=30)
        assert lease is not None
        await lease.release()
        ran = []
        with pytest.raises(LeaseLost, match="already been released"):
            async with lease:
                ran.append(True)
        lost = await locker.try_acquire("ended", ttl=30)
        assert lost is not None
        (info,) = await locker.leases()
        await locker.force_release(info)
        with pytest.raises(LeaseLost):
            await lost.extend()
        with pytest.raises(LeaseLost, match="already been lost"):
            async with lost:
                ran.append(True)
        assert ran == []


async def test_a_closed_locker_refuses_new_work_and_its_leases_still_release(db: Db) -> None:
    locker = make(db)
    lease = await locker.try_acquire("kept", ttl=30)
    assert lease is not None
    await locker.aclose()
    for call in (
        lambda: locker.try_acquire("other"),
        lambda: locker.acquire("other", timeout=1),
        locker.leases,
        lambda: locker.prune(60),
        lambda: locker.semaphore("other", 2).try_acquire(),
    ):
        with pytest.raises(RuntimeError, match="is closed"):
            await call()
    assert held(db) == [("kept", lease.token)]
    assert await lease.release() is True  # what it granted can still be ended
    assert held(db) == []
    assert locker._driver.open_connections() == 0  # the release's connection went with it, not to a closed pool


async def test_is_held_asks_the_database_about_one_name(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        assert await other.is_held("q") is False and await other.leases("q") == []
        lease = await locker.try_acquire("q", ttl=30)
        noise = await locker.try_acquire("q2", ttl=30)
        assert lease is not None and noise is not None
        assert await other.is_held("q") is True  # held by another Locker: the database says so
        assert [(i.name, i.token) for i in await other.leases("q")] == [("q", lease.token)]  # that name only
        await lease.release()
        assert await other.is_held("q") is False
        reader = await locker.readers("q").try_acquire(ttl=30)
        assert reader is not None and await other.is_held("q") is True  # shared leases count too
        assert [i.shared for i in await other.leases("q")] == [True]
        await reader.release()
        expiring = await locker.try_acquire("q", ttl=0.2)
        assert expiring is not None
        await asleep(0.4)
        assert await other.is_held("q") is False  # expired by the database clock, never released
        with pytest.raises(ValueError):
            await other.is_held("")
        await noise.release()


async def test_locked_is_the_old_name_of_synchronized_and_warns(db: Db) -> None:
    async with make(db) as locker:
        with pytest.warns(DeprecationWarning, match="renamed synchronized.*is_held"):
            decorate = locker.locked("old-{n}", timeout=0)

        async def job(n: int) -> int:
            return n * 2

        assert await decorate(job)(21) == 42


async def test_waiting_for_a_name_this_worker_holds_says_so_at_once(
    db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    """Without an owner key, a task (or thread) that waits for a name it holds through the same Locker,
    whose lease would outlast the wait (the default wait, for ever, included), is told so at once;
    one whose own lease ends within the wait is warned and takes it over then. Another task (or
    thread) waits as ever."""
    async with make(db) as locker:
        outer = await locker.acquire("self", ttl=30)
        for timeout in (10, None):  # None: the Locker's default, for ever
            started = time.monotonic()
            with pytest.raises(LockNotAcquired, match="holds it already, through this .*owner key") as caught:
                await locker.acquire("self", timeout=timeout)
            assert time.monotonic() - started < 5  # at once, not at the end of its wait nor of the lease
            assert caught.value.name == "self" and isinstance(caught.value, TimeoutError)
        assert await locker.try_acquire("self") is None  # one try: a miss, as for another owner
        out: list[BaseException] = []

        async def elsewhere() -> None:
            try:
                await locker.acquire("self", timeout=0.3)
            except LockNotAcquired as exc:
                out.append(exc)

        worker = aspawn(elsewhere, name="another")
        await ajoin(worker, 30)
        assert len(out) == 1 and "held by another owner" in str(out[0])
        assert await outer.release() is True
        short = await locker.acquire("self", ttl=0.3)
        with caplog.at_level(logging.WARNING, logger="dblock.locker"):
            again = await locker.acquire("self", timeout=30)  # its own lease ends within the wait
        assert again.token > short.token and await short.release() is False  # taken over at its end
        assert [r for r in caplog.records if "takes it over when that lease ends" in r.getMessage()]
        await again.release()


async def test_the_leases_kept_to_catch_a_wait_for_ones_own_stay_few(db: Db) -> None:
    """The Locker remembers each exclusive lease with the thread or task that took it (to catch
    a wait for its own lease), without a callback per lease: what it keeps stays within a
    small multiple of the leases still held, however many names come and go."""
    async with make(db) as locker:
        kept = await locker.acquire("kept", ttl=30)
        for i in range(300):  # many names, each released
            await (await locker.acquire(f"n{i}", ttl=30)).release()
        for _ in range(50):  # one name again and again
            await (await locker.acquire("again", ttl=30)).release()
        assert len(locker._held_here) <= 2 * 64  # swept whenever it doubles: 64 at least
        assert len(locker._held_here._by_name.get("again", [])) <= 9
        with pytest.raises(LockNotAcquired, match="holds it already"):  # still known after the sweeps
            await locker.acquire("kept", timeout=10)
        await kept.release()


async def test_the_lock_block_releases_on_exit_and_on_error(db: Db) -> None:
    async with make(db) as locker:
        async with locker.lock("blk", ttl=30) as lease:
            assert held(db) == [("blk", lease.token)]
        assert held(db) == []
        with pytest.raises(RuntimeError):
            async with locker.lock("blk", ttl=30):
                raise RuntimeError("the work failed")
        assert held(db) == []


async def test_a_lease_lost_inside_the_block_is_reported_at_its_end(db: Db) -> None:
    async with make(db) as locker:
        with pytest.raises(LeaseLost):
            async with locker.lock("lost", ttl=30):
                (info,) = await locker.leases()
                await locker.force_release(info)
        assert held(db) == []


async def test_leases_lists_what_is_held_with_its_label(db: Db) -> None:
    async with make(db, label="worker-7") as locker:
        lease = await locker.try_acquire("listed", ttl=30)
        assert lease is not None
        (info,) = await locker.leases()
        assert (info.name, info.owner, info.token, info.label) == ("listed", lease.owner, lease.token, "worker-7")
        assert 0 < info.remaining <= 30.01 and not info.shared
        await lease.release()
        assert await locker.leases() == []


async def test_prune_forgets_idle_names_and_tokens_still_grow(db: Db) -> None:
    async with make(db) as locker:
        first = await locker.try_acquire("old", ttl=30)
        assert first is not None
        await first.release()
        other = await locker.try_acquire("other", ttl=30)  # keeps the largest token's row
        assert other is not None
        await asleep(0.05)
        floor = locker.backend.caps.prune_floor
        if floor:  # a name granted within the floor is kept: age old's grant past it
            db.query(f"UPDATE {db.table} SET acquired_at = acquired_at - {db.seconds(floor + 1)} WHERE name = 'old'")
        assert await locker.prune(0.01) == 1
        again = await locker.try_acquire("old", ttl=30)
        assert again is not None and again.token > other.token > first.token
        await again.release()
        await other.release()


async def test_min_hold_keeps_the_lease_after_an_early_release(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        lease = await locker.try_acquire("daily", ttl=30, min_hold=60)
        assert lease is not None
        assert await lease.release() is True
        assert lease.held_until is not None
        assert await lease.release() is False  # kept for its hold: nothing left to end
        assert await other.try_acquire("daily", ttl=30) is None  # still held for its hold


async def test_a_semaphore_admits_its_limit(db: Db) -> None:
    async with make(db) as locker:
        sem = locker.semaphore("quota", 2)
        a = await sem.try_acquire(ttl=30)
        b = await sem.try_acquire(ttl=30)
        assert a is not None and b is not None and a.shared and b.shared
        assert b.token > a.token
        assert await sem.try_acquire(ttl=30) is None  # full
        assert await locker.try_acquire("quota", ttl=30) is None  # the writer is held off too
        await a.release()
        c = await sem.try_acquire(ttl=30)
        assert c is not None and c.token > b.token
        for lease in (b, c):
            await lease.release()


async def test_readers_share_and_hold_off_a_writer(db: Db) -> None:
    async with make(db) as locker:
        r1 = await locker.readers("doc").try_acquire(ttl=30)
        r2 = await locker.readers("doc").try_acquire(ttl=30)
        assert r1 is not None and r2 is not None
        assert await locker.try_acquire("doc", ttl=30) is None
        await r1.release()
        await r2.release()
        writer = await locker.try_acquire("doc", ttl=30)
        assert writer is not None and writer.token > r2.token  # a writer's token fences readers' writes
        assert await locker.readers("doc").try_acquire(ttl=30) is None
        await writer.release()


async def test_a_release_hands_the_lease_to_a_waiter_with_a_larger_token(db: Db) -> None:
    """A waiter (a task, or a thread on the sync face) gets the lease once its holder releases it,
    well before the holder's ttl: by the fair queue's hand-off where there is one, else by polling."""
    async with make(db) as holder, make(db) as waiter:
        lease = await holder.try_acquire("handed", ttl=60)
        assert lease is not None
        got: list[Any] = []

        async def wait() -> None:
            got.append(await waiter.acquire("handed", ttl=30, timeout=20))

        worker = aspawn(wait, name="waiter")
        await asleep(0.2)  # the waiter looks at least once while the lease is held
        assert got == []
        assert await lease.release() is True
        await ajoin(worker, 20)
        assert len(got) == 1 and got[0].token > lease.token
        assert held(db) == [("handed", got[0].token)]
        await got[0].release()


@pytest.mark.parametrize("clock", [{}, {"drift": 0.2, "drift_fixed": 0.5}, {"drift": 0, "drift_fixed": 0}], ids=repr)
async def test_a_lease_is_trusted_for_its_ttl_less_the_clock_allowance(db: Db, clock: dict[str, float]) -> None:
    """From the send of its grant, extend, hand-off or renewal, a lease is trusted for its ttl less
    the Locker's clock allowance (by default 1% of the ttl plus 2 ms), never longer."""
    drift, fixed = clock.get("drift", 0.01), clock.get("drift_fixed", 0.002)

    def span(ttl: float) -> float:
        return ttl - ttl * drift - fixed

    async with make(db, **clock) as locker, make(db, **clock) as other:
        assert (locker.drift, locker.drift_fixed) == (drift, fixed)
        before = time.monotonic()
        lease = await locker.try_acquire("trust", ttl=100)
        assert lease is not None
        left = lease.remaining()
        assert before + span(100) - time.monotonic() <= left <= span(100)
        before = time.monotonic()
        await lease.extend(50)
        left = lease.remaining()
        assert before + span(50) - time.monotonic() <= left <= span(50)
        # Handed over by the release (PostgreSQL's fair queue: trusted from the waiter's last look,
        # sent before the release), or granted to the waiter's look.
        got: list[Any] = []

        async def wait() -> None:
            got.append(await other.acquire("trust", ttl=100, timeout=20))

        before = time.monotonic()
        worker = aspawn(wait, name="waiter")
        if db.backend == "postgresql":
            await until(lambda: queued(db) == 1, "the waiter to queue")
        assert await lease.release() is True
        await ajoin(worker, 20)
        assert len(got) == 1 and got[0].token > lease.token
        assert before + span(100) - time.monotonic() <= got[0].remaining() <= span(100)
        # Renewal's extends: each is trusted as long, from its own send.
        renewed = await locker.try_acquire("renewed", ttl=3, renew=True)
        assert renewed is not None
        first = renewed.expires_at
        await until(lambda: renewed.expires_at > first, "renewal to extend the lease")
        assert 0 < renewed.remaining() <= span(3)
        await renewed.release()
        await got[0].release()


async def test_waiters_of_one_locker_are_served_one_at_a_time(db: Db) -> None:
    """Three waiters of one Locker: each gets the lease in turn, each with a larger token, never two at once."""
    async with make(db) as holder, make(db) as waiters:
        lease = await holder.try_acquire("turns", ttl=60)
        assert lease is not None
        tokens: list[int] = []
        alone: list[bool] = []

        async def wait() -> None:
            mine = await waiters.acquire("turns", ttl=30, timeout=30)
            tokens.append(mine.token)
            alone.append(held(db) == [("turns", mine.token)])  # checked here, asserted by the test
            await mine.release()

        workers = [aspawn(wait, name=f"waiter-{i}") for i in range(3)]
        await lease.release()
        for worker in workers:
            await ajoin(worker, 30)
        assert len(tokens) == 3 and sorted(tokens) == tokens and tokens[0] > lease.token
        assert alone == [True, True, True]


async def test_bad_input_is_refused_before_any_statement(db: Db) -> None:
    async with make(db) as locker:
        for call in (
            lambda: locker.try_acquire(""),
            lambda: locker.try_acquire("x", ttl=0),
            lambda: locker.acquire("x", timeout=-1),
            lambda: locker.try_acquire("x", min_hold=-1),
        ):
            with pytest.raises((ValueError, TypeError)):
                await call()
        with pytest.raises(ValueError):
            locker.semaphore("x", 0)
        # Each error names the parameter the caller gave.
        for call, word in (
            (lambda: locker.prune(older_than=-1), "older_than must be"),
            (lambda: locker.prune(older_than="1h"), "older_than must be a number"),
            (lambda: locker.try_acquire("x", ttl=-1), "ttl must be"),
            (lambda: locker.acquire("x", timeout=-1), "timeout must be"),
            (lambda: locker.try_acquire("x", min_hold=-1), "min_hold must be"),
        ):
            with pytest.raises((ValueError, TypeError), match=word):
                await call()
        assert held(db) == [] and locker.open_connections() == 0  # nothing was sent


async def test_connections_stay_within_the_budget(db: Db) -> None:
    async with make(db, max_connections=2) as locker:
        for _ in range(5):
            lease = await locker.try_acquire("budget", ttl=30)
            assert lease is not None
            await lease.release()
        assert 1 <= locker.open_connections() <= 2
    assert locker.open_connections() == 0  # closed


async def test_errors_share_one_base(db: Db) -> None:
    async with make(db) as locker:
        lease = await locker.try_acquire("base", ttl=30)
        assert lease is not None
        with pytest.raises(DBLockError):
            await locker.acquire("base", timeout=0)
        await lease.release()


async def test_acquire_extend_release_and_the_operator_calls(db: Db) -> None:
    async with make(db) as locker:
        lease = await locker.acquire("job", ttl=5)
        assert lease.token > 0 and trusted(5) - 1 < lease.remaining() <= trusted(5)
        assert await locker.try_acquire("job") is None
        await lease.extend(10)
        assert lease.ttl == 10 and trusted(10) - 1 < lease.remaining() <= trusted(10)
        (info,) = await locker.leases()
        assert (info.name, info.owner, info.token) == ("job", lease.owner, lease.token)
        assert await lease.release() is True
        assert await lease.release() is False
        assert lease.remaining() == 0 and held(db) == []
        again = await locker.try_acquire("job")
        assert again is not None and again.token > lease.token  # G2
        assert await locker.force_release((await locker.leases())[0]) is True
        with pytest.raises(LeaseLost):
            await again.extend()
        assert again.lost.is_set()
        assert await locker.prune(0.001) >= 0


async def test_a_wait_returns_no_earlier_than_its_timeout_and_leaves_the_queue(db: Db) -> None:
    async with make(db) as holder, make(db) as waiter:
        await holder.acquire("busy", ttl=30)
        started = time.monotonic()
        with pytest.raises(LockNotAcquired):
            await waiter.acquire("busy", timeout=0.3)
        assert time.monotonic() - started >= 0.3  # it waited, and did not give up early
        with pytest.raises(LockNotAcquired):
            await waiter.acquire("busy", timeout=0)
        assert queued(db) == 0  # the timed-out waiter left the queue


async def test_a_release_within_min_hold_keeps_the_lease_until_then(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        lease = await locker.acquire("period", ttl=30, min_hold=1.5, renew=True)
        assert lease.min_hold == 1.5
        assert await lease.release() is True and lease.held_until is not None
        assert (lease.held_until - lease.expires_at).total_seconds() < 0  # cut back from the 30 s ttl
        assert held(db) == [("period", lease.token)]  # kept: owner and token stay
        assert await lease.release() is False  # nothing left to end
        with pytest.raises(LeaseLost):
            await lease.extend()
        got: list[Any] = []

        async def wait() -> None:
            got.append(await other.acquire("period", timeout=10))

        worker = aspawn(wait, name="waiter")
        await asleep(0.5)
        assert got == []  # not handed over at the release: the hold runs on
        await ajoin(worker, 10)
        (after,) = got
        assert after.token > lease.token and time.time() >= lease.held_until.timestamp() - 0.05
        await after.release()


async def refused(db: Db, *calls: Any) -> None:
    """Each call raises TypeError/ValueError, before any statement: the table is exactly as before."""
    before = db.rows()
    for call in calls:
        with pytest.raises((TypeError, ValueError)):
            outcome = call()
            if True:  # ASYNC
                if inspect.isawaitable(outcome):
                    await outcome
    assert db.rows() == before


async def test_g3_a_stale_holder_changes_nothing(db: Db) -> None:
    async with make(db) as a_locker, make(db) as b_locker:
        stale = await a_locker.try_acquire("g3", ttl=0.05)
        assert stale is not None
        fresh = await b_locker.acquire("g3", timeout=30)  # after the expiry
        before = db.rows()
        assert await stale.release() is False
        with pytest.raises(LeaseLost):
            await stale.extend(ttl=60)
        assert db.rows() == before and held(db) == [("g3", fresh.token)]
        assert await fresh.release() is True


async def test_g5_trust_ends_no_later_than_the_database_expiry(db: Db) -> None:
    """Right after the client stops trusting the lease, the database may hand it on; never before."""
    async with make(db) as locker, make(db) as other:
        for _ in range(5):
            lease = await locker.try_acquire("g5", ttl=0.2)
            assert lease is not None
            assert time.time() + lease.remaining() <= lease.expires_at.timestamp() + 0.005
            taken = await other.acquire("g5", ttl=30, timeout=30)
            assert lease.remaining() == 0, "the database granted the lock while the old holder still trusted it"
            await taken.release()


async def test_g6_a_retried_attempt_returns_the_lease_it_granted(db: Db) -> None:
    async with make(db) as locker:
        owner = "ab" * 16
        first, _ = await locker._attempt("g6", owner, 30)
        again, _ = await locker._attempt("g6", owner, 30)  # the retry after a lost reply
        assert first is not None and again is not None and again.token == first.token
        assert await locker.try_acquire("g6") is None
        assert await again.release() is True
        assert await first.release() is False  # the same lease: it is gone now


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
async def test_g7_bad_names_are_refused_and_change_nothing(db: Db, name: Any) -> None:
    async with make(db) as locker:
        await locker.try_acquire("held", ttl=60)
        await refused(
            db,
            lambda: locker.try_acquire(name),
            lambda: locker.acquire(name, timeout=0),
            lambda: locker.lock(name),
        )


@pytest.mark.parametrize("ttl", BAD_TTLS, ids=repr)
async def test_g7_bad_ttls_are_refused_and_change_nothing(db: Db, ttl: Any) -> None:
    async with make(db) as locker:
        lease = await locker.try_acquire("held", ttl=60)
        assert lease is not None
        expires_at, trusted = lease.expires_at, lease.remaining()
        await refused(
            db,
            lambda: locker.try_acquire("x", ttl=ttl),
            lambda: locker.acquire("x", ttl=ttl, timeout=0),
            lambda: locker.lock("x", ttl=ttl),
            lambda: lease.extend(ttl=ttl),
            lambda: make(db, ttl=ttl),
        )
        # The lease as it was: neither extended nor ended (its trust only ran on; the checks above
        # may take seconds on a busy machine, so no bound on how long they took).
        assert lease.expires_at == expires_at and not lease.lost.is_set()
        assert 0 < lease.remaining() <= trusted


async def test_g7_a_ttl_the_clock_allowance_leaves_no_trust_in_is_refused(db: Db) -> None:
    """A ttl no longer than the clock allowance (by default 1% of it plus 2 ms) could never be
    relied on: every call refuses it before any statement, and says what would do."""
    async with make(db) as locker, make(db, drift=0.1, drift_fixed=1.0) as careful:
        lease = await locker.try_acquire("held", ttl=60)
        assert lease is not None
        await refused(
            db,
            lambda: locker.try_acquire("x", ttl=0.002),
            lambda: locker.acquire("x", ttl=0.002, timeout=0),
            lambda: locker.lock("x", ttl=0.002),
            lambda: locker.readers("x").try_acquire(ttl=0.002),
            lambda: locker.semaphore("x", 2).acquire(ttl=0.002, timeout=0),
            lambda: locker.try_acquire_all(["x", "y"], ttl=0.002),
            lambda: lease.extend(ttl=0.002),
            lambda: careful.try_acquire("x", ttl=1.1),
        )
        with pytest.raises(ValueError, match=r"ttl 1\.1 s leaves no time to trust .* more than 1\.11 s"):
            await careful.try_acquire("x", ttl=1.1)
        assert await careful.try_acquire("x", ttl=1.2) is not None  # 0.08 s of trust
        # Less than 0.1 ms of trust, but some: accepted, though a grant whose reply took longer
        # than that comes back with nothing to trust and is released unused (None).
        tiny = await locker.try_acquire("y", ttl=0.0021)
        assert tiny is None or tiny.remaining() >= 0


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
async def test_g7_bad_timeouts_are_refused_and_change_nothing(db: Db, timeout: Any) -> None:
    async with make(db) as locker:
        await locker.try_acquire("held", ttl=60)
        await refused(
            db,
            lambda: locker.acquire("x", timeout=timeout),
            lambda: locker.lock("x", timeout=timeout),
            lambda: make(db, timeout=timeout),
        )


@pytest.mark.parametrize(
    "options",
    [
        {"table": "bad-name"}, {"table": "1abc"}, {"table": "x" * 54}, {"table": ""}, {"table": 5},
        {"schema": "a b"}, {"poll_min": 0}, {"poll_min": 0.5, "poll_max": 0.1}, {"ttl": 0}, {"poll_min": -1},
        {"fair": "yes"}, {"max_connections": 0}, {"op_timeout": float("nan")},
        {"drift": -0.01}, {"drift": 0.6}, {"drift": float("nan")}, {"drift": "1%"}, {"drift": True},
        {"drift_fixed": -1}, {"drift_fixed": 61}, {"drift_fixed": "2ms"}, {"ttl": 0.002},
        {"ttl": 30, "drift": 0.5, "drift_fixed": 15},
    ],
    ids=repr,
)
async def test_g7_bad_options_are_refused_up_front(db: Db, options: dict[str, Any]) -> None:
    await refused(db, lambda: AsyncLocker(db.url, **options))


async def test_on_lost_without_renew_is_refused(db: Db) -> None:
    async with make(db) as locker:
        with pytest.raises(ValueError):
            await locker.acquire("x", on_lost=print)
        assert db.rows() == []


# -- the API, call by call ---------------------------------------------------------------
async def test_try_acquire_grants_then_refuses(db: Db) -> None:
    async with make(db) as locker:
        lease = await locker.try_acquire("report", ttl=30)
        assert isinstance(lease, AsyncLease)
        assert lease.name == "report" and isinstance(lease.token, int) and lease.token >= 1
        assert len(lease.owner) == 32
        assert isinstance(lease.expires_at, datetime) and lease.expires_at.tzinfo is not None
        assert trusted(30) - 1 < lease.remaining() <= trusted(30)
        assert await locker.try_acquire("report") is None
        assert await locker.try_acquire("other") is not None


async def test_tokens_grow_across_names_and_grants(db: Db) -> None:
    async with make(db) as locker:
        tokens = []
        for i in range(20):
            lease = await locker.try_acquire(f"n{i % 3}")
            assert lease is not None
            tokens.append((f"n{i % 3}", lease.token))
            await lease.release()
        for name in ("n0", "n1", "n2"):  # every backend: each name's tokens grow
            mine = [token for n, token in tokens if n == name]
            assert mine == sorted(mine) and len(set(mine)) == len(mine)
        if locker.backend.caps.global_tokens:  # one counter for the table: across names too
            every = [token for _, token in tokens]
            assert every == sorted(every) and len(set(every)) == len(every)


async def test_extend_moves_expiry_by_database_clock(db: Db) -> None:
    async with make(db) as locker:
        lease = await locker.try_acquire("x", ttl=5)
        assert lease is not None
        before = lease.expires_at
        await lease.extend(ttl=60)
        assert lease.expires_at > before
        assert trusted(60) - 1 < lease.remaining() <= trusted(60) and lease.ttl == 60
        await lease.extend()  # the lease's own ttl by default
        assert trusted(60) - 1 < lease.remaining() <= trusted(60)


async def test_extend_after_release_raises_lease_lost(db: Db) -> None:
    async with make(db) as locker:
        lease = await locker.try_acquire("x")
        assert lease is not None
        await lease.release()
        with pytest.raises(LeaseLost):
            await lease.extend()


async def test_a_lease_is_a_context_manager(db: Db) -> None:
    async with make(db) as locker:
        async with (await locker.try_acquire("direct")) as lease:
            assert lease.remaining() > 0
        assert await locker.try_acquire("direct") is not None


async def test_the_lock_block_raises_lease_lost_if_taken_over(db: Db) -> None:
    async with make(db) as a, make(db) as b:
        with pytest.raises(LeaseLost):
            async with a.lock("x", ttl=0.05):
                await b.acquire("x", timeout=10)  # waits for the expiry, then takes over


async def test_acquire_times_out_and_the_lockers_default_applies(db: Db) -> None:
    async with make(db) as locker, make(db, timeout=0.05) as short:
        await locker.try_acquire("busy", ttl=30)
        with pytest.raises(LockNotAcquired) as info:
            await locker.acquire("busy", timeout=0.05)
        assert "busy" in str(info.value)
        with pytest.raises(LockNotAcquired):
            await locker.acquire("busy", timeout=0)  # one attempt
        with pytest.raises(LockNotAcquired):
            async with locker.lock("busy", timeout=0):
                pass
        with pytest.raises(LockNotAcquired):
            await short.acquire("busy")  # the Locker's default timeout


async def test_leases_lists_unexpired_with_database_remaining(db: Db) -> None:
    async with make(db) as locker:
        a = await locker.try_acquire("a", ttl=30)
        assert a is not None
        await locker.try_acquire("b", ttl=60)
        gone = await locker.try_acquire("gone")
        assert gone is not None
        await gone.release()
        infos = await locker.leases()
        assert [i.name for i in infos] == ["a", "b"]
        assert infos[0].owner == a.owner and infos[0].token == a.token
        assert 29 < infos[0].remaining <= 30.01 and 59 < infos[1].remaining <= 60.01
        assert infos[0].expires_at.tzinfo is not None


async def test_prune_drops_idle_rows_and_tokens_keep_growing(db: Db) -> None:
    async with make(db) as locker:
        kept = await locker.try_acquire("held", ttl=60)
        assert kept is not None
        last = None
        for name in ("a", "b", "c"):
            last = await locker.try_acquire(name)
            assert last is not None
            await last.release()
        db.query(f"UPDATE {db.table} SET acquired_at = acquired_at - {db.seconds(3600)} WHERE name <> 'held'")
        removed = await locker.prune(older_than=60)
        names = {r[0] for r in db.rows()}
        # Without a token sequence, "c" holds the largest token and is kept, so max(token) never falls.
        assert "held" in names and "a" not in names and "b" not in names
        assert removed == (3 if locker.backend.caps.token_sequence else 2)
        again = await locker.try_acquire("a")
        assert again is not None and last is not None and again.token > last.token and again.token > kept.token


# -- min_hold, read by the database's clock ------------------------------------------------
def row(db: Db, name: str) -> tuple[Any, int, datetime, datetime | None]:
    """The lock's row: owner, token, acquired_at and expires_at (database times)."""
    ((owner, token, acquired, expires),) = db.query(
        f"SELECT owner, token, acquired_at, expires_at FROM {db.table} WHERE name = %s", (name,)
    )
    return owner, token, when(acquired), None if expires is None else when(expires)


def span(start: datetime, end: datetime | None) -> float:
    assert end is not None
    return (end - start).total_seconds()


async def test_a_release_within_the_hold_keeps_the_lease_until_its_grant_plus_the_hold(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        lease = await locker.try_acquire("nightly", ttl=60, min_hold=30)
        assert lease is not None and lease.min_hold == 30 and lease.held_until is None
        assert await lease.release() is True
        owner, token, acquired, expires = row(db, "nightly")
        assert (owner, token) == (lease.owner, lease.token)  # kept: the same owner and token
        # It ends 30 s after its grant, not at its ttl's 60: the work is done.
        assert span(acquired, expires) == pytest.approx(30, abs=1e-3)
        assert lease.held_until == expires and lease.remaining() == 0
        assert await other.try_acquire("nightly") is None
        assert [(i.name, i.token) for i in await other.leases()] == [("nightly", lease.token)]
        assert await lease.release() is False  # once
        with pytest.raises(LeaseLost):
            await lease.extend()  # a kept lease must end on time
        assert row(db, "nightly") == (owner, token, acquired, expires)
        assert "held until" in repr(lease)
        (info,) = await other.leases()  # an operator can end it early, as any lease
        assert await other.force_release(info) is True
        assert await other.try_acquire("nightly") is not None


async def test_a_hold_longer_than_the_ttl_outlives_it_even_once_the_lease_ran_out(db: Db) -> None:
    """The hold may exceed the ttl (a short ttl renewed, a long period). A lease that ran out
    while nobody took it is still this holder's, so its release holds it too."""
    async with make(db) as locker, make(db) as other:
        lease = await locker.try_acquire("weekly", ttl=0.2, min_hold=60)
        assert lease is not None
        await asleep(0.3)
        assert await lease.release() is True
        _, _, acquired, expires = row(db, "weekly")
        assert span(acquired, expires) == pytest.approx(60, abs=1e-3)
        assert await other.try_acquire("weekly") is None


async def test_once_the_hold_has_passed_a_release_ends_the_lease_at_once(db: Db) -> None:
    """Extended past its hold and released after it: it ends now, not at its later expiry."""
    async with make(db) as locker, make(db) as other:
        # ttl 5: the grant must outlast the step to the extend on a busy machine; the extend to 60
        # is the later expiry the release must not wait for.
        lease = await locker.try_acquire("done", ttl=5, min_hold=0.3)
        assert lease is not None
        await lease.extend(ttl=60)
        await asleep(0.4)
        assert await lease.release() is True and lease.held_until is None
        assert row(db, "done")[0] is None
        taken = await other.try_acquire("done")
        assert taken is not None and taken.token > lease.token


# -- shared leases: read locks and semaphores ---------------------------------------------
def holding(db: Db, name: str) -> int:
    """Live shared leases of ``name``, by the database's clock."""
    return int(db.query(f"SELECT count(*) FROM {db.table}_holders WHERE name = %s AND expires_at > {db.now}", (name,))[0][0])


def writer_of(db: Db, name: str) -> list[tuple[Any, ...]]:
    """The exclusive (write) lease of ``name``, if one is held: [(owner, token)]."""
    return db.query(
        f"SELECT owner, token FROM {db.table} WHERE name = %s AND owner IS NOT NULL AND owner <> '*shared'", (name,)
    )


def everything(db: Db) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    return db.rows(), db.query(f"SELECT name, owner, token FROM {db.table}_holders ORDER BY owner")


async def test_readers_share_and_exclude_a_writer(db: Db) -> None:
    async with make(db) as locker:
        r1 = await locker.readers("doc").try_acquire(ttl=30)
        r2 = await locker.readers("doc").try_acquire(ttl=30)
        assert isinstance(r1, AsyncLease) and isinstance(r2, AsyncLease) and r1.shared and r2.shared
        assert r2.token > r1.token and holding(db, "doc") == 2
        assert await locker.try_acquire("doc", ttl=30) is None  # the write lock is the exclusive lock
        with pytest.raises(LockNotAcquired):
            async with locker.write_lock("doc", ttl=30, timeout=0):
                pass
        assert await r1.release() is True
        assert await locker.try_acquire("doc", ttl=30) is None  # one reader left
        assert await r2.release() is True and holding(db, "doc") == 0
        w = await locker.try_acquire("doc", ttl=30)
        assert w is not None and not w.shared and w.token > r2.token
        assert await locker.readers("doc").try_acquire(ttl=30) is None
        assert await locker.semaphore("doc", 5).try_acquire(ttl=30) is None
        await w.release()


async def test_read_lock_and_write_lock_contexts(db: Db) -> None:
    async with make(db) as locker:
        async with locker.read_lock("ctx", ttl=30) as r:
            assert r.shared and holding(db, "ctx") == 1
            async with locker.read_lock("ctx", ttl=30, timeout=5) as r2:
                assert r2.shared and holding(db, "ctx") == 2
        assert holding(db, "ctx") == 0
        with pytest.raises(RuntimeError):
            async with locker.semaphore("ctx", 1).lock(ttl=30):
                raise RuntimeError("boom")
        assert holding(db, "ctx") == 0  # released on error too
        async with locker.write_lock("ctx", ttl=30) as w:
            assert not w.shared and writer_of(db, "ctx") == [(w.owner, w.token)]
        assert writer_of(db, "ctx") == []
        assert repr(locker.semaphore("ctx", 3)) == "<AsyncShared 'ctx' semaphore limit=3>"
        assert isinstance(locker.readers("ctx"), AsyncShared)


async def test_a_semaphore_grants_at_most_its_limit(db: Db) -> None:
    async with make(db) as locker:
        sem = locker.semaphore("sem", 3)
        leases = [await sem.try_acquire(ttl=30) for _ in range(3)]
        assert all(lease is not None and lease.shared for lease in leases)
        assert await sem.try_acquire(ttl=30) is None
        with pytest.raises(LockNotAcquired):
            await sem.acquire(ttl=30, timeout=0)
        assert holding(db, "sem") == 3
        assert leases[0] is not None and await leases[0].release()
        again = await sem.try_acquire(ttl=30)
        assert again is not None and again.token > max(lease.token for lease in leases if lease)


async def test_disagreeing_limits_hold_to_the_smallest_live_one(db: Db) -> None:
    async with make(db) as locker:
        small = await locker.semaphore("mix", 2).try_acquire(ttl=30)
        assert small is not None
        big = locker.semaphore("mix", 5)
        assert await big.try_acquire(ttl=30) is not None  # 1 < 2 and 1 < 5
        assert await big.try_acquire(ttl=30) is None  # 2 live: the limit-2 holder would see 3
        assert await locker.readers("mix").try_acquire(ttl=30) is None  # a reader too respects the live limit
        with pytest.raises(LockNotAcquired):
            await big.acquire(ttl=30, timeout=0.2)  # waiting does not get round it either
        assert await small.release()
        assert await big.try_acquire(ttl=30) is not None  # the limit-2 holder left: 5 binds now
        assert await locker.semaphore("mix", 2).try_acquire(ttl=30) is None  # 2 live, its own limit is 2
        assert await locker.semaphore("mix", 3).try_acquire(ttl=30) is not None


async def test_renewal_keeps_a_shared_lease_alive_past_its_ttl(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        # 1.5 s: renewed every 0.5 s, it survives a 1 s stall of renewal on a busy machine (a 0.3 s
        # ttl did not there: a 0.2 s stall lost it).
        lease = await locker.semaphore("ren", 1).try_acquire(ttl=1.5, renew=True)
        assert lease is not None and lease.shared
        granted_expiry = lease.expires_at.timestamp()
        # Extended once its first ttl had passed: held past the ttl it was granted.
        await until(lambda: lease.expires_at.timestamp() > granted_expiry + 1.5, "renewal past its ttl")
        assert not lease.lost.is_set() and lease.remaining() > 0
        assert holding(db, "ren") == 1  # its row, by the database's clock
        assert await other.semaphore("ren", 1).try_acquire(ttl=30) is None
        assert await lease.release() is True
        assert holding(db, "ren") == 0


async def test_extend_and_a_stale_holder(db: Db) -> None:
    """G3 for an async shared lease: extend works while it holds; once it ran out and the next
    grant forgot it, its extend raises LeaseLost and its release changes nothing."""
    async with make(db) as locker:
        sem = locker.semaphore("st", 1)
        lease = await sem.acquire(ttl=5, timeout=5)
        await lease.extend(10)
        assert lease.ttl == 10 and trusted(10) - 1 < lease.remaining() <= trusted(10)
        await lease.release()
        stale = await sem.try_acquire(ttl=0.05)
        assert stale is not None
        await asleep(0.1)
        fresh = await sem.try_acquire(ttl=30)
        assert fresh is not None and fresh.token > stale.token
        before = db.query(f"SELECT name, owner, token, expires_at FROM {db.table}_holders ORDER BY owner")
        with pytest.raises(LeaseLost):
            await stale.extend(30)
        assert stale.lost.is_set()
        assert await stale.release() is False
        assert db.query(f"SELECT name, owner, token, expires_at FROM {db.table}_holders ORDER BY owner") == before
        (info,) = [i for i in await locker.leases() if i.name == "st"]
        assert info.shared and info.limit == 1 and await locker.force_release(info) is True
        assert holding(db, "st") == 0


@pytest.mark.parametrize("limit", [0, -1, 1.5, "2", True, None, 2**31])
async def test_g7_bad_limits_are_refused_and_change_nothing(db: Db, limit: object) -> None:
    async with make(db) as locker:
        before = everything(db)
        with pytest.raises((TypeError, ValueError)):
            locker.semaphore("x", limit)  # type: ignore[arg-type]
        assert everything(db) == before


@pytest.mark.parametrize(
    "bad", [{"ttl": 0}, {"ttl": -1}, {"ttl": "1"}, {"ttl": float("nan")}, {"timeout": -1}, {"timeout": "1"}], ids=repr
)
async def test_g7_bad_ttls_and_timeouts_are_refused_and_change_nothing(db: Db, bad: dict) -> None:
    async with make(db) as locker:
        before = everything(db)
        for side in (locker.semaphore("x", 2), locker.readers("x")):
            with pytest.raises((TypeError, ValueError)):
                await side.acquire(**bad)
            with pytest.raises((TypeError, ValueError)):
                side.lock(**bad)
            if "timeout" not in bad:
                with pytest.raises((TypeError, ValueError)):
                    await side.try_acquire(**bad)
        with pytest.raises((TypeError, ValueError)):
            locker.read_lock("x", **bad)
        with pytest.raises(ValueError):
            await locker.readers("x").acquire(on_lost=print)  # on_lost without renew
        assert everything(db) == before


@pytest.mark.parametrize("name", ["", "x" * 256, "a\x00b", 5], ids=repr)
async def test_g7_bad_names_are_refused_by_shared_locks_and_change_nothing(db: Db, name: object) -> None:
    async with make(db) as locker:
        before = everything(db)
        for side in (locker.readers, lambda n: locker.semaphore(n, 2), locker.read_lock, locker.write_lock):
            with pytest.raises((TypeError, ValueError)):
                side(name)  # type: ignore[operator]
        assert everything(db) == before
