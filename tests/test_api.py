"""The public API on both backends: acquire, hold, extend, release, inspect."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from datetime import datetime

import pytest
from sqlalchemy import create_engine

from dblock import DBLockError, Lease, LeaseLost, Locker, LockNotAcquired

from .conftest import Db


def test_try_acquire_grants_then_refuses(locker: Locker) -> None:
    lease = locker.try_acquire("report", ttl=30)
    assert isinstance(lease, Lease)
    assert lease.name == "report" and isinstance(lease.token, int) and lease.token >= 1
    assert len(lease.owner) == 32
    assert isinstance(lease.expires_at, datetime) and lease.expires_at.tzinfo is not None
    assert 29 < lease.remaining() <= 30
    assert locker.try_acquire("report") is None
    assert locker.try_acquire("other") is not None


def test_release_frees_the_name_and_reports_once(locker: Locker) -> None:
    lease = locker.try_acquire("job")
    assert lease.release() is True
    assert lease.remaining() == 0
    assert lease.release() is False
    again = locker.try_acquire("job")
    assert again is not None and again.token > lease.token


def test_tokens_grow_across_names_and_grants(locker: Locker) -> None:
    tokens = []
    for i in range(20):
        lease = locker.try_acquire(f"n{i % 3}")
        tokens.append(lease.token)
        lease.release()
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_extend_moves_expiry_by_database_clock(locker: Locker) -> None:
    lease = locker.try_acquire("x", ttl=5)
    before = lease.expires_at
    lease.extend(ttl=60)
    assert lease.expires_at > before
    assert 59 < lease.remaining() <= 60
    assert lease.ttl == 60
    lease.extend()  # the lease's own ttl by default
    assert 59 < lease.remaining() <= 60


def test_extend_after_release_raises_lease_lost(locker: Locker) -> None:
    lease = locker.try_acquire("x")
    lease.release()
    with pytest.raises(LeaseLost):
        lease.extend()


def test_lock_context_releases_on_exit_and_on_error(locker: Locker) -> None:
    with locker.lock("ctx", ttl=10, timeout=1) as lease:
        assert locker.try_acquire("ctx") is None
    assert locker.try_acquire("ctx") is not None

    with pytest.raises(RuntimeError):
        with locker.lock("ctx2") as lease:
            raise RuntimeError("boom")
    assert lease.remaining() == 0
    assert locker.try_acquire("ctx2") is not None


def test_lease_is_a_context_manager(locker: Locker) -> None:
    with locker.try_acquire("direct") as lease:
        assert lease.remaining() > 0
    assert locker.try_acquire("direct") is not None


def test_lock_context_raises_lease_lost_if_taken_over(db: Db) -> None:
    a, b = db.locker(), db.locker()
    with pytest.raises(LeaseLost):
        with a.lock("x", ttl=0.05):
            b.acquire("x", timeout=10)  # waits for the expiry, then takes over


def test_acquire_waits_for_release(locker: Locker) -> None:
    first = locker.try_acquire("w", ttl=30)
    got: list[Lease] = []
    waiter = threading.Thread(target=lambda: got.append(locker.acquire("w", timeout=30)))
    waiter.start()
    first.release()
    waiter.join(30)
    assert got and got[0].token > first.token


def test_acquire_waits_for_expiry(locker: Locker) -> None:
    first = locker.try_acquire("e", ttl=0.2)
    second = locker.acquire("e", timeout=30)
    assert second.token > first.token
    assert first.release() is False


def test_acquire_times_out(locker: Locker) -> None:
    locker.try_acquire("busy", ttl=30)
    with pytest.raises(LockNotAcquired) as info:
        locker.acquire("busy", timeout=0.05)
    assert "busy" in str(info.value)
    with pytest.raises(LockNotAcquired):
        locker.acquire("busy", timeout=0)  # one attempt
    with pytest.raises(LockNotAcquired):
        with locker.lock("busy", timeout=0):
            pass


def test_locker_default_timeout(db: Db) -> None:
    locker = db.locker(timeout=0.05)
    locker.try_acquire("busy")
    with pytest.raises(LockNotAcquired):
        locker.acquire("busy")


def test_leases_lists_unexpired_with_database_remaining(locker: Locker) -> None:
    a = locker.try_acquire("a", ttl=30)
    locker.try_acquire("b", ttl=60)
    locker.try_acquire("gone").release()
    infos = locker.leases()
    assert [i.name for i in infos] == ["a", "b"]
    assert infos[0].owner == a.owner and infos[0].token == a.token
    assert 29 < infos[0].remaining <= 30.01 and 59 < infos[1].remaining <= 60.01
    assert infos[0].expires_at.tzinfo is not None


def test_prune_drops_idle_rows_and_tokens_keep_growing(db: Db) -> None:
    locker = db.locker()
    held = locker.try_acquire("held", ttl=60)
    last = None
    for name in ("a", "b", "c"):
        last = locker.try_acquire(name)
        last.release()
    hour = "interval '1 hour'" if db.backend == "postgresql" else "3600"
    db.query(f"UPDATE {db.table} SET acquired_at = acquired_at - {hour} WHERE name <> 'held'")
    removed = locker.prune(older_than=60)
    names = {r[0] for r in db.rows()}
    # "c" holds the largest token on SQLite and is kept there, so max(token) never falls.
    assert "held" in names and "a" not in names and "b" not in names
    assert removed == (2 if db.backend == "sqlite" else 3)
    again = locker.try_acquire("a")
    assert again.token > last.token and again.token > held.token


def test_embedded_default_needs_no_setup(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DBLOCK_HOME", str(tmp_path / "home"))
    with Locker() as locker:
        lease = locker.try_acquire("cron")
        assert lease is not None
    assert (tmp_path / "home" / "locks.sqlite3").exists()
    # another process, started elsewhere, sees the same lock file
    code = (
        "from dblock import Locker; import sys; "
        "sys.exit(0 if Locker().try_acquire('cron') is None else 1)"
    )
    env = {"DBLOCK_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    assert subprocess.run([sys.executable, "-c", code], cwd="/", env=env).returncode == 0


def test_embedded_default_follows_xdg_data_home(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("DBLOCK_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    if sys.platform != "linux":
        pytest.skip("XDG applies on Linux")
    with Locker() as locker:
        locker.try_acquire("x")
    assert (tmp_path / "xdg" / "dblock" / "locks.sqlite3").exists()


def test_locker_accepts_an_engine(db: Db) -> None:
    engine = create_engine(db.url)
    locker = Locker(engine, table=db.table)
    lease = locker.try_acquire("e")
    assert lease is not None and lease.release()
    locker.close()
    engine.dispose()


def test_missing_table_says_what_to_do(db: Db) -> None:
    locker = db.locker(table="never_created")
    with pytest.raises(DBLockError) as info:
        locker.try_acquire("x")
    assert "dblock migrate" in str(info.value) and "create_schema()" in str(info.value)


def test_timeout_inf_is_accepted(locker: Locker) -> None:
    assert locker.acquire("free", timeout=math.inf) is not None


def test_many_threads_share_one_locker(locker: Locker) -> None:
    holders = []
    count = [0]
    guard = threading.Lock()

    def work() -> None:
        for _ in range(10):
            with locker.lock("shared", ttl=30, timeout=30):
                with guard:
                    count[0] += 1
                    holders.append(count[0])
                with guard:
                    count[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(holders) == 60 and max(holders) == 1


def test_repr_hides_password() -> None:
    locker = Locker("postgresql+psycopg://app:s3cret@db.invalid/app")
    assert "s3cret" not in repr(locker)
    with pytest.raises(DBLockError) as info:
        locker.try_acquire("x")
    assert "s3cret" not in str(info.value)


@pytest.mark.parametrize("backend", ["sqlite"])  # SQLite's whole-file write lock
def test_sqlite_acquire_timeout_holds_while_another_writer_has_the_file(db: Db) -> None:
    """A write transaction held elsewhere blocks SQLite; acquire still gives up at its timeout."""
    locker = db.locker()
    locker.try_acquire("warm").release()
    other = db.connect()
    other.execute("BEGIN IMMEDIATE")
    try:
        started = time.monotonic()
        with pytest.raises(LockNotAcquired):
            locker.acquire("x", timeout=0.2)
        # Not a speed test: without the cap SQLite would block for its 30 s busy timeout.
        assert time.monotonic() - started < 10
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert locker.acquire("x", timeout=5) is not None
