"""dblock behind a real PgBouncer in transaction mode (Debian's package), before the suite's PostgreSQL.

A transaction pooler runs each transaction on whichever server session is
free. A statement prepared on one session is not on the next: dblock names a
statement it prepares by its text (``dblock_`` and a digest), so on a session
another client prepared it on, the name runs the same statement, and on one
where nobody did, the call fails, but it never runs another statement.
``Locker(prepare=False)`` sends every statement unprepared; ``notify=False``
because LISTEN needs a session of its own.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import dblock
from dblock import Lease, Locker, LockNotAcquired

from . import pgbouncer as bouncer
from .conftest import Db, wait_for
from .pgbouncer import PgBouncer
from .test_fencing import Counter
from .test_guarantees import assert_race_was_safe, install_audit
from .workers import run_together

pytestmark = pytest.mark.pgbouncer

HERE = Path(__file__).resolve().parent
# What behind a transaction pooler is: dblock's own Locker options, and for the
# app's engine no automatic preparing (psycopg prepares a query run 5 times).
POOLED = {"prepare": False, "notify": False}
ENGINE = {"prepare_threshold": None}
# The error of a prepared statement meeting a session it was not prepared on.
MISSING = re.compile(r'prepared statement "dblock_[0-9a-f]+" does not exist')


def pooled(db: Db, url: str, **options: Any) -> Locker:
    locker = Locker(url, table=db.table, **{**POOLED, **options})
    db.lockers.append(locker)  # closed when the test's table is dropped
    return locker


# -- the hazard, on one server session shared by two clients -------------------
@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "unprepared"])
def test_two_lockers_sharing_server_sessions(pg: Db, pg_url: str, prepare: bool) -> None:
    """Two Lockers take turns on a pool of ONE server session, which pgbouncer
    replaces twice (RECONNECT: what its server_lifetime, a failover or a restart
    also do).

    Prepared, each client prepares a statement once and then runs it by name on
    whatever session it gets. After the first switch the session holds what the
    other client prepared there under the same names, which are the statements'
    own: c's try_acquire("b-wait") runs the acquire a prepared, the same text,
    and a's release finds c's release prepared already. After the second switch
    nobody prepared anything on the session: c's next acquire fails with a
    clear error and grants nothing. Unprepared, every call does what it says.
    """
    if bouncer.binary() is None:
        pytest.skip(bouncer.MISSING)
    outcome: dict[str, object] = {}

    def step(what: str, call: Callable[[], object]) -> Any:
        try:
            outcome[what] = result = call()
            return result
        except dblock.DBLockError as exc:
            outcome[what] = exc
            return None

    with bouncer.start(pg_url, pool_size=1) as one:
        a = pooled(pg, one.url, prepare=prepare)
        c = pooled(pg, one.url, prepare=prepare)
        step("c.leases", c.leases)
        held_c = step("c.try_acquire c-lock", lambda: c.try_acquire("c-lock"))
        one.admin("RECONNECT")  # the next transaction gets a fresh server session
        held_a = step("a.try_acquire a-lock", lambda: a.try_acquire("a-lock"))
        step("a.extend", lambda: held_a.extend(60))
        step("c.try_acquire b-wait", lambda: c.try_acquire("b-wait"))
        step("c.release", lambda: held_c.release())
        step("a.release", lambda: held_a.release())
        one.admin("RECONNECT")
        step("c.try_acquire b-again", lambda: c.try_acquire("b-again"))
        assert one.stats()["total_xact_count"] >= len(outcome), "the calls did not go through pgbouncer"

    errors = {what: str(r) for what, r in outcome.items() if isinstance(r, dblock.DBLockError)}
    assert isinstance(outcome["c.try_acquire b-wait"], Lease)
    assert outcome["c.release"] is True and outcome["a.release"] is True
    if prepare:
        assert list(errors) == ["c.try_acquire b-again"] and MISSING.search(errors["c.try_acquire b-again"]), errors
        assert [i.name for i in pg.locker().leases()] == ["b-wait"]
    else:
        assert errors == {}
        assert isinstance(outcome["c.try_acquire b-again"], Lease)
        assert sorted(i.name for i in pg.locker().leases()) == ["b-again", "b-wait"]


# -- every call, through the shared pool ----------------------------------------
def test_every_call_through_the_pooler(pg: Db, pgbouncer: PgBouncer) -> None:
    """try_acquire, acquire (waiting its turn, polling), extend, leases, release,
    lock and prune, from two Lockers whose statements share server sessions."""
    before = pgbouncer.stats()["total_xact_count"]
    a = pooled(pg, pgbouncer.url)
    c = pooled(pg, pgbouncer.url)

    lease = a.try_acquire("smoke", ttl=30)
    assert lease is not None
    assert c.try_acquire("smoke") is None
    with pytest.raises(LockNotAcquired):
        c.acquire("smoke", timeout=0.05)
    lease.extend(60)
    assert lease.remaining() > 30
    (info,) = c.leases()
    assert (info.name, info.token) == ("smoke", lease.token) and info.remaining > 30

    got: list[Lease] = []
    waiter = threading.Thread(target=lambda: got.append(c.acquire("smoke", ttl=30, timeout=60)))
    waiter.start()
    wait_for(lambda: pg.query(f"SELECT waiting FROM {pg.table} WHERE name = 'smoke'")[0][0], what="c queued")
    assert lease.release() is True
    waiter.join(60)
    assert len(got) == 1 and got[0].token > lease.token  # handed over in turn (G2)
    assert got[0].release() is True

    with a.lock("other", ttl=30) as other:
        assert {i.name for i in c.leases()} == {"other"} and other.remaining() > 0
    pg.query(f"UPDATE {pg.table} SET acquired_at = acquired_at - interval '1 hour'")
    assert a.prune(older_than=60) == 2
    assert c.leases() == [] and pg.rows() == []
    # 13 calls above, each at least one transaction through pgbouncer (the wait: several).
    assert pgbouncer.stats()["total_xact_count"] - before >= 13


# -- G1 and G2 under a race of processes and threads ----------------------------
def test_g1_g2_race_with_fair_polling_behind_the_pooler(pg: Db, pgbouncer: PgBouncer) -> None:
    """3 processes x 4 threads wait fairly (queue in the row, polling: notify=False)
    for one name with TTLs of 10 acquire+release pairs, through 4 server sessions.

    As tests/test_guarantees.py's race: the database's audit (a trigger,
    installed directly) shows every grant's token above the previous one (G2),
    tokens are unique, and no two clients trusted their leases at once (G1).
    No worker may log or raise a single error.
    """
    install_audit(pg)
    probe = pooled(pg, pgbouncer.url)
    probe.try_acquire("warm").release()
    started = time.monotonic()
    for _ in range(5):
        probe.try_acquire("warm").release()
    pair = (time.monotonic() - started) / 5
    ttl = repr(min(0.5, max(0.01, 10 * pair)))
    before = pgbouncer.stats()["total_xact_count"]
    command = [sys.executable, str(HERE / "race_worker.py"), pgbouncer.url, pg.table, "hot", ttl, "4", "2",
               "fair-poll", json.dumps(POOLED)]
    grants = [g for out in run_together([command] * 3, quiet=True) for g in json.loads(out)]
    assert_race_was_safe(pg, grants)
    tokens = [int(g[0]) for g in grants]
    assert pgbouncer.stats()["total_xact_count"] - before >= len(tokens), "the race did not go through pgbouncer"


# -- a fenced counter -----------------------------------------------------------
def test_fenced_counter_behind_the_pooler(pg: Db, pgbouncer: PgBouncer) -> None:
    """3 processes take the lock (20 ms TTLs), pause, and increment a counter with
    fenced writes, all through the pooler: no lost update, no phantom success."""
    counter = Counter(pg)  # the table and its history trigger, made directly
    try:
        options = json.dumps({"locker": POOLED, "connect_args": ENGINE})
        procs = [
            subprocess.Popen(
                [sys.executable, str(HERE / "fence_worker.py"), "stress", pgbouncer.url, pg.table, counter.name,
                 "0.02", "12", "default", str(seed), options],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed in range(3)
        ]
        accepted: list[int] = []
        fenced_out = 0
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0 and err == "", err
            report = json.loads(out)
            accepted += report["accepted"]
            fenced_out += report["fenced"]
        history = counter.accepted()
        assert fenced_out > 0, "the run never produced a stale write: it tested nothing"
        n, _, last = counter.row()
        assert n == len(accepted) == len(history)  # no lost update, no phantom success
        assert sorted(history) == sorted(accepted)
        assert all(a <= b for a, b in zip(history, history[1:])), history
        assert last == history[-1]
    finally:
        counter.drop()
