"""Idle processes and the cost of a hand-off: it must not grow with processes that once waited.

    python benchmarks/idle_listeners.py [--url postgresql://...] [--processes 50|10,25,50] [--handoffs 200]
        [--rounds 3] [--plot PATH.png]

With no --url (and no DBLOCK_TEST_URL) it starts a throwaway PostgreSQL with pgserver
(pip install -e '.[test]'). PostgreSQL signals every session LISTENing in the database when a
transaction that NOTIFYs commits, and each wakes to read the notification queue: so each
listening session costs every hand-off of every process (``queue_ops.py --listeners``
measures about 14 us each). A dblock process listens only while it has waiters, and for
``IDLE_CLOSE`` seconds after (dblock/_await.py; 30 s before, 1 s now).

``--processes`` idle processes (this file with ``--idle``) each make a Locker, wait once for
a name the main process holds (so their listener starts), and then sleep. The main process
times hand-offs: two of its threads take turns on one name, each release handing the lease
to the other, queued in the fair queue; the time of ``lease.release()``. Phases, in one run:

- **none**: no idle process (measured first and last);
- **plain idle sessions**: as many idle psycopg sessions, no dblock, none listening: what idle
  sessions cost PostgreSQL by themselves;
- **idle, listener closed**: the idle processes, each having just waited once, once their
  ``IDLE_CLOSE`` has passed;
- **idle, listener kept**: the same processes after each waited once more with ``IDLE_CLOSE``
  raised to an hour, as a listener kept for 30 s after its last waiter is for those 30 s.

The last two alternate, ``--rounds`` times; every phase times ``--handoffs`` hand-offs per round,
after ``--settle`` seconds of quiet (50 processes waking, or 50 sessions starting, slow the
machine for a moment whatever they are).
A row gives the p50 and p99 of the release, its ratio to **none**, and the sessions the server
lists as dblock's listeners besides the main process's own (``pg_stat_activity``).

``--processes 10,25,50`` runs the phases of idle sessions and processes at each count in turn
(the plain sessions at every count first; then the idle processes, started as the count grows,
so each count's phases have exactly that many). --plot PATH.png also draws the release's p50
against the count, **none** as a flat line, with benchmarks/_plot.py (needs matplotlib:
pip install 'dblock[plots]').
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

LISTENER = "dblock listener"  # the listener's application_name (dblock.backends.postgresql.APPLICATION_NAME)


def idle(args: argparse.Namespace) -> None:
    """One idle process: a wait whenever the main process says so (its line on stdin), sleeping between."""
    from dblock import Locker, _wait

    locker = Locker(args.url, table=args.table)
    default = _wait.IDLE_CLOSE
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "keep":
            _wait.IDLE_CLOSE = 3600.0  # a listener that stays, as one did for 30 s after its last waiter
        elif command == "close":
            _wait.IDLE_CLOSE = default  # dblock's own: the listener closes after this wait
        if command in ("wait", "keep", "close"):
            locker.acquire(args.name, timeout=60).release()
            print("waited", flush=True)
    locker.close()


PLAIN, CLOSED, KEPT = "plain idle sessions", "idle processes, listener closed", "idle processes, listener kept"


def label(kind: str, count: int) -> str:
    """A phase's row: "50 idle processes, listener kept"."""
    return f"{count} {kind}"


def listening(conn: Any, own: int | None) -> int:
    rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (LISTENER,)).fetchall()
    return sum(1 for (pid,) in rows if pid != own)


def handoffs(locker: Any, name: str, count: int, queued: Any) -> list[float]:
    """``count`` hand-offs between two threads: the microseconds of each release, a waiter queued."""
    times: list[float] = []
    lease = locker.acquire(name, timeout=60)
    holder: dict[str, Any] = {}
    for _ in range(count):
        got = threading.Event()

        def wait() -> None:
            holder["lease"] = locker.acquire(name, timeout=60)
            got.set()

        waiter = threading.Thread(target=wait)
        waiter.start()
        while not queued():
            time.sleep(0.0005)
        start = time.perf_counter()
        lease.release()
        times.append((time.perf_counter() - start) * 1e6)
        got.wait(60)
        waiter.join()
        lease = holder.pop("lease")
    lease.release()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    ap.add_argument("--processes", default="50", help="idle processes, or comma-separated counts (10,25,50)")
    ap.add_argument("--handoffs", type=int, default=200, help="hand-offs per block")
    ap.add_argument("--rounds", type=int, default=3, help="blocks per phase")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds to let the machine settle before a phase")
    ap.add_argument("--idle", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--table", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--plot", metavar="PATH.png", help="also draw release p50 against idle processes (needs dblock[plots])")
    args = ap.parse_args()
    if args.idle:
        idle(args)
        return
    counts = sorted({int(c) for c in args.processes.split(",") if c.strip()})
    most = counts[-1]
    if args.plot:
        import _plot  # benchmarks/_plot.py

        _plot.require()  # before a run of minutes, not after

    import psycopg

    from dblock import Locker, _wait, migrate

    server = None
    if not args.url:
        import pgserver

        # Each idle process holds two sessions while it waits (its pool's and its listener's): more
        # than PostgreSQL's default 100 for 50 processes. Set, then restart, before the run.
        pgdata = tempfile.mkdtemp(prefix="dblock-bench-")
        first = pgserver.get_server(pgdata, cleanup_mode="stop")
        first.psql(f"ALTER SYSTEM SET max_connections = {2 * most + 50}")
        first.cleanup()
        server = pgserver.get_server(pgdata, cleanup_mode="delete")
        args.url = server.get_uri()
    table = "bench_" + secrets.token_hex(4)
    locker = Locker(args.url, table=table)
    locker.create_schema()
    dsn = locker.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    watch = psycopg.connect(dsn, autocommit=True)
    allowed = int(watch.execute("SHOW max_connections").fetchone()[0])
    if allowed < 2 * most + 10:
        sys.exit(f"{most} idle processes need about {2 * most + 10} sessions; the server allows "
                 f"{allowed} (leave --url out: the throwaway server is set up for them)")
    name, bait = "handoff", "bait"
    waiters = f"{table}_waiters"

    def queued() -> bool:
        return bool(watch.execute(f"SELECT 1 FROM {waiters} WHERE name = %s", (name,)).fetchone())

    procs: list[subprocess.Popen[str]] = []
    samples: dict[str, list[float]] = {}
    sessions: dict[str, int] = {}

    def measure(phase: str) -> None:
        samples.setdefault(phase, []).extend(handoffs(locker, name, args.handoffs, queued))
        listener = locker._listener  # noqa: SLF001 - the main process's own listening session, not counted
        own = listener.ident[0] if listener is not None and listener.ident is not None else None
        sessions[phase] = listening(watch, own)

    def tell(command: str) -> None:
        """Every idle process runs ``command``; a wait needs the bait held until all have queued."""
        held = locker.acquire(bait, timeout=60)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        deadline = time.monotonic() + 60
        while watch.execute(f"SELECT count(*) FROM {waiters} WHERE name = %s", (bait,)).fetchone()[0] < len(procs):
            assert time.monotonic() < deadline, "the idle processes did not all queue"
            time.sleep(0.01)
        held.release()  # the line drains: each waits once
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "waited"

    plain: list[Any] = []
    try:
        v = watch.info.server_version
        print(f"PostgreSQL {v // 10000}.{v % 10000}{' (throwaway server)' if server else ''}, {os.cpu_count()} CPUs, "
              f"{', '.join(map(str, counts))} idle processes, IDLE_CLOSE {_wait.IDLE_CLOSE:g} s")
        for _ in range(args.rounds):
            measure("none")
        for count in counts:
            # What idle sessions cost PostgreSQL by themselves, whoever holds them (no LISTEN).
            plain = [psycopg.connect(dsn, autocommit=True) for _ in range(count)]
            time.sleep(args.settle)
            for _ in range(args.rounds):
                measure(label(PLAIN, count))
            for conn in plain:
                conn.close()
        for count in counts:
            started = len(procs)
            for _ in range(count - started):  # the ones already started are idle too: no more than count
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--idle", "--url", args.url, "--table", table, "--name", bait],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                ))
            for proc in procs[started:]:
                assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            for _ in range(args.rounds):  # the two states alternate, so noise hits them alike
                tell("wait")
                time.sleep(_wait.IDLE_CLOSE + args.settle)  # their listeners close, and the machine settles
                measure(label(CLOSED, count))
                tell("keep")  # a listener that stays, as it did for 30 s after its last waiter
                time.sleep(args.settle)
                measure(label(KEPT, count))
                tell("close")
    finally:
        for conn in plain:
            conn.close()
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs:
            proc.wait(30)
    for _ in range(args.rounds):
        measure("none")
    base = statistics.median(samples["none"])
    print(f"{'phase':<36} {'release p50 us':>15} {'p99 us':>9} {'vs none':>8} {'listening':>10}")
    p50s: dict[str, float] = {}
    for phase, times in samples.items():
        ordered = sorted(times)
        p50, p99 = statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        p50s[phase] = p50
        print(f"{phase:<36} {p50:>15.0f} {p99:>9.0f} {p50 / base:>7.2f}x {sessions[phase]:>10}")
    if args.plot:
        _plot.line_plot(
            args.plot, "Idle processes and the hand-off: the release with a waiter queued",
            "idle processes (or plain idle sessions)", "release p50, us",
            {kind: [(c, p50s[label(kind, c)]) for c in counts] for kind in (PLAIN, CLOSED, KEPT)},
            hlines={"none (no idle process)": base},
            note=f"PostgreSQL {v // 10000}.{v % 10000}, {os.cpu_count()} CPUs, "
            f"{args.rounds} x {args.handoffs} hand-offs per phase, IDLE_CLOSE {_wait.IDLE_CLOSE:g} s",
        )
        print(f"plot: {args.plot}", file=sys.stderr)  # stdout ends with the table
    watch.close()
    locker.close()
    migrate.downgrade(locker.engine, table, None)
    if server is not None:
        server.cleanup()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
