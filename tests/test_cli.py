"""The `dblock` command, run as users run it: the installed console script in real subprocesses."""

from __future__ import annotations

import json
import os
import pty
import secrets
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from sqlalchemy.engine import make_url

from dblock.cli import EXIT_BUSY, EXIT_CANNOT_RUN, EXIT_CONFIG, EXIT_LOST, EXIT_NOT_FOUND, EXIT_NOT_HELD, EXIT_UNAVAILABLE, main

from .conftest import Db, wait_for
from .pgproxy import PgProxy

DBLOCK = Path(sys.executable).parent / "dblock"  # the console script pip installed
PY = sys.executable

# The command run under the lock. argv: DIR MODE. Writes DIR/started (its
# DBLOCK_NAME, DBLOCK_TOKEN and pid), then waits for DIR/stop. MODE "handle": a
# SIGTERM/SIGINT/SIGHUP is written to DIR/signals and ends it with status 42;
# "ignore": SIGTERM is ignored; "plain": default signal handling.
CHILD = """
import os, signal, sys, time
d, mode = sys.argv[1], sys.argv[2]
def on(signum, frame):
    with open(os.path.join(d, "signals"), "a") as f:
        f.write(f"{signum}\\n")
    sys.exit(42)
def note(signum, frame):
    with open(os.path.join(d, "signals"), "a") as f:
        f.write(f"{signum}\\n")
if mode in ("handle", "usr1"):
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on)
if mode == "usr1":
    signal.signal(signal.SIGUSR1, note)  # noted, and the command goes on
elif mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(d, "started.tmp"), "w") as f:
    f.write(os.environ["DBLOCK_NAME"] + " " + os.environ["DBLOCK_TOKEN"] + " " + str(os.getpid()))
os.rename(os.path.join(d, "started.tmp"), os.path.join(d, "started"))
while not os.path.exists(os.path.join(d, "stop")):
    time.sleep(0.02)
"""

# Mutual exclusion, checked by the commands themselves: mkdir fails if another
# one is inside. Each appends "start"/"end" to DIR/log.
CRITICAL = """
import os, sys, time
d = sys.argv[1]
try:
    os.mkdir(os.path.join(d, "inside"))
except FileExistsError:
    sys.exit(99)
with open(os.path.join(d, "log"), "a") as f:
    f.write("start\\n")
time.sleep(0.2)
with open(os.path.join(d, "log"), "a") as f:
    f.write("end\\n")
os.rmdir(os.path.join(d, "inside"))
"""

# Exits 0 if the process PID (started at STARTTIME, field 22 of /proc/PID/stat) is
# gone, 3 if it still runs. A zombie counts as gone: it runs nothing, and an init
# that does not reap would leave it. A new process with a reused pid is another process.
GONE = """
import sys
pid, started = sys.argv[1], sys.argv[2]
try:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
except FileNotFoundError:
    sys.exit(0)
state, start = fields[0], fields[19]
sys.exit(0 if state in "ZXx" or start != started else 3)
"""


def start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


class Cli:
    """Runs the console script against one test table (or the embedded default in DBLOCK_HOME)."""

    def __init__(self, db: Db | None, tmp_path: Path) -> None:
        self.db = db
        self.home = tmp_path / "home"
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DBLOCK_HOME": str(self.home)}
        self.options = [] if db is None else ["--url", db.url, "--table", db.table]
        self.holders: list[tuple[subprocess.Popen[str], Path]] = []

    def args(self, command: str, *rest: str) -> list[str]:
        return [str(DBLOCK), command, *self.options, *rest]

    def __call__(self, command: str, *rest: str, **kw: object) -> subprocess.CompletedProcess[str]:
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw.setdefault("env", self.env)
        return subprocess.run(self.args(command, *rest), capture_output=True, text=True, timeout=60, **kw)  # type: ignore[call-overload,no-any-return]

    def start(self, command: str, *rest: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.args(command, *rest), env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def holder(self, name: str, work: Path, *options: str, mode: str = "plain") -> subprocess.Popen[str]:
        """`dblock run NAME -- CHILD`, once its command has started."""
        work.mkdir(exist_ok=True)
        proc = self.start("run", name, *options, "--", PY, "-c", CHILD, str(work), mode)
        self.holders.append((proc, work))
        wait_for(lambda: (work / "started").exists() or proc.poll() is not None, what="the command to start")
        assert proc.poll() is None, proc.communicate()
        return proc


    def stop_holders(self) -> None:
        """After a failed test too: let every command end, so no orphan outlives the suite."""
        for proc, work in self.holders:
            (work / "stop").touch()
        for proc, _ in self.holders:
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


@pytest.fixture
def cli(db: Db, tmp_path: Path) -> Iterator[Cli]:
    """On PostgreSQL and on a SQLite file."""
    c = Cli(db, tmp_path)
    yield c
    c.stop_holders()


@pytest.fixture
def pg_cli(pg: Db, tmp_path: Path) -> Iterator[Cli]:
    """On PostgreSQL only."""
    c = Cli(pg, tmp_path)
    yield c
    c.stop_holders()


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[Cli]:
    """On the embedded default (no --url, DBLOCK_HOME in tmp_path): for what does not depend on the backend."""
    c = Cli(None, tmp_path)
    yield c
    c.stop_holders()


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err


def held_for(db: Db, name: str) -> float:
    span = "EXTRACT(EPOCH FROM expires_at - acquired_at)" if db.backend == "postgresql" else "expires_at - acquired_at"
    rows = db.query(f"SELECT {span} FROM {db.table} WHERE name = %s AND owner IS NOT NULL", (name,))
    return float(rows[0][0]) if rows else 0.0


def owner_of(db: Db, name: str) -> object:
    rows = db.query(f"SELECT owner FROM {db.table} WHERE name = %s", (name,))
    return rows[0][0] if rows else None


# -- run -------------------------------------------------------------------------
def test_concurrent_runs_never_hold_one_name_at_once(cli: Cli, tmp_path: Path) -> None:
    waiting = [cli.start("run", "crit", "--wait", "60", "--ttl", "1", "--", PY, "-c", CRITICAL, str(tmp_path))
               for _ in range(3)]
    not_waiting = [cli.start("run", "crit", "--", PY, "-c", CRITICAL, str(tmp_path))]
    results = [finish(p) for p in waiting + not_waiting]
    assert [r[0] for r in results[:3]] == [0, 0, 0], results
    assert all(r[0] in (0, EXIT_BUSY) for r in results[3:]), results
    for code, _, err in results[3:]:
        if code == EXIT_BUSY:
            assert err.startswith("dblock: lock 'crit' is busy") and err.count("\n") == 1, err
    inside = sum(r[0] == 0 for r in results)
    assert (tmp_path / "log").read_text() == "start\nend\n" * inside


def test_concurrent_first_runs_on_a_fresh_embedded_default(embedded: Cli, tmp_path: Path) -> None:
    """They race to create the SQLite file and its table, then take turns."""
    runs = [embedded.start("run", "crit", "--wait", "60", "--", PY, "-c", CRITICAL, str(tmp_path)) for _ in range(3)]
    results = [finish(p) for p in runs]
    assert [r[0] for r in results] == [0, 0, 0], results
    assert (tmp_path / "log").read_text() == "start\nend\n" * 3


def test_renewal_keeps_a_short_lease_through_a_long_command(pg_cli: Cli, tmp_path: Path) -> None:
    # PostgreSQL only, to keep the suite quick: test_renew.py renews on both backends.
    # A 2 s TTL renews every 0.67 s and survives a stall of the machine up to 1.3 s (the CI host
    # has stalled past the 0.67 s that a 1 s TTL allows).
    cli = pg_cli
    assert cli.db is not None
    holder = cli.holder("long", tmp_path / "w", "--ttl", "2")
    token = int((tmp_path / "w" / "started").read_text().split()[1])

    def lasted() -> bool:
        assert holder.poll() is None, f"the holder ended early: {holder.communicate()}"
        return held_for(cli.db, "long") > 6

    # One grant, renewed: by the database's clock it now spans three TTLs, two of them past.
    wait_for(lasted, timeout=30, what="the lease to last three TTLs")
    busy = cli("run", "long", "--wait", "0", "--", "true")
    assert busy.returncode == EXIT_BUSY, busy
    assert f"(token {token}," in busy.stderr and socket.gethostname() in busy.stderr
    (tmp_path / "w" / "stop").touch()
    assert finish(holder)[0] == 0
    assert owner_of(cli.db, "long") is None  # released at exit, not left to expire


def test_forced_release_stops_the_command(cli: Cli, tmp_path: Path) -> None:
    holder = cli.holder("job", tmp_path / "w", "--ttl", "1", "--grace", "30", mode="handle")
    broken = cli("release", "job", "--force", "--yes")
    assert broken.returncode == 0, broken
    assert "released 'job'" in broken.stderr and socket.gethostname() in broken.stderr
    code, _, err = finish(holder)
    assert code == EXIT_LOST, err
    assert (tmp_path / "w" / "signals").read_text() == f"{int(signal.SIGTERM)}\n"
    assert "lost the lease on 'job'" in err and "SIGTERM" in err and "SIGKILL" not in err


def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(embedded: Cli, tmp_path: Path) -> None:
    cli = embedded
    holder = cli.holder("job", tmp_path / "w", "--ttl", "1", "--grace", "0.2", mode="ignore")
    assert cli("release", "job", "--force", "--yes").returncode == 0
    code, _, err = finish(holder)
    assert code == EXIT_LOST, err
    assert "did not stop within 200 ms; sending SIGKILL" in err  # --grace 0.2, said as people say it


def test_lease_lost_while_the_database_is_silent_stops_the_command(pg: Db, tmp_path: Path) -> None:
    proxy = PgProxy(pg.url)
    cli = Cli(pg, tmp_path)
    try:
        cli.options = ["--url", proxy.url, "--table", pg.table]
        holder = cli.holder("job", tmp_path / "w", "--ttl", "1", mode="handle")
        proxy.pause()
        code, _, err = finish(holder)
        assert code == EXIT_LOST, err
        assert (tmp_path / "w" / "signals").read_text() == f"{int(signal.SIGTERM)}\n"
        assert "did not answer" in err
    finally:
        proxy.close()
        cli.stop_holders()


def test_the_expiring_signal_warns_the_command_before_the_lease_is_lost(pg: Db, tmp_path: Path) -> None:
    proxy = PgProxy(pg.url)
    cli = Cli(pg, tmp_path)
    try:
        cli.options = ["--url", proxy.url, "--table", pg.table]
        holder = cli.holder("job", tmp_path / "w", "--ttl", "1.5", "--expiring-signal", "usr1", mode="usr1")
        proxy.pause()
        code, _, err = finish(holder)
        assert code == EXIT_LOST, err
        # SIGUSR1 while some of the lease was left, then SIGTERM once it was lost.
        assert (tmp_path / "w" / "signals").read_text() == f"{int(signal.SIGUSR1)}\n{int(signal.SIGTERM)}\n"
        assert "could not be renewed yet" in err and "sending SIGUSR1" in err
    finally:
        proxy.close()
        cli.stop_holders()


def test_expiring_options_are_checked(embedded: Cli) -> None:
    for options, message in (
        (["--expiring-signal", "NOPE"], "not a signal: 'NOPE'"),
        (["--expiring-margin", "5"], "give --expiring-signal too"),
        (["--expiring-signal", "USR1", "--expiring-margin", "0"], "expiring-margin must be"),
    ):
        done = embedded("run", "job", *options, "--", "true")
        assert done.returncode == 2 and message in done.stderr, done


def check_signal_reaches_the_command(cli: Cli, work: Path, signum: int) -> None:
    assert cli.db is not None
    holder = cli.holder("job", work, "--ttl", "30", mode="handle")
    assert owner_of(cli.db, "job") is not None
    holder.send_signal(signum)
    code, _, err = finish(holder)
    assert code == 42, err  # the command's own status
    assert (work / "signals").read_text() == f"{int(signum)}\n"
    assert owner_of(cli.db, "job") is None  # released, long before its 30 s TTL


def test_sigterm_reaches_the_command_and_the_lease_is_released(cli: Cli, tmp_path: Path) -> None:
    check_signal_reaches_the_command(cli, tmp_path / "w", signal.SIGTERM)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP])
def test_sigint_and_sighup_reach_the_command_too(embedded: Cli, tmp_path: Path, signum: int) -> None:
    embedded.db = Db("sqlite", f"sqlite:///{embedded.home / 'locks.sqlite3'}", "locks")  # to look inside
    check_signal_reaches_the_command(embedded, tmp_path / "w", signum)


def test_a_command_killed_by_a_signal_exits_128_plus_n(embedded: Cli, tmp_path: Path) -> None:
    holder = embedded.holder("job", tmp_path / "w", mode="plain")
    holder.send_signal(signal.SIGTERM)
    assert finish(holder)[0] == 128 + signal.SIGTERM


def test_run_passes_the_status_and_the_token_on_the_embedded_default(embedded: Cli) -> None:
    out = embedded("run", "job", "--", "sh", "-c", 'echo "$DBLOCK_NAME $DBLOCK_TOKEN"; exit 3')
    assert out.returncode == 3, out
    name, token = out.stdout.split()
    assert name == "job" and int(token) >= 1
    assert (embedded.home / "locks.sqlite3").exists()
    again = embedded("run", "job", "--", "sh", "-c", 'echo "$DBLOCK_TOKEN"')
    assert again.returncode == 0 and int(again.stdout) > int(token)


def test_min_interval_runs_a_job_once_per_period_whichever_machine_starts_it(cli: Cli, tmp_path: Path) -> None:
    """The crontab line on three servers whose clocks differ by more than the job takes: each
    `dblock run` starts after the one before has finished. With --min-interval the first
    runs the job and keeps the lock for the period; without it, every one runs it again."""
    log = tmp_path / "log"
    job = [PY, "-c", f"open({str(log)!r}, 'a').write('ran\\n')"]
    first = cli("run", "report", "--min-interval", "1m", "--", *job)
    assert first.returncode == 0, first
    for _ in range(2):
        late = cli("run", "report", "--min-interval", "1m", "--", *job)
        assert late.returncode == EXIT_BUSY and late.stderr.startswith("dblock: lock 'report' is busy: held by "), late
    assert log.read_text() == "ran\n"
    (info,) = json.loads(cli("status", "report", "--json").stdout)
    # Kept a minute from its grant (not its 30 s ttl), though the job took a moment.
    assert info["held_for"] + info["expires_in"] == pytest.approx(60, abs=0.01) and info["expires_in"] > 30
    for _ in range(2):  # the control: without it, a late start runs the job again
        assert cli("run", "plain", "--", *job).returncode == 0
    assert log.read_text() == "ran\n" * 3


def test_a_command_that_cannot_start_releases_the_lock(embedded: Cli, tmp_path: Path) -> None:
    missing = embedded("run", "job", "--", str(tmp_path / "no-such-command"))
    assert missing.returncode == EXIT_NOT_FOUND and "command not found" in missing.stderr
    script = tmp_path / "not-executable"
    script.write_text("echo hi\n")
    denied = embedded("run", "job", "--", str(script))
    assert denied.returncode == EXIT_CANNOT_RUN
    assert embedded("status", "job").returncode == EXIT_NOT_HELD


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux only")


@linux_only
def test_a_killed_supervisor_takes_its_command_with_it(cli: Cli, tmp_path: Path) -> None:
    """kill -9 of `dblock run` (OOM killer, a runtime killing the wrong process): its
    lease runs out within the TTL, so its command must be gone before a next holder's runs."""
    holder = cli.holder("job", tmp_path / "w", "--ttl", "2")
    pid = (tmp_path / "w" / "started").read_text().split()[2]
    started = start_time(int(pid))
    holder.kill()
    holder.wait()
    # The next grant of the name: its command checks that the first one is no longer running.
    after = cli("run", "job", "--wait", "30", "--", PY, "-c", GONE, pid, started)
    assert after.returncode == 0, f"the first command still ran under the next lease: {after}"


@linux_only
@pytest.mark.parametrize("parent", ["alive", "dead"])
def test_a_command_whose_supervisor_died_before_it_could_arm_ends_itself(parent: str) -> None:
    """The race: the supervisor dies after the fork, before its child asked for the signal."""
    script = f"""
import ctypes, os
from dblock.cli import _die_with
_die_with(os.getppid() if {parent == "alive"} else os.getppid() + 1)()
armed = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(armed), 0, 0, 0)  # PR_GET_PDEATHSIG
print(armed.value)
"""
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=60)
    if parent == "alive":
        assert (out.returncode, out.stdout) == (0, f"{int(signal.SIGKILL)}\n"), out
    else:
        assert (out.returncode, out.stdout) == (-signal.SIGKILL, ""), out


# -- status, release, migrate --------------------------------------------------------
def test_status_table_and_json(cli: Cli, tmp_path: Path) -> None:
    holder = cli.holder("nightly-report", tmp_path / "w", "--ttl", "30")
    token = int((tmp_path / "w" / "started").read_text().split()[1])
    table = cli("status")
    assert table.returncode == 0, table
    header, row = table.stdout.splitlines()
    assert header.split() == ["NAME", "OWNER", "TOKEN", "HELD", "FOR", "EXPIRES", "IN", "WAITERS"]
    assert row.startswith("nightly-report  ") and f"  {token}  " in row
    assert f"{socket.gethostname()}:{holder.pid} " in row and "python" in row  # who to look for
    held, left, waiters = row.rsplit(None, 3)[1:]
    # Renewed every ttl/3, so 20-30 s are left, less what a loaded machine takes between calls.
    assert 15 < float(left.rstrip("s")) <= 30 and 0 <= float(held.rstrip("s")) < 15 and waiters == "0"

    one = cli("status", "nightly-report", "--json")
    assert one.returncode == 0
    (info,) = json.loads(one.stdout)
    assert info["name"] == "nightly-report" and info["token"] == token
    assert info["label"].startswith(f"{socket.gethostname()}:{holder.pid} ") and len(info["owner"]) == 32
    assert 15 < info["expires_in"] <= 30 and 0 <= info["held_for"] < 15 and info["waiters"] == 0
    assert info["expires_at"] > info["acquired_at"]

    other = cli("status", "other")
    assert other.returncode == EXIT_NOT_HELD and other.stdout == "other is not held\n"
    assert other.stderr.startswith("dblock: table ") and " in " in other.stderr
    (tmp_path / "w" / "stop").touch()
    assert finish(holder)[0] == 0
    assert cli("status").stdout == "no leases held\n"


def test_status_on_the_embedded_default_creates_nothing(tmp_path: Path) -> None:
    cli = Cli(None, tmp_path)
    status = cli("status")
    assert status.stdout == "no leases held\n"
    # It names the database it read (on stderr: stdout stays the table, or the JSON).
    assert status.stderr == f"dblock: table 'locks' in the embedded default {cli.home / 'locks.sqlite3'}\n", status
    assert cli("status", "x").returncode == EXIT_NOT_HELD
    assert cli("release", "x", "--force", "--yes").returncode == EXIT_NOT_HELD
    assert not cli.home.exists()


def test_release_asks_on_a_terminal(pg_cli: Cli, tmp_path: Path) -> None:
    cli = pg_cli
    assert cli.db is not None
    holder = cli.holder("job", tmp_path / "w", "--ttl", "1", mode="handle")
    for answer, code in (("n", EXIT_NOT_HELD), ("y", 0)):
        primary, secondary = pty.openpty()
        try:
            os.write(primary, f"{answer}\n".encode())
            out = cli("release", "job", "--force", stdin=secondary)
        finally:
            os.close(primary)
            os.close(secondary)
        assert out.returncode == code, out
        assert "Break the lease on 'job' held by " in out.stderr
        if code:
            assert owner_of(cli.db, "job") is not None and "nothing released" in out.stderr
    assert finish(holder)[0] == EXIT_LOST
    assert owner_of(cli.db, "job") is None


def test_migrate_creates_the_tables_and_prints_the_ddl(tmp_path: Path) -> None:
    cli = Cli(None, tmp_path)
    ddl = cli("migrate", "--sql")
    assert ddl.returncode == 0 and "CREATE TABLE locks" in ddl.stdout and "ADD COLUMN label" in ddl.stdout
    assert not cli.home.exists()  # printing the DDL touches nothing
    target = tmp_path / "app.db"
    made = cli("migrate", "--url", f"sqlite:///{target}", "--table", "app_locks")
    assert made.returncode == 0 and f"created the tables of 'app_locks' (revision " in made.stderr, made
    again = cli("migrate", "--url", f"sqlite:///{target}", "--table", "app_locks")
    assert again.returncode == 0 and "were already current" in again.stderr and "nothing changed" in again.stderr
    ran = cli("run", "--url", f"sqlite:///{target}", "--table", "app_locks", "x", "--", "true")
    assert ran.returncode == 0, ran
    missing = cli("run", "--url", f"sqlite:///{target}", "x", "--", "true")  # table "locks" was never made
    # The advice names this file (not the embedded default) and the table that is missing.
    assert missing.returncode == EXIT_UNAVAILABLE and f"dblock migrate --url sqlite:///{target}" in missing.stderr


def test_migrate_downgrade_removes_dblocks_tables_only(tmp_path: Path) -> None:
    cli = Cli(None, tmp_path)
    url = f"sqlite:///{tmp_path / 'app.db'}"
    made = cli("migrate", "--url", url)
    assert made.returncode == 0, made
    app = sqlite3.connect(tmp_path / "app.db")
    app.execute("CREATE TABLE notes (id integer PRIMARY KEY)")
    app.commit()

    def tables() -> set[str]:
        return {r[0] for r in app.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    down = cli("migrate", "--url", url, "--downgrade", "dblock_0002")
    assert down.returncode == 0 and "is at dblock_0002" in down.stderr, down
    assert app.execute("SELECT version_num FROM alembic_version_dblock").fetchall() == [("dblock_0002",)]
    assert "label" not in {r[1] for r in app.execute("PRAGMA table_info(locks)")}
    higher = cli("migrate", "--url", url, "--downgrade", "dblock_0003")  # above where the tables are
    assert higher.returncode == EXIT_UNAVAILABLE and "below dblock_0003: nothing to downgrade" in higher.stderr
    gone = cli("migrate", "--url", url, "--downgrade", "base")
    assert gone.returncode == 0 and "removed dblock's tables" in gone.stderr, gone
    assert tables() == {"notes"}  # dblock's version table too; the app's table stays
    again = cli("migrate", "--url", url, "--downgrade", "base")
    assert again.returncode == 0 and tables() == {"notes"}
    app.close()


def test_migrate_on_postgresql(pg: Db, tmp_path: Path) -> None:
    cli = Cli(None, tmp_path)
    table = pg.table + "_cli"
    made = cli("--url", pg.url, "migrate", "--table", table)  # options before or after the command
    try:
        assert made.returncode == 0, made
        assert cli("run", "--url", pg.url, "--table", table, "x", "--", "true").returncode == 0
        assert pg.query(f"SELECT name, owner FROM {table}") == [("x", None)]
    finally:
        pg.query(f"DROP TABLE IF EXISTS {table}, {table}_fences, alembic_version_dblock_{table}")
        pg.query(f"DROP SEQUENCE IF EXISTS {table}_token_seq")


def test_printed_ddl_makes_a_working_table_in_a_new_schema(pg: Db, tmp_path: Path) -> None:
    """`migrate --sql --schema S` is what a DBA runs by hand: it must make the schema too."""
    cli = Cli(None, tmp_path)
    schema = pg.table + "_s"
    # --sql connects to nothing: any PostgreSQL URL will do. This one renders with %-escapes
    # (host=/a/socket/dir becomes %2F), which once broke --sql.
    url = "postgresql+psycopg://app@/appdb?host=/run/no/such/dir"
    ddl = cli("migrate", "--url", url, "--schema", schema, "--sql")
    assert ddl.returncode == 0, ddl
    try:
        conn = pg.connect()
        try:
            conn.execute(ddl.stdout)  # one script, as psql -f would run it; the schema does not exist yet
        finally:
            conn.close()
        ran = cli("run", "--url", pg.url, "--schema", schema, "x", "--", "true")
        assert ran.returncode == 0, ran
        assert pg.query(f"SELECT name, owner FROM {schema}.locks") == [("x", None)]
    finally:
        pg.query(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def test_python_m_dblock(tmp_path: Path) -> None:
    out = subprocess.run([PY, "-m", "dblock", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for word in ("run", "status", "release", "migrate", "DBLOCK_URL", "DBLOCK_HOME", f"{EXIT_BUSY} the lock is busy"):
        assert word in out.stdout


# -- passwords and bad arguments -------------------------------------------------------
def test_passwords_never_appear(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on: connecting fails
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    password = "Sup3r:s@cret/%"
    encoded = "Sup3r%3As%40cret%2F%25"
    url = f"postgresql+psycopg://dblock:{encoded}@127.0.0.1:{port}/app"
    cli = Cli(None, tmp_path)
    runs = [
        cli("status", "--url", url),
        cli("status", "-v", f"--url={url}", "--json"),
        cli("run", "--url", url, "x", "--", "true"),
        cli("migrate", "--url", url),
        cli("migrate", "--url", url, "--sql"),
        cli("release", "x", "--force", "--yes", env={**cli.env, "DBLOCK_URL": url}),
    ]
    for out in runs:
        text = out.stdout + out.stderr
        assert password not in text and encoded not in text and "cret" not in text, text
    # Nothing ever listened there: a misconfigured URL (78) for the lock commands; migrate, through
    # SQLAlchemy's engine, says the database is unavailable (69).
    assert [out.returncode for out in runs] == [EXIT_CONFIG] * 3 + [EXIT_UNAVAILABLE, 0, EXIT_CONFIG]
    assert f"dblock:***@127.0.0.1:{port}/app" in runs[0].stderr  # says where, without the secret
    assert "CREATE TABLE locks" in runs[4].stdout


def test_a_one_letter_password_in_the_query_leaves_messages_whole(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = Cli(None, tmp_path)
    out = cli("status", "--url", f"postgresql+psycopg://a:a@127.0.0.1:{port}/a?password=a&application_name=a")
    assert out.returncode == EXIT_CONFIG, out  # nothing ever listened there
    # The old masking replaced every 'a' of the message ("c***nnot"); this one knows where a password stands.
    assert out.stderr.startswith(
        f"dblock: cannot connect to postgresql+psycopg://a:***@127.0.0.1:{port}/a?password=***&application_name=a: "
    ), out.stderr
    assert "password=a" not in out.stderr and ":a@" not in out.stderr


def test_status_json_is_exact_and_a_password_in_the_query_is_never_printed(pg_cli: Cli, tmp_path: Path) -> None:
    """A lock named app-nightly, a role whose password is app, given as ?password=app."""
    cli = pg_cli
    assert cli.db is not None
    role = "app_" + secrets.token_hex(4)
    cli.db.query(f"CREATE ROLE {role} LOGIN PASSWORD 'app'")  # a trust-auth server never checks it: no matter
    try:
        cli.db.query(f"GRANT SELECT ON {cli.db.table}, {cli.db.table}_holders TO {role}")  # status reads both
        url = make_url(cli.db.url).set(username=role, password=None).update_query_dict({"password": "app"})
        as_role = url.render_as_string(hide_password=False)
        assert make_url(as_role).query["password"] == "app"
        # The command line of the holder carries the URL too: its label must not.
        cli.holder("app-nightly", tmp_path / "w", "--ttl", "30", mode="plain")
        (tmp_path / "w2").mkdir()
        wait2 = 'touch "$1/started"; while [ ! -e "$1/stop" ]; do sleep 0.05; done'  # short: the label shows it all
        cli.holders.append((cli.start("run", "app-nightly-2", "--", "sh", "-c", wait2, as_role, str(tmp_path / "w2")),
                            tmp_path / "w2"))
        wait_for(lambda: (tmp_path / "w2" / "started").exists(), what="the second command to start")
        stored = dict(cli.db.query(f"SELECT name, label FROM {cli.db.table} WHERE owner IS NOT NULL"))

        # The password in the userinfo (where the old masking found it, and printed ***-nightly), then in the query.
        in_userinfo = url.set(password="app", query={k: v for k, v in url.query.items() if k != "password"})
        for given in (in_userinfo.render_as_string(hide_password=False), as_role):
            status = cli("status", "--json", "--url", given, "--table", cli.db.table)
            # stderr names the table and database read, the password masked wherever it stood
            assert status.returncode == 0 and status.stderr.startswith(f"dblock: table {cli.db.table!r} in "), status
            assert ":app@" not in status.stderr and "password=app" not in status.stderr, status.stderr
            infos = {i["name"]: i for i in json.loads(status.stdout)}
            assert sorted(infos) == ["app-nightly", "app-nightly-2"]  # exact names
            assert {name: i["label"] for name, i in infos.items()} == stored  # data as stored, not altered
            label = infos["app-nightly-2"]["label"]  # masked when the holder wrote it
            assert "password=***" in label and "password=app" not in label, label
            table = cli("status", "--url", given, "--table", cli.db.table)
            assert table.returncode == 0 and table.stdout.splitlines()[1].startswith("app-nightly  "), table
            # SELECT on the lock table alone: no waiter count ("-", null), and no error.
            assert table.stdout.splitlines()[1].endswith(" -") and infos["app-nightly"]["waiters"] is None
            for out in (status, table):
                assert "password=app" not in out.stdout + out.stderr and ":app@" not in out.stdout + out.stderr
    finally:
        cli.stop_holders()
        cli.holders.clear()
        cli.db.query(f"DROP OWNED BY {role}")
        cli.db.query(f"DROP ROLE {role}")


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["run"],
        ["run", "x"],
        ["run", "x", "--"],
        ["run", "x", "true"],
        ["run", "", "--", "true"],
        ["run", "x", "--ttl", "-1", "--", "true"],
        ["run", "x", "--ttl", "soon", "--", "true"],
        ["run", "x", "--wait", "-2", "--", "true"],
        ["run", "x", "--grace", "nan", "--", "true"],
        ["run", "x", "--min-interval", "-1", "--", "true"],
        ["run", "x", "--min-interval", "inf", "--", "true"],
        ["run", "x", "--min-interval", "soon", "--", "true"],
        ["run", "x", "--bogus", "--", "true"],
        ["run", "x", "--table", "no way", "--", "true"],
        ["run", "x", "--schema", "s", "--", "true"],
        ["run", "x", "--url", "oracle://u@h/db", "--", "true"],
        ["run", "x", "--url", "not a url", "--", "true"],
        ["status", "--schema", "s"],
        ["release", "x"],
        ["release", "x", "--force"],
        ["migrate", "--table", "1x"],
        ["migrate", "--downgrade", "dblock_9999"],
        ["migrate", "--downgrade", "base", "--sql"],
    ],
)
def test_bad_arguments_exit_2_with_usage_and_touch_nothing(
    tmp_path: Path, args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process for speed: the same main() the console script calls (which the next test runs).
    home = tmp_path / "home"
    monkeypatch.setenv("DBLOCK_HOME", str(home))
    monkeypatch.delenv("DBLOCK_URL", raising=False)
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert "usage: dblock" in err and "error:" in err and out == ""
    assert not home.exists()  # the embedded default was not even created


@pytest.mark.parametrize("args", [[], ["run", "x", "--ttl", "-1", "--", "true"], ["release", "x"]])
def test_bad_arguments_through_the_console_script(tmp_path: Path, args: list[str]) -> None:
    cli = Cli(None, tmp_path)
    out = subprocess.run([str(DBLOCK), *args], env=cli.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert out.stderr.startswith("usage: dblock") and "error:" in out.stderr and out.stdout == ""
    assert not cli.home.exists()


def test_bad_arguments_leave_a_held_lock_alone(pg_cli: Cli, tmp_path: Path) -> None:
    cli = pg_cli
    assert cli.db is not None
    holder = cli.holder("job", tmp_path / "w", "--ttl", "30")
    before = cli.db.rows()
    for args in (["run", "job", "--ttl", "0", "--", "true"], ["release", "job"], ["release", "job", "--force"]):
        assert cli(*args).returncode == 2
    assert cli.db.rows()[0][:3] == before[0][:3]  # same holder, same token (the expiry moves: renewal)
    (tmp_path / "w" / "stop").touch()
    assert finish(holder)[0] == 0


# -- durations, --version, hints, waiting on a terminal, status's extra columns -----
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import dblock

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"dblock {dblock.__version__}\n"


def test_durations_take_units(embedded: Cli, tmp_path: Path) -> None:
    cli = embedded
    holder = cli.holder("job", tmp_path / "w", "--ttl", "2m", "--grace", "500ms")
    info = json.loads(cli("status", "--json").stdout)[0]
    assert 110 < info["expires_in"] <= 120  # 2m is 120 s
    (tmp_path / "w" / "stop").touch()
    assert finish(holder)[0] == 0
    busy = cli.holder("busy", tmp_path / "b", "--ttl", "1h")
    out = cli("run", "busy", "--wait", "0.3s", "--", "true")
    assert out.returncode == EXIT_BUSY
    # Human numbers in messages: what it waited, and what the holder has left of its hour.
    assert "stayed busy for 300 ms: held by " in out.stderr and " min left); not running the command" in out.stderr
    (tmp_path / "b" / "stop").touch()
    assert finish(busy)[0] == 0


def test_a_missing_double_dash_is_answered_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DBLOCK_HOME", str(tmp_path / "home"))
    assert main(["run", "nightly", "--ttl", "5m", "./report.sh", "--full"]) == 2
    err = capsys.readouterr().err
    assert "error: put -- before the command to run: dblock run nightly -- ./report.sh --full" in err
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ttl", "1e9"], "ttl must be between 1 ms and 366 days, not 11574.1 days"),
        (["--ttl", "0"], "ttl must be between 1 ms and 366 days, not 0 s"),
        (["--ttl", "2ms"], "ttl 2 ms leaves no time to trust the lease once the clock allowance is taken off "
                           "(1% of the ttl + 2 ms): give a ttl of more than 2.02 ms\n"),
        (["--wait", "-90"], "timeout must be >= 0 seconds (inf waits for ever), not -90 s"),
        (["--ttl", "5 minutes"], "not a duration: '5 minutes' (e.g. 30, 90s, 5m, 1h, 1d, 250ms)"),
        (["--min-interval", "400d"], "min-interval must be between 0 s and 366 days, not 400 days"),
    ],
)
def test_errors_say_durations_as_people_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    monkeypatch.setenv("DBLOCK_HOME", str(tmp_path / "home"))
    assert main(["run", "x", *args, "--", "true"]) == 2
    assert message in capsys.readouterr().err


def _read_until(fd: int, text: str, timeout: float = 30) -> str:
    """What a terminal shows, read until ``text`` appears."""
    seen = b""
    deadline = time.monotonic() + timeout
    while text.encode() not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{text!r} never appeared on the terminal; it showed {seen.decode(errors='replace')!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the other end is closed
                chunk = b""
            if not chunk:
                break
            seen += chunk
    return seen.decode(errors="replace")


def test_run_wait_on_a_terminal_says_who_holds_it_and_when_it_gets_it(cli: Cli, tmp_path: Path) -> None:
    holder = cli.holder("job", tmp_path / "w", "--ttl", "30")
    token = int((tmp_path / "w" / "started").read_text().split()[1])
    primary, secondary = pty.openpty()  # a real terminal as stderr
    try:
        waiter = subprocess.Popen(
            cli.args("run", "job", "--wait", "1m", "--", PY, "-c", "import os; print('token', os.environ['DBLOCK_TOKEN'])"),
            env=cli.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=secondary, text=True,
        )
        os.close(secondary)
        shown = _read_until(primary, " left)\r\n")
        assert f"dblock: waiting up to 60 s for lock 'job': held by {socket.gethostname()}:{holder.pid} " in shown
        assert f"(token {token}, " in shown and waiter.poll() is None
        (tmp_path / "w" / "stop").touch()
        shown = _read_until(primary, "dblock: got lock")  # the second line, once the holder lets go
        shown += _read_until(primary, ")\r\n")
        out, _ = waiter.communicate(timeout=30)
        assert waiter.returncode == 0
        new_token = int(out.split()[1])
        assert f"dblock: got lock 'job' after " in shown and f"(token {new_token})" in shown and new_token > token
    finally:
        os.close(primary)
    assert finish(holder)[0] == 0
    # Not on a terminal (a pipe, a log file): nothing is said while waiting, as before.
    quiet = cli("run", "job", "--wait", "5s", "--", "true")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_status_shows_how_long_it_was_held_and_who_waits(pg_cli: Cli, tmp_path: Path) -> None:
    cli = pg_cli
    holder = cli.holder("job", tmp_path / "w", "--ttl", "30")
    waiters = [cli.start("run", "job", "--wait", "1m", "--", "true") for _ in range(2)]
    try:
        wait_for(lambda: json.loads(cli("status", "--json").stdout)[0]["waiters"] == 2, 30, "two waiters queued")
        time.sleep(1.1)
        (info,) = json.loads(cli("status", "--json").stdout)
        assert info["waiters"] == 2 and 1 < info["held_for"] < 30
        row = cli("status").stdout.splitlines()[1]
        held, left, count = row.rsplit(None, 3)[1:]
        assert count == "2" and float(held.rstrip("s")) > 1 and float(left.rstrip("s")) > 15
        other = cli("status", "nobody")
        assert other.returncode == EXIT_NOT_HELD
    finally:
        (tmp_path / "w" / "stop").touch()
        for proc in waiters:
            assert finish(proc)[0] == 0
    assert finish(holder)[0] == 0
