"""dblock's pytest plugin, run with pytester as a user's project runs it (the entry point loads it)."""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import alembic.context
import alembic.op
import pytest

import dblock.aio
import dblock.migrate
from .conftest import Db
from .docs import samples

# The runs of a user's tests that use dblock's locks go in a process of their own
# (runpytest_subprocess): in this process they would share its threads, its
# exception hooks and the modules the suite's earlier tests loaded, and a CI run
# saw the inner session crash while reporting an expected failure.
# The in-process runs that remain: pytester runs the user's tests in this process and then forgets the modules
# imported since it started. Alembic's `context` and `op` are module proxies
# bound to one class: load them (and dblock.migrate, which uses them) before
# any snapshot, or a later create_schema pairs a forgotten module with a fresh
# one. For the same reason the tests ask for `pg` (which may start pgserver,
# and import psutil that its clean-up needs) before `pytester`.
# dblock.aio likewise: dblock caches its AsyncLease class, which a re-import would replace.
assert alembic.context and alembic.op and dblock.migrate and dblock.aio

pytest_plugins = ["pytester"]



def readme_example() -> str:
    ((_, block),) = samples("pytest.md")
    assert block.startswith("# test_reports.py\n")
    return block


MORE_TESTS = '''
import dblock
import pytest


def test_unhandled_fenced_out_fails_the_users_test(dblock_locker, dblock_expire, dblock_compete):
    def write(lease):
        with dblock_locker.engine.begin() as conn:
            dblock.fence(conn, lease)

    lease = dblock_locker.acquire("job")
    dblock_expire(lease)
    dblock_compete("job", write)
    write(lease)


def test_a_live_lease_keeps_the_competitor_out(dblock_locker, dblock_compete):
    lease = dblock_locker.acquire("job")
    with pytest.raises(dblock.LockNotAcquired):
        dblock_compete("job", lambda other: None, timeout=0.05)
    assert lease.extend() is None and lease.release()
    assert dblock_compete("job", lambda other: other.token) > lease.token


def test_expire_refuses_an_ended_lease(dblock_locker, dblock_expire):
    lease = dblock_locker.acquire("job")
    lease.release()
    with pytest.raises(dblock.LeaseLost):
        dblock_expire(lease)


def test_expire_and_compete_on_the_apps_own_sqlite(tmp_path, dblock_expire, dblock_compete):
    with dblock.Locker(f"sqlite:///{tmp_path / 'app.db'}") as locker:
        locker.create_schema()
        lease = locker.acquire("job")
        dblock_expire(lease)
        assert lease.remaining() > 0  # the holder was not told, as after a real pause
        assert dblock_compete("job", lambda other: other.token, locker=locker) > lease.token
        with pytest.raises(dblock.LeaseLost):
            lease.extend()


@pytest.mark.parametrize("n", [1, 2])
def test_each_test_gets_a_fresh_schema(dblock_locker, n):
    assert dblock_locker.leases() == []
    dblock_locker.acquire("left-held")
    with open("schemas.txt", "a") as f:
        f.write(dblock_locker.schema + "\\n")
'''


def test_users_tests_run_on_the_fixtures(pg: Db, pytester: pytest.Pytester) -> None:
    """The example of docs/pytest.md passes; an unhandled FencedOut fails the user's test; schemas are fresh and dropped."""
    pytester.makepyfile(test_reports=readme_example(), test_more=MORE_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--dblock-url={pg.url}")
    result.assert_outcomes(passed=6, failed=1)
    result.stdout.fnmatch_lines(["*test_unhandled_fenced_out_fails_the_users_test*", "*FencedOut: fenced out*"])
    schemas = (pytester.path / "schemas.txt").read_text().split()
    assert len(set(schemas)) == 2
    assert pg.query("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'dblock_test_%%'") == []


ASYNC_TESTS = '''
import asyncio

import dblock
import pytest


@pytest.mark.asyncio
async def test_an_expired_async_lease_is_taken_over(dblock_async_locker, dblock_expire, dblock_acompete):
    lease = await dblock_async_locker.acquire("job")
    dblock_expire(lease)
    assert lease.remaining() > 0  # not told, as after a real pause

    async def newer(other):
        await asyncio.sleep(0)
        return other.token

    assert await dblock_acompete("job", newer) > lease.token
    with pytest.raises(dblock.LeaseLost):
        await lease.extend()


@pytest.mark.asyncio
async def test_a_live_async_lease_keeps_the_competitor_out(dblock_async_locker, dblock_acompete, dblock_compete):
    lease = await dblock_async_locker.acquire("job")
    with pytest.raises(dblock.LockNotAcquired):
        await dblock_acompete("job", lambda other: None, timeout=0.05)
    with pytest.raises(dblock.LockNotAcquired):
        dblock_compete("job", lambda other: None, locker=dblock_async_locker)
    await lease.release()
    assert await dblock_acompete("job", lambda other: other.token) > lease.token


@pytest.mark.asyncio
async def test_acompete_without_a_locker_says_what_it_needs(dblock_acompete):
    with pytest.raises(TypeError, match="locker="):
        await dblock_acompete("job", lambda other: None)


@pytest.mark.asyncio
async def test_the_async_fixture_is_fresh(dblock_async_locker):
    assert await dblock_async_locker.leases() == []
    await dblock_async_locker.acquire("left-held")
'''


def test_async_tests_run_on_the_async_fixtures(pg: Db, pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_async=ASYNC_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--dblock-url={pg.url}")
    result.assert_outcomes(passed=4)
    assert pg.query("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'dblock_test_%%'") == []


SETTINGS_TEST = '''
import os

def test_settings(dblock_url, request):
    assert dblock_url == os.environ["EXPECT_URL"]
    if "EXPECT_TTL" in os.environ:
        assert request.getfixturevalue("dblock_locker").ttl == float(os.environ["EXPECT_TTL"])
'''


def test_each_setting_is_a_flag_and_an_ini_option(pg: Db, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Flag beats $DBLOCK_TEST_URL beats the ini option."""
    pytester.makeini("[pytest]\ndblock_url = postgresql://ini@example.invalid/db\ndblock_ttl = 7\n")
    pytester.makepyfile(SETTINGS_TEST)
    monkeypatch.delenv("DBLOCK_TEST_URL", raising=False)
    monkeypatch.setenv("EXPECT_URL", "postgresql+psycopg://ini@example.invalid/db")
    pytester.runpytest().assert_outcomes(passed=1)

    monkeypatch.setenv("DBLOCK_TEST_URL", pg.url)
    monkeypatch.setenv("EXPECT_URL", pg.url)
    monkeypatch.setenv("EXPECT_TTL", "7")
    pytester.runpytest().assert_outcomes(passed=1)

    monkeypatch.setenv("DBLOCK_TEST_URL", "postgresql://env@example.invalid/db")
    monkeypatch.setenv("EXPECT_TTL", "5")
    pytester.runpytest(f"--dblock-url={pg.url}", "--dblock-ttl=5").assert_outcomes(passed=1)

    helped = pytester.runpytest("--help")
    helped.stdout.fnmatch_lines(["*--dblock-url=URL*", "*--dblock-ttl=SECONDS*", "*dblock_url (string)*", "*dblock_ttl (string)*"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "*the dblock fixtures need a PostgreSQL: pass --dblock-url=* or pip install 'dblock?testing?' *"),
        (["--dblock-url=sqlite:///x.db"], "*dblock_url must be a PostgreSQL URL (postgresql://user@host/db), not sqlite://*"),
        (["--dblock-url=postgresql://u@h/db", "--dblock-ttl=soon"], "*dblock_ttl must be a number of seconds, not 'soon'*"),
    ],
)
def test_bad_settings_say_what_to_do(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    monkeypatch.delenv("DBLOCK_TEST_URL", raising=False)
    monkeypatch.setitem(sys.modules, "pgserver", None)  # as if dblock[testing] were not installed
    pytester.makepyfile("def test_uses_dblock(dblock_locker):\n    pass\n")
    result = pytester.runpytest(*args)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([message])


def test_plugin_fixtures_leave_the_projects_own_fixtures_alone(pytester: pytest.Pytester) -> None:
    """A user's own `locker` fixture is untouched: the plugin's are all dblock_*."""
    pytester.makeconftest("import pytest\n\n@pytest.fixture\ndef locker():\n    return 'mine'\n")
    pytester.makepyfile("def test_mine(locker):\n    assert locker == 'mine'\n")
    pytester.runpytest().assert_outcomes(passed=1)
    listed = pytester.runpytest("--fixtures")
    names = set(re.findall(r"^(dblock_\w+)", listed.stdout.str(), re.M))
    assert names == {
        "dblock_postgresql", "dblock_url", "dblock_locker", "dblock_expire", "dblock_compete",
        "dblock_async_locker", "dblock_acompete", "dblock_mariadb_url", "dblock_mariadb_locker",
    }


def test_the_plugin_costs_nothing_until_a_fixture_is_used(tmp_path: Path) -> None:
    """pytest loads the plugin in every run where dblock is installed: it must not import
    SQLAlchemy or psycopg (about 0.15 s) for test runs that never touch dblock."""
    import os
    import subprocess

    (tmp_path / "test_plain.py").write_text(
        "import sys\n"
        "def test_plain(request):\n"
        "    assert request.config.pluginmanager.has_plugin('dblock')\n"
        "    assert not {'sqlalchemy', 'psycopg'} & set(sys.modules)\n"
        "    import dblock\n"
        "    assert dblock.Locker and 'sqlalchemy' in sys.modules  # loaded on first use\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


MARIADB_TESTS = '''
import dblock
import pytest


def test_an_expired_lease_is_taken_over_on_mariadb(dblock_mariadb_locker, dblock_expire, dblock_compete):
    lease = dblock_mariadb_locker.acquire("job")
    dblock_expire(lease)
    newer = dblock_compete("job", lambda other: other.token, locker=dblock_mariadb_locker)
    assert newer > lease.token
    with pytest.raises(dblock.LeaseLost):
        lease.extend()
    with open("databases.txt", "a") as f:
        f.write(dblock_mariadb_locker.engine.url.database + "\\n")


def test_each_test_gets_a_fresh_database(dblock_mariadb_locker):
    assert dblock_mariadb_locker.leases() == []
    with open("databases.txt", "a") as f:
        f.write(dblock_mariadb_locker.engine.url.database + "\\n")
'''


def test_the_mariadb_fixtures_start_a_throwaway_server(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no MariaDB URL configured, the plugin starts a server of its own for the session (the
    machine's mariadbd), and each dblock_mariadb_locker works in a fresh database, dropped after."""
    from dblock import _mariadb_server

    found = _mariadb_server.find()
    if isinstance(found, str):
        pytest.skip(found)
    pytester.makepyfile(test_maria=MARIADB_TESTS)
    monkeypatch.delenv("DBLOCK_TEST_MARIADB_URL", raising=False)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    databases = (pytester.path / "databases.txt").read_text().split()
    assert len(set(databases)) == 2 and all(d.startswith("dblock_test_") for d in databases)


USER_MAKER = """
import pwd, sys
from dblock import pytest_plugin
print("ready", flush=True)
sys.stdin.readline()
pytest_plugin._system_user_once(sys.argv[1])
print(pwd.getpwnam(sys.argv[1]).pw_uid, flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="only root makes pgserver's system user")
@pytest.mark.skipif(shutil.which("useradd") is None, reason="no useradd on this machine to make a system user with")
def test_test_processes_started_together_make_one_system_user(tmp_path: Path) -> None:
    """As root, pgserver runs PostgreSQL as a system user it makes on first use; xdist's workers
    start their servers together. Four processes told to make the same new user at the same moment
    all see one user id (unserialized, each ran useradd and each saw its own id: 5 runs in 5)."""
    name = "dbt" + secrets.token_hex(4)
    procs = [
        subprocess.Popen([sys.executable, "-c", USER_MAKER, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        for p in procs:  # released together, once all are ready
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        seen = [p.communicate(timeout=60)[0].strip() for p in procs]
        assert all(p.returncode == 0 for p in procs), seen
        assert len(set(seen)) == 1 and seen[0] == str(pwd.getpwnam(name).pw_uid), seen
    finally:
        for p in procs:
            p.kill()
        subprocess.run(["userdel", "-r", name], capture_output=True)
