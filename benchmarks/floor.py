"""The floor of a durable hand-over: pg_advisory_lock against the least a fenced, durable hand-over does.

    python benchmarks/floor.py [--url postgresql://...] [--handovers 300] [--rounds 3] [--hold 0.002]
        [--plot PATH.png]

Two threads take turns on one lock: the holder holds ``--hold`` s and lets
go while the other waits, ``--handovers`` times per round, in ``--rounds``
interleaved rounds (who goes first rotates). Variants:

- ``pg_advisory_lock``: the baseline. Unlock wakes the session blocked in
  ``pg_advisory_lock``; nothing is written, nothing is flushed, no token.
- ``least durable hand-over``: what any lock that hands a fencing token over
  durably has to do, and nothing more: no queue, no liveness check, no
  expiry. One statement on the releasing session updates one row (owner and
  a token drawn from a sequence, under the row lock) and NOTIFYs the next
  holder's channel; one commit, flushed to disk before the NOTIFY leaves.
  The waiter blocks on its listening connection, with no thread hop. This
  is the floor the issue names (one durable commit plus a NOTIFY wake-up),
  built as cheaply as PostgreSQL allows.
- ``pg_advisory_lock + durable token``: the server's own queue and wake-up
  with the one flush a durable fenced grant needs: the waiter blocked in
  ``pg_advisory_lock`` draws a token, once woken, in one flushed commit
  (an UPDATE of one row from a sequence), and only then holds. The other
  floor the issue names.
- the same with ``synchronous_commit = off``: the floor without the flush,
  which shows what the disk costs (not durable: a grant lost in a crash
  could have its token drawn again after recovery).
- ``dblock``: two Lockers, fair waiting with NOTIFY (the default), and the
  same with ``synchronous_commit = off``.

Columns: release (the holder's call, client side) and hand-over (the
holder calls release -> the other thread's acquire returns, one clock),
medians and p99 in ms, and hand-over p50 as a ratio to pg_advisory_lock's
in the same run. The last line gives dblock's hand-over p50 as a ratio to
both floors. --plot draws hand-over p50 and p99 per variant (pip install
'dblock[plots]').

With no --url (and no DBLOCK_TEST_URL) a throwaway PostgreSQL is started
with pgserver on the disk (its commits flush), as ``waiters.py`` does.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import rotation  # noqa: E402

ADVISORY = "pg_advisory_lock"
ADVISORY_TOKEN = "pg_advisory_lock + durable token"
LEAST = "least durable hand-over"
LEAST_OFF = "least hand-over, synchronous_commit=off"
DBLOCK = "dblock fair, NOTIFY (default)"
DBLOCK_OFF = "dblock, synchronous_commit=off"
SYNC_OFF = "-c synchronous_commit=off"
# The variants' names, short enough for a chart's axis.
SHORT = {
    ADVISORY: "advisory",
    ADVISORY_TOKEN: "advisory\n+ durable token",
    LEAST: "least durable",
    LEAST_OFF: "least,\nsync. commit off",
    DBLOCK: "dblock",
    DBLOCK_OFF: "dblock,\nsync. commit off",
}
TABLE = "floor_" + secrets.token_hex(4)  # this run's tables: TABLE (the least hand-over's), TABLE_dblock, TABLE_tokens

Sample = tuple[list[float], list[float]]  # release call times, hand-over times (seconds)


def _url(url: str, driver: str, off: bool = False) -> str:
    """``url`` for ``driver`` ("postgresql": libpq's, for psycopg; "postgresql+psycopg": SQLAlchemy's,
    for a Locker). ``off``: synchronous_commit off for its sessions (a Locker's URL only: SQLAlchemy
    reads it back; psycopg is given ``options`` itself)."""
    from sqlalchemy.engine import make_url

    sa_url = make_url(url).set(drivername=driver)
    if off:
        sa_url = sa_url.update_query_dict({"options": SYNC_OFF})
    return sa_url.render_as_string(hide_password=False)


def _dsn(url: str) -> str:
    return _url(url, "postgresql")


def _turns(
    take: Callable[[int], None], give: Callable[[int], None], handovers: int, hold: float, start: Callable[[], None]
) -> Sample:
    """Two threads alternate about ``handovers`` times. ``start()`` makes thread 0 the holder;
    ``take(i)`` blocks until thread i holds; ``give(i)`` lets go (and hands over, where the
    variant hands over). A thread that gave waits again at once: the other holds ``hold`` s
    first, so every hand-over wakes a waiter already in line, not a fresh call."""
    released: list[float] = []
    handed: list[float] = []
    gave_at = [0.0]
    ready = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            turns = (handovers + 1 - i) // 2  # thread 0 gives at turns 0, 2, 4...; thread 1 at 1, 3, 5...
            if i == 0:
                start()
            ready.wait()
            for k in range(turns):
                if i == 1 or k > 0:
                    take(i)
                    handed.append(time.perf_counter() - gave_at[0])
                time.sleep(hold)
                gave_at[0] = began = time.perf_counter()
                give(i)
                released.append(time.perf_counter() - began)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
            ready.abort()  # the other thread must not wait for this one

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return released, handed


def advisory(url: str, handovers: int, hold: float, token: bool = False) -> Sample:
    """pg_advisory_lock's own queue and wake-up; ``token``: once woken, the waiter also draws a
    token in one flushed commit before it holds (a durable fenced grant)."""
    import psycopg

    draw = f"UPDATE {TABLE}_grants SET token = nextval('{TABLE}_tokens') WHERE name = 'x' RETURNING token"
    if token:
        with psycopg.connect(_dsn(url), autocommit=True) as setup:
            setup.execute(f"CREATE TABLE IF NOT EXISTS {TABLE}_grants (name text PRIMARY KEY, token bigint NOT NULL)")
            setup.execute(f"CREATE SEQUENCE IF NOT EXISTS {TABLE}_tokens")
            setup.execute(f"INSERT INTO {TABLE}_grants VALUES ('x', 0) ON CONFLICT (name) DO NOTHING")
    conns = [psycopg.connect(_dsn(url), autocommit=True) for _ in (0, 1)]
    for c in conns:
        c.execute("SET lock_timeout = '10s'")  # a turn that never comes fails the run instead of hanging it
    try:

        def take(i: int) -> None:
            conns[i].execute("SELECT pg_advisory_lock(7210)", prepare=True)
            if token:
                conns[i].execute(draw, prepare=True).fetchone()  # flushed before it returns

        def give(i: int) -> None:
            conns[i].execute("SELECT pg_advisory_unlock(7210)", prepare=True)

        return _turns(take, give, handovers, hold, lambda: take(0))
    finally:
        for c in conns:
            c.close()


def least(url: str, handovers: int, hold: float, off: bool = False) -> Sample:
    import psycopg

    with psycopg.connect(_dsn(url), autocommit=True) as setup:
        setup.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (name text PRIMARY KEY, owner text, token bigint NOT NULL)")
        setup.execute(f"CREATE SEQUENCE IF NOT EXISTS {TABLE}_tokens")
        setup.execute(f"INSERT INTO {TABLE} VALUES ('x', '0', 0) ON CONFLICT (name) DO UPDATE SET owner = '0'")
    conns = [psycopg.connect(_dsn(url), autocommit=True, **({"options": SYNC_OFF} if off else {})) for _ in (0, 1)]
    listeners = [psycopg.connect(_dsn(url), autocommit=True) for _ in (0, 1)]
    for i, c in enumerate(listeners):
        c.execute(f"LISTEN {TABLE}_{i}")
    # Hand the row to the other owner, with a token drawn under the row lock, and wake it.
    handover = (
        f"WITH u AS (UPDATE {TABLE} SET owner = %(to)s, token = nextval('{TABLE}_tokens') "
        "WHERE name = 'x' AND owner = %(me)s RETURNING token) "
        f"SELECT pg_notify('{TABLE}_' || %(to)s, token::text) FROM u"
    )
    try:

        def take(i: int) -> None:
            for _ in listeners[i].notifies(timeout=10, stop_after=1):
                return
            raise TimeoutError("no hand-over notification in 10 s")

        def give(i: int) -> None:
            row = conns[i].execute(handover, {"me": str(i), "to": str(1 - i)}, prepare=True).fetchone()
            if row is None:
                raise AssertionError("the hand-over statement found the row with another owner")

        return _turns(take, give, handovers, hold, lambda: None)  # owner '0' holds from the set-up
    finally:
        for c in conns + listeners:
            c.close()


def dblock(url: str, handovers: int, hold: float, off: bool = False) -> Sample:
    from dblock import Locker

    lockers = [Locker(_url(url, "postgresql+psycopg", off), table=TABLE + "_dblock", ttl=10) for _ in (0, 1)]
    lockers[0].create_schema()
    leases: list[Any] = [None, None]
    try:

        def take(i: int) -> None:
            leases[i] = lockers[i].acquire("x", timeout=10)

        def give(i: int) -> None:
            leases[i].release()

        return _turns(take, give, handovers, hold, lambda: take(0))
    finally:
        for locker in lockers:
            locker.close()


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    parser.add_argument("--handovers", type=int, default=300, help="per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hold", type=float, default=0.002)
    parser.add_argument("--plot", metavar="PATH.png", help="draw hand-over p50 and p99 per variant (needs dblock[plots])")
    args = parser.parse_args()
    if args.plot:
        import _plot

        _plot.require()  # before a run of minutes
    server = None
    if not args.url:
        import waiters

        server = waiters._throwaway(100)
        args.url = server.get_uri()
    try:
        import psycopg

        with psycopg.connect(_dsn(args.url), autocommit=True) as c:
            version = c.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        variants: dict[str, Callable[[], Sample]] = {
            ADVISORY: lambda: advisory(args.url, args.handovers, args.hold),
            ADVISORY_TOKEN: lambda: advisory(args.url, args.handovers, args.hold, token=True),
            LEAST: lambda: least(args.url, args.handovers, args.hold),
            LEAST_OFF: lambda: least(args.url, args.handovers, args.hold, off=True),
            DBLOCK: lambda: dblock(args.url, args.handovers, args.hold),
            DBLOCK_OFF: lambda: dblock(args.url, args.handovers, args.hold, off=True),
        }
        samples: dict[str, Sample] = {name: ([], []) for name in variants}
        started = time.monotonic()
        for r in range(args.rounds):
            for name, run in rotation(variants, r):
                released, handed = run()
                samples[name][0].extend(released)
                samples[name][1].extend(handed)
                print(f"[{time.monotonic() - started:5.0f} s] round {r + 1}: {name}", file=sys.stderr)
        base = _p(samples[ADVISORY][1], 50)
        print(
            f"floor: two threads taking turns, hold {args.hold * 1000:g} ms, {args.handovers} hand-overs x "
            f"{args.rounds} interleaved rounds per variant; PostgreSQL {version}"
            f"{' (throwaway, on disk)' if server else ''}, {os.cpu_count()} CPUs"
        )
        print(f"{'variant':42} {'release p50':>11} {'hand-over p50':>13} {'p99':>7} {'vs advisory':>11}")
        for name, (released, handed) in samples.items():
            print(
                f"{name:42} {_p(released, 50):11.3f} {_p(handed, 50):13.3f} {_p(handed, 99):7.2f} "
                f"{_p(handed, 50) / base:10.2f}x"
            )
        least_ratio = _p(samples[LEAST][1], 50) / base
        flush = _p(samples[LEAST][1], 50) - _p(samples[LEAST_OFF][1], 50)
        ours = _p(samples[DBLOCK][1], 50)
        print(
            f"the least durable hand-over is {least_ratio:.2f}x pg_advisory_lock's (its flush {flush:.3f} ms); "
            f"dblock's hand-over p50 is {ours / _p(samples[LEAST][1], 50):.2f}x the least durable one's and "
            f"{ours / _p(samples[ADVISORY_TOKEN][1], 50):.2f}x pg_advisory_lock + durable token's; its p99 "
            f"{_p(samples[DBLOCK][1], 99) / _p(samples[LEAST][1], 99):.2f}x and "
            f"{_p(samples[DBLOCK][1], 99) / _p(samples[ADVISORY_TOKEN][1], 99):.2f}x theirs"
        )
        if args.plot:
            import _plot

            names = list(samples)
            _plot.bar_plot(
                args.plot, "Hand-over between two threads taking turns (ms)", "ms",
                [SHORT.get(name, name) for name in names],
                {q: [_p(samples[name][1], n) for name in names] for q, n in (("p50", 50), ("p99", 99))},
                note=f"PostgreSQL {version.split()[0]}{', throwaway, on disk' if server else ''}; "
                f"{args.handovers} hand-overs x {args.rounds} rounds, hold {args.hold * 1000:g} ms",
            )
    finally:
        if server is not None:
            server.cleanup()
        else:
            _drop(args.url)


def _drop(url: str) -> None:
    """Remove this run's tables from a server that stays."""
    import psycopg

    from dblock import Locker, migrate

    with psycopg.connect(_dsn(url), autocommit=True) as c:
        c.execute(f"DROP TABLE IF EXISTS {TABLE}")
        c.execute(f"DROP TABLE IF EXISTS {TABLE}_grants")
        c.execute(f"DROP SEQUENCE IF EXISTS {TABLE}_tokens")
    locker = Locker(_url(url, "postgresql+psycopg"), table=TABLE + "_dblock")
    migrate.downgrade(locker.engine, TABLE + "_dblock", None)
    locker.close()


if __name__ == "__main__":
    main()
