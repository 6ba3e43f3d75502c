"""Waiters at scale: many threads waiting for one name, dblock against pg_advisory_lock.

    python benchmarks/waiters.py [--url postgresql://...] [--sizes 12,200,1000] [--settle S]
        [--seconds S] [--rounds 2] [--hold 0.002] [--timeout S] [--variants dblock;pg_advisory_lock|all]
        [--breakdown 12|none] [--advisory-max N] [--plot PATH.png]

A size is a number of waiting threads, spread over worker processes:
12 = 3 processes x 4 threads, 200 = 4 x 50, 1000 = 10 x 100; or write PxT
(2x2). Each dblock process has a Locker with a pool of ``max_connections``
10, except at 10 processes, where it is 4 so that the processes fit a server
of default size (10 x (4 + 1 listener) = 50 sessions); PxT/N sets it to N.
pg_advisory_lock needs one session per waiting thread; they set
``deadlock_timeout`` past the acquire timeout (a superuser's setting; one
advisory lock cannot deadlock): with the server's 1 s every waiter runs the
deadlock check once it has waited a second, and a line of 1,000 stalls
(``--variants all`` adds that variant).

Every thread loops: a blocking acquire, hold --hold s, release. Workers
report ready once every thread is warm (one acquire + release each, not
measured) and start together. The measured window opens after --settle s
(default max(1 s, 5 ms per waiter)), when the line has formed, so that as
many acquires are waiting when it closes as when it opened, and lasts
--seconds (default max(4 s, 10 ms per waiter)). Then every thread still in
line is served once and lets go at once; that drain is not measured either.
Variants run in --rounds interleaved rounds per size. Per size and variant,
over the window:

- grants; errors (exceptions other than a timeout, e.g. "too many clients");
- timeouts (the drain's included): a wait that ran out. The timeout is
  generous, max(5 s, 60 ms per waiter): a FIFO line of N waiters comes
  round every N x (hold + hand-over), about N x 3-5 ms here, so a timeout
  means a waiter was passed over for 10 or more turns (starvation), not a
  slow machine;
- per grant: statements sent in the window / grants in the window (the
  counting hook on dblock's Driver._execute that contended.py uses; one per
  advisory lock or unlock call);
- per s: statements sent per second of the window, all processes together
  (it shows the load when few or no grants come through);
- hand-over p50/p99 ms: a holder calls release -> a *different* thread's
  acquire returns (CLOCK_MONOTONIC is shared by the processes of one machine);
- release ms: the median duration of the release call (client side), and its
  ratio to the same variant's at the first size;
- WAL kB per grant: the server's WAL written in the window (pg_current_wal_lsn)
  / grants; on a server others use too, their writes count as well.

The breakdown (--breakdown SIZE, default 12 when it is among the sizes) adds a
dblock variant whose connections run with ``synchronous_commit = off`` and
splits dblock's hand-over: (a) the release call, (b) of which the commit's
WAL flush (release p50 with the flush minus without it; and the server's mean
WAL sync time from pg_stat_wal when ``track_wal_io_timing`` is on, as on the
throwaway server), (c) notification delivery: release returns -> the
NOTIFY is dispatched in the waiter's process (``dblock._wait.Listener._dispatch``
is wrapped in the workers to stamp it; n/a if it does not exist; negative when
it is heard before the release call has returned), by whichever thread reads
the listener's connection (the waiting thread itself, unless another waiter of
its process reads it), (d) wake-up: dispatch -> the waiting thread's acquire
returns. Only
hand-overs whose waiter was woken by a notification are split ("notified").

With no --url (and no DBLOCK_TEST_URL) a throwaway PostgreSQL is started with
pgserver, with ``max_connections`` raised to fit the largest size.

--plot PATH.png also draws hand-over p50 and p99 against the number of waiters, a line
per variant (the breakdown's synchronous_commit=off variant left out), with
benchmarks/_plot.py (needs matplotlib: pip install 'dblock[plots]').
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _plot  # noqa: E402 - benchmarks/_plot.py, for --plot
import contended  # noqa: E402 - the worker machinery: counting hook, dblock and advisory clients

DBLOCK = "dblock fair, NOTIFY (default)"
SYNC_OFF = "dblock, synchronous_commit=off"
ADVISORY = "pg_advisory_lock"
# The same with the server's deadlock_timeout (1 s by default): every session
# that has waited that long runs PostgreSQL's deadlock check, which holds all
# of the lock manager's partitions while it walks the wait queue, so a line of
# 1,000 stalls. The baseline raises it past the timeout for its own sessions
# (one advisory lock cannot deadlock); this variant runs only when asked for.
ADVISORY_DEFAULT = "pg_advisory_lock, deadlock_timeout 1 s"
ADVISORIES = (ADVISORY, ADVISORY_DEFAULT)
VARIANTS = [DBLOCK, ADVISORY]
OPT_IN = [ADVISORY_DEFAULT]
SHAPES = {12: (3, 4), 200: (4, 50), 1000: (10, 100)}
DEFAULT_POOL, SMALL_POOL = 10, 4  # dblock's max_connections; SMALL_POOL from 10 processes on
RESERVED = 15  # sessions a throwaway server has beyond the largest size: superuser reserve, the driver, a margin


# -- one worker process --------------------------------------------------------
def _stamp_dispatch(stamps: dict[str, float]) -> bool:
    """Wrap the listener's dispatch to note when each notification reached this process.

    Every whitespace-separated field of the payload is a key (today
    "owner token expiry"), so the waiter finds its stamp by its lease's token
    or owner. False if this dblock has no ``Listener._dispatch``.
    """
    try:
        from dblock._wait import Listener
    except ImportError:
        return False
    dispatch = getattr(Listener, "_dispatch", None)
    if dispatch is None:
        return False

    def stamped(self: Any, payload: Any, *a: Any, **kw: Any) -> Any:
        at = time.monotonic()
        for field in str(payload).split():
            stamps[field] = at  # before the dispatch wakes the waiter, which then looks
        return dispatch(self, payload, *a, **kw)

    Listener._dispatch = stamped  # type: ignore[method-assign]
    return True


def worker(args: argparse.Namespace) -> None:
    count = contended.Counter()
    stamps: dict[str, float] = {}
    stamping = False
    if args.worker in ADVISORIES:
        if args.worker == ADVISORY and args.deadlock_timeout:
            from urllib.parse import quote

            options = quote(f"-c deadlock_timeout={args.deadlock_timeout:g}s", safe="")
            args.dsn += ("&" if "?" in args.dsn else "?") + "options=" + options
        acquire, release, close = contended._advisory(args, count)
    else:
        acquire, release, close = contended._dblock(args, count, {"max_connections": args.pool})
        stamping = _stamp_dispatch(stamps)
    events: list[tuple[float, float, int, float, float | None]] = []  # got, let go, thread, release took, dispatched
    timeouts = contended.Counter()
    errors: dict[str, int] = {}
    guard = threading.Lock()
    warm = threading.Barrier(args.threads + 1)

    def error(exc: BaseException) -> None:
        key = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        with guard:
            errors[key] = errors.get(key, 0) + 1

    def turn(tid: int, begin: float, end: float) -> None:
        """One acquire, hold, release; recorded when granted within [begin, end)."""
        try:
            held = acquire()
        except Exception as exc:  # noqa: BLE001 - counted and shown, the thread goes on
            error(exc)
            time.sleep(0.01)
            return
        got = time.monotonic()
        if held is None:
            timeouts.add()
            return
        late = got >= end  # the drain: let go at once, not measured
        if not late:
            time.sleep(args.hold)
        let_go = time.monotonic()
        try:
            release(held)
        except Exception as exc:  # noqa: BLE001
            error(exc)
            return
        took = time.monotonic() - let_go
        dispatched = None
        for key in (str(getattr(held, "token", "")), str(getattr(held, "owner", ""))):
            at = stamps.pop(key, None) if key else None
            dispatched = at if dispatched is None else dispatched
        if begin <= got < end:
            with guard:
                events.append((got, let_go, tid, took, dispatched))

    def run(tid: int) -> None:
        turn(tid, 0.0, 0.0)  # warm-up: connections, LISTEN, prepared statements (not measured)
        warm.wait()  # every thread warm
        warm.wait()  # the start time is known
        while time.monotonic() < args.start_at:
            time.sleep(0.0005)
        begin = args.start_at + args.settle
        end = begin + args.seconds
        while time.monotonic() < end:
            turn(tid, begin, end)

    threads = [threading.Thread(target=run, args=(args.proc * 1000 + i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    warm.wait()
    stamps.clear()
    timeouts.n = 0
    print("ready", flush=True)  # the driver starts every process together
    args.start_at = float(sys.stdin.readline())
    warm.wait()
    begin = args.start_at + args.settle
    time.sleep(max(0.0, begin - time.monotonic()))
    at_begin = count.n
    time.sleep(max(0.0, begin + args.seconds - time.monotonic()))
    in_window = count.n - at_begin  # not the settling, nor the drain
    for t in threads:
        t.join()
    close()
    json.dump(
        {"events": events, "timeouts": timeouts.n, "errors": errors, "statements": in_window, "stamping": stamping},
        sys.stdout,
    )


# -- the driver ------------------------------------------------------------------
class Times:
    """A size's acquire timeout, settling time before the window, and window, in seconds."""

    def __init__(self, args: argparse.Namespace, waiters: int) -> None:
        self.timeout = args.timeout if args.timeout is not None else max(5.0, 0.06 * waiters)
        self.settle = args.settle if args.settle is not None else max(1.0, 0.005 * waiters)
        self.seconds = args.seconds if args.seconds is not None else max(4.0, 0.01 * waiters)


class Size:
    def __init__(self, spec: str) -> None:
        shape, _, pool = spec.partition("/")
        if "x" in shape:
            p, _, t = shape.partition("x")
            self.processes, self.threads = int(p), int(t)
        elif int(shape) in SHAPES:
            self.processes, self.threads = SHAPES[int(shape)]
        else:
            raise SystemExit(f"size {spec!r}: use one of {sorted(SHAPES)} or PROCESSESxTHREADS, e.g. 2x2")
        self.pool = int(pool) if pool else (SMALL_POOL if self.processes >= 10 else DEFAULT_POOL)
        self.waiters = self.processes * self.threads
        self.label = str(self.waiters)
        self.shape = f"{self.processes} x {self.threads}"


def run_round(variant: str, size: Size, args: argparse.Namespace, table: str, times: Times) -> dict[str, Any]:
    url = args.url_sync_off if variant == SYNC_OFF else args.url
    cmd = [
        sys.executable, __file__, "--worker", variant, "--url", url, "--table", table,
        "--threads", str(size.threads), "--settle", repr(times.settle), "--seconds", repr(times.seconds),
        "--timeout", repr(times.timeout), "--hold", repr(args.hold), "--pool", str(size.pool),
        "--deadlock-timeout", repr(times.timeout + 10 if args.superuser else 0.0),
    ]
    log = tempfile.TemporaryFile("w+")  # the workers' stderr (dblock's warnings), summed up in the report
    procs = [
        subprocess.Popen([*cmd, "--proc", str(p)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        for p in range(size.processes)
    ]
    # Warm-up and drain each end within a wait's timeout (+ GRACE) per thread.
    limit = time.monotonic() + 3 * times.timeout + times.settle + times.seconds + 120
    try:
        for p in procs:  # each says "ready" once its threads are warm
            assert p.stdout is not None
            if p.stdout.readline() != "ready\n":
                raise SystemExit(f"a {variant} worker failed while warming up ({size.label} waiters)")
        start_at = time.monotonic() + 0.05
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(repr(start_at) + "\n")
            p.stdin.flush()
        wal = _wal_written(args.dsn, start_at + times.settle, start_at + times.settle + times.seconds)
        outs = [json.loads(p.communicate(timeout=max(1.0, limit - time.monotonic()))[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        log.seek(0)
        stderr = log.read()
        log.close()
    if any(p.returncode for p in procs):
        sys.stderr.write(stderr[-5000:])
        raise SystemExit(f"a {variant} worker failed ({size.label} waiters)")
    logged: dict[str, int] = {}
    for line in stderr.splitlines():
        key = _shape_of(line)
        logged[key] = logged.get(key, 0) + 1
    events = sorted(e for o in outs for e in o["events"])
    handover, parts = [], []
    for prev, nxt in zip(events, events[1:]):
        if nxt[2] == prev[2]:
            continue  # the same thread again: no hand-over
        handover.append((nxt[0] - prev[1]) * 1000)
        if nxt[4] is not None:  # woken by a notification: (release, delivery, wake-up)
            released = prev[1] + prev[3]
            parts.append((prev[3] * 1000, (nxt[4] - released) * 1000, (nxt[0] - nxt[4]) * 1000))
    errors: dict[str, int] = {}
    for o in outs:
        for k, v in o["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return {
        "grants": len(events),
        "timeouts": sum(o["timeouts"] for o in outs),
        "errors": errors,
        "statements": sum(o["statements"] for o in outs),
        "handover": handover,
        "parts": parts,
        "stamping": all(o["stamping"] for o in outs),
        "release": [e[3] * 1000 for e in events],
        "logged": logged,
        "wal": wal,
        "window": times.seconds,
    }


def _wal_written(dsn: str, begin: float, end: float) -> float | None:
    """Bytes of WAL the server wrote between two moments (monotonic), or None if it cannot say."""
    import psycopg

    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            time.sleep(max(0.0, begin - time.monotonic()))
            first = c.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
            time.sleep(max(0.0, end - time.monotonic()))
            row = c.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (first,)).fetchone()
            return float(row[0]) if row else None  # type: ignore[index]
    except psycopg.Error:
        return None


def _shape_of(line: str) -> str:
    """A log line with its owner ids and numbers blanked, so that repeats count as one."""
    import re

    return re.sub(r"\b[0-9a-f]{8,}\b|\d+(\.\d+)?", "#", line.strip())[:160]


def _p(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if q == 50:
        return statistics.median(values)
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    grants = sum(r["grants"] for r in rounds)
    handover = [h for r in rounds for h in r["handover"]]
    parts = [x for r in rounds for x in r["parts"]]
    errors: dict[str, int] = {}
    logged: dict[str, int] = {}
    for r in rounds:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
        for k, v in r["logged"].items():
            logged[k] = logged.get(k, 0) + v
    return {
        "logged": logged,
        "grants": grants,
        "timeouts": sum(r["timeouts"] for r in rounds),
        "errors": errors,
        "per_grant": sum(r["statements"] for r in rounds) / grants if grants else float("nan"),
        "per_second": sum(r["statements"] / r["window"] for r in rounds) / len(rounds),
        "wal_kb": (
            sum(r["wal"] for r in rounds) / grants / 1024
            if grants and all(r["wal"] is not None for r in rounds) else float("nan")
        ),
        "p50": _p(handover, 50),
        "p99": _p(handover, 99),
        "release": _p([x for r in rounds for x in r["release"]], 50),
        "stamping": all(r["stamping"] for r in rounds),
        "notified": len(parts) / len(handover) if handover else float("nan"),
        "a": _p([x[0] for x in parts], 50),
        "c": _p([x[1] for x in parts], 50),
        "d": _p([x[2] for x in parts], 50),
    }


def _throwaway(max_connections: int) -> Any:
    """A pgserver on a temporary directory of the disk (commits flush), sized and timing its WAL syncs."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        import pgserver
        from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

        server = pgserver.get_server(tempfile.mkdtemp(prefix="dblock-bench-"), cleanup_mode="delete")
    server.psql("ALTER SYSTEM SET track_wal_io_timing = on;")
    if max_connections > 100:
        server.psql(f"ALTER SYSTEM SET max_connections = {max_connections};")
        pg_ctl(["-w", "restart"], pgdata=server.pgdata, user=server.system_user)
        server.ensure_postgres_running()  # the new postmaster's pid, for clean-up
    else:
        server.psql("SELECT pg_reload_conf();")
    return server


def _wal(dsn: str) -> tuple[int, float] | None:
    """(WAL syncs, ms spent in them) so far, or None where the server does not time them."""
    import psycopg

    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            if c.execute("SHOW track_wal_io_timing").fetchone()[0] != "on":  # type: ignore[index]
                return None
            row = c.execute("SELECT wal_sync, wal_sync_time FROM pg_stat_wal").fetchone()
            return (int(row[0]), float(row[1])) if row else None
    except psycopg.Error:
        return None


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, or None off Linux. Steal counts as busy."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def _busy(before: tuple[int, int] | None, after: tuple[int, int] | None) -> str:
    if before is None or after is None or after[1] == before[1]:
        return "n/a"
    return f"{(after[0] - before[0]) / (after[1] - before[1]) * 100:.0f}%"


def _fmt(x: float, width: int = 7) -> str:
    return f"{'n/a':>{width}}" if x != x else f"{x:{width}.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    ap.add_argument("--sizes", default="12,200,1000", help="comma-separated: 12, 200, 1000, or PxT[/pool]")
    ap.add_argument("--seconds", type=float, help="measured window per round (default max(4 s, 10 ms per waiter))")
    ap.add_argument(
        "--settle", type=float, help="looping before the window opens, so the line has formed (default max(1 s, 5 ms per waiter))"
    )
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per size")
    ap.add_argument("--hold", type=float, default=0.002)
    ap.add_argument("--timeout", type=float, help="acquire timeout (default max(5 s, 60 ms per waiter))")
    ap.add_argument("--variants", help="semicolon-separated prefixes of: " + "; ".join(VARIANTS + OPT_IN) + "; or all")
    ap.add_argument("--breakdown", default="12", help="the size whose hand-over is split, or 'none'")
    ap.add_argument(
        "--advisory-max", type=int, default=1000,
        help="run pg_advisory_lock up to this many waiters (one server session each)",
    )
    ap.add_argument("--plot", metavar="PATH.png", help="also draw hand-over p50/p99 against waiters (needs dblock[plots])")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--table", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pool", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--deadlock-timeout", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--proc", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from sqlalchemy.engine import make_url

    if args.worker:
        args.dsn = make_url(args.url).set(drivername="postgresql").render_as_string(hide_password=False)
        worker(args)
        return
    if args.plot:
        _plot.require()  # before a run of minutes, not after

    sizes = [Size(s.strip()) for s in args.sizes.split(",") if s.strip()]
    variants = list(VARIANTS)
    if args.variants == "all":
        variants += OPT_IN
    elif args.variants:
        wanted = [w.strip() for w in args.variants.split(";")]
        variants = [
            v for v in VARIANTS + OPT_IN
            if any(v.startswith(w) and (v not in OPT_IN or len(w) > len(ADVISORY)) for w in wanted)
        ]
    breakdown = next((s for s in sizes if s.label == args.breakdown), None) if args.breakdown != "none" else None

    def runs_advisory(size: Size) -> bool:
        return any(v in variants for v in ADVISORIES) and size.waiters <= args.advisory_max

    need = max(
        max((s.waiters if runs_advisory(s) else 0) for s in sizes),
        max(s.processes * (s.pool + 1) for s in sizes),
    ) + RESERVED
    server = None
    started = time.monotonic()
    cpu_before = _cpu_times()  # the machine may be shared: say how busy it was
    if not args.url:
        server = _throwaway(need)
        args.url = server.get_uri()
    import psycopg

    from dblock import Locker, migrate

    sa_url = make_url(args.url).set(drivername="postgresql+psycopg")
    args.url = sa_url.render_as_string(hide_password=False)
    args.url_sync_off = sa_url.update_query_dict({"options": "-c synchronous_commit=off"}).render_as_string(
        hide_password=False
    )
    dsn = sa_url.set(drivername="postgresql").render_as_string(hide_password=False)
    args.dsn = dsn
    with psycopg.connect(dsn, autocommit=True) as raw:
        version = f"{raw.info.server_version // 10000}.{raw.info.server_version % 100}"
        allowed = int(raw.execute("SHOW max_connections").fetchone()[0])  # type: ignore[index]
        superuser = bool(raw.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0])  # type: ignore[index]
        in_use = int(raw.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'").fetchone()[0])  # type: ignore[index]
    args.superuser = superuser
    free = allowed - in_use - 5  # superuser_reserved_connections (3) and a margin
    notes: list[str] = []
    if ADVISORY in variants:
        if superuser:
            notes.append(
                "pg_advisory_lock: its sessions set deadlock_timeout past the acquire timeout "
                "(--variants 'pg_advisory_lock, deadlock' runs it with the server's own)"
            )
        else:
            notes.append("pg_advisory_lock: not a superuser, so its sessions keep the server's deadlock_timeout")
    plan: list[tuple[Size, list[str]]] = []
    for size in sizes:
        vs = [v for v in variants if v not in ADVISORIES or runs_advisory(size)]
        for v in ADVISORIES:
            if v in variants and v not in vs:
                notes.append(f"{size.label} waiters: {v} not run (--advisory-max {args.advisory_max})")
            if v in vs and size.waiters > free:
                vs.remove(v)
                notes.append(
                    f"{size.label} waiters: {v} not run: it needs {size.waiters} sessions, "
                    f"the server has {free} free (max_connections {allowed})"
                )
        if size is breakdown and DBLOCK in vs:
            vs.insert(1, SYNC_OFF)
        plan.append((size, vs))

    results: dict[tuple[str, str], dict[str, Any]] = {}
    settings: dict[str, Times] = {}
    wal: dict[str, float] = {}
    for size, vs in plan:
        times = settings[size.label] = Times(args, size.waiters)
        tables = {v: "bench_" + secrets.token_hex(4) for v in vs if v not in ADVISORIES}
        rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in vs}
        wal_before = _wal(dsn) if size is breakdown else None
        try:
            for table in tables.values():
                Locker(sa_url, table=table).create_schema()
            for _ in range(args.rounds):
                for v in vs:
                    rounds[v].append(run_round(v, size, args, tables.get(v, "unused"), times))
                    r = rounds[v][-1]
                    print(  # progress, on stderr: a size of 1,000 takes minutes
                        f"[{time.monotonic() - started:5.0f} s] {size.label} waiters, {v}, round {len(rounds[v])}: "
                        f"{r['grants']} grants, {r['timeouts']} timeouts, {sum(r['errors'].values())} errors",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            for table in tables.values():
                locker = Locker(sa_url, table=table)
                migrate.downgrade(locker.engine, table, None)
                locker.close()
        if wal_before is not None:
            time.sleep(1.1)  # backends report their WAL statistics at most once a second
            wal_after = _wal(dsn)
            if wal_after is not None and wal_after[0] > wal_before[0]:
                syncs = wal_after[0] - wal_before[0]
                wal = {"syncs": syncs, "ms": (wal_after[1] - wal_before[1]) / syncs}
        for v in vs:
            results[(size.label, v)] = summarise(rounds[v])
    wall = time.monotonic() - started

    print(
        f"waiters: hold {args.hold * 1000:g} ms, {args.rounds} interleaved rounds per size; "
        f"PostgreSQL {version} (max_connections {allowed}{', throwaway' if server else ''}), {os.cpu_count()} CPUs; "
        f"whole run {wall:.0f} s; CPU busy {_busy(cpu_before, _cpu_times())} of the time (all processes, ours too)"
    )
    head = (
        f"{'waiters':>7} {'shape':>8} {'variant':40} {'pool':>4} {'timeout':>7} {'window':>6} {'grants':>6} "
        f"{'errors':>6} {'timeouts':>8} {'per grant':>9} {'per s':>6} {'p50 ms':>7} {'p99 ms':>7} {'release ms':>10} {'vs first':>8} {'WAL kB/grant':>12}"
    )
    print(head)
    first: dict[str, float] = {}
    for size, vs in plan:
        times = settings[size.label]
        for v in vs:
            r = results[(size.label, v)]
            first.setdefault(v, r["release"])
            pool = str(size.pool) if v not in ADVISORIES else "-"
            print(
                f"{size.label:>7} {size.shape:>8} {v:40} {pool:>4} {times.timeout:6.3g}s {times.seconds:5.3g}s {r['grants']:6d} "
                f"{sum(r['errors'].values()):6d} {r['timeouts']:8d} {_fmt(r['per_grant'], 9)} {r['per_second']:6.0f} {_fmt(r['p50'])} "
                f"{_fmt(r['p99'])} {_fmt(r['release'], 10)} {_fmt(r['release'] / first[v], 7)}x {_fmt(r['wal_kb'], 12)}"
            )
    for (label, v), r in results.items():
        for message, n in r["errors"].items():
            print(f"  error x{n} ({label} waiters, {v}): {message}")
    for (label, v), r in results.items():
        for line, n in sorted(r["logged"].items(), key=lambda kv: -kv[1])[:3]:
            print(f"  logged x{n} ({label} waiters, {v}): {line}")
    for note in notes:
        print(f"  {note}")

    if breakdown is not None and (breakdown.label, DBLOCK) in results:
        on = results[(breakdown.label, DBLOCK)]
        off = results.get((breakdown.label, SYNC_OFF))
        adv = results.get((breakdown.label, ADVISORY))
        print()
        print(f"where a hand-over goes, {breakdown.label} waiters ({breakdown.shape}), medians in ms:")
        print(
            f"{'variant':32} {'hand-over':>9} {'(a) release':>11} {'(b) flush':>9} {'(c) notify':>10} "
            f"{'(d) wake-up':>11} {'a+c+d':>7} {'notified':>8}"
        )
        flush = on["release"] - off["release"] if off else float("nan")
        for v, row, b in ((DBLOCK, on, flush), (SYNC_OFF, off, float("nan")), (ADVISORY, adv, float("nan"))):
            if row is None:
                continue
            r = row
            stamped = r["stamping"] and r["notified"] == r["notified"] and r["notified"] > 0
            a = r["a"] if stamped else r["release"]
            c, d = (r["c"], r["d"]) if stamped else (float("nan"), float("nan"))
            rest = "" if v != ADVISORY else "   (c+d: unlock returns -> the next session's lock call returns: "
            if v == ADVISORY:
                rest += f"{r['p50'] - r['release']:.2f})"
            notified = f"{r['notified'] * 100:7.0f}%" if stamped else f"{'n/a':>8}"
            print(
                f"{v:32} {_fmt(r['p50'], 9)} {_fmt(a, 11)} {_fmt(b, 9)} {_fmt(c, 10)} {_fmt(d, 11)} "
                f"{_fmt(a + c + d)} {notified}{rest}"
            )
        if off is not None:
            share = flush / on["release"] * 100 if on["release"] else float("nan")
            print(
                f"  (b): release p50 {on['release']:.2f} ms with the flush, {off['release']:.2f} ms with "
                f"synchronous_commit=off: the flush is {flush:.2f} ms, {share:.0f}% of the release"
                + (f"; the server's mean WAL sync over the size's runs: {wal['ms']:.2f} ms ({wal['syncs']:.0f} syncs)" if wal else "")
            )
        if not on["stamping"]:
            print("  (c), (d): n/a: this dblock has no dblock._wait.Listener._dispatch to stamp")
    ratios = [
        f"{size.label}: {_fmt(results[(size.label, DBLOCK)]['p50'] / results[(size.label, ADVISORY)]['p50'], 0)}x"
        for size, vs in plan
        if DBLOCK in vs and ADVISORY in vs
    ]
    if ratios:
        print("hand-over p50, dblock / pg_advisory_lock in the same run: " + ", ".join(ratios))
    if DBLOCK in first:
        last = plan[-1][0].label
        print(
            f"dblock release p50 at {last} waiters / at {plan[0][0].label}: "
            f"{_fmt(results[(last, DBLOCK)]['release'] / first[DBLOCK], 0)}x (target <= 1.5x at 1000 vs 12)"
        )
    if args.plot:
        plotted = [v for v in variants if v != SYNC_OFF]
        p50: dict[str, list[tuple[float, float]]] = {v: [] for v in plotted}
        p99: dict[str, list[tuple[float, float]]] = {v: [] for v in plotted}
        for size, vs in plan:
            for v in plotted:
                if v in vs:
                    p50[v].append((size.waiters, results[(size.label, v)]["p50"]))
                    p99[v].append((size.waiters, results[(size.label, v)]["p99"]))
        _plot.line_plot(
            args.plot, "Waiters at scale: hand-over (a release -> another thread's acquire returns)",
            "threads waiting for one name", "hand-over, ms (log)", {v: pts for v, pts in p50.items() if pts},
            dashed=p99, note=f"p50 (solid) and p99 (dashed); PostgreSQL {version}, {os.cpu_count()} CPUs, "
            f"hold {args.hold * 1000:g} ms, {args.rounds} round(s) per size",
            logx=True, logy=True,
        )
        print(f"plot: {args.plot}", file=sys.stderr)  # stdout ends with the ratios
    if server is not None:
        server.cleanup()


if __name__ == "__main__":
    main()
