"""G4, fenced writes: a stale holder's write changes nothing and raises FencedOut.

Real databases, real pauses: a thread that sleeps past its TTL, a process
stopped with SIGSTOP, and a multi-process stress run audited by a trigger.
"""

from __future__ import annotations

import json
import re
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, create_engine, event, func, insert, select, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import make_url

import dblock
from dblock import FencedOut, LeaseLost, Locker, fence, fenced, fenced_read, fenced_update, fenced_upsert
from dblock.schema import fences_table_name

from .workers import run_together
from .conftest import ALL_BACKENDS, Db, wait_for
from .fence_worker import counter_table

WORKER = str(Path(__file__).with_name("fence_worker.py"))
RMW_WORKER = str(Path(__file__).with_name("rmw_worker.py"))
ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ALL_BACKENDS


class Counter:
    """A guarded table (id, n, owner, fence_token) whose trigger logs every accepted token in order."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self.name = db.table + "_counter"
        self.history = db.table + "_hist"
        self.table = counter_table(self.name)
        self.engine = create_engine(db.url)
        self.statements: list[str] = []
        event.listen(self.engine, "before_cursor_execute", self._count)
        if db.backend == "postgresql":
            db.query(
                f"CREATE TABLE {self.name} (id int PRIMARY KEY, n int NOT NULL, owner int NOT NULL,"
                " fence_token bigint NOT NULL DEFAULT 0)"
            )
            db.query(f"CREATE TABLE {self.history} (seq bigserial PRIMARY KEY, token bigint NOT NULL)")
            db.query(
                f"CREATE FUNCTION {self.history}_log() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"INSERT INTO {self.history} (token) VALUES (NEW.fence_token); RETURN NEW; END $$"
            )
            db.query(
                f"CREATE TRIGGER {self.history}_t AFTER UPDATE ON {self.name} "
                f"FOR EACH ROW EXECUTE FUNCTION {self.history}_log()"
            )
        elif db.backend == "mariadb":
            db.query(
                f"CREATE TABLE {self.name} (id INT PRIMARY KEY, n INT NOT NULL, owner INT NOT NULL,"
                " fence_token BIGINT NOT NULL DEFAULT 0)"
            )
            db.query(f"CREATE TABLE {self.history} (seq BIGINT AUTO_INCREMENT PRIMARY KEY, token BIGINT NOT NULL)")
            db.query(
                f"CREATE TRIGGER {self.history}_t AFTER UPDATE ON {self.name} "
                f"FOR EACH ROW INSERT INTO {self.history} (token) VALUES (NEW.fence_token)"
            )
        else:
            db.query(
                f"CREATE TABLE {self.name} (id INTEGER PRIMARY KEY, n INTEGER NOT NULL, owner INTEGER NOT NULL,"
                " fence_token INTEGER NOT NULL DEFAULT 0)"
            )
            db.query(f"CREATE TABLE {self.history} (seq INTEGER PRIMARY KEY AUTOINCREMENT, token INTEGER NOT NULL)")
            db.query(
                f"CREATE TRIGGER {self.history}_t AFTER UPDATE ON {self.name} "
                f"BEGIN INSERT INTO {self.history} (token) VALUES (NEW.fence_token); END"
            )
        db.query(f"INSERT INTO {self.name} (id, n, owner) VALUES (1, 0, 0)")

    def _count(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.statements.append(statement)

    def row(self, id: int = 1) -> tuple[int, int, int]:
        return self.db.query(f"SELECT n, owner, fence_token FROM {self.name} WHERE id = %s", (id,))[0]

    def accepted(self) -> list[int]:
        return [t for (t,) in self.db.query(f"SELECT token FROM {self.history} ORDER BY seq")]

    def drop(self) -> None:
        self.engine.dispose()
        self.db.query(f"DROP TABLE IF EXISTS {self.name}")
        self.db.query(f"DROP TABLE IF EXISTS {self.history}")
        if self.db.backend == "postgresql":
            self.db.query(f"DROP FUNCTION IF EXISTS {self.history}_log()")


@pytest.fixture
def counter(db: Db) -> Iterator[Counter]:
    c = Counter(db)
    yield c
    c.drop()


def set_owner(counter: Counter, lease: Any, owner: int, *, strict: bool = False) -> Any:
    t = counter.table
    with counter.engine.begin() as conn:
        return fenced_update(conn, update(t).where(t.c.id == 1).values(owner=owner), lease, strict=strict)


def takeover(locker: Locker, name: str) -> dblock.Lease:
    """A second client's acquire: it is granted only once the first lease expired (database time)."""
    return locker.acquire(name, ttl=30, timeout=30)


# -- the Core helper ---------------------------------------------------------------
def _sql(stmt: Any) -> str:
    return re.sub(r"::\w+", "", str(stmt.compile(dialect=postgresql.dialect())))


def test_fenced_puts_the_check_and_the_stamp_in_the_same_statement() -> None:
    t = counter_table("c")
    stmt = fenced(update(t).where(t.c.id == 1).values(n=5), 7)
    assert _sql(stmt) == (
        "UPDATE c SET n=%(n)s, fence_token=%(fence_token)s "
        "WHERE c.id = %(id_1)s AND c.fence_token <= %(fence_token_1)s"
    )
    assert stmt.compile().params["fence_token"] == stmt.compile().params["fence_token_1"] == 7
    strict = fenced(update(t).values(n=5), 7, strict=True)
    assert _sql(strict) == "UPDATE c SET n=%(n)s, fence_token=%(fence_token)s WHERE c.fence_token < %(fence_token_1)s"


def test_a_fresh_lease_writes_in_one_statement_and_stamps_its_token(db: Db, counter: Counter) -> None:
    lease = db.locker().acquire("resource")
    counter.statements.clear()
    result = set_owner(counter, lease, 1)
    assert result.rowcount == 1
    assert [s for s in counter.statements if "UPDATE" in s] == counter.statements  # no extra SELECT
    assert len(counter.statements) == 1
    assert counter.row() == (0, 1, lease.token)
    assert set_owner(counter, lease, 2).rowcount == 1  # the same lease writes again (default mode)
    assert counter.row() == (0, 2, lease.token)


def test_strict_mode_lets_each_grant_write_once(db: Db, counter: Counter) -> None:
    lease = db.locker().acquire("resource")
    set_owner(counter, lease, 1, strict=True)
    with pytest.raises(FencedOut) as caught:
        set_owner(counter, lease, 2, strict=True)
    assert caught.value.newer == lease.token
    assert counter.row() == (0, 1, lease.token)


def test_a_missing_row_is_not_a_fence_failure(db: Db, counter: Counter) -> None:
    old, new = db.locker().acquire("resource", ttl=0.05), None
    new = takeover(db.locker(), "resource")
    set_owner(counter, new, 2)  # another row carries a newer token than `old`
    t = counter.table
    with counter.engine.begin() as conn:
        result = fenced_update(conn, update(t).where(t.c.id == 42).values(owner=9), old)
    assert result.rowcount == 0


def test_pause_in_a_thread_past_the_ttl(db: Db, counter: Counter) -> None:
    """Client 1 sleeps past its TTL; client 2 takes over and writes; client 1's late write is refused."""
    first, second = db.locker(), db.locker()
    lease1 = first.acquire("resource", ttl=0.2)
    client2_wrote = threading.Event()
    outcome: list[object] = []

    def client1() -> None:
        time.sleep(0.4)  # a real pause, twice the TTL
        client2_wrote.wait(30)
        try:
            set_owner(counter, lease1, 1)
            outcome.append("wrote")
        except FencedOut as exc:
            outcome.append(exc)

    thread = threading.Thread(target=client1)
    thread.start()
    lease2 = takeover(second, "resource")  # granted only after lease1 expired
    assert lease2.token > lease1.token
    set_owner(counter, lease2, 2)
    client2_wrote.set()
    thread.join(30)
    (result,) = outcome
    assert isinstance(result, FencedOut), result
    assert (result.token, result.newer) == (lease1.token, lease2.token)
    assert counter.row() == (0, 2, lease2.token)  # client 2's value survives
    assert counter.accepted() == [lease2.token]


@pytest.mark.parametrize("api", ["pause", "apause"], ids=["sync", "asyncio"])
def test_pause_in_a_process_stopped_with_sigstop(db: Db, counter: Counter, api: str) -> None:
    """The holder (a Locker, or an AsyncLocker writing through an AsyncSession) stops right
    before its fenced write; another takes over and writes; the stale write is refused."""
    proc = subprocess.Popen(
        [sys.executable, WORKER, api, db.url, db.table, counter.name, "1.0"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        token1 = int(proc.stdout.readline())  # type: ignore[union-attr]
        _, status = os.waitpid(proc.pid, os.WUNTRACED)  # it stopped itself right before writing
        assert os.WIFSTOPPED(status)
        lease2 = takeover(db.locker(), "resource")
        assert lease2.token > token1
        set_owner(counter, lease2, 2)
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.stdout.readline().strip() == "fenced"  # type: ignore[union-attr]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert counter.row() == (0, 2, lease2.token)
    assert counter.accepted() == [lease2.token]


def _stress(db: Db, counter: Counter, mode: str, processes: int = 3, iterations: int = 12) -> tuple[list[int], int]:
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "stress", db.url, db.table, counter.name, "0.02", str(iterations), mode, str(seed)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for seed in range(processes)
    ]
    accepted: list[int] = []
    fenced_out = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        report = json.loads(out)
        accepted += report["accepted"]
        fenced_out += report["fenced"]
    return accepted, fenced_out


@pytest.mark.parametrize("mode", ["default", "strict"])
def test_stress_no_lost_update_no_phantom_success(db: Db, counter: Counter, mode: str) -> None:
    """Several processes, 20 ms TTLs, random pauses up to 40 ms, increments through fenced writes."""
    accepted, fenced_out = _stress(db, counter, mode)
    history = counter.accepted()
    assert fenced_out > 0, "the run never produced a stale write: it tested nothing"
    n, _, last = counter.row()
    assert n == len(accepted) == len(history)  # no lost update, no phantom success
    assert sorted(history) == sorted(accepted)  # exactly the writes that reported success
    pairs = list(zip(history, history[1:]))
    if mode == "strict":
        assert all(a < b for a, b in pairs), history
    else:
        assert all(a <= b for a, b in pairs), history
    assert last == history[-1]


def test_stress_without_the_fence_shows_what_it_prevents(pg: Db) -> None:
    """Mutant: the same run stamping the token without the predicate lets stale writes land out of order."""
    counter = Counter(pg)
    try:
        _stress(pg, counter, "unfenced")
        history = counter.accepted()
        assert any(a > b for a, b in zip(history, history[1:])), history
    finally:
        counter.drop()


# -- fenced upserts -----------------------------------------------------------------
def test_fenced_upsert_inserts_updates_and_refuses_stale(db: Db, counter: Counter) -> None:
    locker = db.locker()
    old = locker.acquire("resource", ttl=0.05)
    new = takeover(db.locker(), "resource")
    t = counter.table
    with counter.engine.begin() as conn:
        fenced_upsert(conn, t, {"id": 2, "n": 1, "owner": 2}, new)  # insert
    assert counter.row(2) == (1, 2, new.token)
    with counter.engine.begin() as conn:
        fenced_upsert(conn, t, {"id": 2, "n": 5, "owner": 2}, new)  # update by the same lease
    assert counter.row(2) == (5, 2, new.token)
    counter.statements.clear()
    with pytest.raises(FencedOut), counter.engine.begin() as conn:
        fenced_upsert(conn, t, {"id": 2, "n": 99, "owner": 1}, old)
    assert len([s for s in counter.statements if "INSERT" in s]) == 1
    assert counter.row(2) == (5, 2, new.token)
    with pytest.raises(FencedOut) as caught, counter.engine.begin() as conn:
        fenced_upsert(conn, t, {"id": 2, "n": 6, "owner": 2}, new, strict=True)  # strict: once per grant
    assert caught.value.newer == new.token
    assert counter.row(2) == (5, 2, new.token)


def test_fenced_update_with_returning(db: Db, counter: Counter) -> None:
    if not db.locker().backend.update_returning:
        pytest.skip("MariaDB's UPDATE has no RETURNING")
    old = db.locker().acquire("resource", ttl=0.05)
    new = takeover(db.locker(), "resource")
    t = counter.table
    write = update(t).where(t.c.id == 1).returning(t.c.owner)
    with counter.engine.begin() as conn:
        assert fenced_update(conn, write.values(owner=2), new).all() == [(2,)]
    with pytest.raises(FencedOut), counter.engine.begin() as conn:
        fenced_update(conn, write.values(owner=1), old)
    assert counter.row() == (0, 2, new.token)


# -- read-modify-write: stamp first, then read -------------------------------------------
def read_n(conn: Any, counter: Counter) -> int:
    t = counter.table
    return int(conn.execute(select(t.c.n).where(t.c.id == 1)).scalar_one())


def stamp_and_read_n(conn: Any, counter: Counter, lease: Any) -> int:
    t = counter.table
    return int(fenced_read(conn, select(t.c.n).where(t.c.id == 1), lease).scalar_one())


def write_n(conn: Any, counter: Counter, lease: Any, n: int) -> None:
    t = counter.table
    fenced_update(conn, update(t).where(t.c.id == 1).values(n=n), lease)


def test_fenced_read_stamps_and_reads_in_one_statement(db: Db, counter: Counter) -> None:
    """One UPDATE ... RETURNING; without RETURNING on UPDATE (MariaDB), the stamp and a locking
    read of the rows it stamped, in the caller's transaction."""
    locker = db.locker()
    lease = locker.acquire("resource")
    stamp = 1 if locker.backend.update_returning else 2
    counter.statements.clear()
    with counter.engine.begin() as conn:
        n = stamp_and_read_n(conn, counter, lease)
        assert len(counter.statements) == stamp and counter.statements[0].startswith("UPDATE")
        write_n(conn, counter, lease, n + 1)
    assert len(counter.statements) == stamp + 1  # the stamp and the write: no extra SELECT
    assert counter.row() == (1, 0, lease.token)
    with counter.engine.begin() as conn:  # the same lease again: its own stamp does not refuse it
        assert stamp_and_read_n(conn, counter, lease) == 1
    t = counter.table
    with counter.engine.begin() as conn:  # reads like the select: the whole table, keys and all
        rows = fenced_read(conn, select(t).where(t.c.id == 1), lease).mappings().all()
    assert rows == [{"id": 1, "n": 1, "owner": 0, "fence_token": lease.token}]
    with counter.engine.begin() as conn:
        assert fenced_read(conn, select(t.c.n).where(t.c.id == 42), lease).all() == []  # no row: nothing stamped
    assert counter.accepted() == [lease.token] * 4  # stamp, write, stamp, stamp: the token never went down


def test_fenced_read_refuses_when_any_row_carries_a_newer_token(db: Db, counter: Counter) -> None:
    """All or nothing: a read that left out the newer holder's rows would look like a complete one."""
    old = db.locker().acquire("resource", ttl=0.05)
    new = takeover(db.locker(), "resource")
    t = counter.table
    db.query(f"INSERT INTO {counter.name} (id, n, owner) VALUES (2, 0, 0)")
    with counter.engine.begin() as conn:
        stamp_and_read_n(conn, counter, new)  # row 1 now carries the newer token; row 2 does not
    with pytest.raises(FencedOut) as caught, counter.engine.begin() as conn:
        fenced_read(conn, select(t.c.id, t.c.n), old)
    assert (caught.value.token, caught.value.newer) == (old.token, new.token)
    assert "roll back" in str(caught.value)
    assert counter.row(1) == (0, 0, new.token) and counter.row(2) == (0, 0, 0)  # rolled back, never lowered
    history = counter.accepted()
    assert all(a <= b for a, b in zip(history, history[1:])), history


def test_a_naive_read_then_fenced_update_loses_an_update(db: Db, counter: Counter) -> None:
    """Why fenced_read exists. Both writes pass their fence: the fence orders writes, not reads."""
    locker = db.locker()
    a = locker.acquire("resource", ttl=0.05)
    with counter.engine.begin() as conn:
        seen_by_a = read_n(conn, counter)
    b = takeover(db.locker(), "resource")  # A's lease expired while it paused
    with counter.engine.begin() as conn:
        seen_by_b = read_n(conn, counter)
    with counter.engine.begin() as conn:
        write_n(conn, counter, a, seen_by_a + 1)  # late, but no newer token reached the row yet
    with counter.engine.begin() as conn:
        write_n(conn, counter, b, seen_by_b + 1)
    assert counter.accepted() == [a.token, b.token]  # two accepted increments...
    assert counter.row()[0] == 1  # ...and one of them lost


def test_stamp_first_refuses_the_late_write_of_an_older_holder(db: Db, counter: Counter) -> None:
    """The same interleaving through fenced_read: B's stamp reaches the row before A's late write."""
    locker = db.locker()
    a = locker.acquire("resource", ttl=0.05)
    with counter.engine.begin() as conn:
        seen_by_a = stamp_and_read_n(conn, counter, a)
    b = takeover(db.locker(), "resource")
    with counter.engine.begin() as conn:
        seen_by_b = stamp_and_read_n(conn, counter, b)
    with pytest.raises(FencedOut) as caught, counter.engine.begin() as conn:
        write_n(conn, counter, a, seen_by_a + 1)
    assert caught.value.newer == b.token
    with counter.engine.begin() as conn:
        write_n(conn, counter, b, seen_by_b + 1)
    assert counter.row() == (1, 0, b.token)  # one accepted increment, one count


def test_stamp_first_in_one_transaction_makes_the_newer_holder_read_the_older_ones_write(
    db: Db, counter: Counter
) -> None:
    """A stamped and read, then paused past its TTL with its transaction open. B's stamp waits for A's
    transaction; A's late write is legal (nothing newer reached the row) and B reads it."""
    locker = db.locker()
    a = locker.acquire("resource", ttl=0.05)
    conn_a = counter.engine.connect()
    seen_by_a = stamp_and_read_n(conn_a, counter, a)
    wait_for(lambda: not locker.leases(), what="A's lease to expire by database time")
    other = db.locker()
    outcome: list[object] = []

    def holder_b() -> None:
        try:
            # On SQLite A's open transaction holds the database's write lock, so even the takeover
            # waits for it; on PostgreSQL the takeover is granted and the stamp waits for the row.
            b = takeover(other, "resource")
            outcome.append(b)
            with counter.engine.begin() as conn:
                n = stamp_and_read_n(conn, counter, b)
                write_n(conn, counter, b, n + 1)
            outcome.append(n)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=holder_b)
    thread.start()
    b_waited = True
    try:
        if db.backend != "sqlite":  # B's stamp waits for the row lock A's stamp holds
            waiting = lambda: db.lock_waits(f"UPDATE {counter.name}%")  # noqa: E731
            wait_for(lambda: waiting() or not thread.is_alive(), what="B's stamp to wait or finish")
            b_waited = thread.is_alive()
        else:  # A's stamp holds SQLite's write lock, so B's takeover waits for A's commit
            b_waited = write_locked(db)
        write_n(conn_a, counter, a, seen_by_a + 1)
        conn_a.commit()
    finally:
        conn_a.close()  # also on failure: an open transaction would block the table's teardown
        thread.join(30)
    assert b_waited, outcome
    b, seen_by_b = outcome
    assert seen_by_b == 1  # B read A's write
    assert counter.row() == (2, 0, b.token)  # type: ignore[union-attr]  # two accepted increments, two counts


def write_locked(db: Db) -> bool:
    """Whether a transaction holds the SQLite database's write lock right now."""
    probe = sqlite3.connect(make_url(db.url).database, timeout=0, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        probe.close()


def _rmw(db: Db, counter: Counter, mode: str, processes: int = 3, threads: int = 3) -> tuple[int, int, int]:
    """The lost-update loop of issue 11 in ``processes`` x ``threads``: acquire (tiny TTL), read, pause
    0-8 ms, fenced write of read + 1, release. Returns (accepted writes, refused, takeovers seen)."""
    command = [sys.executable, RMW_WORKER, db.url, db.table, counter.name, "0.003", str(threads), "1.5", mode]
    accepted = refused = takeovers = 0
    for out in run_together([command] * processes, cwd=ROOT):
        report = json.loads(out)
        accepted += report["accepted"]
        refused += report["refused"]
        takeovers += report["takeovers"]
    return accepted, refused, takeovers


def test_read_modify_write_loop_loses_no_update_when_it_stamps_first(db: Db, counter: Counter) -> None:
    """3 processes x 3 threads, 3 ms TTLs, pauses of 0-8 ms between the read and the write: with
    fenced_read the counter equals the number of accepted writes, and no stored token went down."""
    accepted, refused, takeovers = _rmw(db, counter, "stamp")
    assert takeovers > 0, "no lease was taken over during a read-modify-write: the loop tested nothing"
    assert accepted + refused >= 45, "the loop did not race"
    n, _, _ = counter.row()
    assert n == accepted, f"{accepted - n} lost updates ({refused} writes refused)"
    history = counter.accepted()
    assert all(a <= b for a, b in zip(history, history[1:])), "a stored token went down"


# -- the fences table -----------------------------------------------------------------
def test_fence_table_refuses_a_stale_token_and_rolls_back_the_callers_writes(db: Db, counter: Counter) -> None:
    old = db.locker().acquire("report", ttl=0.05)
    new = takeover(db.locker(), "report")
    t = counter.table
    with counter.engine.begin() as conn:
        fence(conn, new)  # resource defaults to the lease's name
        conn.execute(update(t).where(t.c.id == 1).values(owner=2))
    assert db.query(f"SELECT resource, last_token FROM {fences_table_name(db.table)}") == [("report", new.token)]
    with pytest.raises(FencedOut) as caught, counter.engine.begin() as conn:
        conn.execute(update(t).where(t.c.id == 1).values(owner=1))  # written first, in the same transaction
        fence(conn, old)
    assert caught.value.newer == new.token
    assert counter.row() == (0, 2, 0)  # the stale holder's other write rolled back with the fence
    with counter.engine.begin() as conn:
        fence(conn, new)  # the same lease passes again (default mode)
    with pytest.raises(FencedOut), counter.engine.begin() as conn:
        fence(conn, new, strict=True)
    with counter.engine.begin() as conn:
        fence(conn, new.token, "other", table=db.table)  # a bare token (e.g. from $DBLOCK_TOKEN)
    assert sorted(db.query(f"SELECT resource, last_token FROM {fences_table_name(db.table)}")) == [
        ("other", new.token),
        ("report", new.token),
    ]


# -- commit-time lease check -----------------------------------------------------------
def test_commit_guard_commits_while_the_lease_is_live(db: Db, counter: Counter) -> None:
    lease = db.locker().acquire("resource")
    t = counter.table
    with counter.engine.connect() as conn, dblock.commit_guard(conn, lease):
        conn.execute(update(t).where(t.c.id == 1).values(owner=1))
    assert counter.row() == (0, 1, 0)


def test_commit_guard_checks_a_commit_made_inside_the_block(db: Db, counter: Counter) -> None:
    lease = db.locker().acquire("resource")
    t = counter.table
    with pytest.raises(LeaseLost), counter.engine.connect() as conn, dblock.commit_guard(conn, lease):
        conn.execute(update(t).where(t.c.id == 1).values(owner=1))
        conn.commit()  # checked: still live
        lease.release()
        conn.execute(update(t).where(t.c.id == 1).values(owner=2))
        conn.commit()  # checked: gone, so rolled back
    assert counter.row() == (0, 1, 0)


def test_the_check_uses_the_time_of_the_check_not_of_the_transactions_start(db: Db, counter: Counter) -> None:
    """A transaction that began while the lease was live must not pass the check after it expired."""
    locker = db.locker()
    lease = locker.acquire("resource", ttl=0.3)
    t = counter.table
    with pytest.raises(LeaseLost), counter.engine.connect() as conn, dblock.commit_guard(conn, lease):
        conn.execute(update(t).where(t.c.id == 1).values(owner=1))  # the transaction begins
        wait_for(lambda: not locker.leases(), what="the lease to expire by database time")
    assert counter.row() == (0, 0, 0)


def test_check_lease_refuses_an_autocommit_connection(db: Db, counter: Counter) -> None:
    lease = db.locker().acquire("resource")
    with counter.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        with pytest.raises(ValueError, match="AUTOCOMMIT"):
            dblock.check_lease(conn, lease)


@pytest.mark.parametrize("via", ["connection", "session"])
def test_commit_guard_refuses_an_autocommit_connection_before_the_block_runs(
    db: Db, counter: Counter, via: str
) -> None:
    """Each statement of an AUTOCOMMIT connection commits at once, unchecked: the guard must refuse
    on entering, so no write inside the block can reach the table."""
    from sqlalchemy.orm import Session

    lease = db.locker().acquire("resource")
    t = counter.table
    autocommit = counter.engine.execution_options(isolation_level="AUTOCOMMIT")
    ran: list[bool] = []
    with autocommit.connect() as conn, Session(autocommit) as session:
        target: Any = conn if via == "connection" else session
        counter.statements.clear()
        with pytest.raises(ValueError, match="AUTOCOMMIT"), dblock.commit_guard(target, lease):
            ran.append(True)
            target.execute(update(t).where(t.c.id == 1).values(owner=1))
        assert not ran, "the block's body ran on an AUTOCOMMIT connection"
        assert counter.statements == []
        if via == "session":
            assert not session.in_transaction()  # the check left no transaction behind
    assert counter.row() == (0, 0, 0)
    assert counter.accepted() == []


def lost_lease(db: Db, how: str) -> dblock.Lease:
    """A lease on "resource" that is gone before it is used: "expired", "taken over" or "released"."""
    locker = db.locker()
    lease = locker.acquire("resource", ttl=0.05 if how != "released" else 30)
    if how == "released":
        lease.release()
    elif how == "taken over":
        takeover(db.locker(), "resource")
    else:
        wait_for(lambda: not locker.leases(), what="the lease to expire by database time")
    return lease


@pytest.mark.parametrize("lost", ["expired", "taken over", "released"])
def test_commit_guard_rolls_back_when_the_lease_is_gone(db: Db, counter: Counter, lost: str) -> None:
    lease = lost_lease(db, lost)
    t = counter.table
    with pytest.raises(LeaseLost), counter.engine.connect() as conn, dblock.commit_guard(conn, lease):
        conn.execute(update(t).where(t.c.id == 1).values(owner=1))
    assert counter.row() == (0, 0, 0)


class Takeover:
    """Another client's acquire of "resource", tried while a checked transaction is open.

    ``before``: whether it was granted then. ``after_commit()``: whether it is
    granted once that transaction has ended. Shared with the asyncio tests.
    """

    def __init__(self, db: Db) -> None:
        self.other = db.locker()
        self.granted: list[dblock.Lease] = []
        self.thread: threading.Thread | None = None
        if db.backend != "sqlite":
            self.thread = threading.Thread(target=self._acquire)
            self.thread.start()
            # The takeover's UPDATE waits for the row lock that the check holds, or is granted.
            thread = self.thread
            wait_for(
                lambda: db.lock_waits(f"%{db.table}%") or not thread.is_alive(), what="the takeover to wait or finish"
            )
        else:
            try:  # the takeover needs SQLite's write lock, which the check took
                self.granted.append(self.other.acquire("resource", timeout=0.2))
            except dblock.LockNotAcquired:
                pass
        self.before = bool(self.granted)

    def _acquire(self) -> None:
        self.granted.append(self.other.acquire("resource", timeout=30))

    def after_commit(self) -> bool:
        if self.thread is not None:
            self.thread.join(30)
        elif not self.granted:
            self.granted.append(self.other.acquire("resource", timeout=0))
        return bool(self.granted)


def _guarded_takeover(db: Db, counter: Counter) -> tuple[bool, bool]:
    """Check the lease, let it expire, try a takeover while the checked transaction is open.

    Returns (takeover granted before the commit, takeover granted after it).
    """
    locker = db.locker()
    lease = locker.acquire("resource", ttl=0.3)
    t = counter.table
    conn = counter.engine.connect()
    dblock.check_lease(conn, lease)  # first in the transaction: what it locks must hold until commit
    wait_for(lambda: not locker.leases(), what="the lease to expire by database time")
    attempt = Takeover(db)
    conn.execute(update(t).where(t.c.id == 1).values(owner=1))
    conn.commit()
    conn.close()
    return attempt.before, attempt.after_commit()


def test_a_checked_lease_cannot_be_taken_over_before_the_commit(db: Db, counter: Counter) -> None:
    before, after = _guarded_takeover(db, counter)
    assert (before, after) == (False, True)
    assert counter.row() == (0, 1, 0)


def test_without_the_row_lock_the_takeover_slips_in(
    db: Db, counter: Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: the same check as a plain read. The takeover is then granted before the commit."""
    from dblock.backends import MariaDB, PostgreSQL, SQLite
    from dblock.backends.mariadb import CLOCK
    from dblock.statements import SQLITE_NOW

    def plain_read(now: str) -> Any:
        return classmethod(
            lambda cls, t: f"SELECT token FROM {t} WHERE name = :name AND owner = :owner AND token = :token"
            f" AND expires_at > {now}"
        )

    monkeypatch.setattr(PostgreSQL, "lease_check", plain_read("clock_timestamp()"))
    monkeypatch.setattr(SQLite, "lease_check", plain_read(SQLITE_NOW))
    monkeypatch.setattr(MariaDB, "lease_check", plain_read(CLOCK))
    before, _ = _guarded_takeover(db, counter)
    assert before is True


# -- bad input changes nothing ----------------------------------------------------------
nullable_fence = Table("nullable_fence", MetaData(), Column("n", Integer), Column("fence_token", BigInteger))


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda c, t, l: fenced_update(c, update(t).values(n=1), True), TypeError),
        (lambda c, t, l: fenced_update(c, update(t).values(n=1), 0), ValueError),
        (lambda c, t, l: fenced_update(c, update(t).values(n=1), 2**63), ValueError),
        (lambda c, t, l: fenced_update(c, update(t).values(n=1), "5"), TypeError),
        (lambda c, t, l: fenced_update(c, update(t).values(fence_token=99), l), ValueError),
        (lambda c, t, l: fenced_update(c, update(t).values(n=1), l, column="nope"), ValueError),
        (lambda c, t, l: fenced_update(c, insert(t).values(n=1), l), TypeError),  # type: ignore[arg-type]
        (lambda c, t, l: fenced_upsert(c, t, {}, l), ValueError),
        (lambda c, t, l: fenced_upsert(c, t, {"nope": 1}, l), ValueError),
        (lambda c, t, l: fenced_upsert(c, t, {"n": 1, "fence_token": 5}, l), ValueError),
        (lambda c, t, l: fenced_upsert(c, t, {"n": 1}, l, index_elements=["nope"]), ValueError),
        (lambda c, t, l: fence(c, l, ""), ValueError),
        (lambda c, t, l: fence(c, l, "x" * 256), ValueError),
        (lambda c, t, l: fence(c, l.token), TypeError),
        (lambda c, t, l: fence(c, l, table="bad name"), ValueError),
        (lambda c, t, l: dblock.check_lease(c, l.token), TypeError),
        (lambda c, t, l: fenced_update(c, update(nullable_fence).values(n=1), l), ValueError),
        (lambda c, t, l: fenced_read(c, update(t).values(n=1), l), TypeError),  # type: ignore[arg-type]
        (lambda c, t, l: fenced_read(c, select(t.c.n), 0), ValueError),
        (lambda c, t, l: fenced_read(c, select(t.c.n), l, column="nope"), ValueError),
        (lambda c, t, l: fenced_read(c, select(nullable_fence.c.n), l), ValueError),
        (lambda c, t, l: fenced_read(c, select(t.c.n).order_by(t.c.n), l), ValueError),
        (lambda c, t, l: fenced_read(c, select(t.c.n).limit(1), l), ValueError),
        (lambda c, t, l: fenced_read(c, select(t.c.n).offset(1), l), ValueError),
        (lambda c, t, l: fenced_read(c, select(t.c.n).distinct(), l), ValueError),
        (lambda c, t, l: fenced_read(c, select(t.c.n).with_for_update(skip_locked=True), l), ValueError),
        (lambda c, t, l: fenced_read(c, select(t.c.n).group_by(t.c.n), l), ValueError),
        (lambda c, t, l: fenced_read(c, select(t.c.n, nullable_fence.c.n), l), ValueError),
        (lambda c, t, l: fenced_read(c, select(t.c.n).join(nullable_fence, t.c.n == nullable_fence.c.n), l), ValueError),
        (lambda c, t, l: fenced_read(c, select(func.count()).select_from(t), l), ValueError),
        (lambda c, t, l: fenced_read(c, select(func.max(t.c.n)), l), ValueError),
        (lambda c, t, l: fenced_read(c, select(t.c.n + 1), l), ValueError),
        (lambda c, t, l: fenced_read(c, select(t.c.n.label("m")), l), ValueError),
    ],
)
def test_bad_input_is_refused_before_any_sql(db: Db, counter: Counter, call: Any, error: type) -> None:
    lease = db.locker().acquire("resource")
    before = counter.row()
    counter.statements.clear()
    with counter.engine.begin() as conn, pytest.raises(error):
        call(conn, counter.table, lease)
    assert counter.statements == []
    assert counter.row() == before


def test_fence_without_dblocks_tables_says_what_to_run(db: Db, counter: Counter) -> None:
    lease = db.locker().acquire("resource")
    with pytest.raises(dblock.SchemaMissing, match="dblock migrate"), counter.engine.begin() as conn:
        fence(conn, lease.token, "r", table="no_such_locks")

