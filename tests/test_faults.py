"""Faults injected for real: a silent endpoint, a frozen server, restarts, a pool under load.

Each test bounds a call's time only by its documented limit (docs/failures.md):
acquire within timeout + 2.5 s, any other call within
op_timeout + 0.25 s (connecting counts whole seconds, at least 2), plus slack
for a loaded machine. Nothing here asserts a speed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
from sqlalchemy.engine import make_url

import dblock
from dblock import DatabaseUnavailable, Locker

from .conftest import Db, wait_for

HERE = Path(__file__).parent
SLACK = 3.0  # a loaded 2-core machine's scheduling, process start-up excluded


class SilentServer:
    """Accepts TCP connections and never says a word, like a black-holed or wedged database."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)  # held open, never read or answered

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://nobody:secret@127.0.0.1:{self.port}/nothing"

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def timed(call: Any) -> tuple[float, BaseException | None, Any]:
    started = time.monotonic()
    try:
        value = call()
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return time.monotonic() - started, exc, None
    return time.monotonic() - started, None, value


# -- a silent endpoint ---------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"notify": False}, {"fair": False}], ids=["fair", "fair-poll", "line"])
def test_acquire_against_a_silent_server_raises_within_its_timeout(silent: SilentServer, options: dict) -> None:
    locker = Locker(silent.url, **options)
    took, exc, _ = timed(lambda: locker.acquire("x", timeout=2))
    assert isinstance(exc, DatabaseUnavailable), exc
    assert took <= 2 + 2.5 + SLACK, f"acquire(timeout=2) took {took:.1f} s against a silent server"
    assert "secret" not in str(exc)
    locker.close()


def test_every_other_call_against_a_silent_server_raises_within_op_timeout(silent: SilentServer) -> None:
    locker = Locker(silent.url, op_timeout=2)
    for call in (lambda: locker.try_acquire("x"), locker.leases, lambda: locker.prune(60)):
        took, exc, _ = timed(call)
        assert isinstance(exc, DatabaseUnavailable), exc
        assert took <= 2 + SLACK, f"a call took {took:.1f} s against a silent server (op_timeout=2)"
    locker.close()


def test_a_connect_keeps_to_an_op_timeout_of_a_fraction_of_seconds(silent: SilentServer) -> None:
    """libpq counts a connect's time in whole seconds: 3.5 s of op_timeout gives the connect
    3 s, not 4, so the call ends within op_timeout + 0.25 s (rounded up it took 4.0 s)."""
    locker = Locker(silent.url, op_timeout=3.5)
    took, exc, _ = timed(lambda: locker.try_acquire("x"))
    assert isinstance(exc, DatabaseUnavailable), exc
    assert took <= 3.5 + 0.25, f"try_acquire took {took:.2f} s against a silent server (op_timeout=3.5)"
    locker.close()


def test_dblock_run_against_a_silent_server_exits_within_its_wait(silent: SilentServer) -> None:
    env = {**os.environ, "DBLOCK_URL": silent.url}
    # `python -m dblock`, timed from once its modules are imported: the bound is the command's,
    # and an interpreter's start-up takes seconds of its own on a busy machine.
    timed = (
        "import atexit, runpy, sys, time; import dblock.cli; start = time.monotonic(); "
        "atexit.register(lambda: print(f'took {time.monotonic() - start:.3f}', file=sys.stderr)); "
        "sys.argv[0] = 'dblock'; runpy.run_module('dblock', run_name='__main__', alter_sys=True)"
    )
    out = subprocess.run(
        [sys.executable, "-c", timed, "run", "job", "--wait", "2", "--", "true"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 69, out.stderr
    took = float(out.stderr.rsplit("took ", 1)[1])
    assert took <= 2 + 2.5 + SLACK, f"dblock run --wait 2 took {took:.1f} s"


# -- a frozen server (SIGSTOP) -------------------------------------------------------


def _server_processes(pgdata: Path) -> list[int]:
    """The postmaster and every process it started (backends, checkpointer, ...)."""
    postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == postmaster:
            children.append(int(stat.parent.name))
    return [postmaster, *children]


@contextmanager
def frozen(pg_server: Any) -> Iterator[None]:
    pids = _server_processes(Path(pg_server.pgdata))
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_a_frozen_server_bounds_every_call_and_leaks_no_lease(pg: Db, pg_server: Any) -> None:
    """SIGSTOP the whole server: calls return in time; what a cut-off call granted is ended after."""
    locker = pg.locker(op_timeout=1)
    locker.try_acquire("warm").release()  # a pooled connection whose backend will freeze
    reading = locker.upgradeable("reads").acquire(ttl=60)
    writing = locker.upgradeable("writes").acquire(ttl=4).upgrade(timeout=5)  # a short ttl: see below
    with frozen(pg_server):
        took, exc, _ = timed(lambda: locker.try_acquire("frozen", ttl=60))
        assert isinstance(exc, DatabaseUnavailable), exc
        assert took <= 2 + SLACK, f"try_acquire took {took:.1f} s on a frozen server (op_timeout=1)"
        took, exc, _ = timed(lambda: locker.acquire("frozen", ttl=60, timeout=2))
        assert isinstance(exc, DatabaseUnavailable), exc
        assert took <= 2 + 2.5 + SLACK, f"acquire(timeout=2) took {took:.1f} s on a frozen server"
        # An upgrade waits as an acquire does, then withdraws its ask (a statement: op_timeout).
        took, exc, _ = timed(lambda: reading.upgrade(timeout=2))
        assert isinstance(exc, DatabaseUnavailable), exc
        assert took <= 2 + 2.5 + 1.25 + SLACK, f"upgrade(timeout=2) took {took:.1f} s on a frozen server"
        took, exc, _ = timed(writing.downgrade)
        assert isinstance(exc, DatabaseUnavailable), exc
        assert took <= 2 + SLACK, f"downgrade took {took:.1f} s on a frozen server (op_timeout=1)"
    # Thawed, the frozen backend runs the acquire it had received: a lease for an owner
    # nobody listens to any more, for 60 s. dblock's clean-up ends it. The reader ends its
    # lease; the downgrade that was cut off may have run, giving a read lease the client
    # never heard of: that one ends at its ttl.
    reading.release()
    writing.release()
    wait_for(lambda: pg.query(f"SELECT count(*) FROM {pg.table} WHERE owner IS NOT NULL AND expires_at > now()") == [(0,)],
             timeout=30, what="the abandoned grants to be ended")
    assert locker.try_acquire("frozen") is not None


# -- restarts ------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["fast", "immediate"])
@pytest.mark.parametrize("options", [{}, {"notify": False}, {"fair": False}], ids=["fair", "fair-poll", "line"])
def test_waits_ride_out_a_restart(pg: Db, pg_server: Any, stop: str, options: dict) -> None:
    """Waiters with time left keep waiting through a restart, and are served after it."""
    from pgserver._commands import pg_ctl

    holder = pg.locker()
    waiter = pg.locker(**options)
    held = holder.try_acquire("r", ttl=2)
    assert held is not None
    results: list[Any] = []

    def wait() -> None:
        try:
            lease = waiter.acquire("r", ttl=30, timeout=25)
            results.append(lease.token)
            lease.release()
        except BaseException as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for t in threads:
        t.start()
    if options.get("fair", True):
        wait_for(lambda: pg.query(f"SELECT waiting FROM {pg.table} WHERE name = 'r'") == [(3,)],
                 what="the waiters to queue")
    pg_ctl(["-m", stop, "-w", "restart"], pgdata=pg_server.pgdata, user=pg_server.system_user)
    for t in threads:
        t.join(timeout=60)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert len(results) == 3 and all(r > held.token for r in results)


# -- the pool ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sqlite"])
def test_sqlite_busy_timeout_is_set_per_call(db: Db) -> None:
    """A short acquire timeout must not stick to the pooled connection: the next call has op_timeout."""
    locker = db.locker()
    assert locker.try_acquire("warm") is not None
    other = sqlite3.connect(make_url(db.url).database, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # the file's one writer
    with pytest.raises(dblock.DBLockError):
        locker.acquire("a", timeout=0.3)  # waits 0.3 s for the writer, then gives up
    threading.Timer(1.5, lambda: other.execute("COMMIT")).start()
    lease = locker.try_acquire("b")  # may wait op_timeout (5 s) for the writer, not 0.3 s
    assert lease is not None
    other.close()


def test_connections_stay_within_max_connections(pg: Db) -> None:
    """Many threads, few connections: statements wait for one of the pool's, and all succeed."""
    locker = pg.locker(max_connections=2, notify=False)
    errors: list[BaseException] = []
    seen: list[int] = []

    def work() -> None:
        try:
            for _ in range(5):
                lease = locker.acquire("pool", ttl=5, timeout=60)
                seen.append(locker.open_connections())
                lease.release()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    assert len(seen) == 100 and max(seen) <= 2


@pytest.mark.slow
def test_200_waiters_in_4_processes_on_a_100_connection_server(pg: Db) -> None:
    """4 processes x 50 threads wait on one name: 0 errors, every lease granted and released,
    never more connections per Locker than max_connections (10) plus its listener."""
    [(limit,)] = pg.query("SHOW max_connections")
    assert int(limit) <= 100, f"the test server allows {limit} connections; the point is a small limit"
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "pool_worker.py"), pg.url, pg.table, f"w{i}", "50", "2"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        for i in range(4)
    ]
    peak: dict[str, int] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for app, count in pg.query(
                "SELECT application_name, count(*) FROM pg_stat_activity GROUP BY application_name"
            ):
                peak[app] = max(peak.get(app, 0), count)
            # Listeners share one application_name with every other dblock's on the server (another
            # test's, or another suite's when the server is shared): these processes' are the
            # sessions their waiters' entries name.
            [(listeners,)] = pg.query(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'dblock listener'"
                f" AND pid IN (SELECT pid FROM {pg.table}_waiters)"
            )
            peak["ours listening"] = max(peak.get("ours listening", 0), listeners)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        sampler.start()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = []
        for p in procs:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0
            reports.append(json.loads(out))
    finally:
        stop.set()
        for p in procs:
            p.kill()
            p.wait()
    sampler.join()
    assert [r["errors"] for r in reports] == [[]] * 4
    assert sum(r["granted"] for r in reports) == 4 * 50 * 2
    assert sum(r["released"] for r in reports) == 4 * 50 * 2
    # The pool's own count, sampled in each process; the server's view of a Locker may briefly
    # show one more while a cut-off statement's session winds down after its connection closed.
    assert all(0 < r["peak"] <= 10 for r in reports), [r["peak"] for r in reports]
    assert 0 < peak["ours listening"] <= 4, peak
    assert sum(peak.get(f"w{i}", 0) for i in range(4)) + peak["ours listening"] < int(limit), peak


def test_a_handed_lease_that_cannot_be_confirmed_is_not_leaked(pg: Db) -> None:
    """A fair waiter handed the lease at the end of its wait must renew it before use (it was
    handed a while ago). When that extend goes unanswered, the wait raises DatabaseUnavailable
    and the lease, ours in the database, is ended in the background, not left until its TTL."""
    t = pg.table
    # The fault: the first extend of the lock row stalls on the server past the call's bound.
    pg.query(f"CREATE SEQUENCE {t}_once")
    pg.query(f"""CREATE FUNCTION {t}_stall() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            -- Nested: a NULL (a release clears owner and expiry) would not stop an AND before nextval.
            IF NEW.owner = OLD.owner AND NEW.expires_at > OLD.expires_at THEN
                IF nextval('{t}_once') = 1 THEN
                    PERFORM pg_sleep(0.8);
                END IF;
            END IF;
            RETURN NEW;
        END $$""")
    pg.query(f"CREATE TRIGGER {t}_stall BEFORE UPDATE ON {t} FOR EACH ROW EXECUTE FUNCTION {t}_stall()")
    holder = pg.locker().try_acquire("job", ttl=60)
    assert holder is not None
    # Polling, and rarely: the waiter looks once, then only at the end of its wait.
    waiter = pg.locker(notify=False, poll_min=60, poll_max=60, op_timeout=0.5)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            waiter.acquire("job", ttl=2, timeout=1.5)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_for(lambda: pg.query(f"SELECT count(*) FROM {t}_waiters")[0][0] == 1, what="the waiter to queue")
    assert holder.release() is True  # handed to the waiter, who is not looking
    thread.join(30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], DatabaseUnavailable), errors
    ((token,),) = pg.query(f"SELECT token FROM {t} WHERE name = 'job'")
    assert token > holder.token  # the release handed it over (to the waiter, who never confirmed it)
    wait_for(lambda: pg.query(f"SELECT owner FROM {t} WHERE name = 'job'") == [(None,)],
             what="the unconfirmed lease to be ended in the background")
