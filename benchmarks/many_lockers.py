"""Many lockers: P processes, each a Locker holding and renewing L leases, for a while.

    python benchmarks/many_lockers.py [--url postgresql://...] [--processes 50] [--leases 100]
        [--seconds 60] [--ttl 15] [--max-connections N] [--variants dblock;one-thread] [--rounds 1]

"dblock renew=True": each process makes one Locker and takes its L leases
with ``try_acquire(name, ttl=--ttl, renew=True)``: the Locker's one renewal
thread extends each lease every ttl/3, the leases due together in one
statement, sent on a worker thread and bounded by the leases' trust. "one thread per process", the
baseline: the same leases taken with dblock, then extended with dblock's own
extend statement, by one thread per process on one raw psycopg connection,
each lease when it is due (ttl/3 after its last extend was sent). Every
process starts (imports, Locker) before any takes a lease, and every lease is
extended once (a warm-up of one renewal interval: connections open,
statements prepared) before the measured --seconds start. With --rounds > 1
the variants alternate, each round --seconds long.

Per variant:

- statements/s: statements the workers sent in the window (counted in the
  workers: dblock's ``Driver._execute`` wrapped, as in contended.py; the
  baseline counts its own), and, server-side, the database's committed
  transactions (``pg_stat_database.xact_commit`` delta: every lock statement
  is one autocommit transaction; the monitoring adds a handful);
- extends/s: attempts, failed ones included; extends failed (raised), lost
  (``lease.lost`` set by renewal; in the baseline, an extend due after the
  lease's trust ran out, ttl after the last extend was sent, which dblock
  would call lost, or one that matched no row), late (sent more than 1 s after
  due), and the lateness p50 / p99 / max; "due" is when a third of the lease's
  trusted time is used up, the moment dblock's renewal aims at (a dblock lease
  whose trust ran out shows as 2 ttl/3 late);
- server CPU: utime + stime from /proc of the postmaster and its children
  (sessions, WAL writer, checkpointer, autovacuum...), the postmaster's
  cutime + cstime counting children that ended, over the window, as a share
  of one core and of the machine's cores; only when the server runs on this
  machine (found through ``pg_backend_pid()``);
- client CPU: the worker processes' own ``getrusage`` over the window (every
  thread, ended ones too), same shares, and context switches per extend;
- connections each process opened (``Driver.open_connections()`` at the end:
  the pool keeps what it opened), threads and resident memory per process,
  and memory before any lease was taken.

With no --url (and no DBLOCK_TEST_URL) it starts a throwaway PostgreSQL with
pgserver. Without --max-connections each Locker keeps dblock's default pool
(10) if processes x 10 fits the server's max_connections, else the largest
pool that fits, and says so.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import resource
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

VARIANTS = ["dblock renew=True", "one thread per process"]
LATE = 1.0  # seconds after due: an extend sent later than this counts as late
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- one worker process --------------------------------------------------------
class Tally:
    """Statements sent and extends made, kept only while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.statements = 0
        self.extends: list[tuple[float, bool]] = []  # (seconds late, succeeded)
        self.failed: dict[str, int] = {}
        self.lost = 0
        self._lock = threading.Lock()

    def statement(self) -> None:
        if self.on:
            with self._lock:
                self.statements += 1

    def extend(self, late: float, ok: bool, error: str | None = None) -> None:
        if self.on:
            with self._lock:
                self.extends.append((late, ok))
                if error is not None:
                    self.failed[error] = self.failed.get(error, 0) + 1


def _status() -> dict[str, int]:
    """Threads and resident KiB of this process, from /proc/self/status."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Threads", "VmRSS"):
            out[key] = int(value.split()[0])
    return out


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_nvcsw + r.ru_nivcsw


def worker(args: argparse.Namespace) -> None:
    from dblock import DBLockError, Lease, Locker, _driver
    from dblock.locker import Keeper

    tally = Tally()
    execute = _driver.Driver._execute

    def counted(self: Any, conn: Any, sql: str, params: dict[str, Any]) -> Any:
        tally.statement()
        return execute(self, conn, sql, params)

    _driver.Driver._execute = counted  # type: ignore[method-assign]
    extend_many = Keeper.extend_many

    def timed_extend_many(keeper: Any, leases: list[Lease], deadline: float) -> Any:
        # dblock's renewal is due when two thirds of the trusted time are left.
        late = [2 * lease.ttl / 3 - lease.remaining() for lease in leases]
        try:
            sent_at, expiries = extend_many(keeper, leases, deadline)
        except Exception as exc:
            for x in late:
                tally.extend(x, False, type(exc).__name__)
            raise
        for expires_at, x in zip(expiries, late):
            tally.extend(x, expires_at is not None)
        return sent_at, expiries

    Keeper.extend_many = timed_extend_many  # type: ignore[method-assign]

    before = _status()
    locker = Locker(args.url, table=args.table, ttl=args.ttl, max_connections=args.max_connections)
    names = [f"p{args.proc}-{i}" for i in range(args.leases)]
    renewing = args.worker == VARIANTS[0]
    leases = []
    not_taken = 0
    # Every process has started (imports are the costly part) before any takes a
    # lease, so the start-up of the last ones does not starve the renewals of the first.
    print("loaded", flush=True)
    assert sys.stdin.readline() == "go\n"
    for name in names:
        try:
            lease = locker.try_acquire(name, renew=renewing)
        except DBLockError:  # the machine or the server is overloaded: say so in the table
            not_taken += 1
            continue
        if lease is None:
            raise SystemExit(f"{name} is held by someone else")
        leases.append(lease)
    stop = threading.Event()
    renewer = None
    if not renewing:
        locker.close()  # the baseline extends on a connection of its own
        renewer = threading.Thread(target=_one_thread, args=(args, leases, locker.backend.sql, tally, stop))
        renewer.start()
    print("ready", flush=True)
    assert sys.stdin.readline() == "start\n"
    tally.on = True
    lost_before = tally.lost if not renewing else sum(1 for lease in leases if lease.lost.is_set())
    cpu0, switches0 = _usage()
    assert sys.stdin.readline() == "stop\n"
    tally.on = False
    cpu1, switches1 = _usage()
    after = _status()
    with tally._lock:
        extends, failed, statements = list(tally.extends), dict(tally.failed), tally.statements
    connections = locker.open_connections() if renewing else 1
    stop.set()
    not_released = release_failed = 0
    if renewer is not None:
        renewer.join()  # it releases the leases
        lost = tally.lost
    else:
        lost = sum(1 for lease in leases if lease.lost.is_set())  # by renewal, in the window or before
        for lease in leases:
            try:
                not_released += not lease.release()
            except DBLockError:  # e.g. no connection free in time: report it, release the rest
                release_failed += 1
    locker.close()
    json.dump(
        {
            "statements": statements, "extends": extends, "failed": failed, "lost": lost - lost_before,
            "lost_before": lost_before, "not_taken": not_taken, "release_failed": release_failed,
            "not_released": not_released, "cpu": cpu1 - cpu0, "switches": switches1 - switches0,
            "connections": connections, "threads": after["Threads"], "rss_kib": after["VmRSS"],
            "rss_before_kib": before["VmRSS"],
        },
        sys.stdout,
    )


def _one_thread(args: argparse.Namespace, leases: list[Any], sql: Any, tally: Tally, stop: threading.Event) -> None:
    """The baseline: extend every lease when it is due, from one thread on one connection."""
    import psycopg
    from sqlalchemy.engine import make_url

    dsn = make_url(args.url).set(drivername="postgresql").render_as_string(hide_password=False)
    interval = args.ttl / 3
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Due a third of the ttl after the grant was sent, as dblock's renewal.
        due = [(lease._state.trusted_until - 2 * interval, i) for i, lease in enumerate(leases)]
        heapq.heapify(due)
        while due and not stop.is_set():
            when, i = due[0]
            if stop.wait(max(0.0, when - time.monotonic())):
                break
            lease = leases[i]
            sent = time.monotonic()
            late = sent - when
            if late >= 2 * interval:
                # Its trust (ttl from the last extend's send) ran out before this
                # extend: dblock's renewal would call it lost and stop. So do we.
                tally.extend(late, False)
                tally.lost += 1
                heapq.heappop(due)
                continue
            tally.statement()
            try:
                rows = conn.execute(
                    sql.extend, {"name": lease.name, "owner": lease.owner, "token": lease.token, "ttl": args.ttl}, prepare=True
                ).fetchall()
            except psycopg.Error as exc:
                tally.extend(late, False, type(exc).__name__)
                heapq.heapreplace(due, (time.monotonic() + interval / 3, i))
                continue
            tally.extend(late, bool(rows))
            if rows:
                heapq.heapreplace(due, (sent + interval, i))
            else:  # taken over: never, as nobody else takes these names
                tally.lost += 1
                heapq.heappop(due)
        stop.wait()
        for lease in leases:  # dblock's release statement, on this connection
            conn.execute(sql.release, {"name": lease.name, "owner": lease.owner, "token": lease.token})


# -- the server's CPU --------------------------------------------------------------
def _stat(pid: str) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields from 3 (state) on; the name may hold spaces


def server_ticks(postmaster: int) -> int:
    """CPU ticks of the postmaster, its children now, and (cutime + cstime) its children that ended."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fields = _stat(pid)
        if fields is None:
            continue
        ppid = int(fields[1])
        if int(pid) == postmaster:
            total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        elif ppid == postmaster:
            total += int(fields[11]) + int(fields[12])
    return total


def find_postmaster(conn: Any) -> int | None:
    backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    fields = _stat(str(backend))
    if fields is None:
        return None  # the server runs on another machine (or in another pid namespace)
    return int(fields[1])


# -- the driver ------------------------------------------------------------------
def _each_says(procs: list[subprocess.Popen[str]], word: str, failure: str) -> None:
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline() != word + "\n":
            raise SystemExit(failure)


def _tell(procs: list[subprocess.Popen[str]], word: str) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(word + "\n")
        p.stdin.flush()


def run_round(variant: str, args: argparse.Namespace, table: str, dsn: str, postmaster: int | None) -> dict[str, Any]:
    import psycopg

    cmd = [
        sys.executable, __file__, "--worker", variant, "--url", args.url, "--table", table,
        "--leases", str(args.leases), "--ttl", str(args.ttl), "--max-connections", str(args.max_connections),
    ]
    t0 = time.monotonic()
    procs = [
        subprocess.Popen([*cmd, "--proc", str(p)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for p in range(args.processes)
    ]
    try:
        _each_says(procs, "loaded", f"a {variant} worker failed while starting")
        loaded = time.monotonic() - t0
        t0 = time.monotonic()
        _tell(procs, "go")
        _each_says(procs, "ready", f"a {variant} worker failed while taking its leases")
        ramp = time.monotonic() - t0
        print(
            f"  {variant}: {args.processes} processes started in {loaded:.1f} s, took their leases in {ramp:.1f} s",
            file=sys.stderr,
        )
        time.sleep(args.ttl / 3 + 1.0)  # warm-up: every lease extended once
        with psycopg.connect(dsn, autocommit=True) as mon:
            stats = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
            upd = "SELECT coalesce(sum(n_tup_upd), 0) FROM pg_stat_user_tables WHERE relname = %s"
            ticks0 = server_ticks(postmaster) if postmaster else 0
            xact0 = mon.execute(stats).fetchone()[0]  # type: ignore[index]
            upd0 = int(mon.execute(upd, (table,)).fetchone()[0])  # type: ignore[index]
            start = time.monotonic()
            _tell(procs, "start")
            time.sleep(args.seconds)
            ticks1 = server_ticks(postmaster) if postmaster else 0
            wall = time.monotonic() - start
            # Busy sessions send their counters at most a second late, at both ends alike.
            xact1 = mon.execute(stats).fetchone()[0]  # type: ignore[index]
            upd1 = int(mon.execute(upd, (table,)).fetchone()[0])  # type: ignore[index]
            _tell(procs, "stop")
            sessions = mon.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND backend_type = 'client backend'"
            ).fetchone()[0]  # type: ignore[index]
        outs = [json.loads(p.communicate(timeout=60 + args.leases)[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a {variant} worker failed")
    return {
        "wall": wall,
        "ramp": ramp,
        "outs": outs,
        "server_cpu": (ticks1 - ticks0) / CLK_TCK if postmaster else None,
        "xact": xact1 - xact0,
        "updates": upd1 - upd0,
        "sessions": sessions,
    }


def summarise(rounds: list[dict[str, Any]], cores: int) -> dict[str, Any]:
    wall = sum(r["wall"] for r in rounds)
    outs = [o for r in rounds for o in r["outs"]]
    extends = [e for o in outs for e in o["extends"]]
    lateness = sorted(late for late, _ in extends)
    failed: dict[str, int] = {}
    for o in outs:
        for k, v in o["failed"].items():
            failed[k] = failed.get(k, 0) + v
    server = [r["server_cpu"] for r in rounds]
    client = sum(o["cpu"] for o in outs)
    n = len(extends)
    return {
        "extends_s": n / wall,
        "statements_s": sum(o["statements"] for o in outs) / wall,
        "xact_s": sum(r["xact"] for r in rounds) / wall,
        "updates_s": sum(r["updates"] for r in rounds) / wall,
        "failed": failed,
        "lost": sum(o["lost"] for o in outs),
        "lost_before": sum(o["lost_before"] for o in outs),
        "not_taken": sum(o["not_taken"] for o in outs),
        "release_failed": sum(o["release_failed"] for o in outs),
        "not_released": sum(o["not_released"] for o in outs),
        "late": sum(1 for late in lateness if late > LATE),
        "late_p50": statistics.median(lateness) if lateness else float("nan"),
        "late_p99": lateness[min(n - 1, int(0.99 * n))] if lateness else float("nan"),
        "late_max": lateness[-1] if lateness else float("nan"),
        "server_core": sum(server) / wall if None not in server else None,
        "client_core": client / wall,
        "cores": cores,
        "switches": sum(o["switches"] for o in outs) / n if n else float("nan"),
        "connections": [o["connections"] for o in outs],
        "sessions": max(r["sessions"] for r in rounds),
        "threads": statistics.mean(o["threads"] for o in outs),
        "rss_mib": statistics.mean(o["rss_kib"] for o in outs) / 1024,
        "rss_before_mib": statistics.mean(o["rss_before_kib"] for o in outs) / 1024,
        "ramp": max(r["ramp"] for r in rounds),
        "wall": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    ap.add_argument("--processes", type=int, default=50)
    ap.add_argument("--leases", type=int, default=100, help="leases per process")
    ap.add_argument("--seconds", type=float, default=60.0, help="measured seconds of each round")
    ap.add_argument("--ttl", type=float, default=15.0, help="lease ttl; renewal extends every ttl/3")
    ap.add_argument("--max-connections", type=int, help="each Locker's pool (default: 10, or what fits the server)")
    ap.add_argument("--variants", default=";".join(VARIANTS), help="semicolon-separated, prefixes match")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per variant, alternating")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--table", help=argparse.SUPPRESS)
    ap.add_argument("--proc", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    started = time.monotonic()
    server = None
    if not args.url:
        import pgserver

        server = pgserver.get_server(  # type: ignore[attr-defined]
            tempfile.mkdtemp(prefix="dblock-bench-"), cleanup_mode="delete"
        )
        args.url = server.get_uri()
    import psycopg
    from sqlalchemy.engine import make_url

    from dblock import Locker, migrate

    sa_url = make_url(args.url).set(drivername="postgresql+psycopg")
    args.url = sa_url.render_as_string(hide_password=False)
    dsn = sa_url.set(drivername="postgresql").render_as_string(hide_password=False)
    wanted = [w.strip() for w in args.variants.split(";")]
    variants = [v for v in VARIANTS if any(v.startswith(w) for w in wanted)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        limit = int(conn.execute("SHOW max_connections").fetchone()[0])  # type: ignore[index]
        reserved = int(conn.execute("SHOW superuser_reserved_connections").fetchone()[0])  # type: ignore[index]
        in_use = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'").fetchone()[0]  # type: ignore[index]
        postmaster = find_postmaster(conn)
    room = limit - reserved - in_use - 2  # the monitoring session, and one to spare
    if args.max_connections is None:
        args.max_connections = min(10, room // args.processes)
        if args.max_connections < 1:
            raise SystemExit(f"{args.processes} processes do not fit the server's {limit} connections ({in_use} in use)")
    elif args.processes * args.max_connections > room:
        print(
            f"warning: {args.processes} x {args.max_connections} connections may not fit the server's "
            f"{limit} ({reserved} reserved, {in_use} in use)",
            file=sys.stderr,
        )
    cores = os.cpu_count() or 1
    rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    table = "bench_" + secrets.token_hex(4)
    locker = Locker(sa_url, table=table)
    locker.create_schema()
    try:
        for _ in range(args.rounds):
            for variant in variants:
                rounds[variant].append(run_round(variant, args, table, dsn, postmaster))
    finally:
        locker.close()
        migrate.downgrade(locker.engine, table, None)
        if server is not None:
            server.cleanup()
    results = {v: summarise(r, cores) for v, r in rounds.items()}

    print(
        f"many lockers: {args.processes} processes x {args.leases} leases, ttl {args.ttl:g} s (extend every "
        f"{args.ttl / 3:g} s), {args.rounds} x {args.seconds:g} s measured per variant; PostgreSQL {version} "
        f"(max_connections {limit}), {cores} CPUs; Locker(max_connections={args.max_connections})"
    )
    print(
        f"{'variant':24} {'extends/s':>9} {'stmts/s':>8} {'xact/s':>8} {'upd/s':>8} {'failed':>6} {'lost':>4} {'late':>4} "
        f"{'late p50/p99/max ms':>21} {'server CPU':>19} {'client CPU':>19} {'switches':>8}"
    )
    for variant, r in results.items():
        server_cpu = (
            f"{r['server_core']:6.1%} ({r['server_core'] / cores:5.1%} of {cores})" if r["server_core"] is not None else "n/a"
        )
        client_cpu = f"{r['client_core']:6.1%} ({r['client_core'] / cores:5.1%} of {cores})"
        lateness = f"{r['late_p50'] * 1000:.0f} / {r['late_p99'] * 1000:.0f} / {r['late_max'] * 1000:.0f}"
        print(
            f"{variant:24} {r['extends_s']:9.1f} {r['statements_s']:8.1f} {r['xact_s']:8.1f} {r['updates_s']:8.1f} "
            f"{sum(r['failed'].values()):6d} {r['lost']:4d} {r['late']:4d} {lateness:>21} {server_cpu:>19} "
            f"{client_cpu:>19} {r['switches']:8.1f}"
        )
    print(f"{'variant':24} {'connections/process':>19} {'sessions':>8} {'threads':>7} {'RSS MiB':>7} {'before leases':>13} {'take leases s':>13}")
    for variant, r in results.items():
        conns = r["connections"]
        print(
            f"{variant:24} {f'{statistics.mean(conns):.1f} (max {max(conns)})':>19} {r['sessions']:8d} "
            f"{r['threads']:7.0f} {r['rss_mib']:7.1f} {r['rss_before_mib']:13.1f} {r['ramp']:13.1f}"
        )
    for variant, r in results.items():
        if r["failed"] or r["not_released"] or r["lost_before"] or r["not_taken"] or r["release_failed"]:
            print(
                f"{variant}: failed extends by error {r['failed']}; {r['not_taken']} leases not taken (the "
                f"acquire failed), {r['lost_before']} lost before the window, {r['not_released']} found gone "
                f"at release, {r['release_failed']} releases failed (raised)"
            )
    print(f"whole run {time.monotonic() - started:.0f} s")
    if len(results) == 2:
        a, b = (results[v] for v in VARIANTS)
        print(
            f"dblock against one thread per process: client CPU {a['client_core'] / b['client_core']:.2f}x, "
            + (f"server CPU {a['server_core'] / b['server_core']:.2f}x, " if a["server_core"] and b["server_core"] else "")
            + f"statements {a['statements_s'] / b['statements_s']:.2f}x"
        )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
