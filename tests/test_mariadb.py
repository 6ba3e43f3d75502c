"""What is MariaDB's own: the command line on it, its URLs, byte-for-byte names, prune's floor, the
least-privilege grants docs/mariadb.md lists, and MySQL servers refused. (The backend contract, both
faces, the guarantees' race, fencing and shared leases run on MariaDB in their own files.)"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from sqlalchemy.engine import make_url

import dblock
from dblock import Locker
from dblock.backends.mariadb import check_server

from .conftest import Db, mariadb_connect
from .docs import blocks, section

BACKENDS = ("mariadb",)
DBLOCK = [sys.executable, "-m", "dblock"]


def cli(db: Db, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DBLOCK, "--url", db.url, "--table", db.table, *args], capture_output=True, text=True, timeout=60)


def test_the_command_line_runs_on_mariadb(db: Db) -> None:
    """migrate, run, status and release --force against a MariaDB URL."""
    assert cli(db, "migrate").returncode == 0
    ran = cli(db, "run", "nightly", "--", sys.executable, "-c", "import os; print(os.environ['DBLOCK_TOKEN'])")
    assert ran.returncode == 0, ran.stderr
    token = int(ran.stdout)
    holder = Locker(db.url, table=db.table).acquire("held", ttl=60)
    status = cli(db, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert [row["name"] for row in json.loads(status.stdout)] == ["held"]
    busy = cli(db, "run", "held", "--", "true")
    assert busy.returncode == 75 and "held by" in busy.stderr
    assert cli(db, "release", "held", "--force", "--yes").returncode == 0
    again = cli(db, "run", "nightly", "--", sys.executable, "-c", "import os; print(os.environ['DBLOCK_TOKEN'])")
    assert int(again.stdout) > token
    assert holder.release() is False  # the operator ended it


def test_names_are_compared_byte_for_byte(db: Db) -> None:
    """'job', 'Job' and 'job ' are three locks, as on PostgreSQL (the tables' no-pad binary collation)."""
    locker = db.locker()
    leases = [locker.try_acquire(name, ttl=30) for name in ("job", "Job", "job ", "jöb")]
    assert all(lease is not None for lease in leases)
    assert sorted(info.name for info in locker.leases()) == sorted(["job", "Job", "job ", "jöb"])


def test_prune_keeps_a_name_granted_within_its_floor(db: Db) -> None:
    """older_than below the floor: a name granted a moment ago is kept, one granted before the floor goes."""
    locker = db.locker()
    assert locker.backend.caps.prune_floor == 120
    locker.try_acquire("recent", ttl=0.01).release()
    locker.try_acquire("old", ttl=0.01).release()
    locker.try_acquire("top", ttl=0.01).release()  # the largest token: always kept
    db.query(f"UPDATE {db.table} SET acquired_at = acquired_at - 121 WHERE name = 'old'")
    assert locker.prune(older_than=0.001) == 1
    assert sorted(r[0] for r in db.rows()) == ["recent", "top"]


def test_url_typos_are_refused_when_the_locker_is_made(db: Db) -> None:
    url = make_url(db.url).update_query_dict({"chraset": "utf8mb4"}).render_as_string(hide_password=False)
    with pytest.raises(ValueError, match="chraset"):
        Locker(url)


def test_a_mysql_server_is_refused_and_old_mariadb_too() -> None:
    with pytest.raises(dblock.DBLockError, match="not on MySQL"):
        check_server("8.0.36", "mysql://db/app")
    with pytest.raises(dblock.DBLockError, match="10.6 or newer"):
        check_server("5.5.5-10.5.22-MariaDB", "mariadb://db/app")
    check_server("5.5.5-10.11.19-MariaDB-0+deb12u1", "mariadb://db/app")
    check_server("11.4.2-MariaDB", "mariadb://db/app")


@pytest.fixture
def app_user(db: Db) -> Iterator[str]:
    """A user with only the grants docs/mariadb.md lists, on the test's database and table."""
    url = make_url(db.url)
    database, user, password = url.database, "app_" + secrets.token_hex(4), secrets.token_hex(8)
    (grants,) = blocks(section("mariadb.md", "Least privilege"), "sql")
    grants = grants.replace("app.alembic_version_dblock", f"{database}.alembic_version_dblock_{db.table}")
    grants = grants.replace("app.locks_holders", f"{database}.{db.table}_holders").replace(
        "app.fences", f"{database}.{db.table}_fences").replace("app.locks", f"{database}.{db.table}")
    grants = grants.replace("'app_user'@'%'", f"'{user}'@'%'")
    conn = mariadb_connect(db.url)
    try:
        conn.cursor().execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'")
        for grant in filter(None, (g.strip() for g in grants.split(";"))):
            conn.cursor().execute(grant)
        yield url.set(username=user, password=password).render_as_string(hide_password=False)
    finally:
        conn.cursor().execute(f"DROP USER IF EXISTS '{user}'@'%'")
        conn.close()


def test_the_documented_grants_are_enough(db: Db, app_user: str) -> None:
    """Every call an app makes, as a user with only those grants; create_schema() changes nothing."""
    with Locker(app_user, table=db.table) as locker:
        assert locker.create_schema().changed is False
        lease = locker.acquire("job", ttl=30)
        lease.extend()
        with locker.read_lock("catalog", ttl=30):
            assert locker.try_acquire("catalog") is None
        assert [i.name for i in locker.leases()] == ["job"]
        assert lease.release() is True
        assert locker.prune(older_than=3600) == 0
    with Locker(app_user, table=db.table + "_nope") as locker, pytest.raises(dblock.PermissionDenied):
        locker.try_acquire("job")


def test_an_apps_alembic_runs_dblocks_migrations_on_mariadb(db: Db, tmp_path: Path) -> None:
    """docs/alembic.md's env.py lines in an app made by `alembic init`, on a fresh MariaDB database:
    one `alembic upgrade head` makes the app's tables and dblock's; each side's downgrade removes
    only its own."""
    from .docs import create_mariadb_database, drop_mariadb_database
    from .test_alembic_app import App

    url = create_mariadb_database(db.url)
    try:
        app = App(tmp_path / "app", Path(sys.executable).parent, url, "app_locks", None)
        app.alembic("revision", "--autogenerate", "-m", "items")
        app.alembic("upgrade", "head")
        dblock_tables = {"app_locks", "app_locks_fences", "app_locks_holders", "alembic_version_dblock_app_locks"}
        assert dblock_tables | {"items", "alembic_version"} <= app.tables()
        assert "No new upgrade operations detected" in app.alembic("check").stdout  # autogenerate leaves dblock's alone
        with Locker(url, table="app_locks") as locker:
            lease = locker.try_acquire("app-job")
            assert lease is not None and lease.release()
        app.alembic("downgrade", "base")
        assert "items" not in app.tables() and dblock_tables <= app.tables()
        app.dblock("migrate", "--downgrade", "base")
        assert not dblock_tables & app.tables()
    finally:
        drop_mariadb_database(url)


def test_the_django_app_runs_on_a_mariadb_database(db: Db, tmp_path: Path) -> None:
    """docs/django.md's project on a MariaDB database (Django's mysql ENGINE, through PyMySQL's
    MySQLdb shim): migrate makes dblock's tables, debit() takes the lock and writes fenced, and
    `manage.py dblock status` reads the same tables."""
    pytest.importorskip("django")
    from .docs import create_mariadb_database, drop_mariadb_database
    from .test_docs import run_the_django_samples

    url = make_url(create_mariadb_database(db.url))
    database = {"ENGINE": "django.db.backends.mysql", "NAME": url.database or "", "USER": url.username or "",
                "PASSWORD": url.password or "", "HOST": url.host or "", "PORT": str(url.port or "")}
    try:
        run_the_django_samples(tmp_path, database, prelude="import pymysql\npymysql.install_as_MySQLdb()\n")
    finally:
        drop_mariadb_database(url.render_as_string(hide_password=False))


# -- faults: a server of the test's own, frozen and killed -----------------------------------------
SLACK = 3.0  # a loaded 2-core machine's scheduling


@pytest.fixture
def own_server() -> Iterator[object]:
    """A throwaway MariaDB server for this test alone (it is frozen and killed)."""
    from dblock import _mariadb_server

    found = _mariadb_server.find()
    if isinstance(found, str):
        pytest.skip(found)
    server = _mariadb_server.MariaDBServer.start()
    try:
        yield server
    finally:
        server.stop()


def _timed(call):  # noqa: ANN001, ANN202
    import time

    started = time.monotonic()
    try:
        result, exc = call(), None
    except Exception as caught:  # noqa: BLE001 - the test reads it
        result, exc = None, caught
    return time.monotonic() - started, exc, result


def test_a_frozen_server_bounds_every_call_and_leaks_no_lease(own_server: object) -> None:
    """SIGSTOP the server: calls return in time (the watchdog cuts PyMySQL's socket); thawed, what a
    cut-off call granted is ended by the clean-up, and the lock works again."""
    import os
    import signal

    from .conftest import wait_for

    url, pid = own_server.url, own_server.pid  # type: ignore[attr-defined]
    table = "t_" + secrets.token_hex(4)
    with Locker(url, table=table, op_timeout=1) as locker:
        locker.create_schema()
        locker.try_acquire("warm").release()  # a pooled connection whose server will freeze
        os.kill(pid, signal.SIGSTOP)
        try:
            took, exc, _ = _timed(lambda: locker.try_acquire("frozen", ttl=60))
            assert isinstance(exc, dblock.DatabaseUnavailable), exc
            assert took <= 1.25 + 1 + SLACK, f"try_acquire took {took:.1f} s on a frozen server (op_timeout=1)"
            took, exc, _ = _timed(lambda: locker.acquire("frozen", ttl=60, timeout=2))
            assert isinstance(exc, dblock.DatabaseUnavailable), exc
            assert took <= 2 + 2.5 + SLACK, f"acquire(timeout=2) took {took:.1f} s on a frozen server"
        finally:
            os.kill(pid, signal.SIGCONT)
        probe = Db("mariadb", url, table)
        wait_for(lambda: probe.query(f"SELECT count(*) FROM {table} WHERE owner IS NOT NULL") == [(0,)],
                 timeout=30, what="the abandoned grants to be ended")
        assert locker.try_acquire("frozen") is not None


def test_a_killed_server_is_an_outage_and_a_restarted_one_serves_again(own_server: object) -> None:
    """The server killed outright: every call raises DatabaseUnavailable in time; started again on
    the same files, the same Locker grants above every earlier token."""
    from dblock import _mariadb_server

    url = own_server.url  # type: ignore[attr-defined]
    table = "t_" + secrets.token_hex(4)
    with Locker(url, table=table, op_timeout=1) as locker:
        locker.create_schema()
        first = locker.try_acquire("k", ttl=60)
        assert first is not None
        own_server.kill()  # type: ignore[attr-defined]
        took, exc, _ = _timed(lambda: locker.try_acquire("k"))
        assert isinstance(exc, dblock.DatabaseUnavailable), exc
        assert took <= 2 + SLACK
        with pytest.raises(dblock.DatabaseUnavailable):
            first.release()
    assert isinstance(_mariadb_server.find(), tuple)
