"""One process of the Galera races: threads on one node of the cluster, riding out its death.

Usage: python galera_worker.py race URL TABLE NAME TTL THREADS DURATION [OVERTIME]
       python galera_worker.py counter URL TABLE COUNTER TTL THREADS DURATION

race: as race_worker.py's "try" mode (try_acquire in a loop, hold a random
while, sometimes past the TTL, release 70% of the leases), but a call that
raises DatabaseUnavailable (the node died, or its statement was cut off at
its deadline), or fails in the audit's trigger (see install_audit in
test_galera.py), is counted and the thread goes on, after 50 ms: a worker whose
node is killed keeps what it was granted before, and reports it. With
OVERTIME, a second line on stdin gives a time (a monotonic value, or -inf):
the race goes on past DURATION, for up to OVERTIME seconds more, until this
process has a grant received after that time (-inf: none). A node that was killed stalls
its survivors' calls until it is evicted, and a call cut off at op_timeout can
end just before DURATION does: the overtime makes sure the survivors race
after the eviction, however long it took, instead of hoping it was short.

counter: the read-modify-write loop of rmw_worker.py's "stamp" mode on one
node: acquire "counter" (TTL, waiting up to 30 s), in one transaction stamp
and read the counter with fenced_read, pause 0-3 ms, write read + 1 with
fenced_update, commit; release. A write refused by the fence (FencedOut) or
whose transaction the cluster aborted (error 1213: a certification conflict
at commit, or a brute-force abort by a replicated write) is not accepted.

Every dblock call is timed: the report holds the slowest of each verb and
every call longer than BOUND seconds (op_timeout 5 s + 0.25 s, and 2 s of
slack for a busy machine; a waiting acquire: its timeout + 2.5 s + 2 s).

Once connected it prints "ready" and reads the start time (a time.monotonic()
value, one clock for every process of the machine) from stdin, then prints one
JSON object: race: grants ([token, received_at, trusted_until]), errors
(counts by kind), first/last error times, slowest, over_bound, calls;
counter: accepted, refused, conflicts, takeovers, tokens (accepted), errors...
"""

from __future__ import annotations

import json
import logging
import math
import random
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable

from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, create_engine, select, update
from sqlalchemy.exc import DBAPIError

import dblock
from dblock import DatabaseUnavailable, DBLockError, Locker

logging.getLogger("dblock").setLevel(logging.CRITICAL)  # a dead node's errors are counted, not logged

OP_BOUND = 5.0 + 0.25 + 2.0  # op_timeout (default) + 0.25 s, and 2 s of slack
WAIT_TIMEOUT = 30.0
TRIGGER_BODY = "has an error in its body"
WAIT_BOUND = WAIT_TIMEOUT + 2.5 + 2.0


def counter_table(name: str) -> Table:
    return Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("n", Integer, nullable=False),
        Column("fence_token", BigInteger, nullable=False),
    )


class Report:
    def __init__(self) -> None:
        self.guard = threading.Lock()
        self.errors: Counter[str] = Counter()
        self.first_error: float | None = None
        self.last_error: float | None = None
        self.slowest: dict[str, float] = {}
        self.over_bound: list[list[Any]] = []
        self.calls = 0
        self.failures: list[BaseException] = []

    def timed(self, verb: str, bound: float, call: Callable[[], Any]) -> Any:
        began = time.monotonic()
        try:
            return call()
        finally:
            took = time.monotonic() - began
            with self.guard:
                self.calls += 1
                self.slowest[verb] = max(self.slowest.get(verb, 0.0), took)
                if took > bound:
                    self.over_bound.append([verb, round(took, 3), began])

    def error(self, kind: str) -> None:
        now = time.monotonic()
        with self.guard:
            self.errors[kind] += 1
            self.first_error = now if self.first_error is None else self.first_error
            self.last_error = now

    def json(self) -> dict[str, Any]:
        return {
            "errors": dict(self.errors), "first_error": self.first_error, "last_error": self.last_error,
            "slowest": self.slowest, "over_bound": self.over_bound, "calls": self.calls,
        }


def code(exc: BaseException) -> int | None:
    orig = getattr(exc, "orig", exc)
    args = getattr(orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def run_threads(threads: int, report: Report, loop: Callable[[], None]) -> None:
    def guarded() -> None:
        try:
            loop()
        except BaseException as exc:  # a thread that dies must fail the test, not shrink the race
            report.failures.append(exc)
            raise

    workers = [threading.Thread(target=guarded) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def race(
    url: str, table: str, name: str, ttl: float, threads: int, duration: float, overtime: float = 0.0
) -> dict[str, Any]:
    locker = Locker(url, table=table, poll_min=0.001, poll_max=0.01)
    locker.leases()  # connected before the start
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    report = Report()
    grants: list[list[float]] = []
    settled = [math.inf]  # no grant is after it until stdin says when
    late = threading.Event()  # a grant received after settled[0]

    def listen() -> None:
        line = sys.stdin.readline()
        settled[0] = float(line) if line.strip() else -math.inf
        with report.guard:  # -inf (or stdin closed): no overtime
            if settled[0] == -math.inf or any(g[1] > settled[0] for g in grants):
                late.set()

    if overtime > 0:
        threading.Thread(target=listen, daemon=True).start()
    else:
        late.set()

    def loop() -> None:
        rng = random.Random()
        while time.monotonic() < start_at:
            time.sleep(0.001)
        end = start_at + duration
        while time.monotonic() < end or (not late.is_set() and time.monotonic() < end + overtime):
            try:
                lease = report.timed("try_acquire", OP_BOUND, lambda: locker.try_acquire(name, ttl=ttl))
            except DatabaseUnavailable:
                report.error("try_acquire")
                time.sleep(0.05)
                continue
            except DBLockError as exc:
                if TRIGGER_BODY not in str(exc):
                    raise
                report.error("audit trigger")
                time.sleep(0.05)
                continue
            if lease is None:
                time.sleep(rng.random() * 0.002)
                continue
            received = time.monotonic()
            trusted_until = received + lease.remaining()
            if rng.random() < 0.5:  # sometimes hold past the TTL, sometimes release
                time.sleep(rng.random() * ttl * 2)
            if rng.random() < 0.7:
                trusted_until = min(trusted_until, time.monotonic())
                try:
                    report.timed("release", OP_BOUND, lease.release)
                except DatabaseUnavailable:
                    report.error("release")
                except DBLockError as exc:
                    if TRIGGER_BODY not in str(exc):
                        raise
                    report.error("audit trigger")
            with report.guard:
                grants.append([lease.token, received, trusted_until])
                if received > settled[0]:
                    late.set()

    run_threads(threads, report, loop)
    report.timed("close", OP_BOUND + 5.0, locker.close)
    if report.failures:
        sys.exit(f"{len(report.failures)} thread(s) failed: {report.failures[0]!r}")
    return {"grants": grants, **report.json()}


def counter(url: str, table: str, name: str, ttl: float, threads: int, duration: float) -> dict[str, Any]:
    locker = Locker(url, table=table, poll_min=0.001, poll_max=0.01)
    engine = create_engine(url, pool_size=threads, connect_args={"connect_timeout": 5})
    t = counter_table(name)
    read = select(t.c.n).where(t.c.id == 1)
    locker.leases()
    with engine.connect():
        pass
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    report = Report()
    totals = {"accepted": 0, "refused": 0, "conflicts": 0, "takeovers": 0}
    tokens: list[int] = []

    def loop() -> None:
        rng = random.Random()
        while time.monotonic() < start_at:
            time.sleep(0.001)
        end, last = start_at + duration, start_at + 10 * duration
        # Run DURATION, and longer (up to 10x) while this process made fewer than 15 attempts.
        while time.monotonic() < end or (sum(totals.values()) < 15 and time.monotonic() < last):
            lease = report.timed(
                "acquire", WAIT_BOUND, lambda: locker.acquire("counter", ttl=ttl, timeout=WAIT_TIMEOUT)
            )
            try:
                with engine.begin() as conn:
                    n = dblock.fenced_read(conn, read, lease).scalar_one()
                    time.sleep(rng.uniform(0, 0.003))
                    dblock.fenced_update(conn, update(t).where(t.c.id == 1).values(n=n + 1), lease)
                outcome = "accepted"  # counted only once committed
            except dblock.FencedOut:
                outcome = "refused"
            except DBAPIError as exc:
                if code(exc) != 1213:  # a certification conflict, or a brute-force abort
                    raise
                outcome = "conflicts"
            taken_over = not report.timed("release", OP_BOUND, lease.release)
            with report.guard:
                totals[outcome] += 1
                totals["takeovers"] += taken_over
                if outcome == "accepted":
                    tokens.append(lease.token)

    run_threads(threads, report, loop)
    report.timed("close", OP_BOUND + 5.0, locker.close)
    engine.dispose()
    if report.failures:
        sys.exit(f"{len(report.failures)} thread(s) failed: {report.failures[0]!r}")
    return {**totals, "tokens": tokens, **report.json()}


def main() -> None:
    mode, url, table, name = sys.argv[1:5]
    ttl, threads, duration = float(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
    if mode == "race":
        out = race(url, table, name, ttl, threads, duration, *map(float, sys.argv[8:9]))
    else:
        out = counter(url, table, name, ttl, threads, duration)
    json.dump(out, sys.stdout)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
