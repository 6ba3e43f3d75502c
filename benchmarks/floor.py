"""The floor of a durable hand-over: pg_advisory_lock against the least a fenced, durable hand-over does.

    python benchmarks/floor.py [--url postgresql://...] [--handovers 300] [--rounds 3] [--hold 0.002]
        [--processes] [--parts] [--plot PATH.png]

Two threads take turns on one lock: the holder holds ``--hold`` s and lets
go while the other waits, ``--handovers`` times per round, in ``--rounds``
interleaved rounds (who goes first rotates). With ``--processes`` the two
sides are two processes instead, as a distributed lock's holders mostly are:
two threads of one process share its interpreter lock, so the waiter woken
by a hand-over also waits for the Python the releasing thread runs next
(dblock's next acquire, where the floors' waiters block at once). Variants:

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

--parts then splits the hand-over of the least durable variants and of
dblock's: the release statement alone (its round trip, server work and
flush; for dblock, the statement inside its release call), when the waiter
read its notification after the release call returned, and the waiter's own
code from that moment until its acquire returned (the least durable
hand-over's waiter holds once it has read the notification). dblock's
listener and driver are timed from the outside (a wrapper on each), which
adds a little to dblock's figures of that run.

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


class Parts:
    """One side's record of the parts of its hand-overs (--parts): the variant's code notes the
    release statement's time and the moment its waiter read the notification."""

    def __init__(self) -> None:
        self.statement: list[float] = []  # the release statement alone (seconds)
        self.woke: float | None = None  # when this side, waiting, read its notification (perf_counter)
        self.takes: list[tuple[float, float]] = []  # (notification read, acquire returned)
        self.gives: list[tuple[float, float]] = []  # (release call began, returned)


_probe = threading.local()  # .parts: the Parts of the side running in this thread, or None


def _noting() -> Parts | None:
    return getattr(_probe, "parts", None)


def _parts(sides: list[Parts]) -> tuple[list[float], list[float], list[float]]:
    """The release statements of both sides; and per hand-over, when the waiter read its
    notification after the release call returned, and the waiter's code from then until its
    acquire returned (seconds). A take's release is the other side's last one that began
    before the notification was read."""
    seen: list[float] = []
    after: list[float] = []
    for i in (0, 1):
        gives = sides[1 - i].gives
        for woke, acquired in sides[i].takes:
            began = [ended for start, ended in gives if start < woke]
            if began:
                seen.append(woke - began[-1])
                after.append(acquired - woke)
    return [x for side in sides for x in side.statement], seen, after


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


Side = tuple[Callable[[], None], Callable[[], None], Callable[[], None]]  # take, give, close


class Variant:
    """A variant: ``setup()`` once (tables, sequences), then ``side(i)`` builds what side i
    needs, on its own connections, in the thread or process that uses it: (take, give, close).
    ``first``: side 0 takes the lock before the turns begin (else the set-up made it the holder)."""

    def __init__(self, side: Callable[[int], Side], setup: Callable[[], None] = lambda: None, first: bool = True) -> None:
        self.side, self.setup, self.first = side, setup, first


def _side_turns(
    variant: Variant, i: int, handovers: int, hold: float, gave_at: Any, ready: Any, parts: Parts | None = None
) -> Sample:
    """Side ``i``'s turns: take (timing the hand-over from the other side's give), hold, give;
    ``parts`` (--parts) notes what the turns consist of."""
    released: list[float] = []
    handed: list[float] = []
    _probe.parts = parts
    take, give, close = variant.side(i)
    try:
        turns = (handovers + 1 - i) // 2  # side 0 gives at turns 0, 2, 4...; side 1 at 1, 3, 5...
        if i == 0 and variant.first:
            take()
        ready.wait()
        if parts is not None:
            parts.statement.clear()  # from the turns only
            parts.woke = None
        for k in range(turns):
            if i == 1 or k > 0:
                take()
                now = time.perf_counter()
                handed.append(now - gave_at.value)
                if parts is not None and parts.woke is not None:
                    parts.takes.append((parts.woke, now))
                    parts.woke = None
            time.sleep(hold)
            gave_at.value = began = time.perf_counter()
            give()
            ended = time.perf_counter()
            released.append(ended - began)
            if parts is not None:
                parts.gives.append((began, ended))
    except BaseException:
        ready.abort()  # the other side must not wait for this one
        raise
    finally:
        _probe.parts = None
        close()
    return released, handed


def _turns(
    variant: Variant, handovers: int, hold: float, processes: bool = False, parts: list[Parts] | None = None
) -> Sample:
    """Two sides alternate about ``handovers`` times, as threads of this process or as two
    processes. A side that gave waits again at once: the other holds ``hold`` s first, so every
    hand-over wakes a waiter already in line, not a fresh call. (perf_counter is the system's
    monotonic clock, one for every process of the machine.) ``parts``: one per side, to note
    what the turns consist of (--parts)."""
    variant.setup()
    if processes:
        return _in_processes(variant, handovers, hold, parts)
    gave_at = _Box()
    ready = threading.Barrier(2)
    results: list[Sample | None] = [None, None]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = _side_turns(variant, i, handovers, hold, gave_at, ready, None if parts is None else parts[i])
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return _merge(results)


class _Box:
    value = 0.0


def _merge(results: list[Sample | None]) -> Sample:
    released = [x for r in results if r for x in r[0]]
    handed = [x for r in results if r for x in r[1]]
    return released, handed


def _process_side(
    variant: Variant, i: int, handovers: int, hold: float, gave_at: Any, ready: Any, out: Any, parts: Parts | None
) -> None:
    try:
        out.put((i, _side_turns(variant, i, handovers, hold, gave_at, ready, parts), parts, None))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        out.put((i, None, None, f"{type(exc).__name__}: {exc}"))


def _in_processes(variant: Variant, handovers: int, hold: float, parts: list[Parts] | None = None) -> Sample:
    import multiprocessing

    context = multiprocessing.get_context("fork")  # the sides build their connections after the fork
    gave_at = context.Value("d", 0.0, lock=False)
    ready = context.Barrier(2)
    out = context.Queue()
    procs = [
        context.Process(
            target=_process_side,
            args=(variant, i, handovers, hold, gave_at, ready, out, None if parts is None else parts[i]),
        )
        for i in (0, 1)
    ]
    for p in procs:
        p.start()
    results: list[Sample | None] = [None, None]
    failures = []
    for _ in procs:
        i, sample, noted, failure = out.get(timeout=120)
        results[i] = sample
        if parts is not None and noted is not None:
            parts[i] = noted  # what the forked side noted, back in this process
        if failure:
            failures.append(f"side {i}: {failure}")
    for p in procs:
        p.join()
    if failures:
        raise RuntimeError("; ".join(failures))
    return _merge(results)


def advisory(url: str, token: bool = False) -> Variant:
    """pg_advisory_lock's own queue and wake-up; ``token``: once woken, the waiter also draws a
    token in one flushed commit before it holds (a durable fenced grant)."""
    import psycopg

    draw = f"UPDATE {TABLE}_grants SET token = nextval('{TABLE}_tokens') WHERE name = 'x' RETURNING token"

    def setup() -> None:
        if token:
            with psycopg.connect(_dsn(url), autocommit=True) as c:
                c.execute(f"CREATE TABLE IF NOT EXISTS {TABLE}_grants (name text PRIMARY KEY, token bigint NOT NULL)")
                c.execute(f"CREATE SEQUENCE IF NOT EXISTS {TABLE}_tokens")
                c.execute(f"INSERT INTO {TABLE}_grants VALUES ('x', 0) ON CONFLICT (name) DO NOTHING")

    def side(i: int) -> Side:
        conn = psycopg.connect(_dsn(url), autocommit=True)
        conn.execute("SET lock_timeout = '10s'")  # a turn that never comes fails the run instead of hanging it

        def take() -> None:
            conn.execute("SELECT pg_advisory_lock(7210)", prepare=True)
            if token:
                conn.execute(draw, prepare=True).fetchone()  # flushed before it returns

        def give() -> None:
            conn.execute("SELECT pg_advisory_unlock(7210)", prepare=True)

        return take, give, conn.close

    return Variant(side, setup)


def least(url: str, off: bool = False) -> Variant:
    import psycopg

    def setup() -> None:
        with psycopg.connect(_dsn(url), autocommit=True) as c:
            c.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (name text PRIMARY KEY, owner text, token bigint NOT NULL)")
            c.execute(f"CREATE SEQUENCE IF NOT EXISTS {TABLE}_tokens")
            c.execute(f"INSERT INTO {TABLE} VALUES ('x', '0', 0) ON CONFLICT (name) DO UPDATE SET owner = '0'")

    # Hand the row to the other owner, with a token drawn under the row lock, and wake it.
    handover = (
        f"WITH u AS (UPDATE {TABLE} SET owner = %(to)s, token = nextval('{TABLE}_tokens') "
        "WHERE name = 'x' AND owner = %(me)s RETURNING token) "
        f"SELECT pg_notify('{TABLE}_' || %(to)s, token::text) FROM u"
    )

    def side(i: int) -> Side:
        conn = psycopg.connect(_dsn(url), autocommit=True, **({"options": SYNC_OFF} if off else {}))
        listener = psycopg.connect(_dsn(url), autocommit=True)
        listener.execute(f"LISTEN {TABLE}_{i}")

        def take() -> None:
            for _ in listener.notifies(timeout=10, stop_after=1):
                parts = _noting()
                if parts is not None:
                    parts.woke = time.perf_counter()  # it holds from here
                return
            raise TimeoutError("no hand-over notification in 10 s")

        def give() -> None:
            began = time.perf_counter()
            row = conn.execute(handover, {"me": str(i), "to": str(1 - i)}, prepare=True).fetchone()
            parts = _noting()
            if parts is not None:
                parts.statement.append(time.perf_counter() - began)
            if row is None:
                raise AssertionError("the hand-over statement found the row with another owner")

        def close() -> None:
            conn.close()
            listener.close()

        return take, give, close

    return Variant(side, setup, first=False)  # owner '0' holds from the set-up


def dblock(url: str, off: bool = False) -> Variant:
    from dblock import Locker

    locker_url, table = _url(url, "postgresql+psycopg", off), TABLE + "_dblock"

    def setup() -> None:
        locker = Locker(locker_url, table=table)
        locker.create_schema()
        locker.close()

    def side(i: int) -> Side:
        locker = Locker(locker_url, table=table, ttl=10)
        lease: list[Any] = [None]

        def take() -> None:
            lease[0] = locker.acquire("x", timeout=10)

        def give() -> None:
            lease[0].release()

        return take, give, locker.close

    return Variant(side, setup)


def _time_dblock() -> None:
    """For --parts: note dblock's release statement (its driver's execute) and the moment its
    waiter reads a hand-off notification (its listener's dispatch), in the side's Parts."""
    from dblock import _driver, _wait

    execute, dispatch = _driver.Driver._execute, _wait.Listener._dispatch

    def timed_execute(driver: Any, conn: Any, sql: str, params: Any) -> Any:
        parts = _noting()
        if parts is None or sql != driver.backend.sql.release:
            return execute(driver, conn, sql, params)
        began = time.perf_counter()
        try:
            return execute(driver, conn, sql, params)
        finally:
            parts.statement.append(time.perf_counter() - began)

    def noted_dispatch(listener: Any, payload: str) -> None:
        parts = _noting()
        if parts is not None:
            parts.woke = time.perf_counter()
        dispatch(listener, payload)

    _driver.Driver._execute = timed_execute  # type: ignore[method-assign,assignment]
    _wait.Listener._dispatch = noted_dispatch  # type: ignore[method-assign,assignment]


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")  # (--parts in a tiny run: no hand-over was woken by its notification)
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    parser.add_argument("--handovers", type=int, default=300, help="per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hold", type=float, default=0.002)
    parser.add_argument(
        "--processes", action="store_true",
        help="the two sides in two processes (as a distributed lock's holders mostly are), not two threads of one",
    )
    parser.add_argument(
        "--parts", action="store_true",
        help="then split the least durable and dblock's hand-overs into their parts (release statement, wake, waiter's code)",
    )
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
        variants: dict[str, Variant] = {
            ADVISORY: advisory(args.url),
            ADVISORY_TOKEN: advisory(args.url, token=True),
            LEAST: least(args.url),
            LEAST_OFF: least(args.url, off=True),
            DBLOCK: dblock(args.url),
            DBLOCK_OFF: dblock(args.url, off=True),
        }
        sides = "two processes" if args.processes else "two threads"
        samples: dict[str, Sample] = {name: ([], []) for name in variants}
        # --parts: per variant split, its release statements, its waiters' wake-ups, their code after it
        split: dict[str, tuple[list[float], list[float], list[float]]] = (
            {name: ([], [], []) for name in (LEAST, LEAST_OFF, DBLOCK, DBLOCK_OFF)} if args.parts else {}
        )
        if args.parts:
            _time_dblock()
        started = time.monotonic()
        for r in range(args.rounds):
            for name, variant in rotation(variants, r):
                noted = [Parts(), Parts()] if name in split else None
                released, handed = _turns(variant, args.handovers, args.hold, args.processes, noted)
                samples[name][0].extend(released)
                samples[name][1].extend(handed)
                if noted is not None:
                    for into, part in zip(split[name], _parts(noted)):
                        into.extend(part)
                print(f"[{time.monotonic() - started:5.0f} s] round {r + 1}: {name}", file=sys.stderr)
        base = _p(samples[ADVISORY][1], 50)
        print(
            f"floor: {sides} taking turns, hold {args.hold * 1000:g} ms, {args.handovers} hand-overs x "
            f"{args.rounds} interleaved rounds per variant; PostgreSQL {version}"
            f"{' (throwaway, on disk)' if server else ''}, {os.cpu_count()} CPUs"
        )
        print(f"{'variant':42} {'release p50':>11} {'hand-over p50':>13} {'p99':>7} {'vs advisory':>11}")
        for name, (released, handed) in samples.items():
            print(
                f"{name:42} {_p(released, 50):11.3f} {_p(handed, 50):13.3f} {_p(handed, 99):7.2f} "
                f"{_p(handed, 50) / base:10.2f}x"
            )
        if split:
            print("the hand-over by parts (medians, ms): the release call, the statement in it, the waiter reading its")
            print("notification after the call returned, and the waiter's code from then until its acquire returned")
            print(f"{'variant':42} {'release':>8} {'statement':>9} {'read after':>10} {'code after':>10} {'hand-over':>9}")
            for name, (statement, seen, after) in split.items():
                print(
                    f"{name:42} {_p(samples[name][0], 50):8.3f} {_p(statement, 50):9.3f} {_p(seen, 50):10.3f} "
                    f"{_p(after, 50):10.3f} {_p(samples[name][1], 50):9.3f}"
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
                args.plot, f"Hand-over between {sides} taking turns (ms)", "ms",
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
