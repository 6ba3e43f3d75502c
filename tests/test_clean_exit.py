"""What a process that waited in PostgreSQL's fair queue leaves behind: nothing, once it ends cleanly.

A fair waiter's process keeps a heartbeat row in the queue's table of processes while it
waits. A Locker's close() deletes it, and so does a clean exit of a process whose Locker was
never closed; a process killed leaves its row to lapse (and ``prune`` to delete). Real
processes, a real server; the unreachable server is a proxy that holds every byte.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dblock import AsyncLocker, Locker, LockNotAcquired

from .conftest import Db, wait_for
from .pgproxy import PgProxy

HERE = Path(__file__).resolve().parent
QUIT_WITHIN = 2.0  # close()'s documented bound for deleting the row (op_timeout if shorter)
SLACK = 3.0  # seconds a loaded machine may add to a bound (scheduling, a thread's start)


def rows(db: Db) -> list[tuple[str, bool]]:
    """The queue's table of processes: (id, still fresh) per row."""
    return db.query(f"SELECT id, until > now() FROM {db.table}_procs ORDER BY id")


def queued(db: Db, name: str) -> int:
    return len(db.query(f"SELECT 1 FROM {db.table}_waiters WHERE name = %s", (name,)))


def worker(db: Db, name: str, face: str, end: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "exit_worker.py"), db.url, db.table, name, face, end],
        stdout=subprocess.PIPE, text=True,
    )


@pytest.mark.parametrize("end", ["close", "exit"])
@pytest.mark.parametrize("face", ["sync", "async"])
def test_three_runs_that_each_waited_once_leave_no_row(pg: Db, face: str, end: str) -> None:
    """A cron job run three times, each waiting once in line (it truly queued: the name was
    held), ending with close() or by a clean exit with its Locker open: no row is left."""
    holder = pg.locker()
    for run in range(3):
        held = holder.try_acquire("cron", ttl=60)
        assert held is not None
        p = worker(pg, "cron", face, end)
        try:
            wait_for(lambda: queued(pg, "cron") == 1, timeout=60, what=f"run {run} to queue")
            assert len(rows(pg)) == 1, "a waiter that queued has its process's row"
            assert held.release() is True
            out, _ = p.communicate(timeout=60)
        finally:
            p.kill()
            p.wait()
        assert out.startswith("granted") and p.returncode == 0, (out, p.returncode)
    assert rows(pg) == []


def test_a_killed_process_leaves_its_row_to_lapse(pg: Db) -> None:
    """Killed in line: no close, no exit handler; its row stays, stops being fresh, and prune deletes it."""
    holder = pg.locker()
    held = holder.try_acquire("killed", ttl=60)
    p = worker(pg, "killed", "sync", "close")
    try:
        wait_for(lambda: queued(pg, "killed") == 1, timeout=60, what="the waiter to queue")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    [(proc, fresh)] = rows(pg)
    assert fresh
    wait_for(lambda: rows(pg) == [(proc, False)], timeout=60, what="its row to lapse")
    holder.prune(0.001)
    assert rows(pg) == []
    assert held.release() is True


def test_a_close_leaves_another_live_process_row_alone(pg: Db) -> None:
    """A Locker that closes deletes its own row only: another process still waiting in line
    keeps its row, its place, and is handed the lease."""
    holder = pg.locker()
    held = holder.try_acquire("neighbours", ttl=60)
    p = worker(pg, "neighbours", "sync", "close")
    try:
        wait_for(lambda: queued(pg, "neighbours") == 1, timeout=60, what="the other process to queue")
        [(other, _)] = rows(pg)
        mine = pg.locker()
        with pytest.raises(LockNotAcquired):
            mine.acquire("neighbours", timeout=1.0, ttl=60)  # queued behind it, then gave up
        assert {proc for proc, _ in rows(pg)} > {other}
        mine.close()
        assert rows(pg) == [(other, True)]
        assert held.release() is True
        out, _ = p.communicate(timeout=60)
        assert out.startswith("granted"), out
    finally:
        p.kill()
        p.wait()
    assert rows(pg) == []


@pytest.mark.parametrize("face", ["sync", "async"])
def test_close_with_the_server_unreachable_returns_within_its_bound(pg: Db, face: str) -> None:
    """The row cannot be deleted: close() gives up within its bound, raises nothing, and the row
    is left to lapse."""
    proxy = PgProxy(pg.url)
    holder = pg.locker()
    held = holder.try_acquire("away", ttl=60)
    try:
        if face == "sync":
            locker = Locker(proxy.url, table=pg.table)
            got: list[Any] = []
            t = threading.Thread(target=lambda: got.append(locker.acquire("away", timeout=120, ttl=60)))
            t.start()
            wait_for(lambda: queued(pg, "away") == 1, timeout=60, what="the waiter to queue")
            assert held.release() is True
            t.join(60)
            assert got[0].release() is True
            proxy.pause()
            start = time.monotonic()
            locker.close()
            took = time.monotonic() - start
        else:

            async def run() -> float:
                locker = AsyncLocker(proxy.url, table=pg.table)
                task = asyncio.ensure_future(locker.acquire("away", timeout=120, ttl=60))
                while not await asyncio.to_thread(queued, pg, "away"):
                    await asyncio.sleep(0.01)
                assert await asyncio.to_thread(held.release) is True
                lease = await asyncio.wait_for(task, 60)
                assert await lease.release() is True
                proxy.pause()
                start = time.monotonic()
                await locker.aclose()
                return time.monotonic() - start

            took = asyncio.run(run())
        assert took < QUIT_WITHIN + SLACK, f"close() took {took:.2f} s"
        [(_, fresh)] = rows(pg)  # left to lapse
    finally:
        proxy.close()
