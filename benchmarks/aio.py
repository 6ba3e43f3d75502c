"""The asyncio API against baselines in the same run: uncontended cost, and 100 tasks on one name.

    python benchmarks/aio.py [--url postgresql://...] [--pairs 3000] [--block 1] [--rounds 5]
                             [--tasks 100] [--hold 0.001] [--seconds 3]

Uncontended: one acquire + release pair, awaited, on one task: ``AsyncLocker``
against the same two statements sent by hand on a raw psycopg
``AsyncConnection`` (the floor the API adds to), and the sync ``Locker``:
``--pairs`` pairs of each, timed in blocks of ``--block`` pairs, the variants
taking turns block by block (who goes first rotating), median per pair. Blocks
of one pair: on two cores a variant's time depends on which server process ran
just before it, and a pair's neighbours change with every block, so the drift
of a busy machine hits the variants alike (blocks of 500 pairs gave 1.07-1.21x
in runs minutes apart; blocks of one, 1.03-1.05x).
Contended: ``--tasks`` tasks of one process take one name in turn (fair
waiting, NOTIFY hand-off), each holding it ``--hold`` s; against the sync
default with as many threads. Per grant: the statements sent (every statement
a Locker's driver runs, heartbeats included) and the hand-over, from the
moment the previous holder called release to the next grant's return.
Rounds interleave the variants so that machine noise hits them alike; the
ratios are the figures that matter.

With no --url (and no DBLOCK_TEST_URL) it starts a throwaway PostgreSQL with pgserver.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import tempfile
import threading
import time
from typing import Any, Awaitable, Callable

import psycopg
from sqlalchemy.engine import make_url

from _timing import ainterleaved  # benchmarks/_timing.py

from dblock import AsyncLocker, Locker
from dblock._adriver import AsyncDriver
from dblock._driver import Driver

COUNT = {"n": 0}


def counting() -> None:
    """Count every statement both drivers send (a benchmark may patch; the library does not)."""
    sync_run, async_run = Driver.run, AsyncDriver.run

    def run(self: Any, *a: Any, **kw: Any) -> Any:
        COUNT["n"] += 1
        return sync_run(self, *a, **kw)

    async def arun(self: Any, *a: Any, **kw: Any) -> Any:
        COUNT["n"] += 1
        return await async_run(self, *a, **kw)

    Driver.run = run  # type: ignore[method-assign]
    AsyncDriver.run = arun  # type: ignore[method-assign]


async def uncontended(url: Any, dsn: str, table: str, pairs: int, rounds: int) -> dict[str, float]:
    locker = AsyncLocker(url, table=table)
    sync = Locker(url, table=table)
    sql, label = sync.backend.sql, sync._label()  # the very statements dblock sends, for the hand-written floor
    own = await psycopg.AsyncConnection.connect(dsn, autocommit=True)

    async def raw() -> None:
        owner = secrets.token_hex(16)
        cur = await own.execute(sql.acquire, {"name": "raw", "owner": owner, "ttl": 30.0, "label": label}, prepare=True)
        (_, token, _, _) = await cur.fetchone()  # type: ignore[misc]
        cur = await own.execute(sql.release, {"name": "raw", "owner": owner, "token": token}, prepare=True)
        await cur.fetchall()

    async def api() -> None:
        lease = await locker.try_acquire("api")
        await lease.release()  # type: ignore[union-attr]

    async def sync_api() -> None:  # blocks the loop: a reference only
        sync.try_acquire("sync").release()  # type: ignore[union-attr]

    try:
        return await ainterleaved({"raw AsyncConnection": raw, "AsyncLocker": api, "Locker (sync)": sync_api}, rounds, pairs)
    finally:
        await own.close()
        await locker.aclose()
        sync.close()


def _summary(gaps: list[float], grants: int, statements: int) -> dict[str, float]:
    gaps.sort()
    return {
        "grants": grants,
        "per_grant": statements / grants if grants else float("nan"),
        "p50": statistics.median(gaps) * 1e3 if gaps else float("nan"),
        "p99": gaps[int(len(gaps) * 0.99)] * 1e3 if gaps else float("nan"),
    }


async def contended_async(url: Any, table: str, tasks: int, hold: float, seconds: float) -> dict[str, float]:
    name = "hot-" + secrets.token_hex(3)
    async with AsyncLocker(url, table=table) as locker:
        async with locker.lock(name):  # warm: connections, statements
            pass
        released_at = [0.0]
        gaps: list[float] = []
        grants = [0]
        stop = [False]
        start_count = [0]

        async def worker() -> None:
            while not stop[0]:
                lease = await locker.acquire(name, timeout=60)
                now = time.perf_counter()
                if released_at[0]:
                    gaps.append(now - released_at[0])
                grants[0] += 1
                await asyncio.sleep(hold)
                released_at[0] = time.perf_counter()
                await lease.release()

        workers = [asyncio.create_task(worker()) for _ in range(tasks)]
        await asyncio.sleep(1.0)  # all queued, steady state
        gaps.clear()
        grants[0], start_count[0] = 0, COUNT["n"]
        await asyncio.sleep(seconds)
        n, statements = grants[0], COUNT["n"] - start_count[0]
        stop[0] = True
        await asyncio.gather(*workers)
        return _summary(gaps[1:], n, statements)


def contended_sync(url: Any, table: str, threads: int, hold: float, seconds: float) -> dict[str, float]:
    name = "hot-" + secrets.token_hex(3)
    with Locker(url, table=table) as locker:
        with locker.lock(name):
            pass
        guard = threading.Lock()
        released_at = [0.0]
        gaps: list[float] = []
        grants = [0]
        stop = threading.Event()

        def worker() -> None:
            while not stop.is_set():
                lease = locker.acquire(name, timeout=60)
                now = time.perf_counter()
                with guard:
                    if released_at[0]:
                        gaps.append(now - released_at[0])
                    grants[0] += 1
                time.sleep(hold)
                with guard:
                    released_at[0] = time.perf_counter()
                lease.release()

        pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
        for t in pool:
            t.start()
        time.sleep(1.0)
        with guard:
            gaps.clear()
            grants[0], begin = 0, COUNT["n"]
        time.sleep(seconds)
        with guard:
            n, statements = grants[0], COUNT["n"] - begin
        stop.set()
        for t in pool:
            t.join()
        return _summary(gaps[1:], n, statements)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    ap.add_argument("--pairs", type=int, default=3000, help="uncontended pairs of each variant")
    ap.add_argument("--block", type=int, default=1, help="uncontended pairs timed together")
    ap.add_argument("--rounds", type=int, default=5, help="contended: rounds of each face (halved)")
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--hold", type=float, default=0.001)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    server = None
    url = args.url
    if not url:
        import pgserver

        server = pgserver.get_server(tempfile.mkdtemp(prefix="dblock-bench-"), cleanup_mode="delete")
        url = server.get_uri()
    sa_url = make_url(url).set(drivername="postgresql+psycopg")
    dsn = sa_url.set(drivername="postgresql").render_as_string(hide_password=False)
    table = "bench_" + secrets.token_hex(4)
    locker = Locker(sa_url, table=table)
    locker.create_schema()
    try:
        blocks = max(1, args.pairs // args.block)
        costs = asyncio.run(uncontended(sa_url, dsn, table, args.block, blocks))
        floor = costs["raw AsyncConnection"]
        print(f"uncontended acquire + release, median of {blocks} blocks x {args.block} pairs")
        print(f"{'variant':<22}{'us/pair':>10}{'ratio':>8}")
        for variant, us in costs.items():
            print(f"{variant:<22}{us:>10.1f}{us / floor:>8.2f}")
        counting()
        rows = []
        for r in range(max(1, args.rounds // 2)):
            order = [("async", contended_async), ("sync", contended_sync)]
            for label, fn in order if r % 2 == 0 else order[::-1]:
                if label == "async":
                    out = asyncio.run(fn(sa_url, table, args.tasks, args.hold, args.seconds))  # type: ignore[arg-type]
                else:
                    out = fn(sa_url, table, args.tasks, args.hold, args.seconds)  # type: ignore[assignment]
                rows.append((label, out))
        print()
        print(f"contended: {args.tasks} tasks (async) or threads (sync) on one name, hold {args.hold * 1e3:g} ms")
        print(f"{'variant':<10}{'grants':>8}{'stmts/grant':>13}{'hand-over p50 ms':>18}{'p99 ms':>9}")
        summary: dict[str, list[float]] = {"async": [], "sync": []}
        for label, out in rows:
            summary[label].append(out["p50"])
            print(f"{label:<10}{out['grants']:>8}{out['per_grant']:>13.2f}{out['p50']:>18.3f}{out['p99']:>9.2f}")
        ratio = statistics.median(summary["async"]) / statistics.median(summary["sync"])
        print(f"hand-over p50, async / sync (medians over rounds): {ratio:.2f}x")
    finally:
        if server is not None:
            server.cleanup()
        else:  # a server that stays: leave nothing of this run on it
            from dblock import migrate

            migrate.downgrade(locker.engine, table, None)
            locker.close()


if __name__ == "__main__":
    main()
