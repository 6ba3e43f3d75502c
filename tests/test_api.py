"""The sync face's own API cases on both backends: the embedded default, engines, threads, repr.

What both faces promise (acquire, hold, extend, release, inspect) is tested once, on both
faces, in test_faces_async.py and the test_faces.py generated from it.
"""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
import threading
import time

import pytest
from sqlalchemy import create_engine

from dblock import DBLockError, Locker, LockNotAcquired

from .conftest import Db


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
    """The advice names this database, table and schema: run as printed, it makes the very table missing."""
    missing = f"{db.table}_never_created"  # named for the fixture's table: its clean-up drops it (a shared server)
    locker = db.locker(table=missing)
    with pytest.raises(DBLockError) as info:
        locker.try_acquire("x")
    message = str(info.value)
    assert "create_schema()" in message
    command = shlex.split(message.split("`")[1])
    assert command[:2] == ["dblock", "migrate"] and command[command.index("--table") + 1] == missing
    url = command.index("--url") + 1
    if "***" in command[url]:  # a password (the throwaway server's is empty) is masked: put it back, as told
        assert "(your password in place of ***)" in message
        command[url] = db.url
    ran = subprocess.run([sys.executable, "-m", "dblock", *command[1:]], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and f"created the tables of {missing!r}" in ran.stderr, ran
    lease = locker.try_acquire("x")
    assert lease is not None and lease.release()
    locker.close()


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


def test_locker_reads_dblock_url_as_the_command_does(db: Db, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("DBLOCK_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DBLOCK_URL", db.url)
    locker = Locker(table=db.table)  # no url: $DBLOCK_URL, not the embedded default
    lease = locker.try_acquire("from-env", ttl=30)
    assert lease is not None
    assert db.query(f"SELECT owner FROM {db.table} WHERE name = 'from-env'") == [(lease.owner,)]
    status = subprocess.run([sys.executable, "-m", "dblock", "status", "--table", db.table, "--json"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and '"from-env"' in status.stdout, status
    assert lease.release() is True
    locker.close()
    assert not (tmp_path / "home").exists()  # the embedded default was never made
    monkeypatch.delenv("DBLOCK_URL")
    embedded = Locker()
    assert embedded.engine.url.database == str(tmp_path / "home" / "locks.sqlite3")
    embedded.close()
