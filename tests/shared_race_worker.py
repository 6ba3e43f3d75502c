"""One process of the shared-lease race: threads taking one name as readers, semaphore
holders and writers, with tiny TTLs.

Usage: python shared_race_worker.py URL TABLE NAME TTL THREADS DURATION SPEC
SPEC, a JSON object: "limits" (a list; each shared take picks one, null for a
reader), "writers" (the share of takes that are exclusive, write-lock takes),
"wait" (true: blocking acquires with a short timeout; false: try_acquire in a
loop), "upgraders" (the share of shared takes that are the upgradeable reader's, which
then try to upgrade, write, and sometimes come back down before they leave), "broken" (a mutant, to show the test's checks catch it: "limit", the
shared acquire ignores the caller's limit; "writer", the write acquire ignores
shared holders; "upgrade", the upgrade does not wait for the other readers), "options"
(Locker keyword options).
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

from dblock import Lease, LeaseLost, Locker, LockNotAcquired, UpgradeableLease
from dblock._faults import Busy


def main() -> None:
    url, table, name = sys.argv[1:4]
    ttl, threads, duration = float(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    spec = json.loads(sys.argv[7])
    limits, writers, wait = spec.get("limits", [None]), float(spec.get("writers", 0.0)), bool(spec.get("wait"))
    upgraders = float(spec.get("upgraders", 0.0))
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
    elif spec.get("broken") == "upgrade":  # the upgrade does not wait for the other holders
        sql = locker.backend.sql.upgrade
        sql = sql.replace(f"{table}_upgrade(", f"{table}_upgrade_broken(")  # PostgreSQL: the test made it
        sql = sql.replace("CASE WHEN EXISTS", "CASE WHEN 0 AND EXISTS")  # SQLite: never "others"
        sql = sql.replace("IF @dblock_n > 0 THEN", "IF 0 THEN")  # MariaDB
        assert sql != locker.backend.sql.upgrade
        locker.backend.sql = dataclasses.replace(locker.backend.sql, upgrade=sql)
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
        if rng.random() < upgraders:
            side, limit = locker.upgradeable(name), None
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
        # A slow machine gets more time (up to ten times as much) to reach 40 grants and, where
        # there are upgradeable readers, 2 upgrades: the test asserts the race raced.
        while time.monotonic() < end or (
            (len(grants) < 40 or (upgraders and sum(g[0] == "w" for g in grants) < 2)) and time.monotonic() < last
        ):
            try:
                kind, lease, limit = take(rng)
            except Busy:  # SQLite's writer lock stayed taken for the call's whole time (a starved machine): a miss
                continue
            if lease is None:
                if not wait:
                    time.sleep(rng.random() * 0.002)
                continue
            received = time.monotonic()
            trusted_until = received + lease.remaining()
            if isinstance(lease, UpgradeableLease):
                # Each part (read, write, read again) is a grant of its own: trusted from when the
                # client had it until it asked for the next (the database ends one as it grants
                # the other), never longer.
                kind, received, trusted_until = upgrade(lease, rng, received, trusted_until)
            if rng.random() < 0.5:  # sometimes hold past the TTL, sometimes release
                time.sleep(rng.random() * ttl * 2)
            if rng.random() < 0.7:
                trusted_until = min(trusted_until, time.monotonic())
                try:
                    lease.release()
                except Busy:  # not ended: it runs out at its ttl; the client stopped trusting it here
                    pass
            with guard:
                grants.append([kind, lease.token, received, trusted_until, limit])

    def upgrade(lease: UpgradeableLease, rng: random.Random, received: float, trusted: float) -> tuple[str, float, float]:
        """Upgrade (and sometimes come back down): the parts before the last go to ``grants`` here;
        the last part's (kind, received, trusted_until), for the caller."""
        read_token, asked = lease.token, time.monotonic()
        try:
            lease.upgrade(timeout=max(0.1, 2 * ttl))  # 20 ms was too short on a loaded machine
        except (LockNotAcquired, LeaseLost, Busy):  # Busy: as above, a starved machine
            return "s", received, trusted
        got = time.monotonic()
        with guard:
            grants.append(["s", read_token, received, min(trusted, asked), None])
        kind, received, trusted = "w", got, got + lease.remaining()
        if rng.random() < 0.5:
            asked = time.monotonic()
            write_token = lease.token
            try:
                lease.downgrade()
            except LeaseLost:
                return kind, received, min(trusted, asked)
            with guard:
                grants.append(["w", write_token, received, min(trusted, asked), None])
            got = time.monotonic()
            kind, received, trusted = "s", got, got + lease.remaining()
        return kind, received, trusted

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
