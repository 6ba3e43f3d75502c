"""Many names: acquire + release over N distinct names, against the same pair on one name, in the same run.

    python benchmarks/many_names.py [--url postgresql://...|sqlite:///file] [--names 1000000]
        [--chunk 1000] [--passes 1] [--plot PATH.png]

One thread, one Locker on a fresh table. "many names" takes each of --names
names once (``try_acquire`` + ``release``): every pair inserts the name's row,
so the table and its index grow by one row per pair. "one name" repeats the
same pair on a single name, on a Locker and table of its own that never hold
more than that row: the floor. The two run in alternating chunks of --chunk
pairs (who goes first alternates too), so a slow spell of the machine hits
both alike; the ratio of their p50s is the figure that matters. With
--passes 2 a second pass takes the same names again in random order: the
steady state of an application with that many names (the update path, rows
mostly out of cache).

Reported: p50 and p99 microseconds per pair and their ratios; the same by
tenths of the run (how the cost moves as the table grows); the table's
rows, heap, index and total size (PostgreSQL: pg_relation_size,
pg_indexes_size, pg_total_relation_size; SQLite: dbstat pages) after the
run, after ``Locker.prune`` with a tiny age, and after VACUUM; how long each
step took. With no --url (and no DBLOCK_TEST_URL) it starts a throwaway
PostgreSQL with pgserver. On SQLite the default is 100,000 names.

--plot PATH.png also draws the tenths' p50 and p99 of both against the names taken so far
(in pass 1, the rows in the table), with benchmarks/_plot.py (needs matplotlib:
pip install 'dblock[plots]').
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import secrets
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any, Callable

from sqlalchemy import text
from sqlalchemy.engine import Engine, make_url

from dblock import Locker, migrate

TENTHS = 10


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted values, nearest rank."""
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def sizes(engine: Engine, table: str) -> dict[str, float]:
    """Rows, and heap / index / total bytes of ``table``."""
    with engine.connect() as conn:
        rows = conn.execute(text(f'SELECT count(*) FROM "{table}"')).scalar_one()
        if engine.dialect.name == "postgresql":
            heap, index, total = conn.execute(
                text("SELECT pg_relation_size(:t), pg_indexes_size(:t), pg_total_relation_size(:t)"),
                {"t": f'"{table}"'},
            ).one()
        else:
            # dbstat: one row per page of each table and index (SQLite's own
            # tables and indexes are named after the table, autoindexes too).
            pages: dict[str, int] = dict(
                conn.execute(
                    text(
                        "SELECT m.type, sum(s.pgsize) FROM dbstat AS s JOIN sqlite_master AS m ON m.name = s.name "
                        "WHERE m.tbl_name = :t GROUP BY m.type"
                    ),
                    {"t": table},
                ).all()
            )
            heap, index = pages.get("table", 0), pages.get("index", 0)
            total = heap + index
    return {"rows": rows, "heap": heap, "index": index, "total": total}


def table_stats(engine: Engine, table: str) -> dict[str, Any] | None:
    """PostgreSQL's counters for ``table`` (inserts, updates, HOT updates, dead rows, vacuums)."""
    if engine.dialect.name != "postgresql":
        return None
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_dead_tup, autovacuum_count, autoanalyze_count "
                "FROM pg_stat_user_tables WHERE relname = :t"
            ),
            {"t": table},
        ).one_or_none()
    if row is None:
        return None
    return dict(zip(("ins", "upd", "hot", "dead", "autovacuum", "autoanalyze"), row))


def mib(n: float) -> str:
    return f"{n / 1048576:.1f} MiB" if n >= 1048576 else f"{n / 1024:.0f} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    ap.add_argument("--names", type=int, help="distinct names (default 1,000,000; 100,000 on SQLite)")
    ap.add_argument("--chunk", type=int, default=1000, help="pairs per chunk; the variants alternate chunks")
    ap.add_argument("--passes", type=int, default=1, choices=(1, 2), help="2: take every name again, in random order")
    ap.add_argument("--ttl", type=float, default=30.0)
    ap.add_argument("--plot", metavar="PATH.png", help="also draw p50/p99 against names taken (needs dblock[plots])")
    args = ap.parse_args()
    if args.plot:
        import _plot  # benchmarks/_plot.py

        _plot.require()  # before a run of minutes, not after
    started = time.monotonic()
    server = None
    url = args.url
    if not url:
        import pgserver

        server = pgserver.get_server(  # type: ignore[attr-defined]
            tempfile.mkdtemp(prefix="dblock-bench-"), cleanup_mode="delete"
        )
        url = server.get_uri()
    sa_url = make_url(url)
    if sa_url.get_backend_name() == "postgresql":
        sa_url = sa_url.set(drivername="postgresql+psycopg")
    sqlite = sa_url.get_backend_name() == "sqlite"
    n = args.names if args.names is not None else (100_000 if sqlite else 1_000_000)
    suffix = secrets.token_hex(4)
    table, one_table = f"bench_{suffix}", f"bench_{suffix}_one"
    many = Locker(sa_url, table=table)
    one = Locker(sa_url, table=one_table)  # its own table and connections: the one-row floor
    many.create_schema()
    one.create_schema()
    engine = many.engine
    with engine.connect() as conn:
        version = (
            "PostgreSQL " + str(conn.exec_driver_sql("SHOW server_version").scalar_one())
            if not sqlite
            else "SQLite " + str(conn.exec_driver_sql("SELECT sqlite_version()").scalar_one())
        )
    ttl = args.ttl
    try:
        width = len(str(n))
        names = [f"name-{i:0{width}d}" for i in range(n)]
        # Warm-up: connections, prepared statements (psycopg prepares on the 5th run).
        for i in range(50):
            many.try_acquire(f"warm-up-{i}", ttl=ttl).release()  # type: ignore[union-attr]
            one.try_acquire("one", ttl=ttl).release()  # type: ignore[union-attr]

        def one_pair(_: str) -> None:
            lease = one.try_acquire("one", ttl=ttl)
            assert lease is not None
            lease.release()

        def many_pair(name: str) -> None:
            lease = many.try_acquire(name, ttl=ttl)
            assert lease is not None, name
            lease.release()

        results: list[dict[str, Any]] = []
        for p in range(args.passes):
            order = names if p == 0 else random.Random(42).sample(names, len(names))
            results.append(run_pass(order, many_pair, one_pair, args.chunk))
        run_s = time.monotonic() - started

        # Close the Lockers' sessions first: a session sends its table counters
        # to the server's statistics when it ends (otherwise up to 10 s later).
        many.close()
        one.close()
        time.sleep(1.0)
        after_run = sizes(engine, table)
        counters = table_stats(engine, table)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.monotonic()
        time.sleep(0.01)  # every row's last release is now more than the age below ago
        with Locker(sa_url, table=table) as pruner:  # `many` is closed: a closed Locker refuses new work
            pruned = pruner.prune(older_than=0.001)
        prune_s = time.monotonic() - t0
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        after_prune = sizes(engine, table)
        t0 = time.monotonic()
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f'VACUUM "{table}"' if not sqlite else "VACUUM")
        vacuum_s = time.monotonic() - t0
        after_vacuum = sizes(engine, table)
    finally:
        many.close()
        one.close()
        migrate.downgrade(many.engine, table, None)
        migrate.downgrade(one.engine, one_table, None)
        if server is not None:
            server.cleanup()

    print(
        f"many names: {n:,} distinct names x {args.passes} pass(es), try_acquire + release on one thread, "
        f"chunks of {args.chunk} alternating with the one-name pair; {version}, {os.cpu_count()} CPUs"
    )
    print(f"{'pass':24} {'pairs':>9} {'p50 us':>8} {'p99 us':>8} {'one name p50':>12} {'p99':>8} {'p50 ratio':>9} {'p99 ratio':>9} {'s':>6}")
    for p, r in enumerate(results):
        label = "1: each name new" if p == 0 else "2: again, random order"
        print(
            f"{label:24} {r['pairs']:9,d} {r['many_p50']:8.1f} {r['many_p99']:8.1f} {r['one_p50']:12.1f} "
            f"{r['one_p99']:8.1f} {r['many_p50'] / r['one_p50']:8.2f}x {r['many_p99'] / r['one_p99']:8.2f}x {r['seconds']:6.0f}"
        )
    for p, r in enumerate(results):
        print(f"pass {p + 1} by tenths of the run (rows in the table at the end of each tenth):")
        print(f"  {'rows':>10} {'p50 us':>8} {'one name':>8} {'ratio':>6} {'p99 us':>8} {'one name':>8} {'ratio':>6}")
        for rows, m50, o50, m99, o99 in r["tenths"]:
            rows_now = rows if p == 0 else n
            print(f"  {rows_now:10,d} {m50:8.1f} {o50:8.1f} {m50 / o50:5.2f}x {m99:8.1f} {o99:8.1f} {m99 / o99:5.2f}x")
    print(f"{'table':40} {'rows':>10} {'heap':>10} {'indexes':>10} {'total':>10} {'took s':>7}")
    for label, s, took in (
        (f"after the run ({len(results)} pass(es))", after_run, run_s),
        (f"after prune(older_than=0.001): -{pruned:,}", after_prune, prune_s),
        ("after VACUUM", after_vacuum, vacuum_s),
    ):
        print(f"{label:40} {s['rows']:10,d} {mib(s['heap']):>10} {mib(s['index']):>10} {mib(s['total']):>10} {took:7.1f}")
    if counters is not None:
        hot = counters["hot"] / counters["upd"] if counters["upd"] else float("nan")
        print(
            f"counters after the run: {counters['ins']:,} inserts, {counters['upd']:,} updates "
            f"({hot:.0%} HOT), {counters['dead']:,} dead rows, {counters['autovacuum']} autovacuums"
        )
    print(f"client peak RSS: {rss_before / 1024:.0f} MiB before prune, {rss_after / 1024:.0f} MiB after (prune returns every name)")
    print(f"whole run {time.monotonic() - started:.0f} s")
    first = results[0]
    print(f"p50 many names / one name: {first['many_p50'] / first['one_p50']:.2f}x (pass 1)")
    if args.plot:
        plot(args.plot, results, f"{version.split(' (')[0]}, {os.cpu_count()} CPUs, {n:,} names, chunks of {args.chunk}")


def plot(path: str, results: list[dict[str, Any]], note: str) -> None:
    """The tenths of each pass: p50 solid, p99 dashed, many names against the one-name floor."""
    import _plot

    p50: dict[str, list[tuple[float, float]]] = {}
    p99: dict[str, list[tuple[float, float]]] = {}
    for p, r in enumerate(results):
        suffix = "" if p == 0 else ", pass 2 (random order)"
        for label, at50, at99 in (("many names, each new", 1, 3), ("one name (the floor)", 2, 4)):
            if p:
                label = label.removesuffix(", each new")
            p50[label + suffix] = [(row[0], row[at50]) for row in r["tenths"]]
            p99[label + suffix] = [(row[0], row[at99]) for row in r["tenths"]]
    _plot.line_plot(
        path, "Many names: try_acquire + release, by tenths of the run", "names taken so far (pass 1: rows in the table)",
        "us per pair (log)", p50, dashed=p99, note="p50 (solid) and p99 (dashed); " + note, logy=True,
    )
    print(f"plot: {path}", file=sys.stderr)  # stdout ends with the ratio


def run_pass(
    order: list[str], many_pair: Callable[[str], None], one_pair: Callable[[str], None], chunk: int
) -> dict[str, Any]:
    """Time each pair: ``many_pair`` over ``order``, ``one_pair`` as often, in alternating chunks."""
    n = len(order)
    many_us, one_us = array("d"), array("d")
    clock = time.perf_counter
    t_start = time.monotonic()
    for c, start in enumerate(range(0, n, chunk)):
        part = order[start : start + chunk]
        runs: list[tuple[Callable[[str], None], array[float], list[str]]] = [
            (many_pair, many_us, part),
            (one_pair, one_us, part),
        ]
        if c % 2:
            runs.reverse()
        for fn, out, names in runs:
            for name in names:
                t0 = clock()
                fn(name)
                out.append((clock() - t0) * 1e6)
        if (c + 1) % max(1, n // chunk // 20) == 0:  # progress, every twentieth of the pass
            done = min(n, start + chunk)
            print(f"  {done:,} names, {time.monotonic() - t_start:.0f} s", file=sys.stderr, flush=True)
    seconds = time.monotonic() - t_start
    all_many, all_one = sorted(many_us), sorted(one_us)
    tenths = []
    for k in range(TENTHS):
        lo, hi = n * k // TENTHS, n * (k + 1) // TENTHS
        m, o = sorted(many_us[lo:hi]), sorted(one_us[lo:hi])
        tenths.append((hi, percentile(m, 0.5), percentile(o, 0.5), percentile(m, 0.99), percentile(o, 0.99)))
    return {
        "pairs": n,
        "many_p50": statistics.median(all_many),
        "many_p99": percentile(all_many, 0.99),
        "one_p50": statistics.median(all_one),
        "one_p99": percentile(all_one, 0.99),
        "tenths": tenths,
        "seconds": seconds,
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
