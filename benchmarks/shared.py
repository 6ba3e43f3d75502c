"""Shared leases (issue 16): a read/write lock against the exclusive lock, and a semaphore under contention.

    python benchmarks/shared.py [--url postgresql://...] [--processes 4] [--threads 4]
        [--seconds 3] [--reads 0.95] [--hold 0.001] [--rounds 2]
        [--limit 4] [--sem-processes 4] [--sem-threads 4] [--attempts 50] [--timeout 10]

1. Read-mostly: ``--processes`` x ``--threads`` threads on one name for
   ``--seconds`` each round; each take is a read lock with probability
   ``--reads``, else a write lock (the exclusive lock), held ``--hold`` s,
   then released. The same load with every take exclusive runs in the same
   invocation, rounds interleaved. Printed: grants/s, timeouts, and the ratio.
2. A semaphore of ``--limit`` with ``--sem-processes`` x ``--sem-threads``
   threads each making ``--attempts`` blocking acquires (``--timeout`` s),
   holding ``--hold`` s: statements sent per grant (acquire attempts and
   releases; a process's set-up is not counted), timeouts, and the most
   holders seen at once by the workers themselves.

Every worker waits with the Locker's defaults (PostgreSQL: readers, semaphore
waiters and writers in one fair queue with NOTIFY hand-over, migration 0008).
With no --url (and no DBLOCK_TEST_URL) a throwaway PostgreSQL is started with pgserver.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

NAME = "hot"


def worker(args: argparse.Namespace) -> None:
    from dblock import Locker, LockNotAcquired, _driver

    count = [0]
    guard = threading.Lock()
    execute = _driver.Driver._execute

    def counted(self: Any, conn: Any, sql: str, params: dict[str, Any]) -> Any:
        with guard:
            count[0] += 1
        return execute(self, conn, sql, params)

    _driver.Driver._execute = counted  # type: ignore[method-assign]
    locker = Locker(args.url, table=args.table, ttl=10)
    locker.leases()  # connected, schema checked
    semaphore = args.worker == "semaphore"
    side = locker.semaphore(NAME, args.limit) if semaphore else locker.readers(NAME)
    reads = args.reads if args.worker == "rw" else 0.0
    threads = args.sem_threads if semaphore else args.threads
    # Warm-up: prepared statements, the listener (not counted).
    side.acquire(timeout=30).release()
    if not semaphore:
        locker.acquire(NAME, timeout=30).release()
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    with guard:
        count[0] = 0
    grants, timeouts, holding, most = [0], [0], [0], [0]

    def run() -> None:
        rng = random.Random()
        while time.monotonic() < start_at:
            time.sleep(0.001)
        end = start_at + args.seconds
        n = 0
        while (n < args.attempts) if semaphore else (time.monotonic() < end):
            n += 1
            try:
                if rng.random() < reads or semaphore:
                    lease = side.acquire(timeout=args.timeout)
                else:
                    lease = locker.acquire(NAME, timeout=args.timeout)
            except LockNotAcquired:
                with guard:
                    timeouts[0] += 1
                continue
            with guard:
                grants[0] += 1
                holding[0] += 1
                most[0] = max(most[0], holding[0])
            time.sleep(args.hold)
            with guard:
                holding[0] -= 1
            lease.release()

    ts = [threading.Thread(target=run) for _ in range(threads)]
    started = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - max(started, start_at)
    locker.close()
    json.dump({"grants": grants[0], "timeouts": timeouts[0], "statements": count[0], "wall": wall, "most": most[0]},
              sys.stdout)


def together(args: argparse.Namespace, kind: str, processes: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", kind, "--url", args.url, "--table", args.table]
    for key in ("threads", "seconds", "reads", "hold", "limit", "sem_threads", "attempts", "timeout"):
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    procs = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    start_at = repr(time.monotonic() + 0.1)
    outs = []
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(start_at + "\n")
        p.stdin.flush()
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        outs.append(json.loads(out))
    wall = max(o["wall"] for o in outs)
    return {
        "grants": sum(o["grants"] for o in outs), "timeouts": sum(o["timeouts"] for o in outs),
        "statements": sum(o["statements"] for o in outs), "wall": wall, "most": max(o["most"] for o in outs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    ap.add_argument("--table", default="bench_shared_" + secrets.token_hex(4))
    ap.add_argument("--worker", default=None)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--reads", type=float, default=0.95)
    ap.add_argument("--hold", type=float, default=0.001)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--sem-processes", type=int, default=4)
    ap.add_argument("--sem-threads", type=int, default=4)
    ap.add_argument("--attempts", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args)
        return
    server = None
    if args.url is None:
        import pgserver  # type: ignore[import-not-found]

        server = pgserver.get_server(tempfile.mkdtemp(prefix="dblock-bench-"), cleanup_mode="delete")
        args.url = server.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
    from dblock import Locker, migrate

    locker = Locker(args.url, table=args.table)
    locker.create_schema()
    try:
        report(args)
    finally:
        if server is not None:
            server.cleanup()
        else:  # a server that stays: leave nothing of this run on it
            migrate.downgrade(locker.engine, args.table, None)
            locker.close()


def report(args: argparse.Namespace) -> None:
    """The runs, and their tables."""
    rw: dict[str, list[dict[str, Any]]] = {"rw": [], "exclusive": []}
    for r in range(args.rounds):
        for kind in (["rw", "exclusive"] if r % 2 == 0 else ["exclusive", "rw"]):
            rw[kind].append(together(args, kind, args.processes))
    rate = {k: sum(o["grants"] for o in v) / sum(o["wall"] for o in v) for k, v in rw.items()}
    print(f"read-mostly: {args.processes} processes x {args.threads} threads, {args.reads:.0%} reads, "
          f"hold {args.hold * 1000:g} ms, {args.rounds} rounds of {args.seconds:g} s; {os.cpu_count()} CPUs")
    print(f"  {'variant':<34} {'grants/s':>10} {'timeouts':>9}")
    for kind, label in (("exclusive", "exclusive lock (every take)"), ("rw", "read/write lock")):
        print(f"  {label:<34} {rate[kind]:>10.0f} {sum(o['timeouts'] for o in rw[kind]):>9}")
    sem = together(args, "semaphore", args.sem_processes)
    print(f"semaphore of {args.limit}: {args.sem_processes} processes x {args.sem_threads} threads, "
          f"{args.attempts} acquires each, hold {args.hold * 1000:g} ms")
    per_grant = sem["statements"] / sem["grants"] if sem["grants"] else float("nan")
    print(f"  grants {sem['grants']}, timeouts {sem['timeouts']}, statements/grant {per_grant:.2f}, "
          f"most held at once in one process {sem['most']}, {sem['grants'] / sem['wall']:.0f} grants/s")
    print(f"read/write vs exclusive: {rate['rw'] / rate['exclusive']:.2f}x")


if __name__ == "__main__":
    main()
