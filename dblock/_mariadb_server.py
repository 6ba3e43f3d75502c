"""A throwaway MariaDB server for tests, as ``pgserver`` gives a throwaway PostgreSQL.

``MariaDBServer.start()`` makes a fresh data directory with the machine's own
``mariadb-install-db``, runs ``mariadbd`` on it on a free 127.0.0.1 port, and
returns once a client can log in; ``stop()`` ends the server and deletes the
directory. dblock's pytest plugin and its own test suite use it; nothing else in
dblock does, so the module needs a MariaDB server installed only when it runs:

    reason = find()                      # the binaries, or why there are none
    if isinstance(reason, str):
        pytest.skip(reason)
    with MariaDBServer.start() as server:
        engine = sqlalchemy.create_engine(server.url)

What the server is like:

- No option file is read (``--no-defaults``): ``/etc/mysql`` and the system's
  own server on port 3306 play no part. The few settings are in ``_SETTINGS``.
- Commits are durable as in production (``innodb_flush_log_at_trx_commit`` keeps
  its default, 1), but the files live in ``/dev/shm`` where the machine has it,
  so a commit costs no disk flush and a slow disk does not slow the tests.
- Clients log in as ``root`` with a random password, over TCP on 127.0.0.1
  (``url``); the database ``dblock_test`` is there, empty. The Unix socket
  (``socket_path``) lets ``root`` in without a password, but only a user who may
  enter the server's directory (mode 0700) can reach it.
- Run as root, the server runs as the OS user ``mysql`` (mariadbd refuses to run
  as root unless told to), which must be able to enter ``base``: ``/dev/shm``
  and the temp directory are fine, pytest's ``tmp_path`` (mode 0700) is not.

A server nobody stopped is stopped when the interpreter exits, by the process
that started it only: a forked child (which has a copy of the object) never
stops its parent's server.

Needs PyMySQL (``pip install pymysql``) to tell when the server is up.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

DATABASE = "dblock_test"
USER = "root"
HOST = "127.0.0.1"

# Where the two binaries may be besides PATH: Debian puts mariadbd in /usr/sbin,
# which a non-root user's PATH often lacks.
_SEARCH = ("/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin")
_INSTALL_DB = "mariadb-install-db"
_MARIADBD = "mariadbd"
_MISSING = "MariaDB server not installed (apt-get install mariadb-server)"

# The server's settings, given to the bootstrap run of mariadb-install-db too so
# that the files it makes already fit them (no log file resize at the first start).
_SETTINGS = (
    "--skip-log-bin",  # no binary log: nothing replicates from a test server
    "--innodb-buffer-pool-size=64M",  # plenty for tests; the default is 128M
    "--innodb-log-file-size=8M",  # the default is 96M of RAM when in /dev/shm
    # What Debian's own configuration sets; without an option file the server
    # would start with latin1, which no production server of today uses.
    "--character-set-server=utf8mb4",
)

# A name for the OS user the server runs as when we are root: the install makes
# the files its, and the server drops to it.
_SERVER_OS_USER = "mysql"

_PORT_TRIES = 3  # another process may take the free port before mariadbd binds it
_POLL = 0.05  # seconds between readiness checks
_CONNECT_TIMEOUT = 1.0  # seconds a readiness check may take
_STOP_GRACE = 10.0  # seconds a SIGTERM'd server has to shut down before SIGKILL
_SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes, the last one a NUL
_TAIL_LINES = 25  # of a log, in an error message


def find() -> tuple[str, str] | str:
    """The paths of ``(mariadb-install-db, mariadbd)``, or why the server cannot run.

    Each is looked up on PATH, then in /usr/sbin, /usr/bin, /usr/local/sbin and
    /usr/local/bin. When one is missing (or PyMySQL, which ``start`` needs to see
    the server answer), the answer is a sentence saying what to install, fit for
    ``pytest.skip``.
    """
    install_db, mariadbd = _which(_INSTALL_DB), _which(_MARIADBD)
    if install_db is None or mariadbd is None:
        missing = [name for name, path in ((_INSTALL_DB, install_db), (_MARIADBD, mariadbd)) if path is None]
        return f"{_MISSING}: no {' or '.join(missing)} on PATH or in {', '.join(_SEARCH)}"
    if importlib.util.find_spec("pymysql") is None:
        return "PyMySQL not installed (pip install pymysql): it tells when a throwaway MariaDB server is up"
    return install_db, mariadbd


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found is not None:
        return found
    for directory in _SEARCH:
        path = os.path.join(directory, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


class MariaDBServer:
    """A running throwaway MariaDB server; make one with ``MariaDBServer.start()``.

    ``url`` is a SQLAlchemy URL (``mariadb+pymysql://root:<password>@127.0.0.1:<port>/dblock_test``);
    ``port`` and ``password`` are its parts, ``socket_path`` the server's Unix
    socket, ``pid`` the ``mariadbd`` process, ``directory`` where all its files
    are (the data in ``directory / "data"``, its error log in ``directory / "mariadbd.log"``).
    """

    def __init__(self, process: subprocess.Popen[bytes], directory: Path, port: int, password: str) -> None:
        self._process = process
        self._owner = os.getpid()  # only this process may stop the server
        self._stopped = False
        self.directory = directory
        self.port = port
        self.password = password
        self.pid = process.pid
        self.socket_path = directory / "s.sock"
        self.url = f"mariadb+pymysql://{USER}:{password}@{HOST}:{port}/{DATABASE}"

    @classmethod
    def start(cls, base: Path | None = None, *, timeout: float = 60) -> MariaDBServer:
        """Start a server in a new directory under ``base``; return once it answers.

        ``base`` defaults to ``/dev/shm`` where it is writable, else the temp
        directory. Everything, from making the data directory to the first
        answered query, takes at most ``timeout`` seconds: past that the server
        (or the install still running) is killed, its directory deleted, and
        ``RuntimeError`` raised with the end of its log. The same happens if the
        server exits before it answers.
        """
        binaries = find()
        if isinstance(binaries, str):
            raise RuntimeError(binaries)
        install_db, mariadbd = binaries
        deadline = time.monotonic() + timeout
        if base is None:
            base = Path(_memory_dir() or tempfile.gettempdir())
        directory = Path(tempfile.mkdtemp(prefix="dblock-mariadb-", dir=base)).resolve()
        process: subprocess.Popen[bytes] | None = None
        try:
            socket_path = directory / "s.sock"
            if len(os.fsencode(socket_path)) > _SOCKET_PATH_MAX:
                raise ValueError(f"base is too long a path for a Unix socket in it ({socket_path}): pass a shorter one")
            user_option = _os_user(directory)
            _install(install_db, directory, user_option, deadline, timeout)
            password = secrets.token_hex(16)  # hex: nothing to quote in the URL or in SQL
            # Run by the server itself before it accepts a connection, so no client
            # ever finds root@127.0.0.1 without its password.
            init = directory / "init.sql"
            init.write_text(
                f"ALTER USER '{USER}'@'{HOST}' IDENTIFIED BY '{password}';\n"
                f"CREATE DATABASE IF NOT EXISTS {DATABASE};\n"
            )
            init.chmod(0o644)  # readable by the server's OS user; the directory is 0700
            server_log = directory / "mariadbd.log"
            log = ""
            for _ in range(_PORT_TRIES):
                port = _free_port()
                begins = server_log.stat().st_size if server_log.exists() else 0  # this try's part of the log
                process = _spawn(mariadbd, directory, port, user_option)
                state = _wait_ready(process, port, password, deadline)
                if state == "ready":
                    init.unlink()  # the password stays only in memory, and in the URL
                    server = cls(process, directory, port, password)
                    _register(server)
                    return server
                if state == "late":
                    raise RuntimeError(
                        f"MariaDB did not answer within {timeout:g} s; the end of its log:\n" + _tail(server_log, begins)
                    )
                process.wait()
                log = _tail(server_log, begins)
                process = None
                if "Address already in use" not in log:
                    raise RuntimeError(f"MariaDB exited before it answered; the end of its log:\n{log}{_hint(log)}")
            raise RuntimeError(f"MariaDB found no free port in {_PORT_TRIES} tries; the end of its log:\n{log}")
        except BaseException:
            if process is not None:
                _kill_group(process)
            _remove(directory)
            raise

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and delete its directory.

        Stopping twice, or a server already killed, is fine. In a forked child
        this does nothing: the server is the parent's.
        """
        if self._stopped or os.getpid() != self._owner:
            return
        if self._process.poll() is None:
            self._process.terminate()  # SIGTERM: mariadbd's clean shutdown
            try:
                self._process.wait(timeout=_STOP_GRACE)
            except subprocess.TimeoutExpired:
                _kill_group(self._process)
        _remove(self.directory)
        self._stopped = True
        _running.discard(self)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would end it; its files stay until ``stop()``."""
        if os.getpid() == self._owner and self._process.poll() is None:
            _kill_group(self._process)

    def __enter__(self) -> MariaDBServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:  # no password: reprs end up in logs
        state = "stopped" if self._stopped else f"pid {self.pid}"
        return f"<MariaDBServer {HOST}:{self.port} {state} in {self.directory}>"


# -- the servers to stop at exit ---------------------------------------------------------------
_running: set[MariaDBServer] = set()
_at_exit_registered = False


def _register(server: MariaDBServer) -> None:
    global _at_exit_registered
    _running.add(server)
    if not _at_exit_registered:
        atexit.register(_stop_all)
        _at_exit_registered = True


def _stop_all() -> None:
    """At interpreter exit: stop what was left running (``stop`` skips a forked child's copies)."""
    for server in list(_running):
        try:
            server.stop()
        except Exception:  # pragma: no cover - the next one must be stopped all the same
            pass


# -- the steps of start ------------------------------------------------------------------------
def _memory_dir() -> str | None:
    """``/dev/shm`` where it is a writable directory, else None (the temp directory)."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def _os_user(directory: Path) -> list[str]:
    """The ``--user`` option, and the directory handed to that user.

    As root: the OS user ``mysql`` (where it exists, else root itself, which
    mariadbd accepts when told explicitly), owning the directory. Otherwise the
    server runs as we do, and no option is needed.
    """
    if os.geteuid() != 0:
        return []
    try:
        entry = pwd.getpwnam(_SERVER_OS_USER)
    except KeyError:
        return ["--user=root"]
    os.chown(directory, entry.pw_uid, entry.pw_gid)
    return [f"--user={_SERVER_OS_USER}"]


def _tmpdir(directory: Path) -> Path:
    """The server's own temporary directory, ``directory / "tmp"``, owned as ``directory`` is.

    Not the shared ``/tmp``: bootstrap runs started at the same moment by other
    test processes lost their temporary tables there now and then
    (``Unknown table 'mysql.tmp_user_sys'``, the install aborted).
    """
    path = directory / "tmp"
    if not path.exists():
        path.mkdir(mode=0o700)
        owner = directory.stat()
        os.chown(path, owner.st_uid, owner.st_gid)
    return path


def _install(install_db: str, directory: Path, user_option: list[str], deadline: float, timeout: float) -> None:
    """Make the system tables in ``directory / "data"`` (about half a second)."""
    command = [
        install_db,
        "--no-defaults",  # must come first
        *user_option,
        f"--datadir={directory / 'data'}",
        "--auth-root-authentication-method=normal",  # root@localhost and root@127.0.0.1, no password yet
        "--skip-test-db",
        "--skip-name-resolve",
        f"--tmpdir={_tmpdir(directory)}",
        *_SETTINGS,
    ]
    log = directory / "install.log"
    with open(log, "wb") as out:
        # A session of its own: the script runs mariadbd --bootstrap as its child,
        # and a timeout must kill both.
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=directory,
            start_new_session=True,
        )
    try:
        code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(process)
        raise RuntimeError(
            f"MariaDB did not start within {timeout:g} s (mariadb-install-db was still running); its output:\n"
            + _tail(log)
        ) from None
    except BaseException:  # an interrupt: no bootstrap server left running either
        _kill_group(process)
        raise
    if code != 0:
        # Its own errors, not the tail: that is a page of advice, the same whatever went wrong.
        output = _tail(log, lines=500)
        errors = "\n".join(line for line in output.splitlines() if "ERROR" in line) or output
        raise RuntimeError(f"mariadb-install-db failed (exit status {code}); its errors:\n{errors}{_hint(errors)}")


def _spawn(mariadbd: str, directory: Path, port: int, user_option: list[str]) -> subprocess.Popen[bytes]:
    command = [
        mariadbd,
        "--no-defaults",  # must come first
        *user_option,
        f"--datadir={directory / 'data'}",
        f"--socket={directory / 's.sock'}",
        f"--port={port}",
        f"--bind-address={HOST}",
        f"--pid-file={directory / 'pid'}",
        "--skip-name-resolve",  # so that root@'127.0.0.1' is the account a TCP client logs in as
        f"--init-file={directory / 'init.sql'}",
        f"--tmpdir={_tmpdir(directory)}",
        *_SETTINGS,
    ]
    # The server logs to stderr without --log-error: into a file we open, which
    # works whatever the OS user the server runs as may write. A session of its
    # own: a Ctrl-C in the terminal goes to the tests, whose exit stops the server.
    with open(directory / "mariadbd.log", "ab") as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=directory,
            start_new_session=True,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait_ready(
    process: subprocess.Popen[bytes], port: int, password: str, deadline: float
) -> Literal["ready", "exited", "late"]:
    """Log in over TCP and run ``SELECT 1`` every 50 ms until it works, the server exits, or the deadline."""
    pymysql: Any = importlib.import_module("pymysql")  # untyped; imported when a server starts
    while True:
        if process.poll() is not None:
            return "exited"
        left = deadline - time.monotonic()
        if left <= 0:
            return "late"
        try:
            connection = pymysql.connect(
                host=HOST,
                port=port,
                user=USER,
                password=password,
                database=DATABASE,
                # Short: a local server greets at once. Whatever else may hold the port
                # (it was free a moment ago) is not left to stall us, nor is a server that
                # exits meanwhile.
                connect_timeout=min(left, _CONNECT_TIMEOUT),
                read_timeout=min(left, _CONNECT_TIMEOUT),
                write_timeout=min(left, _CONNECT_TIMEOUT),
            )
            try:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT 1")
                    cursor.fetchall()
            finally:
                connection.close()
            return "ready"
        except (pymysql.MySQLError, OSError):  # refused until it listens; a timeout
            time.sleep(min(_POLL, max(0.0, deadline - time.monotonic())))


# -- ending ------------------------------------------------------------------------------------
def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process and its session (started with ``start_new_session``), and reap it.

    A child of the process (mariadb-install-db's bootstrap server) is not ours
    to reap: wait, briefly, until it is dead too, so that nothing writes into a
    directory being deleted.
    """
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone, reaped
        pass
    except PermissionError:  # pragma: no cover - not our group after all: the process alone
        process.kill()
    process.wait()
    give_up = time.monotonic() + 5.0
    while _group_runs(process.pid) and time.monotonic() < give_up:
        time.sleep(0.01)


def _group_runs(group: int) -> bool:
    """Whether a process of the group still runs.

    Not ``killpg(group, 0)``: that finds zombies too, dead processes that wait
    for their parent to collect them. An orphan's new parent is the system's
    init, which may take a second to do so (it did in a container here).
    """
    if not os.path.isdir("/proc/self"):  # not Linux: no cheap way to tell a zombie
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (command) state ppid pgrp ...": the command may hold spaces and parentheses.
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == group and state not in ("Z", "X"):
            return True
    return False


def _remove(directory: Path) -> None:
    """Delete the directory; again, briefly, while something (a dying process) still writes in it."""
    for _ in range(20):
        try:
            shutil.rmtree(directory)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    shutil.rmtree(directory, ignore_errors=True)


def _tail(path: Path, begins: int = 0, lines: int = _TAIL_LINES) -> str:
    """The last lines of a log, from byte ``begins`` on."""
    try:
        with open(path, "rb") as log:
            log.seek(begins)
            text = log.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def _hint(log: str) -> str:
    if "Permission denied" in log and os.geteuid() == 0:
        return (
            f"\n(as root, MariaDB runs as the OS user {_SERVER_OS_USER}, which must be able to enter every "
            "directory above its own: pass a base such as /dev/shm or /tmp)"
        )
    return ""
