"""Contended waiting: processes x threads taking turns on one lock name, dblock against its peers.

    python benchmarks/contended.py [--url postgresql://...] [--processes 3] [--threads 4]
        [--attempts 400] [--timeout 1] [--hold 0.001] [--rounds 4] [--variants NAME;...|all]
        [--redis redis://...]

The workload of a published Redis lock framework: every thread makes
``--attempts`` blocking acquires of one name with a ``--timeout`` s wait,
holds the lock ``--hold`` s, releases it. All variants run in the same
invocation on the same machine, in ``--rounds`` interleaved rounds so that a
slow spell of the machine hits them alike. Per variant:

- grants, timeouts;
- per grant: statements (Redis commands) sent per successful acquisition,
  counting acquire attempts, releases and queue bookkeeping; a process's
  one-time set-up (connections, LISTEN) is not counted;
- hand-over p50/p99: from the moment a holder calls release to the moment a
  *different* thread's acquire returns (one clock: CLOCK_MONOTONIC is shared
  by the processes of one machine); it includes the release's own round trip
  and commit, whose median is shown as "release ms";
- regrant: the share of grants that went straight back to the thread that
  had just released;
- wall time of the whole run.

With no --url (and no DBLOCK_TEST_URL) a throwaway PostgreSQL is started
with pgserver. Redis peers run when redis-py / python-redis-lock are installed
(pip install -e '.[bench]') and a server answers at --redis.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

DBLOCK_VARIANTS = {
    "dblock fair, NOTIFY (default)": {},
    "dblock fair, polling (notify=False)": {"notify": False},
    "dblock polling (fair=False)": {"fair": False},
}
PG_PEERS = ["pg_advisory_lock + lock_timeout", "hand-written upsert poll, 5-15 ms"]
REDIS_PEERS = ["redis-py Lock, sleep 0.1 s", "redis-py Lock, sleep 0.01 s", "python-redis-lock (BLPOP)"]
NAME = "hot"


# -- one worker process --------------------------------------------------------
class Counter:
    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def add(self, k: int = 1) -> None:
        with self._lock:
            self.n += k


def _dblock(
    args: argparse.Namespace, count: Counter, options: dict[str, Any] | None = None
) -> tuple[Callable[[], Any], Callable[[Any], None], Callable[[], None]]:
    """``options``: the Locker's, instead of those of the variant named ``args.worker``."""
    from dblock import Locker, LockNotAcquired, _driver

    execute = _driver.Driver._execute

    def counted(self: Any, conn: Any, sql: str, params: dict[str, Any]) -> Any:
        count.add()
        return execute(self, conn, sql, params)

    _driver.Driver._execute = counted  # type: ignore[method-assign]
    locker = Locker(args.url, table=args.table, ttl=10, **(DBLOCK_VARIANTS[args.worker] if options is None else options))

    def acquire() -> Any:
        try:
            return locker.acquire(NAME, timeout=args.timeout)
        except LockNotAcquired:
            return None

    return acquire, lambda lease: lease.release(), locker.close


def _advisory(args: argparse.Namespace, count: Counter) -> tuple[Callable[[], Any], Callable[[Any], None], Callable[[], None]]:
    import psycopg

    local = threading.local()
    conns: list[Any] = []

    def conn() -> Any:
        if not hasattr(local, "c"):
            local.c = psycopg.connect(args.dsn, autocommit=True)
            local.c.execute(f"SET lock_timeout = '{int(args.timeout * 1000)}ms'")  # set-up, not counted
            conns.append(local.c)
        return local.c

    def acquire() -> Any:
        c = conn()
        count.add()
        try:
            c.execute("SELECT pg_advisory_lock(4242)")
        except psycopg.errors.LockNotAvailable:
            return None
        return c

    def release(c: Any) -> None:
        count.add()
        c.execute("SELECT pg_advisory_unlock(4242)")

    return acquire, release, lambda: [c.close() for c in conns]


def _upsert_poll(args: argparse.Namespace, count: Counter) -> tuple[Callable[[], Any], Callable[[Any], None], Callable[[], None]]:
    import random

    import psycopg

    local = threading.local()
    conns: list[Any] = []
    t = args.table + "_poll"

    def conn() -> Any:
        if not hasattr(local, "c"):
            local.c = psycopg.connect(args.dsn, autocommit=True)
            conns.append(local.c)
        return local.c

    def acquire() -> Any:
        c, me = conn(), uuid.uuid4().hex
        deadline = time.monotonic() + args.timeout
        while True:
            count.add()
            got = c.execute(
                f"INSERT INTO {t} (name, owner, expires_at) VALUES (%s, %s, now() + interval '10 s') "
                f"ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at "
                f"WHERE {t}.expires_at <= now() RETURNING owner",
                (NAME, me),
                prepare=True,
            ).fetchall()
            if got:
                return (c, me)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(left, 0.005 + random.random() * 0.010))

    def release(held: Any) -> None:
        c, me = held
        count.add()
        c.execute(f"DELETE FROM {t} WHERE name = %s AND owner = %s", (NAME, me), prepare=True)

    return acquire, release, lambda: [c.close() for c in conns]


def _redis(args: argparse.Namespace, count: Counter) -> tuple[Callable[[], Any], Callable[[Any], None], Callable[[], None]]:
    import redis

    client = redis.Redis.from_url(args.redis)
    execute = client.execute_command

    def counted(*a: Any, **kw: Any) -> Any:
        count.add()
        return execute(*a, **kw)

    if args.worker == "python-redis-lock (BLPOP)":
        import redis_lock

        client.execute_command = counted  # type: ignore[method-assign]

        def acquire() -> Any:
            lock = redis_lock.Lock(client, NAME + args.table, expire=10)
            return lock if lock.acquire(timeout=args.timeout) else None

        return acquire, lambda lock: lock.release(), client.close
    sleep = 0.1 if "0.1" in args.worker else 0.01
    client.execute_command = counted  # type: ignore[method-assign]

    def acquire_py() -> Any:
        lock = client.lock(NAME + args.table, timeout=10, sleep=sleep, blocking_timeout=args.timeout)
        return lock if lock.acquire() else None

    return acquire_py, lambda lock: lock.release(), client.close


def worker(args: argparse.Namespace) -> None:
    count = Counter()
    if args.worker in DBLOCK_VARIANTS:
        make = _dblock
    elif args.worker.startswith("pg_advisory"):
        make = _advisory
    elif args.worker.startswith("hand-written"):
        make = _upsert_poll
    else:
        make = _redis
    acquire, release, close = make(args, count)
    events: list[tuple[float, float, int, float]] = []  # (granted at, release called at, thread id, release took)
    timeouts = Counter()
    guard = threading.Lock()
    warm = threading.Barrier(args.threads + 1)  # the threads and this main thread

    def run(tid: int) -> None:
        held = acquire()  # warm-up: connections, LISTEN, prepared statements (not counted)
        if held is not None:
            release(held)
        warm.wait()  # every thread warm
        warm.wait()  # the start time is known
        while time.monotonic() < args.start_at:
            time.sleep(0.0005)
        for _ in range(args.attempts):
            held = acquire()
            got = time.monotonic()
            if held is None:
                timeouts.add()
                continue
            time.sleep(args.hold)
            let_go = time.monotonic()
            release(held)
            took = time.monotonic() - let_go
            with guard:
                events.append((got, let_go, tid, took))

    threads = [threading.Thread(target=run, args=(args.proc * 1000 + i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    warm.wait()
    count.n = 0
    print("ready", flush=True)  # the driver starts every process together
    args.start_at = float(sys.stdin.readline())
    warm.wait()
    for t in threads:
        t.join()
    close()
    json.dump({"events": events, "timeouts": timeouts.n, "statements": count.n}, sys.stdout)


# -- the driver ------------------------------------------------------------------
def run_round(variant: str, args: argparse.Namespace, table: str, attempts: int) -> dict[str, Any]:
    """One run of the workload for ``variant``: every worker process, ``attempts`` per thread."""
    cmd = [
        sys.executable, __file__, "--worker", variant, "--url", args.url, "--table", table,
        "--threads", str(args.threads), "--attempts", str(attempts), "--timeout", str(args.timeout),
        "--hold", str(args.hold), "--redis", args.redis,
    ]
    procs = [
        subprocess.Popen([*cmd, "--proc", str(p)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for p in range(args.processes)
    ]
    for p in procs:  # each says "ready" once its threads are warm
        assert p.stdout is not None
        if p.stdout.readline() != "ready\n":
            raise SystemExit(f"a {variant} worker failed while warming up")
    start_at = repr(time.monotonic() + 0.05)
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(start_at + "\n")
        p.stdin.flush()
    outs = [json.loads(p.communicate()[0]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a {variant} worker failed")
    events = sorted(e for o in outs for e in o["events"])
    pairs = list(zip(events, events[1:]))
    return {
        "grants": len(events),
        "timeouts": sum(o["timeouts"] for o in outs),
        "statements": sum(o["statements"] for o in outs),
        "handover": [(nxt[0] - prev[1]) * 1000 for prev, nxt in pairs if nxt[2] != prev[2]],
        "regrants": sum(1 for prev, nxt in pairs if nxt[2] == prev[2]),
        "pairs": len(pairs),
        "wall": (events[-1][0] - events[0][0]) if events else 0.0,
        "release": [e[3] * 1000 for e in events],
    }


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    grants = sum(r["grants"] for r in rounds)
    handover = [h for r in rounds for h in r["handover"]]
    pairs = sum(r["pairs"] for r in rounds)
    release = [x for r in rounds for x in r["release"]]
    return {
        "grants": grants,
        "timeouts": sum(r["timeouts"] for r in rounds),
        "per_grant": sum(r["statements"] for r in rounds) / grants if grants else float("nan"),
        "p50": statistics.median(handover) if handover else float("nan"),
        "p99": statistics.quantiles(handover, n=100)[98] if len(handover) > 1 else float("nan"),
        "regrant": sum(r["regrants"] for r in rounds) / pairs if pairs else float("nan"),
        "wall": sum(r["wall"] for r in rounds),
        "release": statistics.median(release) if release else float("nan"),
    }


def _redis_up(url: str) -> bool:
    try:
        import redis

        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except Exception:  # noqa: BLE001 - no client library or no server: skip the Redis peers
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    ap.add_argument("--redis", default=os.environ.get("DBLOCK_BENCH_REDIS", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--attempts", type=int, default=400)
    ap.add_argument("--timeout", type=float, default=1.0)
    ap.add_argument("--hold", type=float, default=0.001)
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds the attempts are split into")
    ap.add_argument(
        "--variants",
        help="semicolon-separated subset of the variant names (prefixes match); 'all' adds dblock's fair polling mode, "
        "slow by design (a waiter finds its hand-off only when it looks)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--table", help=argparse.SUPPRESS)
    ap.add_argument("--proc", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        from sqlalchemy.engine import make_url

        args.dsn = make_url(args.url).set(drivername="postgresql").render_as_string(hide_password=False)
        worker(args)
        return

    server = None
    if not args.url:
        import pgserver

        server = pgserver.get_server(tempfile.mkdtemp(prefix="dblock-bench-"), cleanup_mode="delete")
        args.url = server.get_uri()
    from sqlalchemy.engine import make_url

    import psycopg

    from dblock import Locker, migrate

    sa_url = make_url(args.url).set(drivername="postgresql+psycopg")
    args.url = sa_url.render_as_string(hide_password=False)
    dsn = sa_url.set(drivername="postgresql").render_as_string(hide_password=False)
    variants = [*DBLOCK_VARIANTS, *PG_PEERS, *(REDIS_PEERS if _redis_up(args.redis) else [])]
    if not args.variants:
        variants.remove("dblock fair, polling (notify=False)")
    elif args.variants != "all":
        wanted = [w.strip() for w in args.variants.split(";")]
        variants = [v for v in variants if any(v.startswith(w) for w in wanted)]
    # Round-robin: each variant runs --rounds times, interleaved with the others,
    # so that the machine's slow spells hit every variant alike.
    per_round = max(1, args.attempts // args.rounds)
    tables: dict[str, str] = {}
    rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for variant in variants:
            table = tables[variant] = "bench_" + secrets.token_hex(4)
            Locker(sa_url, table=table).create_schema()
            with psycopg.connect(dsn, autocommit=True) as raw:
                raw.execute(f"CREATE TABLE {table}_poll (name text PRIMARY KEY, owner text, expires_at timestamptz)")
                version = raw.info.server_version
        for _ in range(args.rounds):
            for variant in variants:
                rounds[variant].append(run_round(variant, args, tables[variant], per_round))
    finally:
        for table in tables.values():
            locker = Locker(sa_url, table=table)
            migrate.downgrade(locker.engine, table, None)
            locker.close()
            with psycopg.connect(dsn, autocommit=True) as raw:
                raw.execute(f"DROP TABLE IF EXISTS {table}_poll")
    results = {v: summarise(r) for v, r in rounds.items()}
    print(
        f"contended: {args.processes} processes x {args.threads} threads x {per_round * args.rounds} attempts "
        f"({args.rounds} interleaved rounds), "
        f"timeout {args.timeout:g} s, hold {args.hold * 1000:g} ms; PostgreSQL {version}, {os.cpu_count()} CPUs"
    )
    head = f"{'variant':38} {'grants':>6} {'timeouts':>8} {'per grant':>9} {'p50 ms':>7} {'p99 ms':>7} {'regrant':>7} {'wall s':>6} {'release ms':>10}"
    print(head)
    for variant, r in results.items():
        print(
            f"{variant:38} {r['grants']:6d} {r['timeouts']:8d} {r['per_grant']:9.2f} {r['p50']:7.2f} "
            f"{r['p99']:7.2f} {r['regrant'] * 100:6.0f}% {r['wall']:6.1f} {r['release']:10.2f}"
        )
    if server is not None:
        server.cleanup()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
