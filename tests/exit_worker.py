"""A cron-like process that waits once in the fair queue, then ends.

Usage: python exit_worker.py URL TABLE NAME sync|async close|exit
It waits for NAME (held by the test, so it queues), prints "granted TOKEN", releases it,
and then closes its Locker ("close") or leaves it open for the interpreter's clean exit
("exit"). The test counts the rows it left in the queue's table of processes.
"""

from __future__ import annotations

import asyncio
import sys

from dblock import AsyncLocker, Locker


def main() -> None:
    url, table, name, face, end = sys.argv[1:6]
    if face == "sync":
        locker = Locker(url, table=table)
        lease = locker.acquire(name, timeout=120, ttl=60)
        print("granted", lease.token, flush=True)
        lease.release()
        if end == "close":
            locker.close()
        return

    async def run() -> None:
        locker = AsyncLocker(url, table=table)
        lease = await locker.acquire(name, timeout=120, ttl=60)
        print("granted", lease.token, flush=True)
        await lease.release()
        if end == "close":
            await locker.aclose()

    asyncio.run(run())


if __name__ == "__main__":
    main()
