"""A fencing client in its own process, for the pause and stress tests.

pause URL TABLE COUNTER TTL: acquire, report the token, stop itself with
    SIGSTOP right before its fenced write (a pause at the worst moment), then,
    once continued, write and report "wrote" or "fenced".
stress URL TABLE COUNTER TTL ITERATIONS MODE SEED: acquire, pause a random
    while (often past the TTL), increment the counter with fenced writes
    (twice per grant unless MODE is strict; "unfenced" is a mutant that
    stamps without checking); print the tokens of the writes that
    reported success, and how many were fenced out, as JSON. An optional
    last argument, a JSON object, adds "locker" keyword options and the
    engine's "connect_args" (behind a transaction pooler: {"locker":
    {"prepare": false, "notify": false}, "connect_args": {"prepare_threshold": null}}).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from typing import Any

from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, create_engine, update

import dblock


def counter_table(name: str) -> Table:
    return Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("n", Integer, nullable=False),
        Column("owner", Integer, nullable=False),
        Column("fence_token", BigInteger, nullable=False),
    )


def pause(url: str, table: str, counter: str, ttl: float) -> None:
    locker = dblock.Locker(url, table=table)
    engine = create_engine(url)
    t = counter_table(counter)
    lease = locker.acquire("resource", ttl=ttl, timeout=10)
    print(lease.token, flush=True)
    assert lease.remaining() > 0  # it believes it holds the lock: the check passes...
    os.kill(os.getpid(), signal.SIGSTOP)  # ...and the pause falls between check and write
    try:
        with engine.begin() as conn:
            dblock.fenced_update(conn, update(t).where(t.c.id == 1).values(owner=1), lease)
        print("wrote", flush=True)
    except dblock.FencedOut:
        print("fenced", flush=True)


def apause(url: str, table: str, counter: str, ttl: float) -> None:
    """``pause`` with the asyncio API: an AsyncLocker's lease, a fenced write on an async engine."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    async def main() -> None:
        async with dblock.AsyncLocker(url, table=table) as locker:
            engine = create_async_engine(url.replace("sqlite://", "sqlite+aiosqlite://").replace("+pymysql://", "+aiomysql://"))
            t = counter_table(counter)
            lease = await locker.acquire("resource", ttl=ttl, timeout=10)
            print(lease.token, flush=True)
            assert lease.remaining() > 0
            os.kill(os.getpid(), signal.SIGSTOP)
            try:
                async with engine.begin() as conn:
                    await fenced_update_async(conn, update(t).where(t.c.id == 1).values(owner=1), lease)
                print("wrote", flush=True)
            except dblock.FencedOut:
                print("fenced", flush=True)
            await engine.dispose()

    asyncio.run(main())


def fenced_update_async(conn: Any, stmt: Any, lease: Any) -> Any:
    from dblock.aio import fenced_update

    return fenced_update(conn, stmt, lease)


def stress(
    url: str, table: str, counter: str, ttl: float, iterations: int, mode: str, seed: int, options: dict[str, Any]
) -> None:
    rnd = random.Random(seed)
    locker = dblock.Locker(url, table=table, **options.get("locker", {}))
    connect_args = {"timeout": 30} if url.startswith("sqlite") else {}
    engine = create_engine(url, connect_args={**connect_args, **options.get("connect_args", {})})
    t = counter_table(counter)
    accepted: list[int] = []
    fenced = 0
    for _ in range(iterations):
        lease = locker.acquire("counter", ttl=ttl, timeout=30)
        for _write in range(1 if mode == "strict" else 2):
            time.sleep(rnd.uniform(0, 2 * ttl))  # often past the TTL: another worker takes over
            write = update(t).where(t.c.id == 1).values(n=t.c.n + 1, owner=os.getpid())
            try:
                with engine.begin() as conn:
                    if mode == "unfenced":  # the mutant: stamps the token, checks nothing
                        conn.execute(write.values(fence_token=lease.token))
                    else:
                        dblock.fenced_update(conn, write, lease, strict=mode == "strict")
                accepted.append(lease.token)
            except dblock.FencedOut:
                fenced += 1
        lease.release()
    print(json.dumps({"accepted": accepted, "fenced": fenced}), flush=True)


if __name__ == "__main__":
    mode, url, table, counter, ttl = sys.argv[1:6]
    if mode == "pause":
        pause(url, table, counter, float(ttl))
    elif mode == "apause":
        apause(url, table, counter, float(ttl))
    else:
        options = json.loads(sys.argv[9]) if len(sys.argv) > 9 else {}
        stress(url, table, counter, float(ttl), int(sys.argv[6]), sys.argv[7], int(sys.argv[8]), options)
