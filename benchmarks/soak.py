"""A soak: many processes on every lock kind for N minutes under a schedule of faults, audited.

    python benchmarks/soak.py [--minutes 1] [--ttl 2] [--fault-every 6] [--seed N] [--keep DIR]
                              [--no-partitions] [--mutant unfenced,overtrust,lost]

It starts its own throwaway PostgreSQL (pgserver's binaries, listening on
127.0.0.1 only) and a real PgBouncer in transaction mode before it, so that it
can restart them, then runs worker processes, each on one kind of lock:

- ``ex``: the exclusive lock (one worker renews its lease and holds past its ttl;
  one goes through PgBouncer with ``prepare=False, notify=False``);
- ``writer`` and ``reader``: the write and read sides of one read/write lock;
- ``sem``: a semaphore of 3;
- ``upg`` and ``upr``: upgradeable readers that upgrade (and sometimes downgrade),
  beside plain readers of the same name;
- ``group``: two of three names at once (``acquire_all``);
- ``elect``: candidates of one election, leading for a while and resigning.

Every holder writes while it holds: a fenced ``UPDATE`` (``fenced_update``) of
its name's row in a table of fenced work for the exclusive kinds, a
``commit_guard``-checked ``UPDATE`` for the shared ones. A trigger on that table
records, in the same transaction as each write, the token and the write's id.

Faults, in shuffled rounds, one every ``--fault-every`` seconds: a PostgreSQL
restart (fast and immediate shutdown), a holder killed (SIGKILL, then started
again), a holder paused (SIGSTOP for longer than the ttl, then SIGCONT), a
PgBouncer restart, and, as root, a partition: the server runs in a network
namespace and some clients in another (``tests/netns.py``), whose veth link is
set down for longer than the ttl (packets dropped, no RST), then up again.
Everything listens on loopback or on addresses inside those namespaces only.

The audit, at the end:

- overlaps: on every name, the intervals in which each holder trusted its lease
  (from the moment a call returned it to the first of its release and the end of
  its trust, ``remaining()``, read on the machine's one monotonic clock) never
  put two writers together, a writer with a reader, two upgradeable readers
  together, or more than 3 holders in the semaphore;
- token order: on every fenced row, the trigger's records in commit order have
  tokens that never go down (no write from a stale token after a newer one);
- exact counts: every write a client was told committed is in the trigger's
  records, once; no write id is recorded twice; each row's counter equals its
  number of records;
- bounds: every dblock call returned or raised within its documented bound
  (docs/failures.md), except while its process was paused; and raised nothing
  but dblock's own errors.

It prints a table (faults by kind, grants by kind, refused stale writes, calls
over their bound) and exits 1 on any violation, listing each. Everything it
starts (server, pooler, workers) is stopped on every path.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCHEMA = "soak"
TABLE = "locks"
SEM_LIMIT = 3
GROUP_NAMES = ["g1", "g2", "g3"]
# Rows of fenced work: the fenced (token-ordered) ones, and the shared ones (checked with commit_guard).
FENCED_ROWS = ["ex", "rw", "up", "el", *GROUP_NAMES]
SHARED_ROWS = ["rw.r", "sem", "up.r"]
OP_TIMEOUT = 5.0  # the workers' Lockers' op_timeout (dblock's default)
WAIT = 8.0  # the timeout of their waiting calls
UPGRADE_WAIT = 3.0

# (role, how many, options): every worker process runs one role.
WORKERS: list[tuple[str, int, dict[str, Any]]] = [
    ("ex", 1, {}),
    ("ex", 1, {"renew": True}),
    ("ex", 1, {"bouncer": True}),
    ("writer", 1, {}),
    ("reader", 1, {}),
    ("reader", 1, {"bouncer": True}),
    ("sem", 3, {}),
    ("sem", 1, {"bouncer": True}),
    ("upg", 2, {}),
    ("upr", 1, {}),
    ("group", 2, {}),
    ("elect", 2, {}),
    # Clients in a network namespace of their own, cut off from the server by the partitions.
    ("ex", 1, {"net": True}),
    ("sem", 1, {"net": True}),
    ("elect", 1, {"net": True}),
]


def mono() -> float:
    # CLOCK_MONOTONIC is one clock for every process of the machine: intervals logged by
    # different workers compare directly.
    return time.monotonic()


# =====================================================================================
# The worker: one process, one role, until its deadline.
# =====================================================================================
class Log:
    """A worker's events, one JSON object a line, flushed at once (the page cache outlives a SIGKILL)."""

    def __init__(self, path: str) -> None:
        self.f = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def __call__(self, **event: Any) -> None:
        self.f.write(json.dumps(event, separators=(",", ":")) + "\n")
        self.f.flush()


def work_table() -> Any:
    from sqlalchemy import BigInteger, Column, MetaData, Table, Text

    return Table(
        "work",
        MetaData(schema=SCHEMA),
        Column("name", Text, primary_key=True),
        Column("n", BigInteger, nullable=False),
        Column("fence_token", BigInteger, nullable=False),
        Column("write_id", Text),
    )


class Worker:
    def __init__(self, role: str, wid: str, url: str, log: str, options: dict[str, Any]) -> None:
        import dblock
        from sqlalchemy import create_engine

        self.dblock = dblock
        self.role, self.wid, self.options = role, wid, options
        self.until = math.inf  # set by the go file
        self.log = Log(log)
        self.ttl = float(options["ttl"])
        self.rnd = random.Random(options.get("seed", 0) * 1000 + os.getpid())
        behind = bool(options.get("bouncer"))
        pooled = {"prepare": False, "notify": False} if behind else {}
        self.locker = dblock.Locker(
            url, schema=SCHEMA, table=TABLE, op_timeout=OP_TIMEOUT, max_connections=4, label=f"soak-{wid}", **pooled
        )
        connect_args: dict[str, Any] = {
            "connect_timeout": 3,
            "keepalives": 1, "keepalives_idle": 2, "keepalives_interval": 1, "keepalives_count": 3,
            "tcp_user_timeout": 5000,
            "options": "-c statement_timeout=5000",
        }
        if behind:
            connect_args["prepare_threshold"] = None
            del connect_args["options"]  # PgBouncer refuses startup options it does not know
        self.engine = create_engine(url, connect_args=connect_args, pool_pre_ping=False, pool_size=2)
        self.work = work_table()
        self.seq = 0

    # -- a timed dblock call ------------------------------------------------------------
    def call(self, op: str, bound: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = mono()
        out = "ok"
        try:
            return fn(*args, **kwargs)
        except self.dblock.DBLockError as exc:
            out = type(exc).__name__
            raise
        except BaseException as exc:
            out = "!" + type(exc).__name__ + ": " + str(exc)[:300]
            raise
        finally:
            self.log(e="call", op=op, t0=t0, t1=mono(), bound=bound, out=out)

    def bound_op(self) -> float:
        return OP_TIMEOUT + 0.25

    def bound_wait(self) -> float:
        return WAIT + 2.5

    # -- holds and writes ---------------------------------------------------------------
    def hold(self, name: str, role: str, token: int, remaining: float) -> None:
        now = mono()
        if "overtrust" in self.options.get("mutant", ()):
            remaining += self.ttl
        self.log(e="hold", name=name, role=role, token=token, t0=now, until=now + remaining)

    def trust(self, name: str, token: int, remaining: float) -> bool:
        """Log how long the lease is trusted from now; False once it is not."""
        if "overtrust" in self.options.get("mutant", ()):
            remaining += self.ttl  # believes the lease lasts a ttl longer than it does
        if remaining <= 0:
            return False
        self.log(e="until", name=name, token=token, until=mono() + remaining)
        return True

    def end(self, name: str, token: int) -> None:
        self.log(e="end", name=name, token=token, t=mono())

    def write_id(self) -> str:
        self.seq += 1
        return f"{self.wid}.{os.getpid()}.{self.seq}"

    def fenced_write(self, name: str, lease: Any) -> None:
        from sqlalchemy import update
        from sqlalchemy.exc import SQLAlchemyError

        w = self.work
        wid = self.write_id()
        stmt = update(w).where(w.c.name == name).values(n=w.c.n + 1, write_id=wid)
        token = lease if isinstance(lease, int) else lease.token
        mutant = self.options.get("mutant", ())
        try:
            if "lost" in mutant and (self.seq == 1 or self.rnd.random() < 0.2):
                with self.engine.connect() as conn:
                    self.dblock.fenced_update(conn, stmt, lease)
                    conn.rollback()  # and then says it committed
            else:
                with self.engine.begin() as conn:
                    if "unfenced" in mutant:  # stamps the token, checks nothing
                        conn.execute(stmt.values(fence_token=token))
                    else:
                        self.dblock.fenced_update(conn, stmt, lease)
        except self.dblock.FencedOut:
            self.log(e="refused", name=name, token=token, fenced=True)
            return
        except (SQLAlchemyError, self.dblock.DBLockError) as exc:
            self.log(e="writefail", name=name, err=type(exc).__name__)
            return
        self.log(e="wrote", name=name, wid=wid, token=token)

    def guarded_write(self, row: str, lease: Any) -> None:
        from sqlalchemy import update
        from sqlalchemy.exc import SQLAlchemyError

        w = self.work
        wid = self.write_id()
        stmt = update(w).where(w.c.name == row).values(n=w.c.n + 1, write_id=wid, fence_token=lease.token)
        try:
            with self.engine.connect() as conn, self.dblock.commit_guard(conn, lease):
                conn.execute(stmt)
        except self.dblock.LeaseLost:
            self.log(e="refused", name=row, token=lease.token, fenced=False)
            return
        except (SQLAlchemyError, self.dblock.DBLockError) as exc:
            self.log(e="writefail", name=row, err=type(exc).__name__)
            return
        self.log(e="wrote", name=row, wid=wid, token=lease.token)

    def pause(self, most: float) -> None:
        time.sleep(self.rnd.uniform(0, most))

    def release(self, lease: Any, count: int = 1) -> None:
        try:
            # A group's release is one release per lease, one after the other.
            self.call("release", count * self.bound_op(), lease.release)
        except self.dblock.DBLockError:
            pass

    # -- the roles ----------------------------------------------------------------------
    def run(self) -> None:
        step = getattr(self, "role_" + self.role)
        while mono() < self.until:
            try:
                step()
            except self.dblock.DBLockError:
                time.sleep(0.05)  # counted in the call's record; an outage: try again
            self.pause(0.1 * self.ttl)
        self.locker.close()
        self.engine.dispose()
        self.log(e="done", t=mono())

    def writes(self, name: str, lease: Any, remaining: Callable[[], float], write: Callable[[], None], most: float) -> None:
        """Write while the lease is trusted: 1 to 3 writes over up to ``most`` seconds."""
        for _ in range(self.rnd.randint(1, 3)):
            if not self.trust(name, lease.token if not isinstance(lease, int) else lease, remaining()):
                return
            if self.options.get("mutant") and (self.seq == 0 or self.rnd.random() < 0.3):
                time.sleep(1.5 * self.ttl)  # a pause past the ttl, between the check and the write
            write()
            self.pause(most / 3)

    def role_ex(self) -> None:
        renew = bool(self.options.get("renew"))
        lease = self.call("acquire", self.bound_wait(), self.locker.acquire, "ex", ttl=self.ttl, timeout=WAIT, renew=renew)
        self.hold("ex", "w", lease.token, lease.remaining())
        try:
            if renew:  # past its ttl, renewed meanwhile
                stop = mono() + self.rnd.uniform(self.ttl, 2.5 * self.ttl)
                while mono() < stop and self.trust("ex", lease.token, lease.remaining()):
                    self.fenced_write("ex", lease)
                    self.pause(0.3 * self.ttl)
            else:
                self.writes("ex", lease, lease.remaining, lambda: self.fenced_write("ex", lease), 0.4 * self.ttl)
        finally:
            self.end("ex", lease.token)
            self.release(lease)

    def role_writer(self) -> None:
        lease = self.call("acquire", self.bound_wait(), self.locker.acquire, "rw", ttl=self.ttl, timeout=WAIT)
        self.hold("rw", "w", lease.token, lease.remaining())
        try:
            self.writes("rw", lease, lease.remaining, lambda: self.fenced_write("rw", lease), 0.3 * self.ttl)
        finally:
            self.end("rw", lease.token)
            self.release(lease)

    def _reader(self, name: str, row: str) -> None:
        readers = self.locker.readers(name)
        lease = self.call("acquire", self.bound_wait(), readers.acquire, ttl=self.ttl, timeout=WAIT)
        self.hold(name, "r", lease.token, lease.remaining())
        try:
            self.writes(name, lease, lease.remaining, lambda: self.guarded_write(row, lease), 0.4 * self.ttl)
        finally:
            self.end(name, lease.token)
            self.release(lease)

    def role_reader(self) -> None:
        self._reader("rw", "rw.r")

    def role_upr(self) -> None:
        self._reader("up", "up.r")

    def role_sem(self) -> None:
        sem = self.locker.semaphore("sem", SEM_LIMIT)
        lease = self.call("acquire", self.bound_wait(), sem.acquire, ttl=self.ttl, timeout=WAIT)
        self.hold("sem", "s", lease.token, lease.remaining())
        try:
            self.writes("sem", lease, lease.remaining, lambda: self.guarded_write("sem", lease), 0.4 * self.ttl)
        finally:
            self.end("sem", lease.token)
            self.release(lease)

    def role_upg(self) -> None:
        up = self.locker.upgradeable("up")
        lease = self.call("acquire", self.bound_wait(), up.acquire, ttl=self.ttl, timeout=WAIT)
        self.hold("up", "u", lease.token, lease.remaining())
        token = lease.token
        try:
            self.writes("up", lease, lease.remaining, lambda: self.guarded_write("up.r", lease), 0.2 * self.ttl)
            if self.rnd.random() < 0.7 and lease.remaining() > 0:
                bound = UPGRADE_WAIT + 2.5 + self.bound_op()
                try:
                    self.call("upgrade", bound, lease.upgrade, timeout=UPGRADE_WAIT)
                except self.dblock.LockNotAcquired:
                    return
                except self.dblock.DBLockError:
                    if lease.token != token or not lease.shared:  # it may have become the writer
                        self.end("up", token)
                        token = lease.token
                    return
                self.end("up", token)
                token = lease.token
                self.hold("up", "w", token, lease.remaining())
                self.writes("up", lease, lease.remaining, lambda: self.fenced_write("up", lease), 0.2 * self.ttl)
                if self.rnd.random() < 0.4 and lease.remaining() > 0:
                    self.end("up", token)  # it stops writing before the call, trusted as a reader after it
                    self.call("downgrade", self.bound_op(), lease.downgrade)
                    token = lease.token
                    self.hold("up", "u", token, lease.remaining())
                    self.writes("up", lease, lease.remaining, lambda: self.guarded_write("up.r", lease), 0.2 * self.ttl)
        finally:
            self.end("up", token)
            self.release(lease)

    def role_group(self) -> None:
        names = sorted(self.rnd.sample(GROUP_NAMES, 2))
        group = self.call("acquire_all", self.bound_wait(), self.locker.acquire_all, names, ttl=self.ttl, timeout=WAIT)
        tokens = group.tokens
        left = group.remaining()
        for name in names:
            self.hold(name, "w", tokens[name], left)
        try:
            for _ in range(self.rnd.randint(1, 2)):
                left = group.remaining()
                if not all(self.trust(name, tokens[name], left) for name in names):
                    break
                for name in names:
                    self.fenced_write(name, group[name])
                self.pause(0.15 * self.ttl)
        finally:
            for name in names:
                self.end(name, tokens[name])
            self.release(group, len(names))

    def role_elect(self) -> None:
        election = self.locker.election("el")
        # A waiting acquire, then one statement that writes the value and reads when the term began.
        term = self.call("campaign", self.bound_wait() + self.bound_op(), election.campaign, ttl=self.ttl, timeout=WAIT, value=self.wid)
        self.hold("el", "w", term.token, term.remaining())
        try:
            stop = mono() + self.rnd.uniform(0.5 * self.ttl, 2 * self.ttl)
            while mono() < stop and self.trust("el", term.token, term.remaining()):
                self.fenced_write("el", term)
                self.pause(0.3 * self.ttl)
        finally:
            self.end("el", term.token)
            try:
                self.call("resign", self.bound_op(), term.resign)
            except self.dblock.DBLockError:
                pass


def worker_main(argv: list[str]) -> None:
    role, wid, url, log, options = argv
    opts = json.loads(options)
    worker = Worker(role, wid, url, log, opts)
    # Ready: wait for the start, whose file says when to stop (on CLOCK_MONOTONIC, one clock for
    # every process of the machine). On a busy machine starting takes seconds: the run's minutes
    # count from when every worker is ready. A worker started again after a kill goes at once.
    worker.log(e="ready", t=mono())
    go = Path(opts["go"])
    while not go.exists():
        time.sleep(0.05)
    worker.until = json.loads(go.read_text())["until"]
    try:
        worker.run()
    except BaseException:
        worker.log(e="crash", tb=traceback.format_exc()[-2000:])
        raise


# =====================================================================================
# The servers: a throwaway PostgreSQL and a PgBouncer, both restartable.
# =====================================================================================
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Postgres:
    """A throwaway PostgreSQL: pgserver's binaries and initdb, run as pgserver's system user when we are root.

    Without ``net`` it listens on 127.0.0.1. With ``net`` (a ``tests.netns`` pair) it runs
    inside the pair's server namespace, listening on the pair's server address there
    (for clients in the client namespace) and on a Unix socket in a directory of its
    own (for everyone else: a Unix socket is reached from any namespace).
    """

    def __init__(self, net: Any = None) -> None:
        import warnings

        from dblock.pytest_plugin import _system_user_once, memory_dir

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
            import pgserver

        self.net = net
        self.bin = Path(pgserver.__file__).parent / "pginstall" / "bin"
        _system_user_once()
        self.pgdata = Path(tempfile.mkdtemp(prefix="dblock-soak-pg-", dir=memory_dir()))
        started = pgserver.get_server(self.pgdata, cleanup_mode=None)  # initdb, and a socket-only start
        self.drop: list[str] = []
        self.sockets = Path(tempfile.mkdtemp(prefix="dblock-soak-sock-", dir=memory_dir()))
        os.chmod(self.sockets, 0o755)  # PgBouncer's user must reach the socket
        if started.system_user is not None:
            entry = pwd.getpwnam(started.system_user)
            self.drop = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups"]
            os.chown(self.sockets, entry.pw_uid, entry.pw_gid)
        self.ctl(["-w", "-m", "fast", "stop"])  # again on our own terms
        self.port = free_port()
        host = "127.0.0.1" if net is None else net.server_addr
        if net is not None:
            with open(self.pgdata / "pg_hba.conf", "a") as hba:  # the client namespace, over the veth pair
                hba.write(f"host all all {net.client_addr}/32 trust\n")
        options = " ".join(
            [
                f"-h {host}",
                f"-p {self.port}",
                f"-k {self.sockets}",
                "-c max_connections=300",
                "-c fsync=off",  # a crash of the server's processes loses nothing; only a crash of the machine would
                "-c full_page_writes=off",
                "-c max_wal_size=256MB",
                # Connections of clients cut off for good are found and closed.
                "-c tcp_keepalives_idle=5",
                "-c tcp_keepalives_interval=2",
                "-c tcp_keepalives_count=3",
            ]
        )
        self.options = options
        self.start()
        self.url = (
            f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
            if net is None
            else f"postgresql+psycopg://postgres@/postgres?host={self.sockets}&port={self.port}"
        )
        self.tcp_url = f"postgresql+psycopg://postgres@{host}:{self.port}/postgres"
        self.libpq = {"host": "127.0.0.1" if net is None else str(self.sockets), "port": str(self.port)}

    def ctl(self, args: list[str]) -> None:
        command = [*self.drop, str(self.bin / "pg_ctl"), "-D", str(self.pgdata), *args]
        if self.net is not None:  # pg_ctl starts the server as its child: in the namespace it runs in
            command = self.net.argv(self.net.server, command)
        # Into a file, not a pipe: the server pg_ctl starts would hold a pipe open, and us waiting on it.
        with tempfile.TemporaryFile("w+") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=120)
            out.seek(0)
            if done.returncode != 0:
                raise RuntimeError(f"pg_ctl {' '.join(args)} failed: {out.read().strip()}")

    def start(self) -> None:
        self.ctl(["-w", "-t", "60", "-o", self.options, "-l", str(self.pgdata / "soak.log"), "start"])

    def restart(self, mode: str) -> None:
        self.ctl(["-w", "-t", "60", "-m", mode, "-l", str(self.pgdata / "soak.log"), "restart"])

    def stop(self) -> None:
        try:
            self.ctl(["-w", "-m", "immediate", "stop"])
        except Exception:  # noqa: BLE001 - already down: the files go anyway
            pass
        shutil.rmtree(self.pgdata, ignore_errors=True)
        shutil.rmtree(self.sockets, ignore_errors=True)


class Bouncer:
    """A PgBouncer in transaction mode before the server, on a port it keeps across restarts."""

    def __init__(self, server: Postgres) -> None:
        exe = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not os.access(exe, os.X_OK):
            raise SystemExit("pgbouncer not installed: apt-get install pgbouncer")
        self.workdir = Path(tempfile.mkdtemp(prefix="dblock-soak-pgbouncer-"))
        self.user = "nobody" if os.geteuid() == 0 else None  # Debian's pgbouncer refuses root
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.workdir, entry.pw_uid, entry.pw_gid)
        self.port = free_port()
        config = self.workdir / "pgbouncer.ini"
        config.write_text(
            "[databases]\n"
            f"postgres = host={server.libpq['host']} port={server.port} dbname=postgres user=postgres\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = any\n"
            "pool_mode = transaction\n"
            "default_pool_size = 8\n"
            "max_client_conn = 500\n"
            f"logfile = {self.workdir / 'pgbouncer.log'}\n"
            f"pidfile = {self.workdir / 'pgbouncer.pid'}\n"
        )
        self.command = [exe, *(["-u", self.user] if self.user else []), str(config)]
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        import psycopg

        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = mono() + 30
        while True:
            try:
                with psycopg.connect(host="127.0.0.1", port=self.port, dbname="postgres", user="postgres", connect_timeout=3) as c:
                    c.execute("SELECT 1", prepare=False)
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or mono() > deadline:
                    raise RuntimeError("pgbouncer did not start: " + self.tail())
                time.sleep(0.05)

    def tail(self) -> str:
        try:
            return "\n".join((self.workdir / "pgbouncer.log").read_text(errors="replace").splitlines()[-10:])
        except OSError:
            return "(no log)"

    def restart(self) -> None:
        self.stop_process()
        self.start()

    def stop_process(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        self.stop_process()
        shutil.rmtree(self.workdir, ignore_errors=True)


SETUP_SQL = f"""
CREATE TABLE {SCHEMA}.work (
    name text PRIMARY KEY,
    n bigint NOT NULL DEFAULT 0,
    fence_token bigint NOT NULL DEFAULT 0,
    write_id text
);
CREATE TABLE {SCHEMA}.audit (
    id bigserial PRIMARY KEY,
    name text NOT NULL,
    token bigint NOT NULL,
    write_id text,
    n bigint NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    txid bigint NOT NULL DEFAULT txid_current()
);
CREATE FUNCTION {SCHEMA}.record_work() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {SCHEMA}.audit (name, token, write_id, n) VALUES (NEW.name, NEW.fence_token, NEW.write_id, NEW.n);
    RETURN NEW;
END $$;
CREATE TRIGGER record_work AFTER UPDATE ON {SCHEMA}.work FOR EACH ROW EXECUTE FUNCTION {SCHEMA}.record_work();
"""


def setup_schema(url: str) -> None:
    import psycopg

    import dblock

    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {SCHEMA}")
    locker = dblock.Locker(url, schema=SCHEMA, table=TABLE)
    locker.create_schema()
    locker.close()
    locker.engine.dispose()
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(SETUP_SQL)
        for name in FENCED_ROWS + SHARED_ROWS:
            conn.execute(f"INSERT INTO {SCHEMA}.work (name) VALUES (%s)", (name,))


# =====================================================================================
# The run: workers, faults, audit.
# =====================================================================================
class Proc:
    def __init__(self, role: str, index: int, options: dict[str, Any], popen: subprocess.Popen[bytes], log: Path) -> None:
        self.role, self.index, self.options, self.popen, self.log = role, index, options, popen, log
        self.killed = False


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rnd = random.Random(args.seed)
        self.ttl = args.ttl
        self.dir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="dblock-soak-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.faults: Counter[str] = Counter()
        self.fault_log: list[tuple[float, str, str]] = []
        self.stops: dict[int, list[tuple[float, float]]] = defaultdict(list)  # pid -> paused intervals
        self.pending_cont: list[tuple[float, Proc, float]] = []
        self.net: Any = None  # a tests.netns pair, when partitions are on
        self.heal_at: float | None = None
        self.cut_at = 0.0
        self.cuts: list[tuple[float, float]] = []
        self.server: Postgres | None = None
        self.bouncer: Bouncer | None = None
        self.spawned = 0
        self.problems: list[str] = []

    # -- workers ----------------------------------------------------------------------
    def spawn(self, role: str, index: int, options: dict[str, Any]) -> Proc:
        assert self.server is not None and self.bouncer is not None
        self.spawned += 1
        log = self.dir / f"w{self.spawned:04d}-{role}{index}.jsonl"
        url = self.bouncer.url if options.get("bouncer") else self.server.tcp_url if options.get("net") else self.server.url
        opts = {**options, "ttl": self.ttl, "seed": self.args.seed, "go": str(self.go)}
        if self.args.mutant and role in ("ex", "writer"):
            opts["mutant"] = self.args.mutant
        command = [sys.executable, str(Path(__file__).resolve()), "worker", role, f"{role}{index}", url, str(log), json.dumps(opts)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        stderr = open(self.dir / (log.stem + ".err"), "wb")  # noqa: SIM115 - the child keeps it
        if options.get("net"):
            assert self.net is not None
            command = self.net.argv(self.net.client, command)  # ip netns exec execs: the pid is the worker's
        popen = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
        stderr.close()
        proc = Proc(role, index, options, popen, log)
        self.procs.append(proc)
        return proc

    def holders(self) -> list[Proc]:
        """Live workers whose last event says they hold a lease now (they are told apart by it)."""
        found = []
        for proc in self.procs:
            if proc.killed or proc.popen.poll() is not None or any(p is proc for _, p, _ in self.pending_cont):
                continue
            last = last_event(proc.log)
            if last is not None and last.get("e") in ("hold", "until", "wrote", "refused", "writefail"):
                found.append(proc)
        return found

    def victim(self) -> Proc | None:
        live = self.holders()
        if not live:
            live = [p for p in self.procs if not p.killed and p.popen.poll() is None
                    and not any(p is q for _, q, _ in self.pending_cont)]
        return self.rnd.choice(live) if live else None

    # -- faults -----------------------------------------------------------------------
    def fault(self, kind: str) -> None:
        assert self.server is not None and self.bouncer is not None
        t = mono()
        detail = ""
        if kind in ("pg-restart-fast", "pg-restart-immediate"):
            self.server.restart(kind.rsplit("-", 1)[1])
        elif kind == "pgbouncer-restart":
            self.bouncer.restart()
        elif kind == "holder-sigkill":
            proc = self.victim()
            if proc is None:
                return
            proc.popen.kill()
            proc.popen.wait()
            proc.killed = True
            detail = f"{proc.role}{proc.index} pid {proc.popen.pid}"
            if mono() < self.end - 1:
                self.spawn(proc.role, proc.index, proc.options)
        elif kind == "holder-sigstop":
            proc = self.victim()
            if proc is None:
                return
            pause = self.ttl * self.rnd.uniform(1.5, 3.0)
            proc.popen.send_signal(signal.SIGSTOP)
            self.pending_cont.append((mono() + pause, proc, mono()))
            detail = f"{proc.role}{proc.index} pid {proc.popen.pid} for {pause:.1f} s"
        elif kind == "partition":
            if self.heal_at is not None:
                return
            length = self.ttl * self.rnd.uniform(1.5, 3.0)
            self.net.cut()
            self.cut_at = mono()
            self.heal_at = self.cut_at + length
            cut = sum(1 for p in self.procs if p.options.get("net") and not p.killed)
            detail = f"{cut} clients cut off for {length:.1f} s"
        self.faults[kind] += 1
        self.fault_log.append((t, kind, detail))
        print(f"[{t - self.start:7.1f} s] {kind} {detail} ({mono() - t:.1f} s)", flush=True)

    def recover(self) -> None:
        """After a fault that could not be injected: the server and the pooler up again."""
        assert self.server is not None and self.bouncer is not None
        try:
            self.server.start()
        except Exception:  # noqa: BLE001 - it was up
            pass
        if self.bouncer.proc is None or self.bouncer.proc.poll() is not None:
            try:
                self.bouncer.start()
            except Exception as exc:  # noqa: BLE001
                self.problems.append(f"harness: pgbouncer did not come back: {exc}")

    def continue_due(self, everything: bool = False) -> None:
        now = mono()
        if self.heal_at is not None and (everything or now >= self.heal_at):
            self.net.heal()
            self.cuts.append((self.cut_at, mono()))
            self.heal_at = None
        for item in list(self.pending_cont):
            due, proc, since = item
            if everything or now >= due:
                proc.popen.send_signal(signal.SIGCONT)
                self.stops[proc.popen.pid].append((since, mono()))
                self.pending_cont.remove(item)

    # -- the run ----------------------------------------------------------------------
    def run(self) -> int:
        args = self.args
        import contextlib

        stack = contextlib.ExitStack()
        why = None
        if args.partitions:
            from tests import netns

            why = netns.missing()
            if why is not None:
                print(f"soak: no partitions: {why}", flush=True)
        self.partitions = args.partitions and why is None
        print(f"soak: {args.minutes:g} min, ttl {self.ttl:g} s, a fault every {args.fault_every:g} s, logs in {self.dir}", flush=True)
        try:
            if self.partitions:
                from tests import netns

                netns.sweep()  # what a killed run left behind
                self.net = stack.enter_context(netns.pair())
            self.server = Postgres(self.net)
            self.bouncer = Bouncer(self.server)
            setup_schema(self.server.url)
            self.go = self.dir / "go.json"
            self.start = self.end = mono() + 3600  # for now: the workers wait for the go file
            for role, count, options in WORKERS:
                if options.get("net") and self.net is None:
                    continue
                for i in range(count):
                    self.spawn(role, len([p for p in self.procs if p.role == role]), options)
            ready_by = mono() + 300
            while not all(any(ev.get("e") == "ready" for ev in read_events(p.log)) for p in self.procs):
                dead = [p for p in self.procs if p.popen.poll() is not None]
                if dead or mono() > ready_by:
                    why = (self.dir / (dead[0].log.stem + ".err")).read_text(errors="replace")[-2000:] if dead else "timeout"
                    raise RuntimeError(f"the workers did not get ready: {why}")
                time.sleep(0.2)
            self.start = mono()
            self.end = self.start + args.minutes * 60
            tmp = self.dir / "go.tmp"
            tmp.write_text(json.dumps({"until": self.end}))
            tmp.rename(self.go)
            kinds = ["pg-restart-fast", "pg-restart-immediate", "holder-sigkill", "holder-sigstop", "pgbouncer-restart"]
            if self.net is not None:
                kinds.append("partition")
            round_: list[str] = []
            next_fault = self.start + min(args.fault_every, 3.0)
            while mono() < self.end:
                self.continue_due()
                if mono() >= next_fault and mono() < self.end - 2 * self.ttl:
                    if not round_:
                        round_ = kinds[:]
                        self.rnd.shuffle(round_)
                    kind = round_.pop()
                    try:
                        self.fault(kind)
                    except Exception as exc:  # noqa: BLE001 - the harness's own trouble: say so, carry on
                        self.problems.append(f"harness: could not inject {kind}: {exc}")
                        print(f"harness: could not inject {kind}: {exc}", flush=True)
                        self.recover()
                    next_fault = mono() + args.fault_every * self.rnd.uniform(0.6, 1.4)
                time.sleep(0.05)
            self.continue_due(everything=True)
            # The workers stop starting holds at the end; each finishes what it holds, within its bounds.
            grace = mono() + WAIT + 2.5 + 4 * self.ttl + 20
            for proc in self.procs:
                try:
                    proc.popen.wait(timeout=max(0.1, grace - mono()))
                except subprocess.TimeoutExpired:
                    self.problems.append(f"worker {proc.role}{proc.index} (pid {proc.popen.pid}) did not finish in time: killed")
                    proc.popen.kill()
                    proc.popen.wait()
            for proc in self.procs:
                if not proc.killed and proc.popen.returncode != 0:
                    err = (self.dir / (proc.log.stem + ".err")).read_text(errors="replace")[-1500:]
                    self.problems.append(f"worker {proc.role}{proc.index} exited with {proc.popen.returncode}: {err}")
            return self.audit()
        finally:
            self.continue_due(everything=True)
            for proc in self.procs:
                if proc.popen.poll() is None:
                    proc.popen.kill()
                    proc.popen.wait()
            if self.bouncer is not None:
                self.bouncer.stop()
            if self.server is not None:
                self.server.stop()
            stack.close()  # the namespaces last: deleting them kills what still runs there
            if not args.keep:
                shutil.rmtree(self.dir, ignore_errors=True)

    # -- the audit --------------------------------------------------------------------
    def audit(self) -> int:
        import psycopg

        assert self.server is not None
        problems = self.problems
        events: list[tuple[int, dict[str, Any]]] = []
        for proc in self.procs:
            for event in read_events(proc.log):
                events.append((proc.popen.pid, event))

        # Intervals of trust, by name.
        holds: dict[tuple[int, str, int], dict[str, Any]] = {}
        grants: Counter[str] = Counter()
        role_kind = {"w": "exclusive", "r": "reader", "s": "semaphore", "u": "upgradeable"}
        for pid, ev in events:
            e = ev["e"]
            if e == "hold":
                key = (pid, ev["name"], ev["token"])
                holds[key] = {"name": ev["name"], "role": ev["role"], "t0": ev["t0"], "until": ev["until"], "end": None, "pid": pid, "token": ev["token"]}
                kind = role_kind[ev["role"]]
                if ev["name"] in GROUP_NAMES:
                    kind = "group (per name)"
                elif ev["name"] == "el":
                    kind = "election term"
                elif ev["name"] == "up" and ev["role"] == "w":
                    kind = "upgraded to writer"
                elif ev["name"] == "rw" and ev["role"] == "w":
                    kind = "writer (read/write)"
                grants[kind] += 1
            elif e == "until":
                h = holds.get((pid, ev["name"], ev["token"]))
                if h is not None:
                    h["until"] = max(h["until"], ev["until"])
            elif e == "end":
                h = holds.get((pid, ev["name"], ev["token"]))
                if h is not None and h["end"] is None:
                    h["end"] = ev["t"]
        by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for h in holds.values():
            t1 = h["until"] if h["end"] is None else min(h["end"], h["until"])
            if t1 > h["t0"]:
                by_name[h["name"]].append({**h, "t1": t1})
        overlaps = 0
        for name, intervals in by_name.items():
            intervals.sort(key=lambda h: h["t0"])
            active: list[dict[str, Any]] = []
            for h in intervals:
                active = [a for a in active if a["t1"] > h["t0"]]
                for a in active:
                    clash = "w" in (a["role"], h["role"]) or (a["role"] == "u" and h["role"] == "u")
                    if clash:
                        overlaps += 1
                        problems.append(
                            f"overlap on {name!r}: {a['role']} token {a['token']} (pid {a['pid']}) trusted "
                            f"until {a['t1'] - self.start:.4f} s, {h['role']} token {h['token']} (pid {h['pid']}) "
                            f"from {h['t0'] - self.start:.4f} s"
                        )
                active.append(h)
                if name == "sem" and len(active) > SEM_LIMIT:
                    overlaps += 1
                    problems.append(f"{len(active)} semaphore holders at {h['t0'] - self.start:.4f} s (limit {SEM_LIMIT}): tokens {[a['token'] for a in active]}")

        # The database's record.
        with psycopg.connect(self.server.url.replace("+psycopg", ""), autocommit=True) as conn:
            rows = conn.execute(f"SELECT id, name, token, write_id FROM {SCHEMA}.audit ORDER BY id").fetchall()
            counters: dict[str, int] = dict(conn.execute(f"SELECT name, n FROM {SCHEMA}.work").fetchall())
        recorded: Counter[str] = Counter()
        per_name: Counter[str] = Counter()
        last_token: dict[str, int] = {}
        order_breaks = 0
        for _id, name, token, write_id in rows:
            recorded[write_id] += 1
            per_name[name] += 1
            if name in FENCED_ROWS:
                if token < last_token.get(name, 0):
                    order_breaks += 1
                    problems.append(f"token order on {name!r}: token {token} ({write_id}) recorded after {last_token[name]}")
                last_token[name] = max(token, last_token.get(name, 0))
        twice = [w for w, c in recorded.items() if c > 1]
        for w in twice[:20]:
            problems.append(f"write {w} recorded {recorded[w]} times")
        told = [ev for _, ev in events if ev["e"] == "wrote"]
        lost = [ev for ev in told if ev["wid"] not in recorded]
        for ev in lost[:20]:
            problems.append(f"write {ev['wid']} on {ev['name']!r} (token {ev['token']}) was reported committed but is not in the database")
        for name, n in counters.items():
            if n != per_name[name]:
                problems.append(f"row {name!r}: counter {n}, but {per_name[name]} writes recorded")

        # Bounds and errors of the calls.
        calls = 0
        over: list[str] = []
        paused_calls = 0
        odd: list[str] = []
        outcomes: Counter[str] = Counter()
        closest: tuple[float, str] = (-1.0, "")
        for pid, ev in events:
            if ev["e"] != "call":
                continue
            calls += 1
            outcomes[ev["out"] if not ev["out"].startswith("!") else "other"] += 1
            if ev["out"].startswith("!"):
                odd.append(f"{ev['op']} raised {ev['out']}")
            took = ev["t1"] - ev["t0"]
            paused = any(s < ev["t1"] and ev["t0"] < c for s, c in self.stops.get(pid, []))
            if not paused and took / ev["bound"] > closest[0]:
                closest = (took / ev["bound"], f"{ev['op']} took {took:.2f} s of its {ev['bound']:.2f} s ({ev['out']})")
            if took > ev["bound"]:
                if any(s < ev["t1"] and ev["t0"] < c for s, c in self.stops.get(pid, [])):
                    paused_calls += 1
                    continue
                over.append(f"{ev['op']} took {took:.2f} s, bound {ev['bound']:.2f} s (pid {pid}, at {ev['t0'] - self.start:.1f} s)")
        problems.extend(over)
        problems.extend(odd[:20])
        crashes = [ev for _, ev in events if ev["e"] == "crash"]
        for ev in crashes[:5]:
            problems.append("worker crash: " + ev["tb"])

        refused_fenced = sum(1 for _, ev in events if ev["e"] == "refused" and ev["fenced"])
        refused_guard = sum(1 for _, ev in events if ev["e"] == "refused" and not ev["fenced"])
        failed_writes = sum(1 for _, ev in events if ev["e"] == "writefail")
        elapsed = (self.end - self.start) / 60

        table: list[tuple[str, str]] = [("minutes", f"{elapsed:.1f}"), ("worker processes started", str(self.spawned))]
        kinds = ["pg-restart-fast", "pg-restart-immediate", "holder-sigkill", "holder-sigstop", "pgbouncer-restart"]
        for kind in kinds + (["partition"] if self.net is not None else []):
            table.append((f"fault: {kind}", str(self.faults[kind])))
        for kind in sorted(grants):
            table.append((f"grants: {kind}", str(grants[kind])))
        table += [
            ("writes told committed", str(len(told))),
            ("writes recorded by the trigger", str(len(rows))),
            ("  of which unconfirmed to the client", str(len(rows) - len({ev["wid"] for ev in told} & set(recorded)))),
            ("stale fenced writes refused (FencedOut)", str(refused_fenced)),
            ("shared writes refused at commit (LeaseLost)", str(refused_guard)),
            ("writes failed (database away)", str(failed_writes)),
            ("dblock calls", str(calls)),
        ]
        for out in sorted(outcomes):
            table.append((f"  {out}", str(outcomes[out])))
        table += [
            ("calls over their bound (paused processes aside)", str(len(over))),
            ("calls of paused processes over their bound", str(paused_calls)),
            ("overlaps", str(overlaps)),
            ("token order breaks", str(order_breaks)),
            ("writes lost", str(len(lost))),
            ("writes recorded twice", str(len(twice))),
            ("violations", str(len(problems))),
        ]
        width = max(len(k) for k, _ in table)
        print()
        print(f"| {'':{width}} | {'count':>8} |")
        print(f"|{'-' * (width + 2)}|{'-' * 10}|")
        for k, v in table:
            print(f"| {k:{width}} | {v:>8} |")
        print()
        print(f"slowest call against its bound (paused processes aside): {closest[1] or 'none'}")
        print()
        if problems:
            print(f"VIOLATIONS ({len(problems)}):")
            for p in problems[:100]:
                print("  " + p)
            return 1
        print("clean: no violation")
        return 0


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError:
        return
    for line in text.splitlines():
        try:
            yield json.loads(line)
        except ValueError:
            continue  # a line cut short by a SIGKILL


def last_event(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 2000))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


MUTANTS = ("unfenced", "overtrust", "lost")


def mutants(value: str) -> list[str]:
    """``--mutant``'s value: kinds from MUTANTS, comma-separated."""
    kinds = [k.strip() for k in value.split(",")]
    unknown = [k for k in kinds if k not in MUTANTS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"mutants are {', '.join(MUTANTS)}, not {', '.join(unknown) or 'none'}")
    return kinds


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.path.insert(0, str(ROOT))  # dblock from this checkout, and tests.netns
    if argv and argv[0] == "worker":
        worker_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0, help="how long to run (fractions allowed)")
    parser.add_argument("--ttl", type=float, default=2.0, help="the workers' lease ttl, seconds")
    parser.add_argument("--fault-every", type=float, default=6.0, help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument(
        "--no-partitions", dest="partitions", action="store_false",
        help="no network namespaces (partitions need root and ip netns)",
    )
    parser.add_argument(
        "--mutant", type=mutants, metavar="KIND[,KIND...]",
        help="check the audit itself: the exclusive lock's writers pause past their ttl before some writes, and "
        "write without the fence (unfenced), trust their lease a ttl too long (overtrust), or report writes "
        "they rolled back (lost); the audit must then report violations",
    )
    parser.add_argument("--keep", metavar="DIR", help="keep the workers' logs in DIR")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.ttl <= 0 or args.fault_every <= 0:
        parser.error("--minutes, --ttl and --fault-every must be positive")
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
