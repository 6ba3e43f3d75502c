"""A real PgBouncer in transaction mode, started in front of the suite's PostgreSQL.

``start(backend_url, pool_size=4)`` runs Debian's ``/usr/sbin/pgbouncer`` (1.18
there) on a free 127.0.0.1 port with its own config, log and pid files in a
temporary directory, and stops it when the ``with`` block ends. Clients log in
as any user (``auth_type = any``), or, given ``password``, only as the backend URL's
user with that password (SCRAM, checked by pgbouncer): pgbouncer itself logs into the
server as the backend URL's user. ``pool_size`` server connections serve every client, so
sessions really are shared between clients, one transaction at a time.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import psycopg
from sqlalchemy.engine import URL, make_url

MISSING = "pgbouncer not installed: apt-get install pgbouncer"


def binary() -> str | None:
    """pgbouncer's path; Debian puts it in /usr/sbin, which a non-root PATH often lacks."""
    found = shutil.which("pgbouncer")
    if found is None and os.access("/usr/sbin/pgbouncer", os.X_OK):
        found = "/usr/sbin/pgbouncer"
    return found


class PgBouncer:
    """A running pgbouncer: ``url`` (SQLAlchemy) leads to the backend's database through it."""

    def __init__(self, url: str, port: int, dbname: str, user: str, pool_size: int, log: Path) -> None:
        self.url = url
        self.port = port
        self.dbname = dbname
        self.user = user
        self.pool_size = pool_size
        self.log = log

    def admin(self, command: str) -> list[dict[str, Any]]:
        """Rows of an admin console command (SHOW POOLS, SHOW STATS...), as dicts.

        The console speaks only the simple query protocol, hence libpq's exec_.
        """
        with psycopg.connect(host="127.0.0.1", port=self.port, dbname="pgbouncer", user=self.user) as conn:
            res = conn.pgconn.exec_(command.encode())
            if res.status == psycopg.pq.ExecStatus.COMMAND_OK:  # RECONNECT, PAUSE...: no rows
                return []
            if res.status != psycopg.pq.ExecStatus.TUPLES_OK:
                raise RuntimeError(f"pgbouncer {command!r}: {res.error_message.decode(errors='replace')}")
            names = [res.fname(i).decode() for i in range(res.nfields)]  # type: ignore[union-attr]
            return [
                {n: _cell(res.get_value(r, i)) for i, n in enumerate(names)} for r in range(res.ntuples)
            ]

    def stats(self) -> dict[str, Any]:
        """SHOW STATS for our database: counters since pgbouncer started."""
        (row,) = [r for r in self.admin("SHOW STATS") if r["database"] == self.dbname]
        return row

    def servers(self) -> int:
        """Server connections pgbouncer holds open to PostgreSQL for our database now."""
        return sum(1 for r in self.admin("SHOW SERVERS") if r["database"] == self.dbname)


def _cell(value: bytes | None) -> Any:
    if value is None:
        return None
    text = value.decode()
    return int(text) if text.lstrip("-").isdigit() else text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quote(value: str) -> str:
    """A value for pgbouncer's [databases] connect string (libpq-style quoting)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _backend(url: URL) -> dict[str, str]:
    """The libpq keywords pgbouncer needs to reach the server ``url`` names."""
    query = {k: v if isinstance(v, str) else v[0] for k, v in url.query.items()}
    host = url.host or query.get("host") or "/var/run/postgresql"
    keys = {
        "host": host,
        "port": str(url.port or query.get("port") or 5432),
        "dbname": url.database or "postgres",
        "user": url.username or pwd.getpwuid(os.getuid()).pw_name,
    }
    if url.password:
        keys["password"] = str(url.password)
    return keys


def _run_as(host: str) -> str | None:
    """The system user to run as, or None to stay who we are.

    Debian's pgbouncer refuses to run as root, and CI runs as root: then it
    drops to the owner of the server's socket directory (pgserver keeps its
    socket in a mode 0700 data directory owned by its own system user), or to
    nobody when the server is reached over TCP.
    """
    if os.geteuid() != 0:
        return None
    if host.startswith("/") and os.path.isdir(host):
        owner = os.stat(host).st_uid
        if owner != 0:
            return pwd.getpwuid(owner).pw_name
    return "nobody"


@contextlib.contextmanager
def start(
    backend_url: str, *, pool_size: int = 4, timeout: float = 30.0, password: str | None = None
) -> Iterator[PgBouncer]:
    """Run pgbouncer in transaction mode before ``backend_url`` until the block ends (``password``:
    clients must give it, and a wrong one is refused)."""
    exe = binary()
    if exe is None:
        raise FileNotFoundError(MISSING)
    keys = _backend(make_url(backend_url))
    user = _run_as(keys["host"])
    # Not under pytest's basetemp: a user pgbouncer drops to must be able to enter it.
    workdir = Path(tempfile.mkdtemp(prefix="dblock-pgbouncer-"))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(workdir, entry.pw_uid, entry.pw_gid)
    log = workdir / "pgbouncer.log"
    target = " ".join(f"{k}={_quote(v)}" for k, v in keys.items())
    auth = "auth_type = any\n"
    if password is not None:
        users = workdir / "users.txt"
        users.write_text(f'"{keys["user"]}" "{password}"\n')
        users.chmod(0o600)
        if user is not None:
            os.chown(users, pwd.getpwnam(user).pw_uid, -1)
        auth = f"auth_type = scram-sha-256\nauth_file = {users}\n"
    proc: subprocess.Popen[bytes] | None = None
    try:
        for _ in range(5):  # another process may take the free port before pgbouncer binds it
            port = _free_port()
            config = workdir / "pgbouncer.ini"
            config.write_text(
                "[databases]\n"
                f"{keys['dbname']} = {target}\n"
                "[pgbouncer]\n"
                "listen_addr = 127.0.0.1\n"
                f"listen_port = {port}\n"
                "unix_socket_dir =\n"  # TCP only: no socket file in /tmp to collide with
                f"{auth}"
                f"admin_users = {keys['user']}\n"
                "pool_mode = transaction\n"
                f"default_pool_size = {pool_size}\n"
                "max_client_conn = 500\n"
                f"logfile = {log}\n"
                f"pidfile = {workdir / 'pgbouncer.pid'}\n"
            )
            config.chmod(0o600)
            if user is not None:
                os.chown(config, pwd.getpwnam(user).pw_uid, -1)
            command = [exe, *(["-u", user] if user is not None else []), str(config)]
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if _wait_ready(proc, port, keys, timeout, password):
                break
            proc.wait()
            proc = None
        if proc is None:
            raise RuntimeError(f"pgbouncer did not start; its log:\n{_tail(log)}")
        url = URL.create(
            "postgresql+psycopg", username=keys["user"], password=password, host="127.0.0.1", port=port,
            database=keys["dbname"],
        )
        yield PgBouncer(url.render_as_string(hide_password=False), port, keys["dbname"], keys["user"], pool_size, log)
    finally:
        if proc is not None:
            proc.terminate()  # SIGTERM: pgbouncer's fast exit
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_ready(
    proc: subprocess.Popen[bytes], port: int, keys: dict[str, str], timeout: float, password: str | None = None
) -> bool:
    """True once a query goes through pgbouncer to the server; False if pgbouncer exited."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        try:
            with psycopg.connect(
                host="127.0.0.1", port=port, dbname=keys["dbname"], user=keys["user"], password=password,
                connect_timeout=5,
            ) as conn:
                conn.execute("SELECT 1", prepare=False)
            return True
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"pgbouncer on port {port} did not answer within {timeout:g} s")
            time.sleep(0.05)
    return False


def _tail(log: Path) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    except OSError:
        return "(no log)"
