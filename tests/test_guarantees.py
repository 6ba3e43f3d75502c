"""G1-G7 of DESIGN.md, on PostgreSQL, SQLite and MariaDB, with real threads and processes."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dblock
from dblock import DBLockError, LeaseLost, Locker

from .conftest import ALL_BACKENDS, Db, trusted, wait_for
from .workers import run_together

HERE = Path(__file__).resolve().parent
BACKENDS = ALL_BACKENDS


# -- an audit of every row transition, kept by the database itself -------------
def install_audit(db: Db) -> None:
    t = db.table
    if db.backend == "postgresql":
        db.query(
            f"CREATE TABLE {t}_audit (seq bigserial PRIMARY KEY, op text, old_owner text, new_owner text,"
            " old_token bigint, new_token bigint)"
        )
        db.query(
            f"""CREATE FUNCTION {t}_audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF TG_OP = 'INSERT' THEN
                INSERT INTO {t}_audit (op, new_owner, new_token) VALUES ('I', NEW.owner, NEW.token);
              ELSIF TG_OP = 'UPDATE' THEN
                INSERT INTO {t}_audit (op, old_owner, new_owner, old_token, new_token)
                VALUES ('U', OLD.owner, NEW.owner, OLD.token, NEW.token);
              ELSE
                INSERT INTO {t}_audit (op, old_owner, old_token) VALUES ('D', OLD.owner, OLD.token);
              END IF;
              RETURN NULL;
            END $$"""
        )
        db.query(
            f"CREATE TRIGGER {t}_audit_tr AFTER INSERT OR UPDATE OR DELETE ON {t}"
            f" FOR EACH ROW EXECUTE FUNCTION {t}_audit_fn()"
        )
    elif db.backend == "mariadb":
        # AUTO_INCREMENT numbers the rows as the triggers run; one name's grants run one at a
        # time under its row lock, so their order is the grants' order.
        db.query(
            f"CREATE TABLE {t}_audit (seq BIGINT AUTO_INCREMENT PRIMARY KEY, op CHAR(1), old_owner VARCHAR(32),"
            " new_owner VARCHAR(32), old_token BIGINT, new_token BIGINT)"
        )
        db.query(
            f"CREATE TRIGGER {t}_ai AFTER INSERT ON {t} FOR EACH ROW INSERT INTO {t}_audit (op, new_owner, new_token)"
            " VALUES ('I', NEW.owner, NEW.token)"
        )
        db.query(
            f"CREATE TRIGGER {t}_au AFTER UPDATE ON {t} FOR EACH ROW INSERT INTO {t}_audit"
            " (op, old_owner, new_owner, old_token, new_token) VALUES ('U', OLD.owner, NEW.owner, OLD.token, NEW.token)"
        )
        db.query(
            f"CREATE TRIGGER {t}_ad AFTER DELETE ON {t} FOR EACH ROW INSERT INTO {t}_audit (op, old_owner, old_token)"
            " VALUES ('D', OLD.owner, OLD.token)"
        )
    else:
        db.query(
            f"CREATE TABLE {t}_audit (seq INTEGER PRIMARY KEY AUTOINCREMENT, op TEXT, old_owner TEXT,"
            " new_owner TEXT, old_token INTEGER, new_token INTEGER)"
        )
        db.query(
            f"CREATE TRIGGER {t}_ai AFTER INSERT ON {t} BEGIN INSERT INTO {t}_audit (op, new_owner, new_token)"
            " VALUES ('I', NEW.owner, NEW.token); END"
        )
        db.query(
            f"CREATE TRIGGER {t}_au AFTER UPDATE ON {t} BEGIN INSERT INTO {t}_audit"
            " (op, old_owner, new_owner, old_token, new_token)"
            " VALUES ('U', OLD.owner, NEW.owner, OLD.token, NEW.token); END"
        )
        db.query(
            f"CREATE TRIGGER {t}_ad AFTER DELETE ON {t} BEGIN INSERT INTO {t}_audit (op, old_owner, old_token)"
            " VALUES ('D', OLD.owner, OLD.token); END"
        )


def audited_grants(db: Db) -> list[int]:
    """Tokens of every grant, in the order the database made them."""
    rows = db.query(f"SELECT op, old_token, new_token FROM {db.table}_audit ORDER BY seq")
    return [new for op, old, new in rows if op == "I" or (op == "U" and new != old)]


def start_holder(db: Db, name: str, ttl: float) -> subprocess.Popen:
    """A holder_worker process that has acquired `name`; its first line is the token."""
    return subprocess.Popen(
        [sys.executable, str(HERE / "holder_worker.py"), db.url, db.table, name, str(ttl)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def inversions(tokens: list[int]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in zip(tokens, tokens[1:]) if b <= a]


# -- G1 + G2 under a real race --------------------------------------------------
@pytest.mark.parametrize("mode", ["try", "fair", "fair-poll", "line", "async-try", "async-fair", "async-line"])
def test_g1_g2_race_of_processes_and_threads(db: Db, mode: str) -> None:
    """3 processes x 4 threads take one name with 5 ms TTLs for 3 s (waiting modes: 2 s, TTLs of
    10 acquire+release pairs, at least 10 ms).

    ``mode`` is how they take it: try_acquire in a loop, or blocking acquires
    that queue with NOTIFY hand-offs (fair), queue and poll (fair-poll), or
    poll in a local line per process (line, which is also what SQLite does);
    ``async-``: the same with the asyncio API, 4 tasks per process.
    Holders sometimes overrun their TTL, so takeovers at expiry mix with
    releases and hand-offs. The database's audit must show every grant's
    token above the previous grant's (G2), every token a client got must be
    unique and audited, and no two clients may have trusted their leases at
    the same moment (G1 with G5).
    """
    probe = db.locker()
    if not probe.backend.caps.fair_queue and mode.removeprefix("async-").startswith("fair"):
        pytest.skip(f"{probe.backend.title} has no queue: fair modes wait in the local line, tested as 'line'")
    install_audit(db)
    probe.try_acquire("warm").release()
    # A waiting grant takes a few durable commits (queue, release, sometimes an
    # extend): its TTL must outlast them, or every lease would expire unused and
    # G1 would hold trivially. Scale it to this machine's commit time.
    started = time.monotonic()
    for _ in range(5):
        probe.try_acquire("warm").release()
    pair = (time.monotonic() - started) / 5
    ttl = "0.005" if mode.endswith("try") else repr(min(0.5, max(0.01, 10 * pair)))
    duration = "3" if mode.endswith("try") else "2"
    command = [sys.executable, str(HERE / "race_worker.py"), db.url, db.table, "hot", ttl, "4", duration, mode]
    grants = [g for out in run_together([command] * 3) for g in json.loads(out)]
    assert_race_was_safe(db, grants)


def assert_race_was_safe(db: Db, grants: list[list[float]]) -> None:
    """The race's checks: [token, received, trusted_until] per grant from the workers, and the audit."""
    tokens = [int(g[0]) for g in grants]
    audited = audited_grants(db)
    assert len(tokens) >= 100, f"only {len(tokens)} grants: the race did not race"
    assert inversions(audited) == [], "a grant got a token below an earlier grant's (G2)"
    assert len(set(tokens)) == len(tokens), "a token was handed out twice"
    assert set(tokens) <= set(audited)

    # G1 as the clients saw it: trusted windows [received, trusted_until] never overlap.
    # (1e-4 s covers the rate difference between the realtime and monotonic clocks.)
    windows = sorted((r, u, t) for t, r, u in grants if u > r)
    latest_end, latest_token = -math.inf, None
    for received, until, token in windows:
        assert received >= latest_end - 1e-4, f"token {token} trusted while token {latest_token} still was"
        if until > latest_end:
            latest_end, latest_token = until, token


@pytest.mark.parametrize("variant", ["dblock", "broken: token drawn before the row lock"])
def test_g2_token_is_drawn_after_the_row_lock(pg: Db, variant: str) -> None:
    """A deterministic replay of the race in DESIGN.md §3.

    Acquire A reads a free row and blocks on its row lock; meanwhile grant B
    draws a token and commits. A must then draw a token above B's. The broken
    variant (the token taken in VALUES, DO UPDATE SET token = EXCLUDED.token)
    writes the token it drew before waiting, below B's: this test catches it.
    """
    import dataclasses
    import threading

    import psycopg

    from .conftest import libpq_dsn

    locker = pg.locker()
    locker.try_acquire("x").release()
    t, seq = pg.table, f"{pg.table}_token_seq"
    if variant != "dblock":
        broken = f"""
        INSERT INTO {t} (name, owner, token, acquired_at, expires_at)
        VALUES (%(name)s, %(owner)s, nextval('{seq}'), now(), now() + %(ttl)s * interval '1 second')
        ON CONFLICT (name) DO UPDATE SET owner = EXCLUDED.owner, token = EXCLUDED.token,
            acquired_at = EXCLUDED.acquired_at, expires_at = EXCLUDED.expires_at
        WHERE {t}.owner IS NULL OR {t}.expires_at <= now()
        RETURNING true, token, expires_at, NULL::float8"""
        locker.backend.sql = dataclasses.replace(locker.backend.sql, acquire=broken)

    blocker = psycopg.connect(libpq_dsn(pg.url))
    blocker.execute(f"SELECT 1 FROM {t} WHERE name = 'x' FOR UPDATE")
    result: list = []
    thread = threading.Thread(target=lambda: result.append(locker.try_acquire("x", ttl=30)))
    thread.start()

    watcher = psycopg.connect(libpq_dsn(pg.url), autocommit=True)

    def a_is_waiting() -> bool:
        return bool(
            watcher.execute(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                (f"%{t}%",),
            ).fetchall()
        )

    wait_for(a_is_waiting, what="acquire A to block on the row lock")
    (b_token,) = blocker.execute(
        f"UPDATE {t} SET owner = 'B', token = nextval('{seq}'), acquired_at = now(),"
        " expires_at = now() - interval '1 second' WHERE name = 'x' RETURNING token"
    ).fetchone()
    blocker.commit()
    thread.join(30)
    blocker.close()
    watcher.close()
    assert result and result[0] is not None
    a_token = result[0].token
    if variant == "dblock":
        assert a_token > b_token
    else:
        assert a_token < b_token, "the check above would not have caught the broken statement"


# MariaDB's acquire, broken in the two ways its statement is written to avoid. Each keeps the
# rest of dblock's block as it is; the race's checks must fail on each.
MARIADB_MUTANTS = {
    # The token read before the row is locked (a consistent read), then written after the wait:
    # a grant that committed meanwhile drew the same number. A 0-3 ms pause after the read
    # widens the window, as a busy server would.
    "token drawn before the row lock": [
        ("UPDATE {t} SET",
         "SELECT token + 1 INTO @dblock_k FROM {t} WHERE name = %(name)s; DO SLEEP(RAND() * 0.003);\nUPDATE {t} SET"),
        ("IF(owner <=> %(owner)s, token, token + 1), token),", "IF(owner <=> %(owner)s, token, @dblock_k), token),"),
    ],
    # owner assigned first (rightly, from the old values): the assignments after it read the new
    # owner, so a takeover looks like the owner's own retry and keeps the previous holder's token.
    "the condition reading a column assigned before it": [
        ("    token = IF(@dblock_g :=",
         "    owner = IF(owner IS NULL OR expires_at <= {now} OR owner = %(owner)s, %(owner)s, owner),\n"
         "    token = IF(@dblock_g :="),
        ("    owner = IF(@dblock_g, %(owner)s, owner)\nWHERE", "    label = label\nWHERE"),
        ("GREATEST(expires_at,", "GREATEST(COALESCE(expires_at, 0),"),  # a released row has no expiry
    ],
}


@pytest.mark.parametrize("backend", ["mariadb"])
@pytest.mark.parametrize("mutant", sorted(MARIADB_MUTANTS))
def test_the_race_catches_a_broken_mariadb_acquire(db: Db, mutant: str) -> None:
    """The audited race with a broken acquire statement in every worker: its checks fail."""
    from dblock.backends.mariadb import NOW

    locker = db.locker()
    broken = locker.backend.sql.acquire
    for find, put in MARIADB_MUTANTS[mutant]:
        find, put = find.format(t=db.table, now=NOW), put.format(t=db.table, now=NOW)
        assert broken.count(find) == 1, f"the mutant no longer matches dblock's statement: {find!r}"
        broken = broken.replace(find, put)
    install_audit(db)
    locker.try_acquire("warm").release()
    env = {**os.environ, "DBLOCK_RACE_ACQUIRE": broken}
    command = [sys.executable, str(HERE / "race_worker.py"), db.url, db.table, "hot", "0.005", "4", "3", "try"]
    grants = [g for out in run_together([command] * 3, env=env) for g in json.loads(out)]
    with pytest.raises(AssertionError):
        assert_race_was_safe(db, grants)


def test_g2_after_holder_crash(db: Db) -> None:
    """A holder killed with SIGKILL: the next grant, after its TTL, has a larger token."""
    holder = start_holder(db, "crash", 0.3)
    dead_token = int(holder.stdout.readline())
    holder.kill()
    holder.wait(10)
    lease = db.locker().acquire("crash", timeout=30)
    assert lease.token > dead_token


def test_g3_paused_process_loses_its_lease(db: Db) -> None:
    """A holder stopped with SIGSTOP past its TTL wakes up unable to extend or release."""
    holder = start_holder(db, "paused", 0.3)
    try:
        old_token = int(holder.stdout.readline())
        os.kill(holder.pid, signal.SIGSTOP)
        taker = db.locker().acquire("paused", ttl=60, timeout=30)  # waits out the TTL
        before = db.rows()
        os.kill(holder.pid, signal.SIGCONT)
        holder.stdin.write("remaining\nextend\nrelease\nexit\n")
        holder.stdin.flush()
        remaining = float(holder.stdout.readline())
        assert remaining == 0.0  # it knows, by its own monotonic clock, not to trust the lease
        assert holder.stdout.readline().strip() == "lost"
        assert holder.stdout.readline().strip() == "False"
        assert db.rows() == before
        assert taker.token > old_token
    finally:
        holder.kill()
        holder.wait(10)


def test_g3_extend_after_expiry_works_if_nobody_took_over(locker: Locker) -> None:
    lease = locker.try_acquire("late", ttl=0.05)
    wait_for(lambda: lease.remaining() == 0, what="the lease to run out")
    lease.extend(ttl=60)
    assert locker.try_acquire("late") is None
    assert lease.release() is True


def test_g3_foreign_owner_or_token_changes_nothing(db: Db) -> None:
    locker = db.locker()
    lease = locker.try_acquire("mine", ttl=60)
    before = db.rows()
    forged_owner = dblock.Lease(locker, "mine", "0" * 32, lease.token, lease.expires_at, 60, time.monotonic())
    forged_token = dblock.Lease(locker, "mine", lease.owner, lease.token + 1, lease.expires_at, 60, time.monotonic())
    for forged in (forged_owner, forged_token):
        assert forged.release() is False
        with pytest.raises(LeaseLost):
            forged.extend()
    assert db.rows() == before


# -- G5 --------------------------------------------------------------------------
@pytest.mark.parametrize("shift", [-10 * 365 * 86400, 10 * 365 * 86400])
def test_g5_client_wall_clock_changes_nothing(locker: Locker, monkeypatch: pytest.MonkeyPatch, shift: int) -> None:
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + shift)
    monkeypatch.setattr(time, "time_ns", lambda: int((real_time() + shift) * 1e9))
    lease = locker.try_acquire("clock", ttl=30)
    assert lease is not None and trusted(30) - 1 < lease.remaining() <= trusted(30)
    assert locker.try_acquire("clock") is None
    lease.extend(ttl=60)
    assert trusted(60) - 1 < lease.remaining() <= trusted(60)
    assert [i.name for i in locker.leases()] == ["clock"]
    assert 59 < locker.leases()[0].remaining <= 60.01
    assert lease.release() is True
    with Locker(locker.engine, table=locker.table) as other:  # another holder: this thread would be told it holds it
        short = other.try_acquire("clock", ttl=0.05)
        assert locker.acquire("clock", timeout=30).token > short.token  # expiry still decided by the database


def test_g6_dropped_reply_on_postgresql_returns_the_lease(pg: Db) -> None:
    """The connection dies after the server committed the grant: the retry returns it."""
    from .pgproxy import PgProxy

    proxy = PgProxy(pg.url)
    try:
        locker = Locker(proxy.url, table=pg.table)
        locker.try_acquire("warm").release()  # prepares the statements on the connection
        proxy.drop_next_reply()
        connections = proxy.connections
        lease = locker.try_acquire("g6", ttl=60)
        assert proxy.dropped.is_set(), "the proxy did not drop the reply"
        assert b"E" in proxy.dropped_kinds, "the lost round trip did not execute the acquire"
        assert proxy.connections == connections + 1, "no retry on a fresh connection"
        assert lease is not None
        ((owner, token),) = pg.query(f"SELECT owner, token FROM {pg.table} WHERE name = 'g6'")
        assert (lease.owner, lease.token) == (owner, token)
        ((last,),) = pg.query(f"SELECT last_value FROM {pg.table}_token_seq")
        assert last == token, "the retry drew a second token"
        assert lease.release() is True
        locker.close()
    finally:
        proxy.close()


def test_g6_retried_release_is_harmless(pg: Db) -> None:
    from .pgproxy import PgProxy

    proxy = PgProxy(pg.url)
    try:
        locker = Locker(proxy.url, table=pg.table)
        locker.try_acquire("warm").release()  # prepares acquire and release
        lease = locker.try_acquire("rel", ttl=60)
        proxy.drop_next_reply()
        # The first release committed and its reply was lost; the retry finds the
        # lease already ended, by nobody else: this call did end it.
        assert lease.release() is True
        assert proxy.dropped.is_set() and b"E" in proxy.dropped_kinds
        assert lease.release() is False
        locker.close()
    finally:
        proxy.close()
    assert pg.query(f"SELECT owner FROM {pg.table} WHERE name = 'rel'") == [(None,)]
    assert Locker(pg.url, table=pg.table).try_acquire("rel") is not None


# -- G7 --------------------------------------------------------------------------
BAD_NAMES = ["", "x" * 256, "a\x00b", "\ud800", 123, None, b"bytes"]
BAD_TTLS = [0, -1, float("nan"), float("inf"), 1e12, 0.0001, True, "30"]
BAD_TIMEOUTS = [-1, -0.001, float("nan"), "5", True]


@pytest.mark.parametrize(
    "url",
    [
        "not a url",
        "oracle://root@localhost/test",
        "postgresql+asyncpg://u@h/db?command_timeout=5",  # asyncpg works; this argument has no libpq meaning
        "postgresql+pg8000://u@h/db",
        "sqlite://",
        "sqlite:///:memory:",
        "nosuchdb://x",
        42,
    ],
    ids=repr,
)
def test_g7_bad_urls_are_refused_up_front(url: object) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        Locker(url)  # type: ignore[arg-type]
    assert str(info.value)


def test_g7_unreachable_database_is_a_clear_error() -> None:
    locker = Locker("postgresql+psycopg://nobody:pw@127.0.0.1:1/none")
    with pytest.raises(dblock.DatabaseUnavailable) as info:
        locker.try_acquire("x")
    assert "cannot connect" in str(info.value) and "pw" not in str(info.value)


def test_g7_missing_table_is_a_clear_error_and_creates_nothing(db: Db) -> None:
    locker = db.locker(table="not_migrated")
    for call in (lambda: locker.try_acquire("x"), locker.leases, lambda: locker.acquire("x", timeout=0)):
        with pytest.raises(dblock.SchemaMissing) as info:
            call()
        assert "dblock migrate" in str(info.value)
    missing = {
        "postgresql": "SELECT to_regclass('not_migrated')",
        "sqlite": "SELECT name FROM sqlite_master WHERE name = 'not_migrated'",
        "mariadb": "SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE()"
        " AND table_name = 'not_migrated'",
    }[db.backend]
    assert db.query(missing) in ([(None,)], [])


def test_error_classes_share_one_base() -> None:
    for cls in (dblock.LockNotAcquired, dblock.LeaseLost, dblock.SchemaMissing, dblock.DatabaseUnavailable):
        assert issubclass(cls, DBLockError)
