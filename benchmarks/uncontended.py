"""Uncontended cost of one acquire + release pair on one thread, against baselines in the same run.

    python benchmarks/uncontended.py [--url postgresql://...] [--pairs 500] [--rounds 7] [--block N]
        [--metrics] [--profile] [--layers] [--plot PATH.png]

With no --url (and no DBLOCK_TEST_URL) it starts a throwaway PostgreSQL with
pgserver (pip install -e '.[test]'). Rounds interleave the variants so that
machine noise hits them alike; the table shows the median microseconds per pair
and the ratio to the hand-written pair, the figure that matters. With
``--block 1`` the variants take turns pair by pair and each median is of single
pairs: a busy machine's drift then hits every variant within milliseconds,
where rounds of 500 pairs put seconds between them (the ratios of three runs in
a row spread 1.04-1.11x with rounds of 500, 1.08x in both runs with blocks of 1).
Baselines:

- the hand-written pair: dblock's own two statements, sent with raw psycopg
  on a connection of its own (prepared), so the ratio is what dblock's code
  adds to its statements;
- the same statements through libpq: prepared, each sent with
  ``psycopg.pq``'s ``exec_prepared``, binds made and the row read by hand,
  the least Python a client can put around them. dblock sends its statements
  through libpq too (with psycopg's adaptation around each call, not its
  cursor), so this is its floor, and the line under the table gives dblock's
  pair against it;
- the minimal fenced pair: what a user would write without dblock, an
  upsert that draws a per-name token where the lease is free or has run out
  (``INSERT ... ON CONFLICT DO UPDATE ... WHERE``) and an owner-checked
  release (``UPDATE ... WHERE owner AND token``), on a table of its own: no
  global token order, no waiting count, no label, no hand-off. Against it the
  ratio is dblock's code and its richer statements together.

--layers then times dblock's pair by layers, each in a run of its own with
only the two raw psycopg pairs beside it (the minimal and the hand-written):
what a pair costs here depends on the code that ran between its calls,
because on a cold cache each distinct function dblock runs costs far more than
its CPU in a hot loop. The layers: dblock's two statements through its pool
and watchdog alone (``Driver.run`` twice), then that and a ``Lease`` built
from the grant and released through it, then dblock's whole pair.

--metrics adds dblock's pair with dblock.metrics recording into
OpenTelemetry's SDK (an in-memory reader), to weigh what recording costs
against metrics off. --profile then prints where dblock's pair goes: the
minimal pair, what dblock's statements add, what dblock's code adds,
dblock's costliest functions under cProfile, and the CPU of dblock's own code
per pair with the database's replies canned, on both faces. --plot writes the table as a bar
chart (pip install 'dblock[plots]').
"""

from __future__ import annotations

import argparse
import os
import secrets
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

import psycopg
from sqlalchemy.engine import make_url

from _timing import interleaved  # benchmarks/_timing.py

from dblock import Locker, metrics


# The variants' names, short enough for a chart's axis.
SHORT = {
    "2 x SELECT 1": "2 x SELECT 1",
    "pg_advisory_lock pair (no TTL, no token)": "advisory\n(no TTL, token)",
    "minimal fenced pair, raw psycopg": "minimal\nfenced pair",
    "hand-written pair, raw psycopg": "its statements,\npsycopg cursor",
    "the same statements through libpq (psycopg.pq)": "its statements,\nlibpq",
    "dblock try_acquire + release": "dblock",
    "dblock pair, metrics recording (SDK)": "dblock,\nmetrics on",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    ap.add_argument("--pairs", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--block", type=int, default=0,
        help="time the pairs in rounds of this many (1: the variants take turns pair by pair), "
        "as many rounds as make --rounds x --pairs pairs; default: rounds of --pairs",
    )
    ap.add_argument("--metrics", action="store_true", help="add the pair with metrics recording (opentelemetry-sdk)")
    ap.add_argument("--profile", action="store_true", help="then profile dblock's pair: where its time goes")
    ap.add_argument(
        "--layers", action="store_true",
        help="then time dblock's pair by layers (its driver alone, with a Lease, all of it), each in a run of its own",
    )
    ap.add_argument("--plot", metavar="PATH.png", help="write the table as a bar chart (needs dblock[plots])")
    args = ap.parse_args()
    if args.plot:
        import _plot

        _plot.require()
    server = None
    url = args.url
    if not url:
        import pgserver

        server = pgserver.get_server(tempfile.mkdtemp(prefix="dblock-bench-"), cleanup_mode="delete")
        url = server.get_uri()
    sa_url = make_url(url).set(drivername="postgresql+psycopg")
    dsn = sa_url.set(drivername="postgresql").render_as_string(hide_password=False)
    table = "bench_" + secrets.token_hex(4)
    locker = Locker(sa_url, table=table)
    locker.create_schema()
    sql = locker.backend.sql  # the very statements dblock sends, for the hand-written baseline
    label = locker._label()
    raw = psycopg.connect(dsn, autocommit=True)  # for the SELECT 1 and advisory references
    # The hand-written pair gets a connection of its own, as dblock has: sharing one with the
    # references made it the only variant whose server process had just been busy, which
    # flattered it by up to 30%.
    own = psycopg.connect(dsn, autocommit=True)

    def select1() -> None:
        raw.execute("SELECT 1").fetchall()
        raw.execute("SELECT 1").fetchall()

    def hand_written() -> None:
        owner = secrets.token_hex(16)
        params = {"name": "hand", "owner": owner, "ttl": 30.0, "label": label}
        (_, token, _, _) = own.execute(sql.acquire, params, prepare=True).fetchone()
        own.execute(sql.release, {"name": "hand", "owner": owner, "token": token}, prepare=True).fetchall()

    # The same two statements with the least Python a client can put around them: prepared
    # once, then each sent by libpq (psycopg.pq) with its binds as text made by hand, its row
    # read by hand from a binary result. dblock's statements take this road too (through
    # psycopg's adaptation), where the hand-written pair above goes through psycopg's cursor.
    floor = psycopg.connect(dsn, autocommit=True)
    pgconn = floor.pgconn
    numbered = {key: f"${i}" for i, key in enumerate(("name", "owner", "ttl", "label"), 1)}
    prepared = pgconn.prepare(b"floor_acquire", (sql.acquire % numbered).encode(), [0, 0, 701, 0])
    assert prepared.status == psycopg.pq.ExecStatus.COMMAND_OK, prepared.get_error_message()
    numbered = {key: f"${i}" for i, key in enumerate(("name", "owner", "token"), 1)}
    prepared = pgconn.prepare(b"floor_release", (sql.release % numbered).encode(), [0, 0, 20])
    assert prepared.status == psycopg.pq.ExecStatus.COMMAND_OK, prepared.get_error_message()
    encoded_label = label.encode()

    def through_libpq() -> None:
        owner = secrets.token_hex(16).encode()
        got = pgconn.exec_prepared(b"floor_acquire", [b"floor", owner, b"30.0", encoded_label], None, 1)
        token = got.get_value(0, 1)
        assert token is not None, got.get_error_message()
        pgconn.exec_prepared(b"floor_release", [b"floor", owner, str(int.from_bytes(token, "big")).encode()], None, 1)

    # The minimal fenced pair, on a table and connection of its own.
    minimal_table = table + "_minimal"
    mine = psycopg.connect(dsn, autocommit=True)
    mine.execute(
        f"CREATE TABLE {minimal_table} (name text PRIMARY KEY, owner text, token bigint NOT NULL, expires_at timestamptz)"
    )
    take = f"""
INSERT INTO {minimal_table} AS l (name, owner, token, expires_at)
VALUES (%(name)s, %(owner)s, 1, now() + %(ttl)s * interval '1 second')
ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, token = l.token + 1, expires_at = excluded.expires_at
WHERE l.owner IS NULL OR l.expires_at <= now()
RETURNING token"""
    give = f"UPDATE {minimal_table} SET owner = NULL WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s"

    def minimal() -> None:
        owner = secrets.token_hex(16)
        (token,) = mine.execute(take, {"name": "min", "owner": owner, "ttl": 30.0}, prepare=True).fetchone()
        mine.execute(give, {"name": "min", "owner": owner, "token": token}, prepare=True)

    def advisory() -> None:
        raw.execute("SELECT pg_advisory_lock(42)").fetchall()
        raw.execute("SELECT pg_advisory_unlock(42)").fetchall()

    def dblock_pair() -> None:
        locker.try_acquire("dblock", ttl=30).release()

    variants = {
        "2 x SELECT 1": select1,
        "pg_advisory_lock pair (no TTL, no token)": advisory,
        "minimal fenced pair, raw psycopg": minimal,
        "hand-written pair, raw psycopg": hand_written,
        "the same statements through libpq (psycopg.pq)": through_libpq,
        "dblock try_acquire + release": dblock_pair,
    }
    if args.metrics:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
        metrics.enable(provider)
        recording, metrics.recorder = metrics.recorder, metrics.OFF  # on only inside the variant below

        def dblock_pair_recorded() -> None:
            metrics.recorder = recording
            try:
                dblock_pair()
            finally:
                metrics.recorder = metrics.OFF

        variants["dblock pair, metrics recording (SDK)"] = dblock_pair_recorded
    # Rounds of --block pairs each (default: --pairs), as many as make rounds x pairs in all.
    block = args.block or args.pairs
    rounds = max(1, args.rounds * args.pairs // block)
    medians = interleaved(variants, rounds, block)
    base = medians["hand-written pair, raw psycopg"]
    least = medians["minimal fenced pair, raw psycopg"]
    print(f"uncontended, {rounds} rounds x {block} pairs, PostgreSQL {raw.info.server_version}")
    print(f"{'variant':48} {'us/pair':>9} {'vs hand-written':>16} {'vs minimal':>11}")
    for name, med in medians.items():
        print(f"{name:48} {med:9.1f} {med / base:15.2f}x {med / least:10.2f}x")
    ours, floor_us = medians["dblock try_acquire + release"], medians["the same statements through libpq (psycopg.pq)"]
    print(f"dblock's pair against its statements through libpq: {ours / floor_us:.2f}x ({ours - floor_us:+.1f} us)")
    if args.profile:
        profile(locker, dblock_pair, args.pairs * args.rounds, medians)
    if args.layers:
        layers(locker, label, {"minimal": minimal, "hand-written": hand_written}, rounds, block)
    if args.plot:
        import _plot

        _plot.bar_plot(
            args.plot, "Uncontended acquire + release, one thread", "us per pair (median)",
            [SHORT.get(name, name) for name in medians], {"us per pair": list(medians.values())},
            note=f"PostgreSQL {raw.info.server_version // 10000}; {rounds} rounds x {block} pairs",
        )
    raw.close()
    own.close()
    floor.close()
    mine.execute(f"DROP TABLE {minimal_table}")
    mine.close()
    locker.close()
    from dblock import migrate

    migrate.downgrade(locker.engine, table, None)
    if server is not None:
        server.cleanup()


def profile(locker: Locker, pair: Callable[[], None], pairs: int, medians: dict[str, float]) -> None:
    """Where dblock's pair goes: from the medians, the minimal fenced pair, what dblock's richer
    statements add to it (its statements hand-written, less the minimal pair) and what dblock's
    code adds to those (dblock's pair, less its statements hand-written); then ``pair`` run
    ``pairs`` times under cProfile, for dblock's own functions that cost most (their own time,
    not their callees'; cProfile slows Python calls down, so these are upper bounds); and last,
    the CPU time of dblock's code alone, the database's replies canned (no socket, no server),
    which a loaded machine disturbs far less than the medians."""
    import cProfile
    import pstats

    import dblock as package

    least = medians["minimal fenced pair, raw psycopg"]
    statements = medians["hand-written pair, raw psycopg"]
    ours = medians["dblock try_acquire + release"]
    print("where dblock's pair goes (us per pair, from the medians above):")
    for part, us in (
        ("the minimal fenced pair", least),
        ("+ dblock's richer statements", statements - least),
        ("+ dblock's own code", ours - statements),
    ):
        print(f"  {part:45} {us:9.1f}")
    where = str(Path(package.__file__).resolve().parent)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(pairs):
        pair()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    own = sorted(
        ((tottime, calls, f"{Path(filename).name}:{function}") for (filename, _, function), (calls, _, tottime, _, _)
         in stats.items() if filename.startswith(where)),
        reverse=True,
    )
    total = sum(t for t, _, _ in own)
    print(f"dblock's own functions under cProfile: {total / pairs * 1e6:.1f} us per pair in all; the most:")
    for tottime, calls, name in own[:8]:
        print(f"  {name:45} {tottime / pairs * 1e6:9.1f} us  ({calls / pairs:g} calls per pair)")
    # The replies dblock's two statements get when the name is free: a grant, then "ended here".
    backend, sql = locker.backend, locker.backend.sql
    expires = datetime.now(timezone.utc) + timedelta(seconds=30)
    canned = {sql.acquire: [(True, 1, expires, None)], sql.release: [(1, False)]}
    backend.execute = lambda cursor, statement, params: canned[statement]  # type: ignore[method-assign]
    try:
        started = time.thread_time()
        for _ in range(pairs):
            pair()
        cpu = (time.thread_time() - started) / pairs * 1e6
    finally:
        del backend.execute  # the class's own again
    print(f"dblock's own code, the replies canned: {cpu:.1f} us of CPU per pair ({cpu / ours:.1%} of dblock's pair above)")
    aio = canned_async(locker, pairs)
    print(f"the same on the asyncio face (AsyncLocker, one task): {aio:.1f} us of CPU per pair ({aio / cpu:.2f}x the sync face's)")


def layers(
    locker: Locker, label: str, raw: dict[str, Callable[[], None]], rounds: int, block: int
) -> None:
    """dblock's pair by layers, each timed in a run of its own beside only the raw pairs ``raw``
    (so that no other dblock variant warms its code), as a ratio to the hand-written pair."""
    from dblock._lease import Lease
    from dblock._process import new_owner

    sql, driver = locker.backend.sql, locker._verbs.driver

    def grant(name: str) -> tuple[str, int, object, float]:
        owner = new_owner()
        sent_at = time.monotonic()
        params = {"name": name, "owner": owner, "ttl": 30.0, "label": label}
        rows = driver.run(sql.acquire, params, sql.holder, deadline=sent_at + 5).rows
        return owner, rows[0][1], rows[0][2], sent_at

    def statements() -> None:
        owner, token, _, _ = grant("layer-driver")
        driver.run(sql.release, {"name": "layer-driver", "owner": owner, "token": token}, deadline=time.monotonic() + 5)

    def with_lease() -> None:
        owner, token, expires_at, sent_at = grant("layer-lease")
        Lease(locker, "layer-lease", owner, token, expires_at, 30.0, sent_at).release()

    def whole() -> None:
        locker.try_acquire("layer-dblock", ttl=30).release()

    print("dblock's pair by layers, each in a run of its own beside the raw pairs (us per pair):")
    print(f"  {'layer':55} {'us/pair':>9} {'vs hand-written':>16} {'vs minimal':>11}")
    for title, variant in (
        ("its two statements through its pool (Driver.run x 2)", statements),
        ("... and a Lease built from the grant, released through it", with_lease),
        ("dblock's pair (try_acquire + release)", whole),
    ):
        medians = interleaved({**raw, title: variant}, rounds, block)
        us = medians[title]
        print(f"  {title:55} {us:9.1f} {us / medians['hand-written']:15.2f}x {us / medians['minimal']:10.2f}x")


def canned_async(locker: Locker, pairs: int) -> float:
    """CPU per pair of an AsyncLocker on ``locker``'s table, its replies canned as ``profile``'s."""
    import asyncio

    from dblock.aio import AsyncLocker

    async def run() -> float:
        face = AsyncLocker(locker.engine.url, table=locker.table)
        try:
            for _ in range(20):  # the pool's connection, prepared statements, the listener's imports
                await (await face.try_acquire("canned")).release()  # type: ignore[union-attr]
            backend, sql = face.backend, face.backend.sql
            expires = datetime.now(timezone.utc) + timedelta(seconds=30)
            canned = {sql.acquire: [(True, 1, expires, None)], sql.release: [(1, False)]}

            async def execute(cursor: object, statement: str, params: object) -> object:
                return canned[statement]

            backend.aexecute = execute  # type: ignore[method-assign]
            started = time.thread_time()
            for _ in range(pairs):
                await (await face.try_acquire("canned")).release()  # type: ignore[union-attr]
            return (time.thread_time() - started) / pairs * 1e6
        finally:
            await face.aclose()

    return asyncio.run(run())


if __name__ == "__main__":
    main()
