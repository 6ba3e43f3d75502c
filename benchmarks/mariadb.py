"""dblock on MariaDB: the uncontended pair, the redo a miss writes, and contention, in one run.

    python benchmarks/mariadb.py [--url mariadb+pymysql://root@127.0.0.1:3306/test | --galera]
        [--pairs 300] [--rounds 7] [--misses 100] [--threads 8] [--processes 3]
        [--process-threads 4] [--seconds 5] [--hold 0.001] [--timeout 2]

With no --url (and no DBLOCK_TEST_MARIADB_URL) it starts a throwaway MariaDB with
``dblock._mariadb_server`` (the machine's own mariadbd, data in /dev/shm). Every
part uses one table made with ``Locker(url, table=...).create_schema()``, dropped
at the end.

1. Uncontended: one acquire + release pair on one thread, median microseconds
   per pair over ``--rounds`` interleaved rounds of ``--pairs`` pairs, and the
   ratio to the hand-written pair (dblock's own two statement texts, from
   ``locker.backend.sql``, with dblock's binds, sent with raw PyMySQL on one
   autocommit connection with dblock's session settings) and to the
   ``GET_LOCK(name, 0)`` + ``RELEASE_LOCK(name)`` pair, the advisory lock
   MariaDB's own peers use (no TTL, no token, lost with its session).
2. Redo per miss: the change of ``Innodb_lsn_current`` over ``--misses``
   try_acquires of a name another lease holds, against as many granted and
   released pairs. The server's other work (purge, other clients) moves the
   LSN too: a window counts only when the LSN stood still for as long as the
   window lasted both just before and just after it, and it is retried until
   one does (the smallest delta seen is reported if none does).
3. Contended: ``--threads`` threads of one process, then ``--processes``
   processes x ``--process-threads`` threads, each looping ``acquire(name,
   ttl=10, timeout=--timeout)``, hold ``--hold`` s, release, on one name for
   ``--seconds`` s. Per run: grants/s; statements per grant (every text sent
   through the backend's ``execute``, counted by wrapping it on each Locker's
   backend object: acquire attempts, releases and anything else; a text is
   one round trip, however many SQL statements it holds; warm-up not
   counted); hand-over p50/p99 from a holder calling release to a different
   thread's acquire returning (CLOCK_MONOTONIC, which the processes of one
   machine share), which includes the release's own round trip and commit;
   regrant, the share of grants that went straight back to the thread that
   had just released; and, with processes, the share of hand-overs that
   crossed to another process. MariaDB has no NOTIFY: a waiter in another
   process finds the name free only when it polls; threads of one process
   take turns, the head of the line polling and woken by a local release.
4. A release noticed in another process: a holder keeps the name ``--notice-hold``
   s and releases it, while one waiter in another process has been waiting since
   the grant; the time from the release's return to that waiter's grant (p50,
   p90, max over ``--notices`` hand-overs), and the acquire texts the waiter sent
   per grant, for the waiter's ``poll_max`` 0.5 s (the default), 0.1 and 0.02 s.
   Also counted: "resent", the texts dblock's MariaDB backend sent again
   because the server rolled them back (error 1213, a deadlock or a lost
   certification, or 1205, a lock wait timeout), and "errors", calls that
   raised DatabaseUnavailable (the thread goes on).

--galera starts a throwaway 3-node Galera cluster on loopback with
``tests/galera.py`` (as root; the machine's own mariadbd and galera-4, data in
/dev/shm; 10-40 s to start; stopped at the end whatever happens) and
measures on it instead of one server (no --url):

a. the uncontended pair, as in 1, on node 0, and the dblock pair with its
   Locker on node 1 and on node 2 (every grant still replicates to all three);
   then whether GET_LOCK excludes across nodes (a name held through node 0,
   GET_LOCK(name, 0) on node 1: 1 means granted, so it does not);
b. the contended runs of 3 on node 0 (one process, then --processes), and the
   --processes run again with process p on node p % 3, each with the cluster's
   certification conflicts over the timed window: ``wsrep_local_cert_failures``
   (a local commit lost certification) and ``wsrep_local_bf_aborts`` (a local
   transaction aborted by a replicated one), the changes summed over the three
   nodes; either one is an error 1213 to the client, which dblock sends again
   (the "resent" column), and one conflict may be counted by both.

The redo per miss is not measured on Galera.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

NAME = "hot"


# -- counting the texts a Locker sends ------------------------------------------------
class Counts:
    """Texts sent through one backend's ``execute``, by kind (acquire, release, other)."""

    def __init__(self) -> None:
        self.by_kind: dict[str, int] = {"acquire": 0, "release": 0, "other": 0}
        self.resent = 0  # texts sent again (count_resends); -1: not counted
        self._lock = threading.Lock()

    def wrap(self, backend: Any) -> None:
        execute, sql = backend.execute, backend.sql
        kinds = {sql.acquire: "acquire", sql.release: "release"}

        def counted(cursor: Any, text: str, params: dict[str, Any]) -> Any:
            kind = kinds.get(text, "other")
            with self._lock:
                self.by_kind[kind] += 1
            return execute(cursor, text, params)

        backend.execute = counted

    def reset(self) -> None:
        with self._lock:
            self.by_kind = dict.fromkeys(self.by_kind, 0)
            self.resent = min(self.resent, 0)  # -1 (not counted) stays

    def count_resends(self) -> None:
        """Count the texts the MariaDB backend sends again (after a 1213 or 1205 it pauses for
        ``_backoff(attempt)`` first): this process's, whichever Locker sent them."""
        from dblock.backends import mariadb

        backoff = getattr(mariadb, "_backoff", None)
        if backoff is None:  # the backend no longer pauses this way: nothing counted
            self.resent = -1
            return

        def counted(attempt: int) -> float:
            with self._lock:
                self.resent += 1
            return backoff(attempt)

        mariadb._backoff = counted


# -- 1. uncontended ----------------------------------------------------------------------
def multi(cur: Any, statement: str, binds: dict[str, Any] | None) -> Any:
    """Send a multi-statement text: the rows of its last statement that returns rows."""
    cur.execute(statement, binds)
    rows = None
    while True:
        if cur.description is not None:
            rows = cur.fetchall()
        if not cur.nextset():
            return rows


def uncontended(
    args: argparse.Namespace, locker: Any, raw: Any, own: Any, others: dict[str, Any] | None = None, where: str = ""
) -> None:
    """The pairs on ``locker``'s server; ``others``: more dblock pairs, by label, each on a Locker of its own."""
    from _timing import interleaved  # benchmarks/_timing.py

    sql = locker.backend.sql  # the very texts dblock sends, for the hand-written baseline
    label = locker._label()
    rc, oc = raw.cursor(), own.cursor()

    def select1() -> None:
        rc.execute("SELECT 1")
        rc.fetchall()
        rc.execute("SELECT 1")
        rc.fetchall()

    def get_lock() -> None:
        rc.execute("SELECT GET_LOCK(%s, 0)", ("getlock",))
        rc.fetchall()
        rc.execute("SELECT RELEASE_LOCK(%s)", ("getlock",))
        rc.fetchall()

    def hand_written() -> None:  # dblock's binds (_verbs.py): name, owner, ttl, label; name, owner, token
        owner = secrets.token_hex(16)
        ((_, token, _, _),) = multi(oc, sql.acquire, {"name": "hand", "owner": owner, "ttl": 30.0, "label": label})
        multi(oc, sql.release, {"name": "hand", "owner": owner, "token": token})

    def dblock_pair() -> None:
        locker.try_acquire("dblock", ttl=30).release()

    advisory, hand = "GET_LOCK(name, 0) + RELEASE_LOCK (no TTL, no token)", "hand-written pair, raw PyMySQL"
    variants = {
        "2 x SELECT 1": select1,
        advisory: get_lock,
        hand: hand_written,
        "dblock try_acquire + release": dblock_pair,
    }
    def other_pair(other: Any, key: str) -> Callable[[], None]:
        return lambda: other.try_acquire(key, ttl=30).release()

    for i, (name, other) in enumerate((others or {}).items()):
        variants[name] = other_pair(other, f"dblock{i + 1}")
    medians = interleaved(variants, args.rounds, args.pairs)
    print(f"\n1. uncontended{where}, {args.rounds} rounds x {args.pairs} pairs")
    print(f"{'variant':52} {'us/pair':>9} {'vs hand-written':>16} {'vs GET_LOCK':>12}")
    for name, med in medians.items():
        print(f"{name:52} {med:9.1f} {med / medians[hand]:15.2f}x {med / medians[advisory]:11.2f}x")
    rc.close()
    oc.close()


# -- 2. redo per miss -------------------------------------------------------------------
def lsn(conn: Any) -> int:
    with conn.cursor() as cur:
        cur.execute("SHOW GLOBAL STATUS LIKE 'Innodb_lsn_current'")
        return int(cur.fetchone()[1])


def quiet_delta(conn: Any, fn: Callable[[], None], tries: int = 30) -> tuple[int, int, bool]:
    """LSN change over ``fn()`` in a window the LSN stood still around; (delta, windows tried, quiet).

    A window counts when the LSN did not move for as long as ``fn()`` took, both just
    before it and just after it; otherwise it is tried again, and if none ever does,
    the smallest delta seen is returned."""
    seen: list[int] = []
    span = 0.2  # how long fn() takes, once known
    for attempt in range(1, tries + 1):
        before = lsn(conn)
        time.sleep(span)
        a = lsn(conn)
        started = time.perf_counter()
        fn()
        span = time.perf_counter() - started
        b = lsn(conn)
        time.sleep(span)
        after = lsn(conn)
        if before == a and b == after:
            return b - a, attempt, True
        seen.append(b - a)
        time.sleep(0.2)
    return min(seen), tries, False


def redo(args: argparse.Namespace, locker: Any, raw: Any, table: str) -> None:
    from dblock import Locker

    holder = Locker(args.url, table=table)  # another Locker holds the name the misses ask for
    held = holder.try_acquire("held", ttl=300)
    assert held is not None
    counts = Counts()
    counts.wrap(locker.backend)

    def misses() -> None:
        for _ in range(args.misses):
            assert locker.try_acquire("held", ttl=30) is None

    def grants() -> None:
        for _ in range(args.misses):
            locker.try_acquire("granted", ttl=30).release()

    misses()  # warm: the rows exist
    grants()
    counts.reset()
    miss = quiet_delta(raw, misses)
    sent = sum(counts.by_kind.values())
    pair = quiet_delta(raw, grants)
    held.release()
    holder.close()
    print(f"\n2. redo (Innodb_lsn_current), {args.misses} calls per window")
    print(f"{'calls':34} {'LSN delta':>10} {'bytes/call':>11} {'windows tried':>14}")
    for name, (delta, tries, quiet) in (
        ("try_acquire of a held name (miss)", miss),
        ("try_acquire + release (granted)", pair),
    ):
        note = "" if quiet else " (no quiet window: the smallest delta seen)"
        print(f"{name:34} {delta:10d} {delta / args.misses:11.1f} {tries:14d}{note}")
    print(f"(texts dblock sent per miss: {sent / (args.misses * miss[1]):.2f})")


# -- 3. contended: one worker process ---------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    from dblock import DatabaseUnavailable, Locker, LockNotAcquired

    locker = Locker(args.url, table=args.table, ttl=10)
    counts = Counts()
    counts.wrap(locker.backend)
    counts.count_resends()
    events: list[tuple[float, float, int]] = []  # (acquire returned, release called, thread id)
    timeouts = [0]
    errors = [0]
    guard = threading.Lock()
    warm = threading.Barrier(args.threads + 1)  # the threads and this main thread

    def run(tid: int) -> None:
        locker.acquire(NAME, ttl=10, timeout=30).release()  # warm-up: connections (not counted)
        warm.wait()  # every thread warm
        warm.wait()  # the start and end times are known
        while time.monotonic() < args.start_at:
            time.sleep(0.0005)
        while time.monotonic() < args.end_at:
            try:
                lease = locker.acquire(NAME, ttl=10, timeout=args.timeout)
            except LockNotAcquired:
                with guard:
                    timeouts[0] += 1
                continue
            except DatabaseUnavailable:  # a statement resent until it gave up, say: counted, and go on
                with guard:
                    errors[0] += 1
                continue
            got = time.monotonic()
            if args.hold:
                time.sleep(args.hold)
            let_go = time.monotonic()
            try:
                lease.release()
            except DatabaseUnavailable:
                with guard:
                    errors[0] += 1
                continue
            with guard:
                events.append((got, let_go, tid))

    threads = [threading.Thread(target=run, args=(args.proc * 1000 + i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    warm.wait()
    counts.reset()
    print("ready", flush=True)  # the driver starts every process together
    args.start_at, args.end_at = (float(x) for x in sys.stdin.readline().split())
    warm.wait()
    for t in threads:
        t.join()
    locker.close()
    json.dump(
        {"events": events, "timeouts": timeouts[0], "errors": errors[0], "counts": counts.by_kind,
         "resent": counts.resent},
        sys.stdout,
    )


def contend(
    args: argparse.Namespace, table: str, processes: int, threads: int, urls: list[str] | None = None,
    around: Callable[[], dict[str, int]] | None = None,
) -> dict[str, Any]:
    """One contended run; process p on ``urls[p % len(urls)]`` (default: ``args.url``). ``around()``
    is read just before the timed window and after it: the changes are returned under "around"."""
    urls = urls or [args.url]
    cmd = [
        sys.executable, __file__, "--worker", "--table", table, "--threads", str(threads),
        "--hold", str(args.hold), "--timeout", str(args.timeout),
    ]
    procs = [
        subprocess.Popen(
            [*cmd, "--url", urls[p % len(urls)], "--proc", str(p)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )
        for p in range(processes)
    ]
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline() != "ready\n":
            raise SystemExit("a contended worker failed while warming up")
    before = around() if around else {}
    start_at = time.monotonic() + 0.05
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(f"{start_at!r} {start_at + args.seconds!r}\n")
        p.stdin.flush()
    outs = [json.loads(p.communicate()[0]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a contended worker failed")
    after = around() if around else {}
    events = sorted(e for o in outs for e in o["events"])
    pairs = list(zip(events, events[1:]))
    handover = [(nxt[0] - prev[1]) * 1000 for prev, nxt in pairs if nxt[2] != prev[2]]
    crossed = sum(1 for prev, nxt in pairs if nxt[2] // 1000 != prev[2] // 1000)
    counts = {k: sum(o["counts"][k] for o in outs) for k in outs[0]["counts"]}
    grants = len(events)
    return {
        "grants": grants,
        "rate": grants / args.seconds,
        "timeouts": sum(o["timeouts"] for o in outs),
        "errors": sum(o["errors"] for o in outs),
        "resent": sum(o["resent"] for o in outs) if all(o["resent"] >= 0 for o in outs) else -1,
        "around": {k: after[k] - before[k] for k in before},
        "per_grant": sum(counts.values()) / grants if grants else float("nan"),
        "acquires": counts["acquire"] / grants if grants else float("nan"),
        "p50": statistics.median(handover) if handover else float("nan"),
        "p99": statistics.quantiles(handover, n=100)[98] if len(handover) > 1 else float("nan"),
        "regrant": (len(pairs) - len(handover)) / len(pairs) if pairs else float("nan"),
        "crossed": crossed / len(handover) if handover else float("nan"),
        "by_process": [len(o["events"]) for o in outs],
    }


Run = tuple[str, int, int, "list[str] | None"]  # label, processes, threads per process, URL of process p


def contended(
    args: argparse.Namespace, table: str, runs: list[Run] | None = None, number: str = "3",
    around: Callable[[], dict[str, int]] | None = None,
) -> None:
    """The contended runs (default: one process, then ``--processes``, on ``args.url``); with
    ``around``, its changes over each timed window in columns of their own."""
    if runs is None:
        runs = [
            (f"1 process x {args.threads} threads", 1, args.threads, None),
            (f"{args.processes} processes x {args.process_threads} threads", args.processes, args.process_threads,
             None),
        ]
    width = max(24, *(len(name) for name, *_ in runs))
    results = []
    for name, procs, threads, urls in runs:
        results.append((name, procs, contend(args, table, procs, threads, urls, around)))
    keys = list(results[0][2]["around"]) if results else []
    print(f"\n{number}. contended: one name, {args.seconds:g} s per run, hold {args.hold * 1000:g} ms, "
          f"acquire timeout {args.timeout:g} s, ttl 10 s")
    print(f"{'run':{width}} {'grants':>6} {'grants/s':>8} {'timeouts':>8} {'errors':>6} {'per grant':>9} "
          f"{'acq/grant':>9} {'resent':>6} {'p50 ms':>7} {'p99 ms':>7} {'regrant':>7} {'crossed':>7}"
          + "".join(f" {k:>{len(k)}}" for k in keys))
    split: list[str] = []
    for name, procs, r in results:
        crossed = f"{r['crossed'] * 100:6.0f}%" if procs > 1 else f"{'-':>7}"
        resent = f"{r['resent']:6d}" if r["resent"] >= 0 else f"{'?':>6}"
        print(f"{name:{width}} {r['grants']:6d} {r['rate']:8.0f} {r['timeouts']:8d} {r['errors']:6d} "
              f"{r['per_grant']:9.2f} {r['acquires']:9.2f} {resent} {r['p50']:7.2f} {r['p99']:7.2f} "
              f"{r['regrant'] * 100:6.0f}% {crossed}" + "".join(f" {r['around'][k]:>{len(k)}d}" for k in keys))
        if procs > 1:
            split.append(f"grants by process ({name}): {' / '.join(str(n) for n in r['by_process'])}")
    for line in split:
        print(line)
    if keys:
        print(f"({', '.join(keys)}: the changes over each timed window, summed over the nodes)")


# -- a Galera cluster --------------------------------------------------------------------
CONFLICTS = ("wsrep_local_cert_failures", "wsrep_local_bf_aborts")


def on_galera(args: argparse.Namespace) -> None:
    """Start a 3-node cluster (tests/galera.py), measure the pair on node 0 and contention across
    the nodes, and stop the cluster whatever happens."""
    import pymysql
    from sqlalchemy.engine import make_url

    from dblock import Locker
    from dblock.backends.mariadb import _SESSION, connect_params, pymysql_url

    sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
    import galera  # type: ignore[import-not-found]  # tests/galera.py

    reason = galera.missing()
    if reason is not None:
        raise SystemExit(f"--galera cannot run here. {reason}")
    if os.geteuid() != 0:
        raise SystemExit("--galera runs as root (the cluster's servers drop to the mysql OS user)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the cluster too (finally below)
    cluster = galera.Cluster()
    lockers: list[Any] = []
    conns: list[Any] = []
    try:
        print("starting a 3-node Galera cluster on 127.0.0.1 ...", flush=True)
        cluster.start(timeout=120)
        urls = [pymysql_url(make_url(u)) for u in cluster.urls]
        args.url = urls[0].render_as_string(hide_password=False)
        nodes = [u.render_as_string(hide_password=False) for u in urls]
        table = "bench_" + secrets.token_hex(4)
        locker = Locker(urls[0], table=table)
        lockers.append(locker)
        locker.create_schema()  # through node 0; the DDL runs on every node
        others = {f"dblock pair, Locker on node {i}": Locker(urls[i], table=table) for i in (1, 2)}
        lockers.extend(others.values())
        raw = pymysql.connect(**connect_params(urls[0]))
        conns.append(raw)
        own = pymysql.connect(**connect_params(urls[0]))
        conns.append(own)
        multi(own.cursor(), _SESSION, None)
        own.cursor().execute("SET SESSION wsrep_retry_autocommit = 0")  # as dblock's sessions
        with raw.cursor() as cur:
            cur.execute("SELECT VERSION()")
            version = cur.fetchone()[0]
        provider = cluster.status(0, "wsrep_provider_version").get("wsrep_provider_version", "?")
        print(f"MariaDB {version}, Galera {provider}: 3 nodes on 127.0.0.1, started in "
              f"{cluster.start_seconds:.1f} s; {os.cpu_count()} CPUs for the nodes and the clients")

        def conflicts() -> dict[str, int]:
            totals = dict.fromkeys(CONFLICTS, 0)
            for i in range(galera.NODES):
                for k, v in cluster.status(i, *CONFLICTS).items():
                    totals[k] += int(v)
            return totals

        uncontended(args, locker, raw, own, others, where=" on node 0 of the Galera cluster")
        # GET_LOCK is no lock of the cluster's: each node keeps its own (is it still so here?).
        elsewhere = cluster.connect(1)
        conns.append(elsewhere)
        with raw.cursor() as here, elsewhere.cursor() as there:
            here.execute("SELECT GET_LOCK('probe', 0)")
            there.execute("SELECT GET_LOCK('probe', 0)")
            print(f"GET_LOCK('probe', 0) on node 0 returned {here.fetchone()[0]}, then on node 1 "
                  f"{there.fetchone()[0]} (1: granted, so not a lock across the nodes)")
            here.execute("SELECT RELEASE_LOCK('probe')")
            there.execute("SELECT RELEASE_LOCK('probe')")
        p, t = args.processes, args.process_threads
        contended(args, table, [
            (f"1 process x {args.threads} threads, node 0", 1, args.threads, [nodes[0]]),
            (f"{p} processes x {t} threads, all on node 0", p, t, [nodes[0]]),
            (f"{p} processes x {t} threads, process p on node p % 3", p, t, nodes),
        ], number="2", around=conflicts)
    finally:
        for conn in conns:
            conn.close()
        for one in lockers:
            one.close()
        cluster.stop()  # the table goes with it


# -- 4. a release noticed by a waiter in another process --------------------------------
def lone_waiter(args: argparse.Namespace) -> None:
    """The other process: per line on stdin, acquire the name (waiting), print the monotonic
    time it was granted, release it."""
    from dblock import Locker

    locker = Locker(args.url, table=args.table, poll_max=args.poll_max)
    locker.acquire("warm", ttl=1, timeout=30).release()
    counts = Counts()
    counts.wrap(locker.backend)
    print("ready", flush=True)
    for _ in sys.stdin:
        counts.reset()
        lease = locker.acquire(NAME, ttl=10, timeout=30)
        got = time.monotonic()
        lease.release()
        print(repr(got), counts.by_kind["acquire"], flush=True)
    locker.close()


def across(args: argparse.Namespace, table: str) -> None:
    """A holder releases after ``--notice-hold`` s; one waiter in another process, waiting since
    the grant, acquires: the time from the release's return to the waiter's grant."""
    from dblock import Locker

    holder = Locker(args.url, table=table)
    print(f"\n4. a release noticed by a waiter in another process: hold {args.notice_hold:g} s, "
          f"{args.notices} hand-overs per poll_max")
    print(f"{'waiter poll_max s':>18} {'p50 ms':>8} {'p90 ms':>8} {'max ms':>8} {'waiter acquires/grant':>22}")
    for poll_max in (0.5, 0.1, 0.02):
        cmd = [sys.executable, __file__, "--lone-waiter", "--url", args.url, "--table", table,
               "--poll-max", str(poll_max)]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline() != "ready\n":
            raise SystemExit("the waiting process failed to start")
        gaps, sent = [], 0
        for _ in range(args.notices):
            lease = holder.try_acquire(NAME, ttl=10)
            assert lease is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            time.sleep(args.notice_hold)  # the waiter misses, then backs off
            lease.release()
            let_go = time.monotonic()
            got, asked = proc.stdout.readline().split()
            gaps.append((float(got) - let_go) * 1000)
            sent += int(asked)
        proc.stdin.close()
        proc.wait(30)
        gaps.sort()
        p90 = gaps[min(len(gaps) - 1, int(len(gaps) * 0.9))]
        print(f"{poll_max:18g} {statistics.median(gaps):8.1f} {p90:8.1f} {gaps[-1]:8.1f} {sent / args.notices:22.1f}")
    holder.close()


# -- the driver -------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a MariaDB server (default: $DBLOCK_TEST_MARIADB_URL, else a throwaway one)")
    ap.add_argument("--galera", action="store_true", help="measure on a throwaway 3-node Galera cluster (as root)")
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--misses", type=int, default=100)
    ap.add_argument("--threads", type=int, default=8, help="threads of the one-process contended run")
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--process-threads", type=int, default=4, help="threads per process of the second run")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each contended run")
    ap.add_argument("--hold", type=float, default=0.001, help="seconds each grant is held")
    ap.add_argument("--timeout", type=float, default=2.0, help="each contended acquire's timeout")
    ap.add_argument("--notices", type=int, default=20, help="hand-overs to a waiter in another process, per poll_max")
    ap.add_argument("--notice-hold", type=float, default=0.3, help="seconds the holder keeps the name before each")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lone-waiter", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--poll-max", type=float, default=0.5, help=argparse.SUPPRESS)
    ap.add_argument("--table", help=argparse.SUPPRESS)
    ap.add_argument("--proc", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.lone_waiter:
        lone_waiter(args)
        return
    if args.galera:
        if args.url:
            ap.error("--galera starts a cluster of its own: no --url")
        on_galera(args)
        return
    args.url = args.url or os.environ.get("DBLOCK_TEST_MARIADB_URL")

    import pymysql
    from sqlalchemy.engine import make_url

    from dblock import Locker, migrate
    from dblock.backends.mariadb import _SESSION, connect_params, pymysql_url

    server = None
    if not args.url:
        from dblock._mariadb_server import MariaDBServer

        server = MariaDBServer.start()
        args.url = server.url
    try:
        url = pymysql_url(make_url(args.url))
        args.url = url.render_as_string(hide_password=False)
        table = "bench_" + secrets.token_hex(4)
        locker = Locker(url, table=table)
        locker.create_schema()
        raw = pymysql.connect(**connect_params(url))  # SELECT 1, GET_LOCK, SHOW GLOBAL STATUS
        # The hand-written pair has a connection of its own, as dblock has, with dblock's session.
        own = pymysql.connect(**connect_params(url))
        multi(own.cursor(), _SESSION, None)
        try:
            with raw.cursor() as cur:
                cur.execute("SELECT VERSION()")
                version = cur.fetchone()[0]
            print(f"MariaDB {version}{' (throwaway server)' if server else ''}, {os.cpu_count()} CPUs")
            uncontended(args, locker, raw, own)
            redo(args, locker, raw, table)
            contended(args, table)
            across(args, table)
        finally:
            raw.close()
            own.close()
            locker.close()
            migrate.downgrade(locker.engine, table, None)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
