"""min_hold: a released lease is kept until a set time after its grant, so a job runs once per period.

Times are read from the lock's row (the database's clock), never from this
process's clock. A control run without a hold shows that each scenario would
run the job more than once: the tests can tell the two apart.
"""

from __future__ import annotations

import asyncio
import math
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dblock import LeaseLost, Locker, LockNotAcquired

from .conftest import ALL_BACKENDS, Db, libpq_dsn, wait_for, warm_waiting

BACKENDS = ALL_BACKENDS
from .pgproxy import PgProxy
from .test_faces_async import row, span  # the lock's row by the database clock
from .test_waiting import count_statements, in_thread, joined, queue
from .workers import run_together

HERE = Path(__file__).resolve().parent


# -- what a release does with a hold ------------------------------------------------------
def test_a_second_release_of_a_held_lease_sends_nothing(db: Db) -> None:
    """The sync face's statement count; what a held release keeps, and until when, is tested on
    both faces in test_faces_async.py."""
    locker = db.locker()
    lease = locker.try_acquire("nightly", ttl=60, min_hold=30)
    assert lease is not None and lease.release() is True
    before = row(db, "nightly")
    sent = count_statements(locker)
    assert lease.release() is False
    with pytest.raises(LeaseLost):
        lease.extend()
    assert sent == [] and row(db, "nightly") == before


def test_a_with_block_and_a_decorated_function_keep_the_lease_for_the_hold(db: Db) -> None:
    locker, other = db.locker(), db.locker()
    with locker.lock("block", min_hold=30) as lease:
        pass
    assert lease.held_until is not None and other.try_acquire("block") is None
    runs = []

    @locker.synchronized("report-{day}", timeout=0, min_hold=30)
    def report(day: str) -> None:
        runs.append(day)

    report("monday")
    with pytest.raises(LockNotAcquired):
        report("monday")  # done already this period, on this machine or another
    report("tuesday")

    @locker.synchronized("sync", timeout=0, min_hold=30)
    async def sync() -> None:
        runs.append("sync")

    asyncio.run(sync())
    with pytest.raises(LockNotAcquired):
        asyncio.run(sync())
    assert runs == ["monday", "tuesday", "sync"]


def test_renewal_stops_at_a_held_release(db: Db) -> None:
    locker = db.locker()
    # 1.5 s: renewed every 0.5 s, it survives a 1 s stall of renewal on a busy machine (a 0.3 s
    # ttl leaves 0.2 s).
    lease = locker.acquire("renewed", ttl=1.5, renew=True, min_hold=5)
    granted = lease.expires_at
    wait_for(lambda: lease.expires_at > granted, what="renewal to extend it")
    assert lease.release() is True
    kept = row(db, "renewed")
    assert span(kept[2], kept[3]) == pytest.approx(5, abs=1e-3)
    time.sleep(1.0)  # renewal, were it running, would have extended it again by now (every 0.5 s)
    assert row(db, "renewed") == kept
    assert locker.keeper.renewer.renewing() == 0


def test_a_held_release_waits_for_an_extend_in_flight_so_it_cannot_push_the_hold_out(pg: Db) -> None:
    """Renewal's extend, sent before the release and landing after it, would set the expiry
    to its own now + ttl. The release waits for it: here the row is locked while the
    extend is in flight, and the release is not sent until the extend has come back."""
    locker = pg.locker()
    lease = locker.acquire("inflight", ttl=4.5, renew=True, min_hold=60)  # extended after 1.5 s
    waiting = f"SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND strpos(query, '{pg.table}') > 0"
    blocker = psycopg.connect(libpq_dsn(pg.url))
    try:
        blocker.execute(f"SELECT FROM {pg.table} WHERE name = 'inflight' FOR UPDATE")
        wait_for(lambda: pg.query(waiting) == [(1,)], timeout=4, what="renewal's extend to wait for the row")
        t, out = in_thread(lease.release)
        time.sleep(0.3)
        assert t.is_alive() and pg.query(waiting) == [(1,)], "the release went out with the extend in flight"
    finally:
        blocker.commit()
        blocker.close()
    assert joined(t, out) is True
    owner, _, acquired, expires = row(pg, "inflight")
    assert owner == lease.owner and span(acquired, expires) == pytest.approx(60, abs=1e-3)


# -- waiters --------------------------------------------------------------------------------
def test_a_held_release_hands_nothing_to_a_queued_waiter_who_gets_it_when_the_hold_ends(pg: Db) -> None:
    """PostgreSQL's fair queue: a plain release hands the lease to the first waiter in the
    same statement. A held release must not; the waiter takes it at the hold's end, as
    after a holder that died (the first in line looks then)."""
    holder, waiter = pg.locker(), pg.locker()
    warm_waiting(pg, waiter)
    held = holder.try_acquire("n", ttl=60, min_hold=1.5)
    assert held is not None
    t, out = in_thread(lambda: waiter.acquire("n", timeout=60))
    wait_for(lambda: len(queue(pg, "n")) == 1, what="the waiter to join the queue")
    assert held.release() is True
    assert row(pg, "n")[:2] == (held.owner, held.token)  # not handed over
    assert len(queue(pg, "n")) == 1
    lease = joined(t, out)
    assert lease.token > held.token
    assert held.held_until is not None and row(pg, "n")[2] >= held.held_until
    lease.release()


@pytest.mark.parametrize("fair", [True, False])
def test_a_waiter_gets_the_lease_when_the_hold_ends_not_before(db: Db, fair: bool) -> None:
    locker = db.locker(fair=fair)
    held = locker.try_acquire("w", ttl=60, min_hold=1.0)
    assert held is not None
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(locker.acquire("w", timeout=30)))
    waiter.start()
    time.sleep(0.1)
    assert held.release() is True
    waiter.join(30)
    assert got, "the waiter never got the lease"
    assert held.held_until is not None and row(db, "w")[2] >= held.held_until
    got[0].release()


# -- statements -------------------------------------------------------------------------------
def test_without_a_hold_release_sends_the_plain_statement_as_before(db: Db) -> None:
    locker = db.locker()
    sent = count_statements(locker)
    for hold in (None, 0, 0.0):
        lease = locker.try_acquire("plain", min_hold=hold)
        assert lease is not None and lease.min_hold == 0
        assert lease.release() is True and lease.held_until is None
    assert sent.count(locker.backend.sql.release) == 3 and locker.backend.sql.release_held not in sent
    lease = locker.try_acquire("plain", min_hold=10)
    assert lease is not None and lease.release() is True
    assert sent[-1] == locker.backend.sql.release_held and sent.count(locker.backend.sql.release) == 3


def test_a_held_release_is_one_round_trip_kept_or_ended(pg: Db, proxy: PgProxy) -> None:
    locker = Locker(proxy.url, table=pg.table)
    locker.try_acquire("warm", min_hold=60).release()  # first use on a connection prepares the statement
    kept = locker.try_acquire("kept", min_hold=60)
    ended = locker.try_acquire("ended", min_hold=0.001)
    assert kept is not None and ended is not None
    time.sleep(0.01)
    proxy.reset()
    assert kept.release() is True and proxy.round_trips == 1
    assert ended.release() is True and proxy.round_trips == 2
    assert kept.held_until is not None and ended.held_until is None
    locker.close()


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad, error, message",
    [
        (-1, ValueError, "min_hold must be between 0 s and 366 days, not -1 s"),
        (367 * 86400, ValueError, "min_hold must be between 0 s and 366 days, not 367 days"),
        (math.inf, ValueError, "min_hold must be between 0 s and 366 days, not for ever"),
        (math.nan, ValueError, "min_hold must be a number of seconds, not NaN"),
        ("60", TypeError, "min_hold must be a number of seconds, not str"),
        (True, TypeError, "min_hold must be a number of seconds, not bool"),
    ],
)
def test_a_bad_min_hold_is_refused_before_any_sql(db: Db, bad: object, error: type, message: str) -> None:
    locker = db.locker()
    locker.try_acquire("warm").release()  # type: ignore[union-attr]
    before = db.rows()
    sent = count_statements(locker)
    calls = {
        "try_acquire": lambda: locker.try_acquire("x", min_hold=bad),  # type: ignore[arg-type]
        "acquire": lambda: locker.acquire("x", min_hold=bad),  # type: ignore[arg-type]
        "lock": lambda: locker.lock("x", min_hold=bad),  # type: ignore[arg-type]
        "locked": lambda: locker.synchronized("x", min_hold=bad),  # type: ignore[arg-type]
    }
    for verb, call in calls.items():
        with pytest.raises(error, match=re.escape(message)):
            call()
            pytest.fail(f"{verb} took min_hold={bad!r}")
    assert sent == [] and db.rows() == before


# -- several machines -------------------------------------------------------------------------
@pytest.mark.parametrize("hold", [30.0, 0.0], ids=["held", "control-no-hold"])
def test_a_job_started_on_several_machines_within_the_period_runs_once(db: Db, hold: float) -> None:
    """Four processes start the same short job from their own clocks, up to 1.2 s apart
    (a cron line on four servers whose clocks differ). The job takes 50 ms: without a
    hold, a late machine finds it free and runs it again."""
    offsets = [0.0, 0.4, 0.8, 1.2]
    worker = [sys.executable, str(HERE / "period_worker.py"), db.url, db.table, "report", str(hold)]
    outs = run_together([[*worker, str(offset), "0.05"] for offset in offsets], quiet=True)
    ran = [out for out in outs if out.startswith("ran ")]
    assert len(ran) + outs.count("skipped\n") == len(offsets), outs
    if hold:
        assert len(ran) == 1, outs
    else:
        assert len(ran) >= 2, f"the control ran the job only once, so the test did not test: {outs}"
