"""One process of the shared-lease race: threads taking one name as readers, semaphore
holders and writers, with tiny TTLs.

Usage: python shared_race_worker.py URL TABLE NAME TTL THREADS DURATION SPEC
SPEC, a JSON object: "limits" (a list; each shared take picks one, null for a
reader), "writers" (the share of takes that are exclusive, write-lock takes),
"wait" (true: blocking acquires with a short timeout; false: try_acquire in a
loop), "broken" (a mutant, to show the test's checks catch it: "limit", the
shared acquire ignores the caller's limit; "writer", the write acquire ignores
shared holders), "options" (Locker keyword options).
Prints "ready", reads the start time (time.monotonic()) from stdin, then prints
one JSON list of grants: [kind, token, received_at, trusted_until, limit],
kind "w" (write lock) or "s" (shared), in monotonic seconds.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import threading
import time

from dblock import Lease, Locker, LockNotAcquired


def main() -> None:
    url, table, name = sys.argv[1:4]
    ttl, threads, duration = float(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    spec = json.loads(sys.argv[7])
    limits, writers, wait = spec.get("limits", [None]), float(spec.get("writers", 0.0)), bool(spec.get("wait"))
    locker = Locker(url, table=table, poll_min=0.001, poll_max=0.01, **spec.get("options", {}))
    if spec.get("broken") == "limit":  # the shared acquire forgets the caller's limit
        sql = locker.backend.sql.share_acquire.replace("%(limit)s", "NULL").replace(":limit", "NULL")
        locker.backend.sql = dataclasses.replace(locker.backend.sql, share_acquire=sql)
    elif spec.get("broken") == "writer":  # the write (exclusive) acquire ignores shared holders
        sql = locker.backend.sql.acquire.replace("l.owner IS NULL OR", "l.owner IS NULL OR l.owner = '*shared' OR")
        sql = sql.replace("WHERE owner IS NULL OR", "WHERE owner IS NULL OR owner = '*shared' OR")
        sql = sql.replace("@dblock_g := (owner IS NULL OR", "@dblock_g := (owner IS NULL OR owner = '*shared' OR")  # MariaDB
        assert sql != locker.backend.sql.acquire
        locker.backend.sql = dataclasses.replace(locker.backend.sql, acquire=sql)
    locker.leases()
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    grants: list[list[object]] = []
    guard = threading.Lock()
    failures: list[BaseException] = []

    def take(rng: random.Random) -> tuple[str, Lease | None, int | None]:
        timeout = max(0.05, 5 * ttl)
        if rng.random() < writers:
            if not wait:
                return "w", locker.try_acquire(name, ttl=ttl), None
            try:
                return "w", locker.acquire(name, ttl=ttl, timeout=timeout), None
            except LockNotAcquired:
                return "w", None, None
        limit = rng.choice(limits)
        side = locker.readers(name) if limit is None else locker.semaphore(name, limit)
        if not wait:
            return "s", side.try_acquire(ttl=ttl), limit
        try:
            return "s", side.acquire(ttl=ttl, timeout=timeout), limit
        except LockNotAcquired:
            return "s", None, limit

    def race() -> None:
        rng = random.Random()
        while time.monotonic() < start_at:
            time.sleep(0.001)
        end, last = start_at + duration, start_at + 10 * duration
        while time.monotonic() < end or (len(grants) < 40 and time.monotonic() < last):
            kind, lease, limit = take(rng)
            if lease is None:
                if not wait:
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
                grants.append([kind, lease.token, received, trusted_until, limit])

    def hammer() -> None:
        try:
            race()
        except BaseException as exc:  # a thread that dies must fail the test, not shrink the race
            failures.append(exc)
            raise

    workers = [threading.Thread(target=hammer) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    locker.close()
    if failures:
        sys.exit(f"{len(failures)} thread(s) failed: {failures[0]!r}")
    json.dump(grants, sys.stdout)


if __name__ == "__main__":
    main()
