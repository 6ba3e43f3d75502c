"""One process of the G1/G2 race: threads hammering one lock name with tiny TTLs.

Usage: python race_worker.py URL TABLE NAME TTL THREADS DURATION [MODE [OPTIONS]]
MODE is how threads take the lock: "try" (try_acquire in a loop, the default),
or a blocking acquire with a short timeout (5 TTLs, at least 50 ms): "fair" (queue + NOTIFY hand-off),
"fair-poll" (queue, polling), "line" (fair=False: local line + polling). With an
"async-" prefix (e.g. "async-fair") the asyncio API races instead: THREADS tasks
on one event loop, with an AsyncLocker.
OPTIONS, a JSON object, adds Locker keyword options (e.g. {"prepare": false}
behind a transaction pooler). DBLOCK_RACE_ACQUIRE in the environment replaces the acquire
statement (a test's deliberately broken one, to show the race's checks catch it).
Once connected it prints "ready" and reads the start time from stdin: a
time.monotonic() value (one clock for every process on the machine), so all
processes start together however long each took to start. Then it prints one
JSON list of grants:
[token, received_at, trusted_until] in monotonic seconds, where trusted_until
is when this client stopped relying on the lease: min(sent + ttl, release call).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import logging
import random
import sys
import threading
import time

from dblock import AsyncLease, AsyncLocker, Lease, Locker, LockNotAcquired

# The race abandons leases on purpose (30% are never released) and acquires the name again in the
# same thread or task: dblock warns of each such wait for a lease the waiter holds itself, which is
# what happens here by design. The tests read stderr for a thread's death, so keep it to errors.
logging.getLogger("dblock.locker").setLevel(logging.ERROR)

MODES = {"try": {}, "fair": {}, "fair-poll": {"notify": False}, "line": {"fair": False}}


def broken(locker: Locker | AsyncLocker) -> None:
    """Swap in the acquire statement DBLOCK_RACE_ACQUIRE names, if any (the faces read it per call)."""
    sql = os.environ.get("DBLOCK_RACE_ACQUIRE")
    if sql:
        locker.backend.sql = dataclasses.replace(locker.backend.sql, acquire=sql)


def main() -> None:
    url, table, name = sys.argv[1:4]
    ttl, threads, duration = float(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    mode = sys.argv[7] if len(sys.argv) > 7 else "try"
    if mode.startswith("async-"):
        mode = mode[len("async-"):]
        options = {**MODES[mode], **(json.loads(sys.argv[8]) if len(sys.argv) > 8 else {})}
        asyncio.run(race_tasks(url, table, name, ttl, threads, duration, mode, options))
        return
    options = {**MODES[mode], **(json.loads(sys.argv[8]) if len(sys.argv) > 8 else {})}
    locker = Locker(url, table=table, poll_min=0.001, poll_max=0.01, **options)
    broken(locker)
    # Connected before the start. Not by taking a lock: grants of other names draw from the same
    # token sequence and may commit out of order, which the test's audit (of every grant) would flag.
    locker.leases()
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())

    def take() -> Lease | None:
        if mode == "try":
            return locker.try_acquire(name, ttl=ttl)
        try:
            return locker.acquire(name, ttl=ttl, timeout=max(0.05, 5 * ttl))
        except LockNotAcquired:
            return None

    grants: list[list[float]] = []
    guard = threading.Lock()
    failures: list[BaseException] = []

    def hammer() -> None:
        try:
            race()
        except BaseException as exc:  # a thread that dies must fail the test, not shrink the race
            failures.append(exc)
            raise

    def race() -> None:
        rng = random.Random()
        while time.monotonic() < start_at:
            time.sleep(0.001)
        end, last = start_at + duration, start_at + 10 * duration
        # Run DURATION, and longer (up to 10x) while this process has fewer than
        # 40 grants: a stalled machine must not turn the race into no race.
        while time.monotonic() < end or (len(grants) < 40 and time.monotonic() < last):
            lease = take()
            if lease is None:
                if mode == "try":
                    time.sleep(rng.random() * 0.002)
                continue
            received = time.monotonic()
            trusted_until = received + lease.remaining()
            if rng.random() < 0.5:  # sometimes hold past the TTL, sometimes release
                time.sleep(rng.random() * ttl * 2)
            if rng.random() < 0.7:
                trusted_until = min(trusted_until, time.monotonic())
                lease.release()
            with guard:
                grants.append([lease.token, received, trusted_until])

    workers = [threading.Thread(target=hammer) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    locker.close()
    if failures:
        sys.exit(f"{len(failures)} thread(s) failed: {failures[0]!r}")
    json.dump(grants, sys.stdout)


async def race_tasks(
    url: str, table: str, name: str, ttl: float, tasks: int, duration: float, mode: str, options: dict
) -> None:
    """The race with the asyncio API: ``tasks`` tasks on one loop instead of threads."""
    locker = AsyncLocker(url, table=table, poll_min=0.001, poll_max=0.01, **options)
    broken(locker)
    await locker.leases()
    print("ready", flush=True)
    start_at = float(await asyncio.to_thread(sys.stdin.readline))
    grants: list[list[float]] = []

    async def take() -> AsyncLease | None:
        if mode == "try":
            return await locker.try_acquire(name, ttl=ttl)
        try:
            return await locker.acquire(name, ttl=ttl, timeout=max(0.05, 5 * ttl))
        except LockNotAcquired:
            return None

    async def race() -> None:
        rng = random.Random()
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        end, last = start_at + duration, start_at + 10 * duration
        while time.monotonic() < end or (len(grants) < 40 and time.monotonic() < last):
            lease = await take()
            if lease is None:
                if mode == "try":
                    await asyncio.sleep(rng.random() * 0.002)
                continue
            received = time.monotonic()
            trusted_until = received + lease.remaining()
            if rng.random() < 0.5:
                await asyncio.sleep(rng.random() * ttl * 2)
            if rng.random() < 0.7:
                trusted_until = min(trusted_until, time.monotonic())
                await lease.release()
            grants.append([lease.token, received, trusted_until])

    await asyncio.gather(*(race() for _ in range(tasks)))  # a task that fails fails the process
    await locker.aclose()
    json.dump(grants, sys.stdout)


if __name__ == "__main__":
    main()
