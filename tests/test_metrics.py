"""dblock.metrics: what each instrument records, through OpenTelemetry's real SDK, on real databases.

Each test enables metrics with a MeterProvider of its own whose
InMemoryMetricReader collects what was recorded; ``disable()`` follows, so
no test leaves them on for the next.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Iterator

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, insert, update

import dblock
from dblock import FencedOut, LeaseLost, LockNotAcquired, SchemaMissing, fence, fenced_update, metrics
from dblock.pytest_plugin import expire_now

from .conftest import Db, wait_for

WAIT = "dblock.lock.wait.duration"
HOLD = "dblock.lock.hold.duration"
GRANTS = "dblock.lock.grants"
TIMEOUTS = "dblock.lock.timeouts"
LOSSES = "dblock.lock.losses"
REFUSALS = "dblock.fence.refusals"


class Metrics:
    """What the SDK collected: per instrument, its data points."""

    def __init__(self, reader: InMemoryMetricReader) -> None:
        self.reader = reader

    def collect(self) -> dict[str, Any]:
        data = self.reader.get_metrics_data()
        found: dict[str, Any] = {}
        for resource in [] if data is None else data.resource_metrics:
            for scope in resource.scope_metrics:
                assert scope.scope.name == "dblock" and scope.scope.version == dblock.__version__
                for metric in scope.metrics:
                    found[metric.name] = metric
        return found

    def points(self, name: str) -> list[tuple[dict[str, Any], Any]]:
        metric = self.collect().get(name)
        return [] if metric is None else [(dict(p.attributes), p) for p in metric.data.data_points]

    def count(self, name: str, *, outcome: str | None = None, system: str | None = None, lock: str | None = None) -> int:
        """Counters: the sum; histograms: how many measurements. Of the points with these attributes."""
        wanted = {"dblock.lock.outcome": outcome, "db.system.name": system, "dblock.lock.name": lock}
        total = 0
        for attributes, point in self.points(name):
            if all(attributes.get(key) == value for key, value in wanted.items() if value is not None):
                total += point.count if hasattr(point, "count") else point.value
        return total

    def seconds(self, name: str, outcome: str) -> tuple[float, float]:
        """A histogram's (min, max) over its measurements with this outcome."""
        (point,) = [p for a, p in self.points(name) if a["dblock.lock.outcome"] == outcome]
        return point.min, point.max

    def attribute_sets(self) -> list[dict[str, Any]]:
        return [attributes for name in self.collect() for attributes, _ in self.points(name)]


@pytest.fixture
def recorded() -> Iterator[Metrics]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.enable(provider)
    try:
        yield Metrics(reader)
    finally:
        metrics.disable()
        provider.shutdown()


def test_a_grant_is_counted_and_its_wait_and_hold_timed(db: Db, recorded: Metrics) -> None:
    locker = db.locker()
    lease = locker.acquire("job", ttl=30, timeout=5)
    assert recorded.count(GRANTS, system=db.backend) == 1
    assert recorded.count(WAIT, outcome="acquired") == 1
    assert recorded.count(HOLD) == 0  # still held
    time.sleep(0.2)
    assert lease.release() is True
    assert recorded.count(HOLD, outcome="released", system=db.backend) == 1
    low, high = recorded.seconds(HOLD, "released")
    assert 0.2 <= low <= high < 5
    assert lease.release() is False  # a second release ends nothing: not timed again
    assert recorded.count(HOLD) == 1 and recorded.count(LOSSES) == 0
    found = recorded.collect()
    assert found[WAIT].unit == found[HOLD].unit == "s"
    assert (found[GRANTS].unit, found[GRANTS].data.is_monotonic) == ("{grant}", True)


def test_a_locked_call_is_timed(db: Db, recorded: Metrics) -> None:
    locker = db.locker()

    @locker.synchronized("job-{n}", ttl=30, timeout=1)
    def work(n: int) -> bool:
        return dblock.current_lease() is not None

    assert work(1)
    assert recorded.count(GRANTS) == 1 and recorded.count(WAIT, outcome="acquired") == 1
    assert recorded.count(HOLD, outcome="released") == 1


def test_the_wait_runs_from_the_call_to_the_grant(db: Db, recorded: Metrics) -> None:
    holder = db.locker().try_acquire("job", ttl=30)
    assert holder is not None
    waiter = db.locker()  # made before the clock starts: the timer and the wait start together
    started = time.monotonic()
    timer = threading.Timer(0.5, holder.release)
    timer.start()
    lease = waiter.acquire("job", ttl=30, timeout=10)
    waited = time.monotonic() - started
    timer.join()
    assert recorded.count(GRANTS) == 2 and recorded.count(WAIT, outcome="acquired") == 2
    low, high = recorded.seconds(WAIT, "acquired")
    # The holder's try_acquire was quick; the waiter waited out the hold (less the instant between the
    # timer's start and the acquire's own first reading of the clock, which a busy machine may stretch).
    assert low < 0.1 and 0.45 <= high <= waited
    lease.release()


def test_a_timeout_is_counted_and_a_busy_try_is_not(db: Db, recorded: Metrics) -> None:
    db.locker().try_acquire("job", ttl=30)
    waiter = db.locker()
    assert waiter.try_acquire("job") is None
    assert recorded.count(WAIT, outcome="busy") == 1
    assert recorded.count(TIMEOUTS) == 0
    with pytest.raises(LockNotAcquired):
        waiter.acquire("job", timeout=0.3)
    with pytest.raises(LockNotAcquired):
        with waiter.lock("job", timeout=0):
            pass
    assert recorded.count(TIMEOUTS, system=db.backend) == 2
    assert recorded.count(WAIT, outcome="timeout") == 2
    low, high = recorded.seconds(WAIT, "timeout")
    assert low < 0.3 <= high < 5
    assert recorded.count(GRANTS) == 1  # the holder's only


def test_an_error_is_timed_with_its_type(pg: Db, recorded: Metrics) -> None:
    locker = pg.locker(table="t_never_created")
    with pytest.raises(SchemaMissing):
        locker.try_acquire("job")
    (attributes,) = [a for a, _ in recorded.points(WAIT)]
    assert attributes == {
        "db.system.name": "postgresql",
        "dblock.lock.outcome": "error",
        "error.type": "dblock.errors.SchemaMissing",
    }
    assert recorded.count(GRANTS) == recorded.count(TIMEOUTS) == 0


def test_a_lease_lost_to_a_takeover_under_renewal_is_counted_once(db: Db, recorded: Metrics) -> None:
    lease = db.locker().try_acquire("job", ttl=0.5, renew=True)
    assert lease is not None
    operator = db.locker()
    (info,) = operator.leases()
    assert operator.force_release(info) is True
    taker = operator.try_acquire("job", ttl=30)
    assert taker is not None
    assert lease.lost.wait(10), "renewal did not notice the takeover"
    wait_for(lambda: recorded.count(LOSSES) == 1, what="the loss to be counted")
    assert recorded.count(HOLD, outcome="lost", system=db.backend) == 1
    with pytest.raises(LeaseLost):
        lease.extend()
    assert lease.release() is False
    assert recorded.count(LOSSES) == 1 and recorded.count(HOLD) == 1  # once, whoever finds out next


def test_a_lease_that_expired_and_was_taken_over_is_lost_at_extend(db: Db, recorded: Metrics) -> None:
    lease = db.locker().try_acquire("job", ttl=30)
    assert lease is not None
    expire_now(lease)
    assert db.locker().try_acquire("job", ttl=30) is not None
    assert recorded.count(LOSSES) == 0  # nobody told the holder yet
    with pytest.raises(LeaseLost):
        lease.extend()
    assert recorded.count(LOSSES) == 1 and recorded.count(HOLD, outcome="lost") == 1


def test_a_with_block_whose_lease_was_taken_over_counts_a_loss(db: Db, recorded: Metrics) -> None:
    with pytest.raises(LeaseLost):
        with db.locker().lock("job", ttl=30) as lease:
            expire_now(lease)
            assert db.locker().try_acquire("job", ttl=30) is not None
    assert recorded.count(LOSSES) == 1
    assert recorded.count(HOLD, outcome="lost") == 1 and recorded.count(HOLD) == 1


def test_a_fenced_out_write_is_counted(db: Db, recorded: Metrics) -> None:
    locker = db.locker()
    old = locker.try_acquire("job", ttl=30)
    assert old is not None
    expire_now(old)
    new = locker.try_acquire("job", ttl=30)
    assert new is not None
    accounts = Table(
        f"{db.table}_accounts", MetaData(),
        Column("id", Integer, primary_key=True), Column("fence_token", BigInteger, nullable=False),
    )
    accounts.create(locker.engine)
    try:
        with locker.engine.begin() as conn:
            conn.execute(insert(accounts).values(id=1, fence_token=0))
            fence(conn, new)
            fenced_update(conn, update(accounts).where(accounts.c.id == 1), new)
        assert recorded.count(REFUSALS) == 0
        with locker.engine.begin() as conn, pytest.raises(FencedOut):
            fence(conn, old)
        with locker.engine.begin() as conn, pytest.raises(FencedOut):
            fenced_update(conn, update(accounts).where(accounts.c.id == 1), old.token)  # a bare token
        assert recorded.count(REFUSALS) == 2
        assert [a for a, _ in recorded.points(REFUSALS)] == [{}]  # no lock names unless asked
    finally:
        accounts.drop(locker.engine)


def test_lock_names_only_when_asked(db: Db, recorded: Metrics) -> None:
    locker = db.locker()
    locker.try_acquire("report-1", ttl=30).release()  # type: ignore[union-attr]
    sets = recorded.attribute_sets()
    assert len(sets) >= 3 and not any("dblock.lock.name" in a for a in sets)

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.enable(provider, lock_names=True)  # again: replaces the settings
    try:
        named = Metrics(reader)
        lease = locker.try_acquire("report-2", ttl=30)
        assert lease is not None
        assert locker.try_acquire("report-2") is None
        expire_now(lease)
        taker = db.locker().try_acquire("report-2", ttl=30)
        assert taker is not None
        assert lease.release() is False
        with locker.engine.begin() as conn:
            fence(conn, taker)
        with locker.engine.begin() as conn, pytest.raises(FencedOut):
            fence(conn, lease)
        with locker.engine.begin() as conn, pytest.raises(FencedOut):
            fence(conn, lease.token, "report-2", table=locker.table)  # a bare token has no lock name
        for name in (WAIT, HOLD, GRANTS, LOSSES):
            assert {a["dblock.lock.name"] for a, _ in named.points(name)} == {"report-2"}, name
        assert named.count(WAIT, lock="report-2", outcome="busy") == 1
        assert sorted(map(str, (a for a, _ in named.points(REFUSALS)))) == ["{'dblock.lock.name': 'report-2'}", "{}"]
        assert recorded.count(GRANTS) == 1  # the first provider got nothing more
    finally:
        provider.shutdown()


def test_nothing_is_recorded_once_disabled(db: Db, recorded: Metrics) -> None:
    locker = db.locker()
    held = locker.try_acquire("held", ttl=30)  # granted while enabled
    assert held is not None and metrics.enabled()
    before = recorded.count(GRANTS), recorded.count(WAIT)
    metrics.disable()
    assert not metrics.enabled()
    assert held.release() is True
    locker.try_acquire("job", ttl=30).release()  # type: ignore[union-attr]
    assert locker.try_acquire("held", ttl=30) is not None
    with pytest.raises(LockNotAcquired):
        locker.acquire("held", timeout=0)
    assert (recorded.count(GRANTS), recorded.count(WAIT)) == before == (1, 1)
    assert recorded.count(HOLD) == recorded.count(TIMEOUTS) == 0


def test_enable_refuses_bad_arguments_and_stays_off() -> None:
    with pytest.raises(TypeError, match="lock_names must be True or False, not str"):
        metrics.enable(lock_names="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="meter_provider must be an opentelemetry MeterProvider or None, not str"):
        metrics.enable("http://collector:4317")  # type: ignore[arg-type]
    assert not metrics.enabled()


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_dblock_does_not_import_opentelemetry_until_enabled(db: Db) -> None:
    out = _python(f"""
        import sys
        import dblock, dblock.metrics
        from dblock import Locker
        from dblock.pytest_plugin import expire_now

        def otel():
            return sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")

        locker = Locker({db.url!r}, table={db.table!r})
        lease = locker.acquire("job", ttl=30, timeout=1)
        expire_now(lease)
        assert locker.try_acquire("job", ttl=30) is not None
        assert lease.release() is False
        print(otel())
        dblock.metrics.enable()
        print(otel() != [])
    """)
    assert out.splitlines() == ["[]", "True"]


def test_without_opentelemetry_dblock_works_and_enable_says_what_to_install(db: Db) -> None:
    out = _python(f"""
        import sys
        sys.modules["opentelemetry"] = None  # as if the package were not installed: importing it fails
        from dblock import Locker, metrics

        locker = Locker({db.url!r}, table={db.table!r})
        locker.acquire("job", ttl=30, timeout=1).release()
        try:
            metrics.enable()
        except ImportError as exc:
            print(exc)
        print(metrics.enabled())
    """)
    assert out.splitlines() == [
        "dblock.metrics.enable needs OpenTelemetry's API: pip install 'dblock[otel]' (or opentelemetry-api)",
        "False",
    ]


def test_enable_records_into_the_global_provider_set_up_later(pg: Db) -> None:
    """The OpenTelemetry convention: a library meters through the global provider, which the app may set afterwards."""
    out = _python(f"""
        from opentelemetry import metrics as otel
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from dblock import Locker, metrics

        metrics.enable()
        reader = InMemoryMetricReader()
        otel.set_meter_provider(MeterProvider(metric_readers=[reader]))
        Locker({pg.url!r}, table={pg.table!r}).acquire("job", ttl=30, timeout=1).release()
        data = reader.get_metrics_data()
        print(sorted(m.name for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics))
    """)
    assert out.strip() == str(sorted([GRANTS, HOLD, WAIT]))


def test_the_asyncio_face_records_the_same(db: Db, recorded: Metrics) -> None:
    """AsyncLocker: a grant, a timeout, a loss found by renewal, each as the sync face records it."""
    import asyncio

    from dblock import AsyncLocker

    async def main() -> None:
        async with AsyncLocker(db.url, table=db.table) as locker:
            lease = await locker.acquire("job", ttl=30, timeout=5)
            with pytest.raises(dblock.LockNotAcquired):
                await locker.acquire("job", timeout=0.05)
            assert await lease.release() is True
            lost = await locker.acquire("renewed", ttl=0.3, renew=True)
            (info,) = await locker.leases()
            await locker.force_release(info)
            await asyncio.wait_for(lost.lost.wait(), 5)

    asyncio.run(main())
    assert recorded.count(GRANTS, system=db.backend) == 2
    assert recorded.count(WAIT, outcome="acquired") == 2 and recorded.count(WAIT, outcome="timeout") == 1
    assert recorded.count(TIMEOUTS) == 1
    assert recorded.count(HOLD, outcome="released") == 1 and recorded.count(HOLD, outcome="lost") == 1
    assert recorded.count(LOSSES) == 1


def test_shared_leases_are_recorded_on_both_faces(db: Db, recorded: Metrics) -> None:
    """Read locks and semaphore slots: grants, waits, timeouts and holds, as exclusive leases are."""
    import asyncio

    from dblock import AsyncLocker

    locker = db.locker()
    sem = locker.semaphore("quota", 1)
    slot = sem.acquire(ttl=30, timeout=5)
    assert sem.try_acquire() is None  # full: a busy try
    with pytest.raises(LockNotAcquired):
        sem.acquire(timeout=0.2)
    with locker.read_lock("catalog", ttl=30):
        pass
    assert slot.release() is True

    async def main() -> None:
        async with AsyncLocker(db.url, table=db.table) as alocker:
            async with alocker.read_lock("catalog", ttl=30):
                pass
            assert await alocker.semaphore("quota", 1).try_acquire(ttl=30) is not None

    asyncio.run(main())
    assert recorded.count(GRANTS, system=db.backend) == 4
    assert recorded.count(WAIT, outcome="acquired") == 4 and recorded.count(WAIT, outcome="busy") == 1
    assert recorded.count(TIMEOUTS) == 1 and recorded.count(WAIT, outcome="timeout") == 1
    assert recorded.count(HOLD, outcome="released") == 3
