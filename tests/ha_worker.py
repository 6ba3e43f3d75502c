"""One client process of the failover scenario: the tiny-TTL race and a fenced counter, riding out failovers.

Usage: python ha_worker.py URL TABLE RACE_TTL RACE_THREADS COUNTER_TTL COUNTER_THREADS WAIT_TIMEOUT

RACE_THREADS threads take the name "hot" with try_acquire and RACE_TTL-second
leases, as tests/race_worker.py does (holding past the TTL now and then,
releasing most leases). COUNTER_THREADS threads take "counter" with a waiting
acquire (WAIT_TIMEOUT seconds) and make two fenced increments per grant, often
after a pause past the lease's TTL: each increment is one transaction that
passes the fences table (``dblock.fence``), bumps ``<TABLE>_counter`` with
``fenced_update`` and logs a row with a random id in ``<TABLE>_writes``, so the
test can tell an applied increment from a lost or a doubled one.

Database errors (the failover) are counted, never fatal: the process must keep
working. Once connected it prints "ready", reads a start time (time.monotonic(),
one clock for the machine) and works from then until a line "stop" arrives on
stdin. Then it prints one JSON object:
  grants: [token, received, trusted_until] of the race (as race_worker.py)
  writes: [id, token, at, outcome] per fenced increment: "ok" (committed),
          "fenced" (FencedOut), "doubt" (the database failed: may or may not have committed)
  waits:  [started, ended, timeout, outcome] per waiting acquire ("granted", "timeout", "unavailable")
  errors: [at, error class] per database error of the race threads
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import uuid

from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, Text, create_engine, insert, update
from sqlalchemy.exc import SQLAlchemyError

import dblock
from dblock import DatabaseUnavailable, DBLockError, Locker, LockNotAcquired


def tables(table: str) -> tuple[Table, Table]:
    meta = MetaData()
    counter = Table(
        f"{table}_counter", meta,
        Column("id", Integer, primary_key=True),
        Column("n", Integer, nullable=False),
        Column("fence_token", BigInteger, nullable=False, server_default="0"),
    )
    writes = Table(
        f"{table}_writes", meta,
        Column("id", Text, primary_key=True),
        Column("token", BigInteger, nullable=False),
        Column("seq", BigInteger),  # filled by the database (a bigserial)
    )
    return counter, writes


def main() -> None:
    url, table = sys.argv[1:3]
    race_ttl, race_threads = float(sys.argv[3]), int(sys.argv[4])
    counter_ttl, counter_threads, wait_timeout = float(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
    locker = Locker(url, table=table, poll_min=0.005, poll_max=0.05, op_timeout=2)
    # The app's own engine for the fenced writes: dead connections found at checkout after a failover.
    engine = create_engine(
        url, pool_pre_ping=True, pool_size=counter_threads,
        connect_args={"connect_timeout": 2, "keepalives": 1, "keepalives_idle": 2, "tcp_user_timeout": 5000},
    )
    counter, writes_table = tables(table)
    locker.leases()
    with engine.connect():
        pass
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    stop = threading.Event()

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    guard = threading.Lock()
    grants: list[list[float]] = []
    writes: list[list[object]] = []
    waits: list[list[object]] = []
    errors: list[list[object]] = []
    failures: list[BaseException] = []

    def until_start() -> None:
        while time.monotonic() < start_at:
            time.sleep(0.001)

    def race() -> None:
        rng = random.Random()
        until_start()
        while not stop.is_set():
            try:
                lease = locker.try_acquire("hot", ttl=race_ttl)
            except DBLockError as exc:
                with guard:
                    errors.append([time.monotonic(), type(exc).__name__])
                time.sleep(0.01)
                continue
            if lease is None:
                time.sleep(rng.random() * 0.002)
                continue
            received = time.monotonic()
            trusted_until = received + lease.remaining()
            if rng.random() < 0.5:
                time.sleep(rng.random() * race_ttl * 2)
            if rng.random() < 0.7:
                trusted_until = min(trusted_until, time.monotonic())
                try:
                    lease.release()
                except DBLockError as exc:
                    with guard:
                        errors.append([time.monotonic(), type(exc).__name__])
            with guard:
                grants.append([lease.token, received, trusted_until])

    def count() -> None:
        rng = random.Random()
        until_start()
        while not stop.is_set():
            started = time.monotonic()
            try:
                lease = locker.acquire("counter", ttl=counter_ttl, timeout=wait_timeout)
            except LockNotAcquired:
                outcome = "timeout"
            except DatabaseUnavailable:
                outcome = "unavailable"
            else:
                outcome = "granted"
            with guard:
                waits.append([started, time.monotonic(), wait_timeout, outcome])
            if outcome != "granted":
                time.sleep(0.01)
                continue
            for _ in range(2):
                # Often past the TTL: another thread takes over, and this write must be refused.
                time.sleep(rng.uniform(0, 1.5 * counter_ttl))
                wid = uuid.uuid4().hex
                try:
                    with engine.begin() as conn:
                        dblock.fence(conn, lease, "counter")
                        dblock.fenced_update(
                            conn, update(counter).where(counter.c.id == 1).values(n=counter.c.n + 1), lease
                        )
                        conn.execute(insert(writes_table).values(id=wid, token=lease.token))
                    result = "ok"
                except dblock.FencedOut:
                    result = "fenced"
                except (SQLAlchemyError, DBLockError):
                    result = "doubt"
                with guard:
                    writes.append([wid, lease.token, time.monotonic(), result])
            try:
                lease.release()
            except DBLockError:
                pass

    def guarded(fn):  # a thread that dies must fail the test, not shrink the scenario
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                failures.append(exc)
                raise
        return run

    threads = [threading.Thread(target=guarded(race)) for _ in range(race_threads)]
    threads += [threading.Thread(target=guarded(count)) for _ in range(counter_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    locker.close()
    engine.dispose()
    if failures:
        sys.exit(f"{len(failures)} thread(s) failed: {failures[0]!r}")
    json.dump({"grants": grants, "writes": writes, "waits": waits, "errors": errors}, sys.stdout)


if __name__ == "__main__":
    main()
