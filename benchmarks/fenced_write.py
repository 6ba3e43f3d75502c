"""What the fence costs: a fenced UPDATE against the same UPDATE without the fence, in the same run.

    python benchmarks/fenced_write.py [--url postgresql://...] [--writes 500] [--rounds 7]

Each write is one committed transaction on a SQLAlchemy connection (what an
application does): the plain UPDATE, the same UPDATE through
``dblock.fenced_update`` (check and stamp in the statement), through
``dblock.fence`` on the fences table plus the UPDATE, and under
``dblock.commit_guard`` (lease check with FOR SHARE before COMMIT). Rounds
interleave the variants; the table shows median microseconds per write and
the ratio to the plain UPDATE. With no --url (and no DBLOCK_TEST_URL) it
starts a throwaway PostgreSQL with pgserver.
"""

from __future__ import annotations

import argparse
import os
import secrets
import tempfile
from typing import Callable

from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, create_engine, update
from sqlalchemy.engine import make_url

import dblock
from _timing import interleaved  # benchmarks/_timing.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    ap.add_argument("--writes", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    url = args.url
    if not url:
        import pgserver

        server = pgserver.get_server(tempfile.mkdtemp(prefix="dblock-bench-"), cleanup_mode="delete")
        url = server.get_uri()
    sa_url = make_url(url).set(drivername="postgresql+psycopg")
    suffix = secrets.token_hex(4)
    engine = create_engine(sa_url)
    locker = dblock.Locker(engine, table=f"bench_{suffix}")
    locker.create_schema()
    md = MetaData()
    t = Table(
        f"bench_rows_{suffix}",
        md,
        Column("id", Integer, primary_key=True),
        Column("n", Integer, nullable=False),
        Column("fence_token", BigInteger, nullable=False, server_default="0"),
    )
    md.create_all(engine)
    with engine.begin() as conn:
        conn.execute(t.insert(), [{"id": 1, "n": 0}])
    lease = locker.acquire("bench", ttl=3600)
    write = update(t).where(t.c.id == 1).values(n=t.c.n + 1)
    conn = engine.connect()

    def plain() -> None:
        conn.execute(write)
        conn.commit()

    def fenced() -> None:
        dblock.fenced_update(conn, write, lease)
        conn.commit()

    def fences_table() -> None:
        dblock.fence(conn, lease)
        conn.execute(write)
        conn.commit()

    def guarded() -> None:
        with dblock.commit_guard(conn, lease):
            conn.execute(write)

    variants: dict[str, Callable[[], None]] = {
        "plain UPDATE": plain,
        "fenced_update (token column)": fenced,
        "fence() + UPDATE (fences table)": fences_table,
        "UPDATE under commit_guard": guarded,
    }
    medians = interleaved(variants, args.rounds, args.writes, warmup=50)
    base = medians["plain UPDATE"]
    print(f"| variant | us/write | ratio |  ({args.rounds} rounds x {args.writes} writes, median)")
    print("|---|---:|---:|")
    for name, med in medians.items():
        print(f"| {name} | {med:.1f} | {med / base:.2f}x |")
    conn.close()
    lease.release()
    md.drop_all(engine)
    locker.close()
    from dblock import migrate

    migrate.downgrade(engine, f"bench_{suffix}", None)  # the lock's tables too: nothing of this run stays
    engine.dispose()


if __name__ == "__main__":
    main()
