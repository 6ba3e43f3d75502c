"""``@locker.synchronized(...)``: functions and coroutine functions that run holding a lease."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from dblock import LeaseLost, Locker, LockNotAcquired, current_lease

from .conftest import ALL_BACKENDS, Db, wait_for

BACKENDS = ALL_BACKENDS


def test_a_function_runs_holding_the_lock_and_releases_it(db: Db) -> None:
    locker, other = db.locker(), db.locker()
    seen = []

    @locker.synchronized("nightly", ttl=30)
    def job(x: int) -> int:
        """The job."""
        lease = current_lease()
        assert lease is not None
        seen.append((lease.name, lease.token, other.try_acquire("nightly")))
        return x * 2

    assert current_lease() is None
    assert job(21) == 42
    (name, token, rival), = seen
    assert (name, rival) == ("nightly", None) and token >= 1
    assert job.__name__ == "job" and job.__doc__ == "The job."  # functools.wraps
    assert current_lease() is None and locker.leases() == []


def test_an_error_in_the_function_releases_and_propagates(db: Db) -> None:
    locker = db.locker()

    @locker.synchronized("failing")
    def job() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        job()
    assert locker.leases() == [] and current_lease() is None


def test_the_name_is_formatted_from_the_bound_arguments_with_defaults(db: Db) -> None:
    locker = db.locker()
    names = []

    class Order:
        id = 7

    @locker.synchronized("report-{customer_id}-{kind}-{order.id}")
    def report(customer_id: int, order: Order, kind: str = "daily") -> None:
        names.append(current_lease().name)  # type: ignore[union-attr]

    report(3, Order())
    report(customer_id=4, order=Order(), kind="weekly")
    assert names == ["report-3-daily-7", "report-4-weekly-7"]


def test_a_busy_lock_raises_lock_not_acquired_and_the_function_does_not_run(db: Db) -> None:
    locker = db.locker()
    held = db.locker().try_acquire("busy", ttl=60)
    assert held is not None
    ran = []

    @locker.synchronized("busy", timeout=0)
    def job() -> None:
        ran.append(1)

    with pytest.raises(LockNotAcquired) as info:
        job()
    assert info.value.name == "busy" and ran == []
    waited = locker.synchronized("busy", timeout=0.2)(job)
    started = time.monotonic()
    with pytest.raises(LockNotAcquired):
        waited()
    assert 0.2 <= time.monotonic() - started < 5 and ran == []


@pytest.mark.parametrize(
    "template, message",
    [
        ("report-{customer}", "'customer', which job() has no parameter for; its parameters: customer_id, kind"),
        ("report-{}", "name the argument in each {} field"),
        ("report-{0}", "name the argument in each {} field"),
        ("report-{customer_id", "is not a valid format template"),
    ],
)
def test_a_bad_template_is_refused_when_decorating(db: Db, template: str, message: str) -> None:
    locker = db.locker()
    before = db.rows()

    def job(customer_id: int, kind: str = "daily") -> None:
        pass

    with pytest.raises(ValueError) as info:
        locker.synchronized(template)(job)
    assert message in str(info.value)
    assert db.rows() == before


def test_bad_calls_and_bad_formatted_names_run_no_sql(db: Db) -> None:
    locker = db.locker()
    locker.try_acquire("warm").release()  # type: ignore[union-attr]
    before = db.rows()

    @locker.synchronized("{key}")
    def job(key: str) -> None:
        raise AssertionError("must not run")

    with pytest.raises(ValueError, match="lock name must not be empty"):
        job("")
    with pytest.raises(ValueError, match="255"):
        job("x" * 256)
    with pytest.raises(TypeError, match="missing a required argument: 'key'"):
        job()  # type: ignore[call-arg]
    assert db.rows() == before


def test_a_template_may_name_keyword_arguments(db: Db) -> None:
    locker = db.locker()

    @locker.synchronized("task-{queue}")
    def job(**options: str) -> str:
        return current_lease().name  # type: ignore[union-attr]

    assert job(queue="mail") == "task-mail"
    before = db.rows()
    with pytest.raises(ValueError, match="needs the argument 'queue', which this call of job"):
        job(other="x")
    assert db.rows() == before


def test_bad_options_and_generators_are_refused(db: Db) -> None:
    locker = db.locker()
    with pytest.raises(ValueError, match="ttl"):
        locker.synchronized("x", ttl=0)
    with pytest.raises(ValueError, match="timeout"):
        locker.synchronized("x", timeout=-1)
    with pytest.raises(ValueError, match="renew=True"):
        locker.synchronized("x", on_lost=print)
    with pytest.raises(TypeError, match="str"):
        locker.synchronized(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NUL"):
        locker.synchronized("a\x00b")

    def gen() -> object:
        yield 1

    async def agen() -> object:
        yield 1

    for fn in (gen, agen):
        with pytest.raises(TypeError, match="generator function"):
            locker.synchronized("x")(fn)


def test_a_lost_lease_raises_lease_lost_after_the_function(db: Db) -> None:
    locker, other = db.locker(), db.locker()

    @locker.synchronized("short", ttl=0.2)
    def job() -> None:
        time.sleep(0.3)  # the lease ran out meanwhile, and someone else took it
        assert other.try_acquire("short", ttl=60) is not None

    with pytest.raises(LeaseLost):
        job()


# -- coroutine functions -----------------------------------------------------------
def test_a_coroutine_function_waits_without_blocking_the_loop(db: Db) -> None:
    locker = db.locker()
    holder = db.locker().try_acquire("async", ttl=60)
    assert holder is not None
    ticks: list[int] = []
    inside: list[int] = []

    @locker.synchronized("async", timeout=10)
    async def job(value: int) -> int:
        lease = current_lease()
        assert lease is not None and lease.name == "async"
        inside.append(len(ticks))
        await asyncio.sleep(0)
        return value + 1

    async def ticker(stop: asyncio.Event) -> None:
        while not stop.is_set():
            ticks.append(1)
            await asyncio.sleep(0.01)

    async def main() -> int:
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        threading.Timer(0.5, holder.release).start()  # the holder lets go while job waits
        try:
            return await job(1)
        finally:
            stop.set()
            await tick

    assert asyncio.run(main()) == 2
    # The loop ticked all the while job waited half a second for the lock.
    assert inside and inside[0] >= 20, inside
    assert current_lease() is None and locker.leases() == []


def test_a_coroutine_function_gets_a_name_from_its_arguments_and_reports_busy(db: Db) -> None:
    locker = db.locker()
    held = db.locker().try_acquire("user-2", ttl=60)
    assert held is not None

    @locker.synchronized("user-{user_id}", timeout=0)
    async def job(user_id: int) -> str:
        return current_lease().name  # type: ignore[union-attr]

    assert asyncio.run(job(1)) == "user-1"
    with pytest.raises(LockNotAcquired):
        asyncio.run(job(2))
    assert [i.name for i in locker.leases()] == ["user-2"]


def test_a_coroutine_functions_error_releases_and_propagates(db: Db) -> None:
    locker = db.locker()

    @locker.synchronized("async-error")
    async def job() -> None:
        await asyncio.sleep(0)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        asyncio.run(job())
    assert locker.leases() == []


def test_a_cancelled_waiter_releases_the_lease_it_gets_afterwards(db: Db) -> None:
    locker = db.locker()
    holder = db.locker().try_acquire("cancelled", ttl=60)
    assert holder is not None
    ran = []

    @locker.synchronized("cancelled", timeout=10, renew=True)
    async def job() -> None:
        ran.append(1)

    async def main() -> None:
        task = asyncio.create_task(job())
        await asyncio.sleep(0.3)  # waiting for the lock on its worker thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 5  # asyncio.run did not wait for the abandoned wait to time out
    holder.release()  # the abandoned wait gets the lease now (a newer token), and must let it go at once

    def granted_and_released() -> bool:
        ((token, owner),) = db.query(f"SELECT token, owner FROM {db.table} WHERE name = 'cancelled'")
        return token > holder.token and owner is None

    wait_for(granted_and_released, what="the abandoned wait's lease to be granted and released")
    assert db.locker().try_acquire("cancelled", ttl=60) is not None
    assert ran == []


def test_a_recursive_call_with_an_owner_key_re_enters_and_without_one_is_told_at_once(db: Db) -> None:
    locker, other = db.locker(), db.locker()
    tokens: list[int] = []

    @locker.synchronized("tree-{root}", ttl=30, timeout=5, owner="walker-{root}")
    def walk(root: str, depth: int) -> None:
        lease = current_lease()
        tokens.append(lease.token)
        assert other.try_acquire(f"tree-{root}") is None
        if depth:
            walk(root, depth - 1)

    walk("a", 3)
    assert len(tokens) == 4 and len(set(tokens)) == 1  # one lease, entered four times
    assert locker.leases() == []  # ended when the outermost call returned

    @locker.synchronized("plain", ttl=30, timeout=10)
    def again(depth: int) -> None:
        if depth:
            again(depth - 1)

    started = time.monotonic()
    with pytest.raises(LockNotAcquired, match="holds it already"):
        again(1)
    assert time.monotonic() - started < 5  # told at once, not after its 10 s timeout
    assert locker.leases() == []


def test_an_owner_key_template_is_checked_when_decorating(db: Db) -> None:
    locker = db.locker()
    with pytest.raises(ValueError, match="owner key 'w-{missing}' names 'missing'"):
        locker.synchronized("job", owner="w-{missing}")(lambda x: x)
    with pytest.raises(TypeError, match="owner key must be a str"):
        locker.synchronized("job", owner=7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="owner key must not be empty"):
        locker.synchronized("job", owner="")
