"""Uncontended cost of one acquire + release pair on one thread, against baselines in the same run.

    python benchmarks/uncontended.py [--url postgresql://...] [--pairs 500] [--rounds 7] [--metrics]

With no --url (and no DBLOCK_TEST_URL) it starts a throwaway PostgreSQL with
pgserver (pip install -e '.[test]'). Rounds interleave the variants so that
machine noise hits them alike; the table shows the median microseconds per pair
and the ratio to the hand-written pair, the figure that matters. --metrics adds
dblock's pair with dblock.metrics recording into OpenTelemetry's SDK (an
in-memory reader), to weigh what recording costs against metrics off.
"""

from __future__ import annotations

import argparse
import os
import secrets
import tempfile

import psycopg
from sqlalchemy.engine import make_url

from _timing import interleaved  # benchmarks/_timing.py

from dblock import Locker, metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    ap.add_argument("--pairs", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--metrics", action="store_true", help="add the pair with metrics recording (opentelemetry-sdk)")
    args = ap.parse_args()
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
        (_, token, _, _) = own.execute(sql.acquire, params).fetchone()
        own.execute(sql.release, {"name": "hand", "owner": owner, "token": token}).fetchall()

    def advisory() -> None:
        raw.execute("SELECT pg_advisory_lock(42)").fetchall()
        raw.execute("SELECT pg_advisory_unlock(42)").fetchall()

    def dblock_pair() -> None:
        locker.try_acquire("dblock", ttl=30).release()

    variants = {
        "2 x SELECT 1": select1,
        "pg_advisory_lock pair (no TTL, no token)": advisory,
        "hand-written pair, raw psycopg": hand_written,
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
    medians = interleaved(variants, args.rounds, args.pairs)
    base = medians["hand-written pair, raw psycopg"]
    print(f"uncontended, {args.rounds} rounds x {args.pairs} pairs, PostgreSQL {raw.info.server_version}")
    print(f"{'variant':45} {'us/pair':>9} {'vs hand-written':>16}")
    for label, med in medians.items():
        print(f"{label:45} {med:9.1f} {med / base:15.2f}x")
    raw.close()
    own.close()
    locker.close()
    from dblock import migrate

    migrate.downgrade(locker.engine, table, None)
    if server is not None:
        server.cleanup()


if __name__ == "__main__":
    main()
