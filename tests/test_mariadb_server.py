"""The throwaway MariaDB server (dblock/_mariadb_server.py), started and stopped for real.

Each test gives the servers a base directory of its own, so that it can check
that nothing is left behind: no directory, and no process whose command line
names the base (mariadbd, or mariadb-install-db and its bootstrap server).
Skipped, with what to install, where MariaDB's binaries or PyMySQL are missing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from dblock._mariadb_server import DATABASE, MariaDBServer, find

FOUND = find()
if isinstance(FOUND, str):
    pytest.skip(FOUND, allow_module_level=True)

import pymysql  # noqa: E402 - after the skip: find() checks that it is installed

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory for the test's servers; at the end it must be empty, with no process in it.

    Not pytest's tmp_path: as root the server runs as the OS user mysql, which
    must be able to enter the directory (mode 0711).
    """
    shm = "/dev/shm"
    where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
    path = Path(tempfile.mkdtemp(prefix="dblock-test-mariadb-", dir=where))
    path.chmod(0o711)
    try:
        yield path
        assert list(path.iterdir()) == []
        assert processes_naming(path) == []
    finally:
        for pid in processes_naming(path):  # a failed test must not leave a server running
            os.kill(pid, 9)
        subprocess.run(["rm", "-rf", str(path)], check=False)


def processes_naming(path: Path) -> list[int]:
    """The pids of the processes whose command line mentions ``path``."""
    needle = os.fsencode(path)
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path("/proc", entry, "cmdline").read_bytes()
            except OSError:  # gone meanwhile
                continue
            if needle in cmdline:
                found.append(int(entry))
    return found


def connect(server: MariaDBServer) -> Any:
    """A PyMySQL connection made from the parts of ``server.url``."""
    url = make_url(server.url)
    return pymysql.connect(
        host=url.host, port=url.port, user=url.username, password=url.password, database=url.database
    )


def query(server: MariaDBServer, sql: str) -> list[tuple[Any, ...]]:
    connection = connect(server)
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql)
            return list(cursor.fetchall())
    finally:
        connection.close()


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_server_stores_and_answers_then_stops_leaving_nothing(base: Path) -> None:
    began = time.monotonic()
    server = MariaDBServer.start(base)
    took = time.monotonic() - began
    try:
        assert took < 30, took
        url = make_url(server.url)
        assert url.drivername == "mariadb+pymysql"
        assert (url.host, url.port, url.username, url.password, url.database) == (
            "127.0.0.1", server.port, "root", server.password, DATABASE,
        )
        assert server.password not in repr(server)
        assert server.directory.parent == base.resolve()
        assert server.socket_path.is_socket()
        assert int((server.directory / "pid").read_text()) == server.pid
        assert not (server.directory / "init.sql").exists()  # it held the password

        connection = connect(server)
        try:
            with connection.cursor() as cursor:
                cursor.execute("CREATE TABLE notes (id INT PRIMARY KEY, body VARCHAR(50)) ENGINE=InnoDB")
                cursor.execute("INSERT INTO notes VALUES (1, 'first'), (2, 'ünïcode ✓')")
            connection.commit()
        finally:
            connection.close()
        assert query(server, "SELECT id, body FROM notes ORDER BY id") == [(1, "first"), (2, "ünïcode ✓")]
        ((version,),) = query(server, "SELECT @@version")
        assert "MariaDB" in version
        # Production-like where it matters: durable commits, utf8mb4, no binary log.
        assert query(server, "SELECT @@innodb_flush_log_at_trx_commit, @@character_set_server, @@log_bin") == [
            (1, "utf8mb4", 0)
        ]

        engine = create_engine(server.url)  # the URL works as SQLAlchemy's too
        try:
            with engine.connect() as sa:
                assert sa.execute(text("SELECT COUNT(*) FROM notes")).scalar_one() == 2
        finally:
            engine.dispose()
    finally:
        server.stop()
    server.stop()  # again: nothing to do
    assert refused(server.port)
    assert not server.directory.exists()
    assert not alive(server.pid)


def test_two_servers_at_once_are_independent(base: Path) -> None:
    with MariaDBServer.start(base) as first, MariaDBServer.start(base) as second:
        assert first.port != second.port
        assert first.directory != second.directory
        assert first.password != second.password
        query(first, "CREATE TABLE only_in_first (x INT)")
        tables = "SELECT table_name FROM information_schema.tables WHERE table_schema = 'dblock_test'"
        assert query(first, tables) == [("only_in_first",)]
        assert query(second, tables) == []
        first.stop()
        assert refused(first.port)
        assert query(second, "SELECT 1") == [(1,)]  # the other one still serves
    assert not first.directory.exists() and not second.directory.exists()


def test_a_killed_server_stops_without_error(base: Path) -> None:
    server = MariaDBServer.start(base)
    server.kill()
    assert not alive(server.pid)  # gone, and reaped
    assert refused(server.port)
    assert server.directory.exists()  # its files stay until stop(), as a crash leaves them
    server.kill()  # again: nothing to do
    server.stop()
    assert not server.directory.exists()


def test_a_start_past_its_timeout_leaves_no_process_and_no_directory(base: Path) -> None:
    with pytest.raises(RuntimeError, match=r"did not (start|answer) within 0\.001 s"):
        MariaDBServer.start(base, timeout=0.001)
    # The fixture checks: base is empty, and no process names it.


def test_a_timeout_anywhere_in_the_start_leaves_nothing_behind(base: Path) -> None:
    """Timeouts a little short of a start: killed while installing or while the server starts up,
    the start leaves nothing behind; or, being fast enough, it gives a server that works."""
    began = time.monotonic()
    MariaDBServer.start(base).stop()
    usual = time.monotonic() - began
    for fraction in (0.3, 0.6, 0.8, 0.95):  # here: install killed, install killed, mariadbd killed, served
        try:
            server = MariaDBServer.start(base, timeout=usual * fraction)
        except RuntimeError as error:
            assert "within" in str(error)
        else:
            with server:
                assert query(server, "SELECT 1") == [(1,)]
        assert list(base.iterdir()) == []
        assert processes_naming(base) == []


def test_a_forgotten_server_stops_at_exit_but_not_when_a_fork_exits(base: Path) -> None:
    script = textwrap.dedent(
        """
        import os, sys
        from pathlib import Path
        import pymysql
        from dblock._mariadb_server import MariaDBServer

        server = MariaDBServer.start(Path(sys.argv[1]))
        child = os.fork()
        if child == 0:
            sys.exit(0)  # a normal exit: atexit runs in the child, and must leave the server be
        os.waitpid(child, 0)
        pymysql.connect(host="127.0.0.1", port=server.port, user="root", password=server.password).close()
        print(server.pid, server.port, server.directory)
        # no stop(): the interpreter's exit stops it
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(base)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    pid, port, directory = done.stdout.split()
    assert not alive(int(pid))
    assert refused(int(port))
    assert not Path(directory).exists()
