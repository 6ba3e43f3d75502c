"""Waiting on the sync face alone: the fair queue across processes (order, a dead or lapsed
waiter skipped, a busy neighbour), forks, the local line's bookkeeping, and the queue
statements' own races (a concurrent change, a hand-off's expiry and trust, a late statement).
What both faces promise about waiting is written once in ``test_waiting_faces_async.py``.

Wake-ups are asserted by statement counts (a waiter woken by a hand-off sends
nothing after joining the queue) and by who got which token, never by time.
Waiters that must not poll get a 60 s backoff: a poll would show in the
count, and a missed wake-up would hang the test instead of passing it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dblock import Locker, LockNotAcquired
from dblock._wait import Hotspot
from dblock.schema import LISTENER_LOCK

from .conftest import Db, wait_for, warm_waiting
from .test_waiting_faces import background as in_thread, count_statements, joined

HERE = Path(__file__).resolve().parent
SLOW = {"poll_min": 60.0, "poll_max": 60.0}  # no poll or fallback wake-up within a test's life


def queue(db: Db, name: str) -> list[dict[str, Any]]:
    """The name's waiters in line: owner ("o"), listener pid ("p"), process id ("proc"), place ("seq")."""
    rows = db.query(f"SELECT owner, pid, proc, seq FROM {db.table}_waiters WHERE name = %s ORDER BY seq", (name,))
    return [{"o": o, "p": p, "proc": proc, "seq": seq} for o, p, proc, seq in rows]


def join_queue_in(conn: Any, db: Db, name: str, owner: str, ttl: float) -> None:
    """In ``conn``'s open transaction: what a waiter's enqueue does, for another (live) process."""
    conn.execute(f"SELECT FROM {db.table} WHERE name = %s FOR UPDATE", (name,))
    conn.execute(f"INSERT INTO {db.table}_procs (id, until) VALUES ('p-' || %s, now() + interval '1 hour')", (owner,))
    conn.execute(f"INSERT INTO {db.table}_waiters (name, owner, ttl, proc) VALUES (%s, %s, %s, 'p-' || %s)",
                 (name, owner, ttl, owner))
    conn.execute(f"UPDATE {db.table} SET waiting = waiting + 1 WHERE name = %s", (name,))


def release_before_0012(table: str) -> str:
    """The release statement of a dblock from before migration 0012: a CTE whose UPDATE matched only
    with nobody waiting, else the hand-off function (0005; 0011's body), joined by UNION ALL."""
    return f"""
WITH r AS (
    UPDATE {table} SET owner = NULL, expires_at = NULL
    WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s AND waiting = 0
    RETURNING token
)
SELECT token, false FROM r
UNION ALL
SELECT h.token, h.notified FROM {table}_handoff(%(name)s, %(owner)s, %(token)s::bigint) AS h
WHERE NOT EXISTS (SELECT FROM r)"""


def waiter_process(db: Db, name: str, timeout: float = 60, mode: str = "fair") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "wait_worker.py"), db.url, db.table, name, str(timeout), mode],
        stdout=subprocess.PIPE,
        text=True,
    )


# -- across processes --------------------------------------------------------------------
def test_waiters_are_served_in_arrival_order_across_processes(pg: Db) -> None:
    """FIFO: four processes queue one after another; each releases at once, handing on to the next."""
    holder = pg.locker()
    held = holder.try_acquire("fifo", ttl=60)
    procs = []
    for i in range(4):
        procs.append(waiter_process(pg, "fifo"))
        wait_for(lambda: len(queue(pg, "fifo")) == i + 1, what=f"waiter {i} to queue")
    assert held.release() is True
    tokens = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert out.startswith("granted"), out
        tokens.append(int(out.split()[1]))
    assert tokens == sorted(tokens) and tokens[0] > held.token, "grants did not follow the queue order"


def test_a_queued_waiter_is_not_starved_by_a_busy_neighbour(pg: Db) -> None:
    """A thread that takes and releases the lock in a tight loop cannot jump the queue."""
    busy, patient = pg.locker(), pg.locker()
    stop = threading.Event()
    grants: list[int] = []

    def hog() -> None:
        while not stop.is_set():
            lease = busy.acquire("hot", timeout=30)
            grants.append(lease.token)
            lease.release()

    queued_at: list[int] = []  # the hog's grant count when the patient's enqueue came back "queued"
    execute = patient._driver._execute

    def watch(conn: Any, sql: str, params: dict[str, Any]) -> Any:
        rows = execute(conn, sql, params)
        if sql == patient.backend.queue.enqueue and rows and not rows[0][0]:
            queued_at.append(len(grants))
        return rows

    patient._driver._execute = watch  # type: ignore[method-assign]
    t = threading.Thread(target=hog)
    t.start()
    wait_for(lambda: len(grants) > 20, what="the busy loop to run")
    try:
        queued_rounds = 0
        for _ in range(50):
            queued_at.clear()
            lease = patient.acquire("hot", timeout=30)
            got_at = len(grants)
            lease.release()
            if queued_at:
                # Once queued, the patient is next: the hog's lease of that moment
                # is the last it gets before the patient (its append may trail its grant).
                assert got_at - queued_at[0] <= 1
                queued_rounds += 1
        assert queued_rounds >= 5, "the patient hardly ever had to queue: the test did not test"
    finally:
        stop.set()
        t.join(timeout=30)


def test_a_waiter_whose_process_died_is_skipped(pg: Db) -> None:
    """Its listener session is gone, so the release hands the lease to the next live waiter."""
    holder = pg.locker()
    held = holder.try_acquire("dead", ttl=60)
    doomed = waiter_process(pg, "dead")
    wait_for(lambda: len(queue(pg, "dead")) == 1, what="the doomed waiter to queue")
    doomed_pid = queue(pg, "dead")[0]["p"]
    survivor = pg.locker(**SLOW)
    t, out = in_thread(lambda: survivor.acquire("dead", timeout=60))
    wait_for(lambda: len(queue(pg, "dead")) == 2, what="the survivor to queue")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    wait_for(lambda: not pg.query("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (doomed_pid,)),
             what="the dead process's session to end")
    assert held.release() is True
    lease = joined(t, out)
    assert pg.query(f"SELECT owner FROM {pg.table} WHERE name = 'dead'") == [(lease.owner,)]
    assert queue(pg, "dead") == []
    survivor.close()


def test_a_waiter_that_stopped_refreshing_is_skipped(pg: Db) -> None:
    """A polling waiter (no listener session to check) that died drops out when its entry lapses."""
    holder = pg.locker()
    held = holder.try_acquire("lapse", ttl=60)
    doomed = waiter_process(pg, "lapse", timeout=0.5, mode="poll")
    wait_for(lambda: len(queue(pg, "lapse")) == 1, what="the doomed waiter to queue")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    wait_for(
        lambda: pg.query(
            f"SELECT now() > q.until FROM {pg.table}_waiters AS w JOIN {pg.table}_procs AS q ON q.id = w.proc "
            "WHERE w.name = 'lapse'"
        ) == [(True,)],
        what="the entry to lapse",
    )
    survivor = pg.locker(**SLOW)
    t, out = in_thread(lambda: survivor.acquire("lapse", timeout=60))
    # The lapsed entry stays in line until a release or a grant reaches it: no waiter refreshes it.
    wait_for(lambda: len(queue(pg, "lapse")) == 2 and queue(pg, "lapse")[1]["p"] is not None,
             what="the survivor to queue behind it")
    assert held.release() is True
    lease = joined(t, out)
    assert lease.token > held.token
    assert queue(pg, "lapse") == []  # the release dropped the lapsed entry on its way
    survivor.close()


# -- the queue statements' races ---------------------------------------------------------
def _row_locked_by(conn: Any, db: Db, name: str) -> None:
    """In ``conn``, a transaction that holds ``name``'s row lock (as a join or a leave does)."""
    conn.execute("BEGIN")
    conn.execute(f"SELECT FROM {db.table} WHERE name = %s FOR UPDATE", (name,))


def _waits_for_the_row_lock(db: Db) -> None:
    wait_for(
        lambda: db.query(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
            (f"%UPDATE {db.table} SET owner = NULL%",),  # a release (pg_stat_activity shows its text), not any lock wait
        ) != [(0,)],
        what="the release to wait for the row lock",
    )


def test_joining_the_queue_waits_for_a_concurrent_change_and_keeps_it(pg: Db) -> None:
    """EvalPlanQual: an enqueue blocked by another transaction's change to the row re-reads it, losing nothing."""
    holder, waiter = pg.locker(), pg.locker(**SLOW)
    holder.try_acquire("epq", ttl=60)
    conn = pg.connect()
    conn.execute("BEGIN")
    join_queue_in(conn, pg, "epq", "other", 5)
    t, out = in_thread(lambda: waiter.acquire("epq", timeout=2))
    wait_for(lambda: pg.query("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'") != [(0,)],
             what="the enqueue to wait for the row lock")
    conn.execute("COMMIT")
    conn.close()
    wait_for(lambda: len(queue(pg, "epq")) == 2, what="the enqueue to finish")
    assert [e["o"] for e in queue(pg, "epq")][0] == "other"
    with pytest.raises(LockNotAcquired):
        joined(t, out)
    assert [e["o"] for e in queue(pg, "epq")] == ["other"]


def test_a_hand_off_expires_a_ttl_after_the_waiter_joined_not_after_the_release_began(pg: Db) -> None:
    """G5 for handed leases: the waiter trusts from its queueing attempt's send time.

    A release that waited for the row lock behind that attempt began before it
    was sent; an expiry counted from the release's start (PostgreSQL's now())
    would end before the waiter stops trusting, and a third client could take
    the lock while the waiter still works (G1). Here the "attempt" is a
    transaction that queues a waiter and commits 0.5 s after the release began.
    """
    holder = pg.locker()
    lease = holder.try_acquire("g5h", ttl=60)
    assert lease is not None
    conn = pg.connect()
    conn.execute("BEGIN")
    join_queue_in(conn, pg, "g5h", "waiter", 2)
    t, out = in_thread(lease.release)
    _waits_for_the_row_lock(pg)
    time.sleep(0.5)  # the gap between the release's start and the waiter's send
    [(sent,)] = conn.execute("SELECT clock_timestamp()").fetchall()  # the waiter "sends" its attempt
    conn.execute("COMMIT")
    conn.close()
    assert joined(t, out) is True
    [(owner, expires_at)] = pg.query(f"SELECT owner, expires_at FROM {pg.table} WHERE name = 'g5h'")
    assert owner == "waiter"
    assert (expires_at - sent).total_seconds() >= 2, "the handed lease expires before the waiter stops trusting it"


def test_a_release_that_waited_for_the_row_lock_skips_a_head_that_left_meanwhile(pg: Db) -> None:
    """A waiter first in line when the release began, which left while the release waited for
    the row lock, is not handed the lease: the one behind it is. (A statement that read the line
    from its own snapshot, taken before that wait, would still see the waiter that left.)"""
    lease = pg.locker().try_acquire("left", ttl=60)
    assert lease is not None
    conn = pg.connect()
    conn.execute("BEGIN")
    join_queue_in(conn, pg, "left", "first", 60)
    join_queue_in(conn, pg, "left", "second", 60)
    conn.execute("COMMIT")
    _row_locked_by(conn, pg, "left")
    t, out = in_thread(lease.release)
    _waits_for_the_row_lock(pg)
    conn.execute(f"SELECT * FROM {pg.table}_cancel('left', 'first', NULL)")  # the head gives up
    conn.execute("COMMIT")
    conn.close()
    assert joined(t, out) is True
    assert pg.query(f"SELECT owner, waiting FROM {pg.table} WHERE name = 'left'") == [("second", 0)]
    assert queue(pg, "left") == []


def test_a_release_that_waited_for_the_row_lock_hands_nothing_on_once_its_lease_was_taken(pg: Db) -> None:
    """The release's lease ran out and another owner took the name while the release waited for
    the row lock: the release ends nothing and hands nothing on; the line stays as it was."""
    lease = pg.locker().try_acquire("taken", ttl=60)
    assert lease is not None
    conn = pg.connect()
    conn.execute("BEGIN")
    join_queue_in(conn, pg, "taken", "waiter", 60)
    conn.execute("COMMIT")
    _row_locked_by(conn, pg, "taken")
    t, out = in_thread(lease.release)
    _waits_for_the_row_lock(pg)
    conn.execute(
        f"UPDATE {pg.table} SET owner = 'other', token = nextval('{pg.table}_token_seq'), "
        "expires_at = now() + interval '1 minute' WHERE name = 'taken'"
    )
    conn.execute("COMMIT")
    conn.close()
    assert joined(t, out) is False
    assert pg.query(f"SELECT owner, waiting FROM {pg.table} WHERE name = 'taken'") == [("other", 1)]
    assert [e["o"] for e in queue(pg, "taken")] == ["waiter"]


def test_a_handed_lease_is_trusted_from_the_hand_off_not_from_the_last_look(pg: Db) -> None:
    """A waiter far back looks rarely; its lease, handed over later, is trusted from the database's
    hand-off (its expiry placed on the waiter's clock through its last look), not aged by that look:
    no extend is needed, and the trust still ends no later than the database's expiry (G5)."""
    holder = pg.locker()
    held = holder.try_acquire("aged", ttl=60)
    assert held is not None
    waiter = pg.locker(**SLOW)  # no look between joining and the hand-off
    sent = count_statements(waiter)
    t, out = in_thread(lambda: waiter.acquire("aged", ttl=2, timeout=30))
    wait_for(lambda: len(queue(pg, "aged")) == 1, what="the waiter to queue")
    time.sleep(1.5)  # the last look is now 1.5 s old: most of a 2 s ttl
    assert held.release() is True
    lease = joined(t, out)
    [(left,)] = pg.query(f"SELECT extract(epoch FROM expires_at - clock_timestamp()) FROM {pg.table} WHERE name = 'aged'")
    # Read after the database's: both count down, so the trust left now is no more than what the
    # database had left then (however slow the query), unless the trust outlasts the expiry.
    trusted = lease.remaining()
    assert trusted <= float(left) + 0.001, "trusted past the database's expiry"
    assert trusted > 1.0, f"only {trusted:.3f} s of 2 trusted: the hand-off was aged by the last look"
    assert waiter.backend.sql.extend not in sent


@pytest.mark.parametrize("verb", ["extend", "retry"])
def test_a_late_statement_never_shortens_a_lease(pg: Db, verb: str) -> None:
    """G5 against late statements: PostgreSQL computes an UPDATE's new values before it waits
    for the row lock, and a statement the client cut off may run on the server later still.
    Here an extend (or an acquire retried by the same owner, G6) waits behind a transaction
    that sets a later expiry, as a later extend of the same holder would: the late statement
    must keep the later expiry, or the lease would end while its holder still trusts it."""
    locker = pg.locker()
    lease = locker.try_acquire("late", ttl=60)
    assert lease is not None
    conn = pg.connect()
    conn.execute("BEGIN")
    conn.execute(f"UPDATE {pg.table} SET expires_at = now() + interval '1 hour' WHERE name = 'late'")
    if verb == "extend":
        call = lambda: lease.extend(2)  # noqa: E731
    else:
        call = lambda: locker._attempt("late", lease.owner, 2)  # noqa: E731
    t, out = in_thread(call)
    wait_for(lambda: pg.query("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'") != [(0,)],
             what="the statement to wait for the row lock")
    conn.execute("COMMIT")
    conn.close()
    joined(t, out)
    [(left,)] = pg.query(f"SELECT extract(epoch FROM expires_at - now()) FROM {pg.table} WHERE name = 'late'")
    assert left > 3000, "a late statement shortened the lease"


# -- resources ------------------------------------------------------------------------
def test_the_local_line_forgets_idle_names() -> None:
    """100k distinct names, some with a queue behind them: nothing stays in the map."""
    hot = Hotspot()
    for i in range(100_000):
        name = f"n{i}"
        me = hot.join(name)
        assert me.is_set()
        if i % 10 == 0:
            other = hot.join(name)
            assert not other.is_set()
            hot.released(name)
            hot.leave(name, me)
            assert other.is_set()  # the next in line is the head now
            hot.leave(name, other)
        else:
            hot.leave(name, me)
    assert len(hot) == 0


def listening_waiter(pg: Db) -> tuple[Locker, Locker, int]:
    """A holder, and a waiter whose listener is up; and the listener's backend pid."""
    holder, waiter = pg.locker(), pg.locker()
    warm_waiting(pg, waiter)
    assert waiter._listener is not None and waiter._listener.ident is not None
    return holder, waiter, waiter._listener.ident[0]


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_child_gets_its_own_listener(pg: Db) -> None:
    holder, waiter, parent_session = listening_waiter(pg)
    holder.try_acquire("fork", ttl=0.3)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            lease = waiter.acquire("fork", timeout=30)
            ident = waiter._listener.ident if waiter._listener else None
            os.write(w, json.dumps([lease.token, ident[0] if ident else None]).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(child, 0)
    token, session = json.loads(os.read(r, 1000))
    os.close(r)
    assert token > 0 and session not in (None, parent_session)


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_close_in_a_forked_child_leaves_the_parents_listener_alone(pg: Db) -> None:
    """close() ends the listener by shutting its socket, which a forked child shares."""
    holder, waiter, parent_session = listening_waiter(pg)
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            waiter.close()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    held = holder.try_acquire("after-fork", ttl=60)
    assert held is not None
    threading.Timer(0.2, held.release).start()
    lease = waiter.acquire("after-fork", timeout=30)  # handed over through the same listener
    assert lease.token > held.token
    assert waiter._listener.ident is not None and waiter._listener.ident[0] == parent_session


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_child_cannot_end_or_extend_its_parents_lease(db: Db) -> None:
    locker = db.locker()
    lease = locker.try_acquire("parents", ttl=60)
    assert lease is not None
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        outcome = []
        try:
            for verb in (lease.release, lease.extend):
                try:
                    verb()
                    outcome.append("done")
                except RuntimeError as exc:
                    outcome.append("refused" if "parent of this forked one" in str(exc) else str(exc))
            os.write(w, json.dumps(outcome).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(child, 0)
    assert json.loads(os.read(r, 1000)) == ["refused", "refused"]
    os.close(r)
    assert db.query(f"SELECT owner, token FROM {db.table} WHERE name = 'parents'") == [(lease.owner, lease.token)]
    assert lease.release() is True  # the parent's to end
    locker.close()


def test_a_release_with_only_dead_waiters_frees_the_lock(pg: Db) -> None:
    """Every queued entry lapsed or names a session that is gone: nobody is handed the lease."""
    holder = pg.locker()
    held = holder.try_acquire("ghosts", ttl=60)
    t = pg.table
    pg.query(f"INSERT INTO {t}_procs (id, until) VALUES ('stale', now() - interval '1 s'), ('fresh', now() + interval '1 h')")
    pg.query(f"""INSERT INTO {t}_waiters (name, owner, ttl, proc, pid, start) VALUES
        ('ghosts', 'lapsed', 5, 'stale', NULL, NULL),
        ('ghosts', 'gone', 5, 'fresh', 2147483647, '2020-01-01'),
        ('ghosts', 'late', 5, 'fresh', NULL, NULL)""")
    pg.query(f"UPDATE {t}_waiters SET until = now() - interval '1 s' WHERE owner = 'late'")
    pg.query(f"UPDATE {t} SET waiting = 3 WHERE name = 'ghosts'")
    assert held.release() is True
    assert pg.query(f"SELECT owner, waiting FROM {t} WHERE name = 'ghosts'") == [(None, 0)]
    assert queue(pg, "ghosts") == []
    assert holder.try_acquire("ghosts") is not None


def test_0012_keeps_the_release_of_an_earlier_dblock_working_and_asks_this_one_to_upgrade(pg: Db) -> None:
    """A dblock from before 0012, still running beside this one, releases with its own statement:
    with nobody waiting it frees the name, with a waiter in line it hands it on (the hand-off
    function stays). This dblock against tables from before 0012 raises SchemaMissing, naming
    the upgrade, instead of releasing without handing on."""
    from dblock import SchemaMissing, migrate

    holder = pg.locker()
    t = pg.table
    lease = holder.try_acquire("old", ttl=60)
    assert lease is not None
    key = {"name": "old", "owner": lease.owner, "token": lease.token}
    assert pg.query(release_before_0012(t), key) == [(lease.token, False)]
    assert pg.query(f"SELECT owner, waiting FROM {t} WHERE name = 'old'") == [(None, 0)]
    lease = holder.try_acquire("old", ttl=60)
    assert lease is not None
    conn = pg.connect()
    conn.execute("BEGIN")
    join_queue_in(conn, pg, "old", "next", 60)
    conn.execute("COMMIT")
    conn.close()
    ((token, handed),) = pg.query(release_before_0012(t), {"name": "old", "owner": lease.owner, "token": lease.token})
    assert handed is True
    assert pg.query(f"SELECT owner, token, waiting FROM {t} WHERE name = 'old'") == [("next", token, 0)]
    assert token > lease.token and queue(pg, "old") == []
    migrate.downgrade(holder.engine, t, None, "dblock_0011")
    fresh = pg.locker()
    with pytest.raises(SchemaMissing, match="older dblock"):
        fresh.try_acquire("new", ttl=30)
    fresh.close()
    assert holder.create_schema().after == "dblock_0013"
    assert holder.try_acquire("new", ttl=30) is not None
    holder.close()


def test_0013_changes_how_hand_on_finds_the_head_not_whom_it_hands_to(pg: Db) -> None:
    """Migration 0013 gives hand_on a shorter body (the head found once and deleted by its row
    address, the notification sent by the grant's UPDATE); its downgrade puts 0012's back. At
    either revision a release hands the name to the first live writer in line, not to one
    behind it. dblock's statements are the same at both, so a dblock of either works on both."""
    from dblock import migrate

    t = pg.table
    holder = pg.locker()

    def body() -> str:
        [(source,)] = pg.query("SELECT prosrc FROM pg_proc WHERE proname = %s", (f"{t}_hand_on",))
        return str(source)

    def hands_on_in_order(name: str) -> None:
        lease = holder.try_acquire(name, ttl=60)
        assert lease is not None
        conn = pg.connect()
        conn.execute("BEGIN")
        join_queue_in(conn, pg, name, f"{name}-first", 60)
        join_queue_in(conn, pg, name, f"{name}-second", 60)
        conn.execute("COMMIT")
        conn.close()
        assert lease.release() is True
        [(owner, token, waiting)] = pg.query(f"SELECT owner, token, waiting FROM {t} WHERE name = %s", (name,))
        assert (owner, waiting) == (f"{name}-first", 1) and token > lease.token
        assert [w["o"] for w in queue(pg, name)] == [f"{name}-second"]

    assert "ctid" in body() and "min(y.seq)" not in body()
    hands_on_in_order("at0013")
    migrate.downgrade(holder.engine, t, None, "dblock_0012")
    assert "ctid" not in body() and "min(y.seq)" in body()
    hands_on_in_order("at0012")
    assert holder.create_schema().after == "dblock_0013"
    assert "ctid" in body()
    holder.close()


def test_a_waiters_listener_is_alive_while_it_holds_its_advisory_lock(pg: Db) -> None:
    """A waiter that names a listener session is live while that session holds the advisory lock
    (LISTENER_LOCK, its pid), whatever the server's list of sessions says (0011: one lookup). A
    session without it (a listener of an earlier dblock) is judged by that list, as before: its
    waiter keeps its place while the session lives, and is skipped once its pid names another
    session."""
    holder = pg.locker()
    held = holder.try_acquire("alive", ttl=60)
    t = pg.table
    locked, earlier = pg.connect(), pg.connect()
    locked.execute("SELECT pg_advisory_lock(%s, pg_backend_pid())", (LISTENER_LOCK,))
    (pid_locked,) = locked.execute("SELECT pg_backend_pid()").fetchone()
    pid_earlier, start_earlier = earlier.execute(
        "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
    ).fetchone()
    pg.query(f"INSERT INTO {t}_procs (id, until) VALUES ('fresh', now() + interval '1 h')")
    for owner, pid, start in (
        ("locked, start unknown", pid_locked, "2020-01-01"),  # the lock decides: live
        ("earlier dblock", pid_earlier, start_earlier),  # the list decides: live
        ("earlier, pid reused", pid_earlier, "2020-01-01"),  # the list decides: another session now
    ):
        pg.query(f"INSERT INTO {t}_waiters (name, owner, ttl, proc, pid, start) VALUES ('alive', %s, 60, 'fresh', %s, %s)",
                 (owner, pid, start))
    pg.query(f"UPDATE {t} SET waiting = 3 WHERE name = 'alive'")
    assert held.release() is True
    granted = []
    for _ in range(2):
        ((owner, token),) = pg.query(f"SELECT owner, token FROM {t} WHERE name = 'alive'")
        granted.append(owner)
        assert pg.query(holder.backend.sql.release, {"name": "alive", "owner": owner, "token": token})
    assert granted == ["locked, start unknown", "earlier dblock"]
    assert pg.query(f"SELECT owner, waiting FROM {t} WHERE name = 'alive'") == [(None, 0)]  # the third skipped
    assert queue(pg, "alive") == []
    locked.close()
    earlier.close()
    holder.close()


def test_a_listener_session_holds_its_advisory_lock_while_it_lives(pg: Db) -> None:
    """What the hand-off's O(1) liveness check reads: the listener takes (LISTENER_LOCK, its pid)
    exclusively when it starts, and the server drops it with the session."""
    holder, waiter = pg.locker(), pg.locker(**SLOW)
    held = holder.try_acquire("listening", ttl=60)
    worker, out = in_thread(lambda: waiter.acquire("listening", timeout=60))
    wait_for(lambda: len(queue(pg, "listening")) == 1)
    (entry,) = queue(pg, "listening")
    lock = f"""SELECT mode, granted FROM pg_locks WHERE locktype = 'advisory' AND classid = %s::oid
               AND objid = %s::oid AND objsubid = 2 AND pid = %s"""
    assert pg.query(lock, (LISTENER_LOCK, entry["p"], entry["p"])) == [("ExclusiveLock", True)]
    held.release()
    joined(worker, out).release()
    waiter.close()
    wait_for(lambda: pg.query(lock, (LISTENER_LOCK, entry["p"], entry["p"])) == [])
    holder.close()


def test_joining_a_short_line_reads_only_that_line(pg: Db) -> None:
    """A long line on another name must not make joining (or looking at) a short one read it all.

    The waiters ahead are counted in the queue's index order; without that the
    function's cached generic plan scanned the whole waiters table (0005).
    """
    locker = pg.locker()
    held = [locker.try_acquire(name, ttl=600) for name in ("short", "middle", "long")]
    assert all(held)
    conn = pg.connect()
    conn.execute(f"INSERT INTO {pg.table}_procs (id, until) VALUES ('p', now() + interval '1 hour')")
    for name, count in (("long", 30_000), ("middle", 1_000), ("short", 3)):
        conn.execute(
            f"INSERT INTO {pg.table}_waiters (name, owner, ttl, proc, until) "
            "SELECT %s, md5(random()::text), 600, 'p', now() + interval '1 hour' FROM generate_series(1, %s)",
            (name, count),
        )
        conn.execute(f"UPDATE {pg.table} SET waiting = waiting + %s WHERE name = %s", (count, name))
    conn.execute(f"ANALYZE {pg.table}_waiters")

    def join(name: str) -> Any:
        params = {
            "name": name, "owner": os.urandom(16).hex(), "ttl": 600, "label": None, "proc": "p", "lapse": 3600,
            "pid": None, "start": None, "until": 600, "seq": None,
        }
        return conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + locker.backend.queue.enqueue, params).fetchone()[0]

    # Past PL/pgSQL's five custom plans, lines of all lengths: the cached generic plan is in use.
    for _ in range(10):
        for name in ("long", "middle", "short"):
            join(name)
    plan = join("short")[0]["Plan"]
    touched = plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)
    pages = conn.execute(f"SELECT relpages FROM pg_class WHERE relname = '{pg.table}_waiters'").fetchone()[0]
    assert touched < 100 < pages, f"joining a line of 3 touched {touched} buffers; the waiters table has {pages} pages"
    conn.close()


def test_a_hand_over_reads_the_head_of_the_line_not_all_of_it(pg: Db) -> None:
    """A release to the head of a line of 3,000 reads the entries it uses, not the line (0009).

    The waiters table was analyzed while the line was short, as it is in use: a
    line forms and drains faster than autovacuum looks. 0008's walk, a FOR loop
    over the name's entries in seq order, was then planned as a scan of every
    entry plus a sort; the same hand-overs, with 0008's walk put back, show that
    this measure sees it.
    """
    from dblock import migrate

    locker = pg.locker()
    t = pg.table
    assert locker.try_acquire("long", ttl=600)
    conn = pg.connect()
    conn.execute(f"INSERT INTO {t}_procs (id, until) VALUES ('p', now() + interval '1 hour')")

    def line(count: int) -> None:
        conn.execute(
            f"INSERT INTO {t}_waiters (name, owner, ttl, proc, until) "
            "SELECT 'long', md5(random()::text), 600, 'p', now() + interval '1 hour' FROM generate_series(1, %s)",
            (count,),
        )
        conn.execute(f"UPDATE {t} SET waiting = waiting + %s WHERE name = 'long'", (count,))

    line(2)
    conn.execute(f"ANALYZE {t}_waiters")
    line(3_000)

    release = locker.backend.sql.release

    def hand_over() -> int:
        """Buffers one release touches; it hands the lease to the head of the line."""
        ((owner, token),) = conn.execute(f"SELECT owner, token FROM {t} WHERE name = 'long'").fetchall()
        params = {"name": "long", "owner": owner, "token": token}
        ((plans,),) = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + release, params).fetchall()
        plan = plans[0]["Plan"]
        assert conn.execute(f"SELECT owner <> %s FROM {t} WHERE name = 'long'", (owner,)).fetchone() == (True,)
        return int(plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0))

    pages = conn.execute(f"SELECT pg_relation_size('{t}_waiters') / current_setting('block_size')::int").fetchone()[0]
    # The first calls compile and plan (catalog reads); past PL/pgSQL's five custom
    # plans the cached generic plan is in use too.
    touched = max([hand_over() for _ in range(8)][2:])
    assert touched < 40 < pages, f"a hand-over touched {touched} buffers; the waiters table has {pages} pages"

    migrate.downgrade(locker.engine, t, None, "dblock_0008")
    release = release_before_0012(t)  # this dblock's release calls 0012's function
    conn.close()
    conn = pg.connect()  # a session whose plans are 0008's
    # (PL/pgSQL's first five plans are custom ones, made for 'long' with the stale
    # statistics: those read the line.)
    assert max([hand_over() for _ in range(8)][2:]) > pages // 2, "0008's walk no longer reads the line: the measure is blind"
    conn.close()
    locker.create_schema()


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_child_draws_owner_ids_no_one_else_draws(db: Db) -> None:
    """Owner ids are a random half made once per process and a count: a forked child makes its
    own half (and knows its own pid), so the ids its acquires draw are never its parent's,
    though both counts go on from the same number. Kept from the parent, a child's acquire
    would present an id a live lease of the parent's may have, and be given that lease."""
    from dblock import _process

    locker = db.locker()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            lease = locker.try_acquire("child's", ttl=60)
            drawn = [_process.new_owner() for _ in range(100)]
            os.write(w, json.dumps([lease.owner if lease else None, drawn, _process.pid == os.getpid()]).encode())
        finally:
            os._exit(0)
    os.close(w)
    lease = locker.try_acquire("parent's", ttl=60)
    drawn = [_process.new_owner() for _ in range(100)]
    os.waitpid(child, 0)
    with os.fdopen(r) as pipe:
        child_owner, child_drawn, knows_its_pid = json.loads(pipe.read())
    assert lease is not None and child_owner is not None and knows_its_pid
    assert {lease.owner, *drawn}.isdisjoint({child_owner, *child_drawn})
    assert all(len(o) == 32 and int(o, 16) >= 0 for o in (lease.owner, child_owner, *drawn))
    assert len({*drawn, *child_drawn}) == 200
