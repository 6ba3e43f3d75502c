"""Several names at once, and leader election: their costs against the plain lock's, in one run.

    python benchmarks/coordination.py [--url postgresql://... | --url sqlite:///path/to/file.db]
        [--sizes 2,5,20] [--pairs 300] [--rounds 7] [--handovers 50] [--block 10] [--settle 0.1]
        [--observations 40] [--interval 0.5]

With no --url (and no DBLOCK_TEST_URL) it starts a throwaway PostgreSQL with
pgserver (pip install -e '.[test]'). Every part uses one table made with
``Locker(url, table=...).create_schema()``, dropped at the end.

1. Several names at once, one thread, free names: for each N in ``--sizes``,
   median microseconds over ``--rounds`` interleaved rounds (benchmarks/_timing.py)
   of ``acquire_all(names)`` + ``group.release()``, of ``try_acquire_all(names)``
   + ``group.release()``, and of the baseline, N ``try_acquire(name)`` +
   ``release()`` pairs in a loop on the same N names. Also N waiting
   ``acquire(name)`` + ``release()`` pairs: ``acquire_all`` sends a waiting
   acquire's statement for each name (on PostgreSQL the fair queue's, not
   ``try_acquire``'s), so this tells what the group adds from what the waiting
   statement costs. Each round makes about ``--pairs`` name grants per
   variant (``--pairs // N`` groups). Also the texts each variant sends per
   group, counted by wrapping the Locker's ``backend.execute`` in a pass of
   its own (not timed): a text is one round trip, however many SQL
   statements it holds.
2. Election hand-over after a resign: two candidates, each in a process of its
   own (this file with ``--candidate``), take turns. The leader resigns while
   the other has been campaigning (waiting) for ``--settle`` s; the time from
   the start of the ``resign()`` call to the return of the other's
   ``campaign()`` (CLOCK_MONOTONIC, which the processes of one machine share).
   The baseline is the same pattern with a plain lock: ``acquire(name)`` and
   ``lease.release()``. Blocks of ``--block`` hand-overs alternate between the
   two until each has ``--handovers``. Also: the ``resign``/``release`` call
   itself, and the texts the new holder sent from the start of its wait to its
   grant. A campaign is a waiting acquire plus one statement (``relabel``:
   the leader's value, and the notification watchers hear).
3. How soon ``observe()`` hears a new leader: an observer thread (a Locker of
   its own) follows an election while the main thread campaigns with nobody in
   line, ``--observations`` times, each after a random pause; the time from
   ``campaign()`` returning to the observer's yield of the new term. The
   observer listens for the leaders' notifications (PostgreSQL; a Locker with
   ``notify=True``, the default) or only looks every ``--interval`` s (a Locker
   with ``notify=False``; every backend without NOTIFY). The two observers'
   trials alternate. On PostgreSQL a third row is the floor: a raw psycopg
   connection LISTENing on the same election's channel, with no dblock in the
   way, timed in the NOTIFY observer's trials. A notification may arrive
   before the campaigner has read its own reply, so a time can be below zero.

The texts counted are those sent through ``backend.execute``: the LISTEN
connections' own statements and the notifications they receive are not.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ELECTION, LOCK = "election", "lock"
NAMES = {ELECTION: "elected", LOCK: "locked"}  # the hand-over's names (an election's name is no plain lock)


# -- counting the texts a Locker sends ------------------------------------------------
class Counts:
    """Texts sent through one backend's ``execute``, by statement (the field of ``backend.sql`` or
    ``backend.queue`` whose text it is; "other" for any other)."""

    def __init__(self) -> None:
        self.by_kind: dict[str, int] = {}
        self._lock = threading.Lock()

    def wrap(self, backend: Any) -> None:
        execute = backend.execute
        kinds: dict[str, str] = {}
        sources = [backend.sql] + ([backend.queue] if backend.caps.fair_queue else [])
        for source in sources:
            for field in dataclasses.fields(source):
                text = getattr(source, field.name)
                if isinstance(text, str):
                    kinds.setdefault(text, field.name)

        def counted(cursor: Any, text: str, params: dict[str, Any]) -> Any:
            kind = kinds.get(text, "other")
            with self._lock:
                self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
            return execute(cursor, text, params)

        backend.execute = counted

    def reset(self) -> None:
        with self._lock:
            self.by_kind = {}

    def total(self) -> int:
        with self._lock:
            return sum(self.by_kind.values())

    def kinds(self) -> str:
        """"enqueue:1,relabel:1" ("-" if none)."""
        with self._lock:
            return ",".join(f"{kind}:{n}" for kind, n in sorted(self.by_kind.items())) or "-"

    def described(self, per: int) -> str:
        """"3 enqueue + 3 release" per call, over ``per`` calls."""
        with self._lock:
            return " + ".join(f"{n / per:g} {kind}" for kind, n in sorted(self.by_kind.items()))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


# -- 1. several names at once -------------------------------------------------------------
def several(args: argparse.Namespace, locker: Any) -> None:
    from _timing import interleaved  # benchmarks/_timing.py

    counts = Counts()
    print(f"\n1. several names at once, one thread, free names: median of {args.rounds} interleaved rounds, "
          f"about {args.pairs} grants per variant per round")
    print(f"{'N':>3} {'acquire_all us':>14} {'try_acquire_all us':>18} {'N singles us':>12} "
          f"{'acquire_all/singles':>19} {'try_all/singles':>15} {'N waiting us':>12} {'acquire_all/waiting':>19} "
          f"{'texts acquire_all':>17} {'texts try_all':>13} {'texts singles':>13}")
    details: list[str] = []
    for n in args.sizes:
        names = [f"n{n}-{i:02d}" for i in range(n)]

        def group() -> None:
            locker.acquire_all(names, ttl=30, timeout=5).release()

        def tried() -> None:
            held = locker.try_acquire_all(names, ttl=30)
            assert held is not None, "a name of the group is held"
            held.release()

        def singles() -> None:
            for name in names:
                lease = locker.try_acquire(name, ttl=30)
                assert lease is not None, "a name is held"
                lease.release()

        def waiting() -> None:
            for name in names:
                locker.acquire(name, ttl=30, timeout=5).release()

        variants: dict[str, Callable[[], None]] = {
            "acquire_all": group, "try_acquire_all": tried, "singles": singles, "waiting singles": waiting,
        }
        calls = max(1, args.pairs // n)
        medians = interleaved(variants, args.rounds, calls, warmup=max(2, 20 // n))
        sent: dict[str, float] = {}
        counts.wrap(locker.backend)
        try:
            for label, fn in variants.items():
                counts.reset()
                for _ in range(5):
                    fn()
                sent[label] = counts.total() / 5
                details.append(f"N={n} {label}: {counts.described(5)}")
        finally:
            del locker.backend.execute  # the class's own again
        base = medians["singles"]
        print(f"{n:3d} {medians['acquire_all']:14.1f} {medians['try_acquire_all']:18.1f} {base:12.1f} "
              f"{medians['acquire_all'] / base:18.2f}x {medians['try_acquire_all'] / base:14.2f}x "
              f"{medians['waiting singles']:12.1f} {medians['acquire_all'] / medians['waiting singles']:18.2f}x "
              f"{sent['acquire_all']:17g} {sent['try_acquire_all']:13g} {sent['singles']:13g}")
    print("texts per group, by statement:")
    for line in details:
        print("  " + line)


# -- 2. hand-over after a resign ------------------------------------------------------------
def candidate(args: argparse.Namespace) -> None:
    """The other process: on "campaign MODE", campaign (or acquire) and print "lead <monotonic time
    granted> <texts sent> <kind:count,...>"; on "resign MODE", resign (or release) and print
    "resigned <start> <end>"."""
    from dblock import Locker

    locker = Locker(args.url, table=args.table)
    warm = f"warm{args.proc}"
    locker.acquire(warm, ttl=5, timeout=30).release()  # prepares the statements
    locker.election(warm + "-election").campaign(ttl=5, timeout=30).resign()
    elections = {ELECTION: locker.election(NAMES[ELECTION])}
    counts = Counts()
    counts.wrap(locker.backend)
    held: Any = None
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "campaign":
            counts.reset()
            if command[1] == ELECTION:
                held = elections[ELECTION].campaign(value=f"candidate {args.proc}", ttl=30, timeout=30)
            else:
                held = locker.acquire(NAMES[LOCK], ttl=30, timeout=30)
            got = time.monotonic()
            print(f"lead {got!r} {counts.total()} {counts.kinds()}", flush=True)
        elif command[0] == "resign":
            began = time.monotonic()
            ended = held.resign() if command[1] == ELECTION else held.release()
            done = time.monotonic()
            assert ended, "the term had ended before its resign"
            held = None
            print(f"resigned {began!r} {done!r}", flush=True)
    locker.close()


class Candidate:
    """A candidate process, driven line by line."""

    def __init__(self, args: argparse.Namespace, table: str, proc: int) -> None:
        cmd = [sys.executable, __file__, "--candidate", "--url", args.url, "--table", table, "--proc", str(proc)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout

    def ready(self) -> None:
        if self.stdout.readline() != "ready\n":
            raise SystemExit("a candidate process failed to start")

    def send(self, *words: str) -> None:
        self.stdin.write(" ".join(words) + "\n")
        self.stdin.flush()

    def read(self, word: str) -> list[str]:
        line = self.stdout.readline().split()
        if not line or line[0] != word:
            raise SystemExit(f"a candidate process answered {line!r}, not {word!r}")
        return line[1:]

    def close(self) -> None:
        self.stdin.close()
        if self.proc.wait(30):
            raise SystemExit("a candidate process failed")


# Per variant: hand-over ms, resign call ms, texts per grant, texts by statement (summed).
Turns = tuple[list[float], list[float], list[float], dict[str, int]]


def block(pair: list[Candidate], mode: str, count: int, settle: float, out: Turns) -> None:
    """``count`` hand-overs between the two candidates, in ``mode``."""
    handover, resign, texts, kinds = out
    leader, other = pair
    leader.send("campaign", mode)
    leader.read("lead")
    other.send("campaign", mode)
    time.sleep(settle)  # the other is waiting by now
    for i in range(count):
        leader.send("resign", mode)
        began, done = map(float, leader.read("resigned"))
        got, sent, by_kind = other.read("lead")
        handover.append((float(got) - began) * 1000)
        resign.append((done - began) * 1000)
        texts.append(float(sent))
        for kind, n in (item.split(":") for item in by_kind.split(",") if item != "-"):
            kinds[kind] = kinds.get(kind, 0) + int(n)
        if i < count - 1:
            leader.send("campaign", mode)
            time.sleep(settle)
        leader, other = other, leader
    leader.send("resign", mode)  # nobody in line
    leader.read("resigned")


def handovers(args: argparse.Namespace, table: str) -> None:
    pair = [Candidate(args, table, p) for p in (0, 1)]
    try:
        for c in pair:
            c.ready()
        results: dict[str, Turns] = {mode: ([], [], [], {}) for mode in (ELECTION, LOCK)}
        r = 0
        while any(len(results[mode][0]) < args.handovers for mode in results):
            modes = [LOCK, ELECTION] if r % 2 else [ELECTION, LOCK]
            for mode in modes:
                left = args.handovers - len(results[mode][0])
                if left > 0:
                    block(pair, mode, min(args.block, left), args.settle, results[mode])
            r += 1
    finally:
        for c in pair:
            c.close()
    print(f"\n2. hand-over after a resign: two candidate processes take turns, {args.handovers} hand-overs each, "
          f"in blocks of {args.block}; the other has waited {args.settle:g} s")
    print(f"{'variant':37} {'p50 ms':>7} {'p90 ms':>7} {'max ms':>7} {'resign p50 ms':>13} {'texts/grant':>11} "
          f"{'p50 vs lock':>11}")
    base = statistics.median(results[LOCK][0])
    labels = {LOCK: "lock: release -> acquire returns", ELECTION: "election: resign -> campaign returns"}
    for mode in (LOCK, ELECTION):
        gaps, calls, texts, _ = results[mode]
        p50 = statistics.median(gaps)
        print(f"{labels[mode]:37} {p50:7.2f} {pct(gaps, 0.9):7.2f} {max(gaps):7.2f} {statistics.median(calls):13.2f} "
              f"{statistics.mean(texts):11.2f} {p50 / base:10.2f}x")
    for mode in (LOCK, ELECTION):
        kinds, grants = results[mode][3], len(results[mode][0])
        print(f"  texts per grant, {mode}: " + " + ".join(f"{n / grants:g} {k}" for k, n in sorted(kinds.items())))


# -- 3. observe ----------------------------------------------------------------------------
HEAR_WITHIN = 30.0  # seconds an observer has to hear a term before the run fails (a loaded machine is slow)

class Hearing:
    """A thread that hears an election's terms: when it heard each (None: nobody leading)."""

    interval = 0.5

    def __init__(self) -> None:
        self.heard: dict[int | None, float] = {}
        self.changed = threading.Condition()
        self.stop = False
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self.guarded, daemon=True)

    def guarded(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # reported by wait()
            self.failed = exc
            with self.changed:
                self.changed.notify_all()

    def run(self) -> None:
        raise NotImplementedError

    def record(self, term: int | None) -> None:
        at = time.monotonic()
        with self.changed:
            self.heard.setdefault(term, at)
            self.changed.notify_all()

    def wait(self, term: int | None, timeout: float) -> float:
        """When ``term`` was heard, waiting up to ``timeout`` s."""
        with self.changed:
            if not self.changed.wait_for(lambda: term in self.heard or self.failed is not None, timeout):
                raise SystemExit(f"{self!r} did not hear term {term} within {timeout:g} s (heard: {self.heard})")
        if self.failed is not None:
            raise SystemExit(f"{type(self).__name__} failed: {self.failed!r}")
        return self.heard[term]

    def close(self, campaigner: Any) -> None:
        self.stop = True
        self.thread.join(self.interval * 3 + 5)

    def __repr__(self) -> str:
        return type(self).__name__


class Observer(Hearing):
    """``observe()`` on a Locker of its own (``notify``: listening for the leaders, or only looking)."""

    def __init__(self, url: str, table: str, name: str, notify: bool, interval: float) -> None:
        from dblock import Locker

        super().__init__()
        self.locker = Locker(url, table=table, notify=notify)
        self.notify = notify
        self.election = self.locker.election(name)
        self.interval = interval
        self.thread.start()

    def __repr__(self) -> str:
        return f"Observer({'NOTIFY' if self.notify else 'polling'})"

    def run(self) -> None:
        watching = self.election.observe(interval=self.interval)
        try:
            for leader in watching:
                self.record(None if leader is None else leader.term)
                if self.stop:
                    break
        finally:
            getattr(watching, "close")()  # a generator (typed an Iterator): closes its LISTEN connection

    def close(self, campaigner: Any) -> None:
        self.stop = True
        if self.failed is None and self.thread.is_alive():
            # Something to yield, so that it sees stop (unless it saw it after its last yield and ended).
            leadership = campaigner.campaign(ttl=30, timeout=5)
            try:
                self.thread.join(HEAR_WITHIN)
            finally:
                leadership.resign()
        super().close(campaigner)
        self.locker.close()


class Listener(Hearing):
    """The reference on PostgreSQL: a raw psycopg connection LISTENing on the election's channel
    (no dblock in the way), recording each notification as it arrives."""

    def __init__(self, url: str, channel: str) -> None:
        import psycopg
        from sqlalchemy.engine import make_url

        super().__init__()
        dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute(f"LISTEN {channel}")  # a plain identifier (dblock._core.election_channel)
        self.thread.start()

    def run(self) -> None:
        while not self.stop:
            for note in self.conn.notifies(timeout=0.2):
                self.record(int(note.payload.split(" ", 1)[0]))  # "token acquired_at label"

    def close(self, campaigner: Any) -> None:
        super().close(campaigner)
        self.conn.close()


def observing(args: argparse.Namespace, locker: Any, table: str) -> None:
    from dblock import _core

    modes = [("observe(), polling only (notify=False)", False)]
    if locker.backend.caps.notify:
        modes.insert(0, ("observe(), NOTIFY (the default)", True))
    hearings: dict[str, Hearing] = {
        label: Observer(args.url, table, f"observed-{i}", notify, args.interval)
        for i, (label, notify) in enumerate(modes)
    }
    campaigners = {label: locker.election(f"observed-{i}") for i, (label, _) in enumerate(modes)}
    raw = "raw LISTEN on the channel (psycopg)"
    if locker.backend.caps.notify:  # hears the NOTIFY observer's election too, in its trials
        hearings[raw] = Listener(args.url, _core.election_channel(table, None, "observed-0"))
        campaigners[raw] = campaigners[modes[0][0]]
    heard: dict[str, list[float]] = {label: [] for label in hearings}
    try:
        for label, _ in modes:
            hearings[label].wait(None, HEAR_WITHIN)  # the first look: nobody leads
        for k in range(args.observations):
            for label, _ in (modes if k % 2 == 0 else list(reversed(modes))):
                time.sleep(random.uniform(0, args.interval))  # anywhere in the observer's polling cycle
                leadership = campaigners[label].campaign(value="bench", ttl=30, timeout=5)
                returned = time.monotonic()
                heard[label].append((hearings[label].wait(leadership.term, HEAR_WITHIN) - returned) * 1000)
                if label == modes[0][0] and raw in hearings:
                    heard[raw].append((hearings[raw].wait(leadership.term, HEAR_WITHIN) - returned) * 1000)
                leadership.resign()
    finally:
        for label, hearing in hearings.items():
            hearing.close(campaigners[label])
    print(f"\n3. a new leader heard: ms from campaign() returning to the observer's yield, "
          f"{args.observations} terms each, nobody else in line, interval {args.interval:g} s")
    print(f"{'observer':40} {'p50 ms':>8} {'p90 ms':>8} {'min ms':>8} {'max ms':>8} {'p50 vs polling':>14}")
    base = statistics.median(heard[modes[-1][0]])
    for label in [raw, *(label for label, _ in modes)]:
        if label not in heard:
            continue
        values = heard[label]
        p50 = statistics.median(values)
        ratio = f"{'-':>14}" if label == raw else f"{p50 / base:13.3f}x"
        print(f"{label:40} {p50:8.2f} {pct(values, 0.9):8.2f} {min(values):8.2f} {max(values):8.2f} {ratio}")


# -- the driver -------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("DBLOCK_TEST_URL"))
    ap.add_argument("--sizes", default="2,5,20", help="names per group, comma-separated")
    ap.add_argument("--pairs", type=int, default=300, help="name grants per variant per round (--pairs // N groups)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--handovers", type=int, default=50, help="hand-overs per variant")
    ap.add_argument("--block", type=int, default=10, help="hand-overs per block (the variants' blocks alternate)")
    ap.add_argument("--settle", type=float, default=0.1, help="seconds the next candidate waits before each resign")
    ap.add_argument("--observations", type=int, default=40, help="terms heard per observer")
    ap.add_argument("--interval", type=float, default=0.5, help="observe()'s interval (the Locker's poll_max default)")
    ap.add_argument("--candidate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--table", help=argparse.SUPPRESS)
    ap.add_argument("--proc", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.candidate:
        candidate(args)
        return
    args.sizes = [int(n) for n in args.sizes.split(",") if n.strip()]

    from dblock import Locker, migrate

    server = None
    if not args.url:
        import pgserver

        server = pgserver.get_server(tempfile.mkdtemp(prefix="dblock-bench-"), cleanup_mode="delete")
        args.url = server.get_uri()
    table = "bench_" + secrets.token_hex(4)
    locker = Locker(args.url, table=table)
    locker.create_schema()
    try:
        backend = locker.backend
        with locker.engine.connect() as conn:
            version = conn.dialect.server_version_info
        where = ".".join(str(v) for v in version or ())
        print(f"{backend.title} {where}{' (throwaway server)' if server else ''}, {os.cpu_count()} CPUs, "
              f"table {table}; fair queue {'on' if backend.caps.fair_queue else 'off'}, "
              f"NOTIFY {'on' if backend.caps.notify else 'none'}")
        several(args, locker)
        handovers(args, table)
        observing(args, locker, table)
    finally:
        locker.close()
        migrate.downgrade(locker.engine, table, None)
        if server is not None:
            server.cleanup()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
