"""A dblock client in its own process, run inside the client namespace of a partition test.

Usage: python partition_worker.py URL TABLE COUNTER [LOCKER_OPTIONS_JSON]
Reads one JSON command a line on stdin and writes JSON events, one a line, on stdout;
every event carries ``at``, this process's ``time.monotonic()`` (the same clock as the test's:
both run on one machine, and a network namespace has no clock of its own).

Commands (``{"do": ...}``):
- ``hold`` name ttl: acquire with renewal, ``on_expiring`` and ``on_lost``; reports
  ``held`` (token, trust_end), ``renewed`` at each extend, then ``expiring``, ``lost`` and ``untrusted`` (the first
  look at ``remaining()`` that found 0) as they come, each with ``trust_end``: the last
  ``now + remaining()`` seen while the lease was trusted (where its trust ends).
- ``write`` name: a fenced increment of the counter row with the lease held as ``name``:
  ``wrote``, ``fenced`` (with ``newer``) or ``failed``.
- ``take`` name ttl: acquire and keep without renewal: ``taken``.
- ``calls`` busy: the bounded calls under a blackhole, each timed: ``called`` per call
  (``call``, ``took``, ``raised``: the exception's class and the DBLockError check).
- ``wait`` name ttl timeout: a waiting acquire on a thread of its own; ``granted`` (token,
  remaining) or ``failed``.
- ``again`` name timeout: ``trying``, then ``acquire`` on the same Locker, timed: ``granted`` or ``failed``.
- ``fresh`` name ttl: ``trying``, then ``try_acquire`` on a new Locker (a connect first):
  ``granted`` (remaining, lost, took), ``missed`` or ``failed``.
- ``status`` name: ``status`` of the lease kept as ``name`` (remaining, lost).
- ``exit``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, create_engine, update

import dblock
from dblock import DBLockError, FencedOut, Locker

_OUT = threading.Lock()


def say(event: str, **fields: Any) -> None:
    line = json.dumps({"event": event, "at": time.monotonic(), **fields})
    with _OUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def failure(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "dblock_error": isinstance(exc, DBLockError), "message": str(exc)[:300]}


class Worker:
    def __init__(self, url: str, table: str, counter: str, options: dict[str, Any]) -> None:
        self.url = url
        self.locker = Locker(url, table=table, **options)
        self.engine = create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 2})
        self.counter = Table(
            counter, MetaData(),
            Column("id", Integer, primary_key=True),
            Column("n", Integer, nullable=False),
            Column("fence_token", BigInteger, nullable=False),
        )
        self.leases: dict[str, Any] = {}

    def hold(self, name: str, ttl: float) -> None:
        trust: dict[str, float | None] = {"end": None}

        def expiring(lease: Any) -> None:
            say("expiring", remaining=lease.remaining(), trust_end=trust["end"])

        def lost(lease: Any) -> None:
            say("lost", remaining=lease.remaining(), lost=lease.lost.is_set(), trust_end=trust["end"])

        lease = self.locker.acquire(name, ttl=ttl, timeout=30, renew=True, on_expiring=expiring, on_lost=lost)
        self.leases[name] = lease
        trust["end"] = time.monotonic() + lease.remaining()
        say("held", token=lease.token, trust_end=trust["end"])

        def watch() -> None:  # where the lease's trust ends, from remaining() alone
            while True:
                now = time.monotonic()
                left = lease.remaining()
                if left <= 0:
                    say("untrusted", seen=now, trust_end=trust["end"], lost=lease.lost.is_set())
                    return
                end = now + left
                if end > (trust["end"] or 0) + ttl / 10:  # an extend moved it on
                    say("renewed", trust_end=end)
                trust["end"] = end
                time.sleep(0.002)

        threading.Thread(target=watch, daemon=True).start()

    def write(self, name: str) -> None:
        lease = self.leases[name]
        stmt = update(self.counter).where(self.counter.c.id == 1).values(n=self.counter.c.n + 1)
        try:
            with self.engine.begin() as conn:
                result = dblock.fenced_update(conn, stmt, lease)
            say("wrote", token=lease.token, rows=result.rowcount)  # type: ignore[attr-defined]
        except FencedOut as exc:
            say("fenced", token=lease.token, newer=exc.newer)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            say("failed", **failure(exc))

    def take(self, name: str, ttl: float) -> None:
        lease = self.locker.acquire(name, ttl=ttl, timeout=30)
        self.leases[name] = lease
        say("taken", token=lease.token)

    def calls(self, busy: str) -> None:
        """Every kind of call, against a server it cannot reach; each must come back in its bound."""
        fresh = Locker(self.url, table=self.locker.table, op_timeout=self.locker.op_timeout)
        cases = [
            ("try_acquire", lambda: self.locker.try_acquire("free", ttl=30)),
            ("acquire(timeout=1)", lambda: self.locker.acquire(busy, ttl=30, timeout=1)),
            ("extend", lambda: self.leases["a"].extend()),
            ("release", lambda: self.leases["b"].release()),
            ("leases", self.locker.leases),
            ("try_acquire on a new Locker", lambda: fresh.try_acquire("free", ttl=30)),
        ]
        for call, run in cases:
            started = time.monotonic()
            try:
                value = run()
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                say("called", call=call, took=time.monotonic() - started, **failure(exc))
            else:
                say("called", call=call, took=time.monotonic() - started, value=repr(value)[:200])
        fresh.close()

    def wait(self, name: str, ttl: float, timeout: float) -> None:
        def run() -> None:
            try:
                lease = self.locker.acquire(name, ttl=ttl, timeout=timeout)
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                say("failed", **failure(exc))
                return
            self.leases[name] = lease
            say("granted", token=lease.token, remaining=lease.remaining(), ttl=ttl)

        threading.Thread(target=run, daemon=True).start()

    def again(self, name: str, timeout: float) -> None:
        say("trying")
        started = time.monotonic()
        try:
            lease = self.locker.acquire(name, ttl=30, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            say("failed", took=time.monotonic() - started, **failure(exc))
            return
        self.leases[name] = lease
        say("granted", token=lease.token, remaining=lease.remaining(), took=time.monotonic() - started, started=started)

    def fresh(self, name: str, ttl: float) -> None:
        """try_acquire on a Locker of its own, which has no connection yet: ``trying``, then
        ``granted`` (with the trust left as the call returned), ``missed`` or ``failed``."""
        locker = Locker(self.url, table=self.locker.table, op_timeout=self.locker.op_timeout)
        say("trying")
        started = time.monotonic()
        try:
            lease = locker.try_acquire(name, ttl=ttl)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            say("failed", took=time.monotonic() - started, **failure(exc))
            return
        if lease is None:
            say("missed", took=time.monotonic() - started)
            return
        self.leases[name] = lease
        say("granted", token=lease.token, remaining=lease.remaining(), lost=lease.lost.is_set(),
            took=time.monotonic() - started)

    def status(self, name: str) -> None:
        lease = self.leases.get(name)
        if lease is None:
            say("status", held=False)
        else:
            say("status", held=True, token=lease.token, remaining=lease.remaining(), lost=lease.lost.is_set())


def main() -> None:
    url, table, counter = sys.argv[1], sys.argv[2], sys.argv[3]
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    worker = Worker(url, table, counter, options)
    say("ready")
    for line in sys.stdin:
        command = json.loads(line)
        do = command.pop("do")
        if do == "exit":
            break
        try:
            getattr(worker, do)(**command)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            say("failed", do=do, **failure(exc))


if __name__ == "__main__":
    main()
