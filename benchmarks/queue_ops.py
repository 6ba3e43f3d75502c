"""The fair queue's own operations, one at a time, with 10, 1,000 and 100,000 waiters in line.

    python benchmarks/queue_ops.py [--url postgresql://...] [--sizes 10,1000,100000]
        [--rounds 5] [--calls 100]

waiters.py measures whole systems of waiting threads, where the client
machine's load (1,000 Python threads on 2 cores) moves every figure. This one
asks only what the issue asks of the queue: does an operation cost the same
with a long line as with a short one? One connection, one operation at a time,
on names whose lines are built directly in ``<table>_waiters`` (every waiter
live: a fresh process heartbeat, and a listener session of its own that holds
the listener's advisory lock, so the hand-off's session check runs for real). Operations, each
the exact statement dblock sends:

- join: a new waiter's first look while the lock is held (enqueue, no seq);
  it is taken out again afterwards, untimed;
- look: a waiter in the middle of the line looks again (enqueue with its
  seq; writes nothing);
- leave: a waiter in the middle of the line gives up (cancel); it is put back
  at the end, untimed;
- hand-off: the holder releases and the head of the line is granted (the
  release statement); the line is topped up at its end, untimed, and the new
  holder is the next to release;
- beat: the process heartbeat.

Per operation and line length: the median time of a call (microseconds,
client side, over --rounds rounds of --calls calls; the sizes take turns
within each round, so noise hits them alike), its ratio to the shortest line's,
and the shared buffers the call touched (hit + read, from ``EXPLAIN (ANALYZE,
BUFFERS)`` of the same statement, the function's inner statements included),
which does not depend on the machine's load at all.

With no --url (and no DBLOCK_TEST_URL) it starts a throwaway PostgreSQL with
pgserver.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections import deque

import psycopg
from pathlib import Path
from typing import Any, Callable

OPS = ["join", "look", "leave", "hand-off", "beat"]
PROC = "queue-ops-bench"


class Line:
    """One name with a line of ``size`` waiters, and a holder."""

    def __init__(self, conn: Any, backend: Any, table: str, size: int) -> None:
        sql = backend.sql
        self.queue = backend.queue  # the fair queue's statements
        self.conn, self.sql, self.table, self.size = conn, sql, table, size
        self.name = f"line-{size}"
        self.waiters = f"{table}_waiters"
        # The waiters' listener: a session of its own, which takes the listener's advisory lock as
        # dblock's does (backend.session), so the hand-off finds it alive as it finds a real one.
        self.listener = psycopg.connect(conn.info.dsn, password=conn.info.password, autocommit=True)
        pid, start = self.listener.execute(backend.session).fetchone()
        self.session = {"pid": pid, "start": start}
        self.owner = secrets.token_hex(16)
        row = conn.execute(sql.acquire, {"name": self.name, "owner": self.owner, "ttl": 3600, "label": "bench"}).fetchone()
        assert row[0], row
        self.token = row[1]
        self.line: deque[tuple[int, str]] = deque()  # (seq, owner), head first
        self._add(size)

    def _add(self, count: int) -> None:
        rows = self.conn.execute(
            f"""INSERT INTO {self.waiters} (name, owner, ttl, label, proc, pid, start, until)
            SELECT %(name)s, md5(random()::text), 3600, 'bench', %(proc)s, %(pid)s, %(start)s,
                   now() + interval '1 day'
            FROM generate_series(1, %(count)s) RETURNING seq, owner""",
            {"name": self.name, "proc": PROC, "count": count, **self.session},
        ).fetchall()
        self.conn.execute(f"UPDATE {self.table} SET waiting = waiting + %s WHERE name = %s", (count, self.name))
        self.line.extend(sorted(rows))

    def params(self, op: str) -> tuple[str, dict[str, Any]]:
        """The statement and binds of one call of ``op``."""
        sql = self.sql
        if op == "join":
            return self.queue.enqueue, self._enqueue(secrets.token_hex(16), None)
        if op == "look":
            seq, owner = self.line[len(self.line) // 2]
            return self.queue.enqueue, self._enqueue(owner, seq)
        if op == "leave":
            seq, owner = self.line[len(self.line) // 2]
            return self.queue.cancel, {"name": self.name, "owner": owner, "seq": seq}
        if op == "hand-off":
            return sql.release, {"name": self.name, "owner": self.owner, "token": self.token}
        return self.queue.beat, {"proc": PROC, "lapse": 86400}

    def _enqueue(self, owner: str, seq: int | None) -> dict[str, Any]:
        return {
            "name": self.name, "owner": owner, "ttl": 3600, "label": "bench", "proc": PROC, "lapse": 86400,
            "until": 86400, "seq": seq, **self.session,
        }

    def after(self, op: str, binds: dict[str, Any], rows: list[Any]) -> None:
        """Put the line back as it was (untimed)."""
        if op == "join":
            (granted, _, _, _, seq, _, _), = rows
            assert not granted
            self.conn.execute(self.queue.cancel, {"name": self.name, "owner": binds["owner"], "seq": seq})
        elif op == "leave":
            self.line.remove((binds["seq"], binds["owner"]))
            self._add(1)
        elif op == "hand-off":
            ((_, handed),) = rows  # the token of the lease it ended, and whether it handed one on
            assert handed, "the release handed the lease to nobody"
            _, self.owner = self.line.popleft()
            ((self.token,),) = self.conn.execute(f"SELECT token FROM {self.table} WHERE name = %s", (self.name,)).fetchall()
            self._add(1)


def run(conn: Any, lines: list[Line], rounds: int, calls: int) -> dict[tuple[str, int], dict[str, float]]:
    times: dict[tuple[str, int], list[float]] = {(op, line.size): [] for op in OPS for line in lines}
    buffers: dict[tuple[str, int], list[int]] = {(op, line.size): [] for op in OPS for line in lines}
    for r in range(-1, rounds):  # round -1 warms up (plans, caches) and is not kept
        order = lines[r % len(lines):] + lines[: r % len(lines)]
        for op in OPS:
            for line in order:
                for i in range(calls):
                    sql, binds = line.params(op)
                    if i == 0:  # one call of each batch under EXPLAIN: the buffers it touches
                        plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, binds).fetchone()[0]
                        top = plan[0]["Plan"]
                        if r >= 0:
                            buffers[(op, line.size)].append(top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0))
                        # EXPLAIN ran it: undo as after a timed call.
                        line.after(op, binds, _rows_after_explain(conn, line, op, binds))
                        sql, binds = line.params(op)
                    start = time.perf_counter()
                    rows = conn.execute(sql, binds, prepare=True).fetchall()
                    if r >= 0:
                        times[(op, line.size)].append((time.perf_counter() - start) * 1e6)
                    line.after(op, binds, rows)
    return {
        key: {"us": statistics.median(times[key]), "buffers": statistics.median(buffers[key])}
        for key in times
    }


def _listeners(conn: Any, dsn: str, line: Line, rounds: int, calls: int, count: int) -> tuple[float, float] | None:
    """Median hand-off time without and with ``count`` other sessions LISTENing, rounds interleaved.

    PostgreSQL signals every session LISTENing in the database when a transaction that
    NOTIFYs commits, whatever their channels; each dblock process waiting on a fair lock
    has one such session (its listener)."""
    import psycopg

    if count <= 0:
        return None
    others = [psycopg.connect(dsn, autocommit=True) for _ in range(count)]
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for r in range(-1, rounds):
            for crowd in (False, True):
                for other in others:
                    other.execute(f"LISTEN dblock_{secrets.token_hex(8)}" if crowd else "UNLISTEN *")
                for _ in range(calls):
                    sql, binds = line.params("hand-off")
                    start = time.perf_counter()
                    rows = conn.execute(sql, binds, prepare=True).fetchall()
                    if r >= 0:
                        times[crowd].append((time.perf_counter() - start) * 1e6)
                    line.after("hand-off", binds, rows)
    finally:
        for other in others:
            other.close()
    return statistics.median(times[False]), statistics.median(times[True])


def _rows_after_explain(conn: Any, line: Line, op: str, binds: dict[str, Any]) -> list[Any]:
    """What the call run under EXPLAIN returned, read back from the tables (EXPLAIN shows no rows)."""
    if op == "join":
        seq = conn.execute(
            f"SELECT seq FROM {line.waiters} WHERE name = %s AND owner = %s", (line.name, binds["owner"])
        ).fetchone()[0]
        return [(False, None, None, None, seq, None, None)]
    if op == "hand-off":
        token = conn.execute(f"SELECT token FROM {line.table} WHERE name = %s", (line.name,)).fetchone()[0]
        return [(token, True)]
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    ap.add_argument("--sizes", default="10,1000,100000", help="comma-separated line lengths")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100, help="calls per operation, line and round")
    ap.add_argument(
        "--listeners", type=int, default=50,
        help="then time the hand-off on the shortest line with this many other sessions LISTENing (0: skip)",
    )
    args = ap.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    server = None
    if not args.url:
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
            import pgserver

            server = pgserver.get_server(tempfile.mkdtemp(prefix="dblock-bench-"), cleanup_mode="delete")
        args.url = server.get_uri()
    import psycopg
    from sqlalchemy.engine import make_url

    from dblock import Locker, migrate

    sa_url = make_url(args.url).set(drivername="postgresql+psycopg")
    dsn = sa_url.set(drivername="postgresql").render_as_string(hide_password=False)
    table = "bench_" + secrets.token_hex(4)
    locker = Locker(sa_url, table=table)
    locker.create_schema()
    started = time.monotonic()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
            conn.execute(
                f"INSERT INTO {table}_procs (id, until) VALUES (%s, now() + interval '1 day')", (PROC,)
            )
            lines = [Line(conn, locker.backend, table, size) for size in sizes]
            conn.execute(f"ANALYZE {table}_waiters")
            results = run(conn, lines, args.rounds, args.calls)
            listening = _listeners(conn, dsn, lines[0], args.rounds, args.calls, args.listeners)
    finally:
        locker.close()
        migrate.downgrade(locker.engine, table, None)
        if server is not None:
            server.cleanup()
    print(
        f"queue operations, one at a time on one connection: lines of {', '.join(f'{s:,}' for s in sizes)} waiters; "
        f"{args.rounds} rounds x {args.calls} calls; PostgreSQL {version}, {os.cpu_count()} CPUs; "
        f"{time.monotonic() - started:.0f} s"
    )
    first = sizes[0]
    head = f"| operation | {' | '.join(f'{s:,}: us (x{first}) / buffers' for s in sizes)} |"
    print(head)
    print("|---|" + "---:|" * len(sizes))
    for op in OPS:
        cells = []
        for s in sizes:
            r, base = results[(op, s)], results[(op, first)]
            cells.append(f"{r['us']:.0f} ({r['us'] / base['us']:.2f}x) / {r['buffers']:.0f}")
        print(f"| {op} | {' | '.join(cells)} |")
    if listening:
        alone, crowd = listening
        print(
            f"hand-off on the line of {first:,} with {args.listeners} other sessions LISTENing (other channels): "
            f"{crowd:.0f} us against {alone:.0f} us with none ({crowd / alone:.2f}x; "
            f"{(crowd - alone) / args.listeners:.1f} us per listening session)"
        )
    print(json.dumps({f"{op} {s}": results[(op, s)] for op in OPS for s in sizes}), file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
