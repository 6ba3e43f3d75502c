"""A throwaway 3-node MariaDB Galera cluster on 127.0.0.1, for the Galera tests.

``Cluster.start()`` makes one directory (under ``/dev/shm`` where writable),
with a directory per node owned by the ``mysql`` OS user, runs the machine's
own ``mariadbd`` (Debian's 10.11) with the ``galera-4`` provider three times,
and returns once all three are ``Synced`` in one primary component of three:

- node 0 is made with ``mariadb-install-db`` and bootstrapped with
  ``--wsrep-new-cluster``; an init file sets root@127.0.0.1's password and
  creates the database ``dblock_test`` before it accepts a connection;
- nodes 1 and 2 start with an empty data directory and join: a full state
  transfer (SST, ``rsync``) copies node 0's files to them, password and
  database included, one joiner at a time;
- every node has its own client port, Unix socket, Galera port
  (``wsrep_node_address``), IST port (``ist.recv_addr``) and SST port
  (``wsrep_sst_receive_address``).

The server's settings are its defaults, but for what Galera requires
(``binlog_format=ROW``, ``innodb_autoinc_lock_mode=2``) and a few sizes fit
for tests (buffer pool, redo log, gcache): ``wsrep_retry_autocommit`` and
``wsrep_sync_wait`` keep their defaults, which is what dblock must hold at,
since they are what a user's cluster runs with. No option file is read
(``--no-defaults``), so ``/etc/mysql`` and the system's server play no part.

``kill(i)`` SIGKILLs node i (as a crash would), ``restart(i)`` starts it again
on its data directory and waits until it has rejoined (IST or SST),
``wait_size(n)`` waits until the live nodes see a cluster of n, ``stop()`` kills
everything and removes the directory. Every wait is bounded and raises
``RuntimeError`` with the end of the node's error log.

Run as root, as ``dblock._mariadb_server`` does: the servers drop to ``mysql``.
"""

from __future__ import annotations

import atexit
import os
import pwd
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from dblock import _mariadb_server as single

HOST = "127.0.0.1"
DATABASE = single.DATABASE
NODES = 3
PROVIDERS = ("/usr/lib/galera/libgalera_smm.so", "/usr/lib/libgalera_smm.so", "/usr/lib64/galera-4/libgalera_smm.so")
INSTALL = "apt-get install mariadb-server galera-4 rsync"
_POLL = 0.1
_CONNECT_TIMEOUT = 2.0
_TAIL_LINES = 30

# Sizes fit for a test machine (three servers at once), none of them a semantic setting.
_SIZES = (
    "--innodb-buffer-pool-size=64M",
    "--innodb-log-file-size=8M",
    "--character-set-server=utf8mb4",
)
# What Galera requires of every node.
_GALERA_REQUIRES = ("--binlog-format=ROW", "--innodb-autoinc-lock-mode=2", "--default-storage-engine=InnoDB")


def provider() -> str | None:
    for path in PROVIDERS:
        if os.path.isfile(path):
            return path
    return None


def missing() -> str | None:
    """Why the cluster cannot run here (a reason to skip), or None."""
    found = single.find()
    gaps = []
    if isinstance(found, str):
        gaps.append(found)
    if provider() is None:
        gaps.append("the Galera provider (libgalera_smm.so; Debian: galera-4)")
    if single._which("rsync") is None or single._which("wsrep_sst_rsync") is None:
        gaps.append("rsync and wsrep_sst_rsync (Debian: rsync, mariadb-server) for the state transfer")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("mysql")
        except KeyError:
            gaps.append("a mysql OS user to run the servers as")
    if not gaps:
        return None
    return "Galera cluster not available: missing " + "; ".join(gaps) + f" ({INSTALL})"


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class Node:
    def __init__(self, index: int, home: Path, port: int, gport: int, iport: int, sport: int) -> None:
        self.index = index
        self.home = home
        self.data = home / "data"
        self.port = port  # clients
        self.gport = gport  # group communication (wsrep_node_address)
        self.iport = iport  # incremental state transfer (ist.recv_addr)
        self.sport = sport  # full state transfer (wsrep_sst_receive_address)
        self.log = home / "mariadbd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_from = 0  # where this run's part of the log begins

    @property
    def socket_path(self) -> Path:
        return self.home / "s.sock"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        return f"node {self.index} (port {self.port}), the end of its log:\n" + single._tail(
            self.log, self.log_from, _TAIL_LINES
        )

    def __repr__(self) -> str:
        state = f"pid {self.proc.pid}" if self.running() else "down"  # type: ignore[union-attr]
        return f"<galera node {self.index} {HOST}:{self.port} {state}>"


class Cluster:
    """Three Galera nodes on loopback; ``urls[i]`` is node i's SQLAlchemy URL."""

    def __init__(self, base: Path | None = None) -> None:
        reason = missing()
        if reason is not None:
            raise RuntimeError(reason)
        found = single.find()
        assert not isinstance(found, str)
        self.install_db, self.mariadbd = found
        self.provider = provider()
        base = base or Path(single._memory_dir() or tempfile.gettempdir())
        self.directory = Path(tempfile.mkdtemp(prefix="dblock-galera-", dir=base)).resolve()
        self.nodes: list[Node] = []
        try:
            self.user_option = single._os_user(self.directory)  # chowns the directory to mysql (as root)
            self.directory.chmod(0o755)
            ports = _free_ports(4 * NODES)
            for i in range(NODES):
                home = self.directory / f"node{i}"
                home.mkdir()
                _hand_over(home)
                self.nodes.append(Node(i, home, *ports[4 * i : 4 * i + 4]))
        except BaseException:
            single._remove(self.directory)
            raise
        self.password = secrets.token_hex(16)  # hex: nothing to quote in a URL or in SQL
        self.name = "dblock-" + secrets.token_hex(4)
        self.urls = [f"mariadb+pymysql://root:{self.password}@{HOST}:{n.port}/{DATABASE}" for n in self.nodes]
        self.start_seconds: float | None = None  # how long start() took
        self._owner = os.getpid()
        self._stopped = False
        atexit.register(self.stop)  # a cluster nobody stopped (an interrupted run) is stopped at exit

    # -- starting -------------------------------------------------------------------------
    def start(self, timeout: float = 90) -> Cluster:
        """Bootstrap node 0, then join nodes 1 and 2; return once all three are Synced."""
        began = time.monotonic()
        deadline = began + timeout
        try:
            first = self.nodes[0]
            single._install(self.install_db, first.home, self.user_option, deadline, timeout)
            init = first.home / "init.sql"
            init.write_text(
                f"ALTER USER 'root'@'{HOST}' IDENTIFIED BY '{self.password}';\n"
                f"CREATE DATABASE IF NOT EXISTS {DATABASE};\n"
            )
            init.chmod(0o644)
            self._spawn(first, bootstrap=True, init=init)
            self._wait_synced(first, deadline)
            init.unlink()
            for node in self.nodes[1:]:
                node.data.mkdir()
                _hand_over(node.data)
                self._spawn(node)
            for node in self.nodes[1:]:
                self._wait_synced(node, deadline)
            self.wait_size(NODES, max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began
        return self

    def _command(self, node: Node, *, bootstrap: bool = False, init: Path | None = None) -> list[str]:
        peers = ",".join(f"{HOST}:{n.gport}" for n in self.nodes)
        options = f"gmcast.listen_addr=tcp://{HOST}:{node.gport};ist.recv_addr={HOST}:{node.iport};gcache.size=32M"
        command = [
            self.mariadbd,
            "--no-defaults",  # must come first
            *self.user_option,
            f"--datadir={node.data}",
            f"--socket={node.socket_path}",
            f"--port={node.port}",
            f"--bind-address={HOST}",
            f"--pid-file={node.home / 'pid'}",
            "--skip-name-resolve",
            *_SIZES,
            *_GALERA_REQUIRES,
            "--wsrep-on=ON",
            f"--wsrep-provider={self.provider}",
            f"--wsrep-cluster-name={self.name}",
            f"--wsrep-cluster-address=gcomm://{peers}",
            f"--wsrep-node-name=node{node.index}",
            f"--wsrep-node-address={HOST}:{node.gport}",
            f"--wsrep-node-incoming-address={HOST}:{node.port}",
            f"--wsrep-provider-options={options}",
            "--wsrep-sst-method=rsync",
            f"--wsrep-sst-receive-address={HOST}:{node.sport}",
        ]
        if init is not None:
            command.append(f"--init-file={init}")
        if bootstrap:
            command.append("--wsrep-new-cluster")
        return command

    def _spawn(self, node: Node, *, bootstrap: bool = False, init: Path | None = None) -> None:
        node.log_from = node.log.stat().st_size if node.log.exists() else 0
        with open(node.log, "ab") as log:
            node.proc = subprocess.Popen(
                self._command(node, bootstrap=bootstrap, init=init),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=node.home,
                start_new_session=True,  # its SST scripts and rsync too: one group to kill
            )

    # -- reading the nodes ------------------------------------------------------------------
    def connect(self, i: int, timeout: float = _CONNECT_TIMEOUT) -> Any:
        """A PyMySQL connection to node i (autocommit, UTC)."""
        import pymysql

        node = self.nodes[i]
        conn = pymysql.connect(
            host=HOST, port=node.port, user="root", password=self.password, database=DATABASE, autocommit=True,
            connect_timeout=timeout, read_timeout=timeout + 10, write_timeout=timeout + 10,
        )
        with conn.cursor() as cur:
            cur.execute("SET time_zone = '+00:00'")
        return conn

    def query(self, i: int, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        conn = self.connect(i)
        try:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                return [tuple(r) for r in cur.fetchall()] if cur.description is not None else []
        finally:
            conn.close()

    def status(self, i: int, *names: str) -> dict[str, str]:
        """Node i's wsrep status variables (lowercase names)."""
        rows = self.query(i, "SHOW GLOBAL STATUS WHERE Variable_name IN %s", (tuple(names),))
        return {str(k).lower(): str(v) for k, v in rows}

    def live(self) -> list[int]:
        return [n.index for n in self.nodes if n.running()]

    def _wait_synced(self, node: Node, deadline: float) -> None:
        """Until node answers as Synced and ready, or raise with the end of its log."""
        import pymysql

        last = ""
        while True:
            if not node.running():
                raise RuntimeError(f"Galera node {node.index} exited before it was synced; {node.tail()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"Galera node {node.index} not synced in time ({last}); {node.tail()}")
            try:
                state = self.status(node.index, "wsrep_local_state_comment", "wsrep_ready")
                last = f"state {state}"
                if state.get("wsrep_local_state_comment") == "Synced" and state.get("wsrep_ready") == "ON":
                    return
            except (pymysql.MySQLError, OSError) as exc:  # not listening yet, or not a member yet
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(min(_POLL, max(0.0, deadline - time.monotonic())))

    def wait_size(self, n: int, timeout: float = 30) -> float:
        """Until every live node reports wsrep_cluster_size == n and is Synced; the seconds it took."""
        import pymysql

        began = time.monotonic()
        deadline = began + timeout
        last: dict[int, str] = {}
        while True:
            done = True
            for i in self.live():
                try:
                    state = self.status(i, "wsrep_cluster_size", "wsrep_local_state_comment", "wsrep_ready")
                    last[i] = str(state)
                    if (
                        state.get("wsrep_cluster_size") != str(n)
                        or state.get("wsrep_local_state_comment") != "Synced"
                        or state.get("wsrep_ready") != "ON"
                    ):
                        done = False
                except (pymysql.MySQLError, OSError) as exc:
                    last[i] = f"{type(exc).__name__}: {exc}"
                    done = False
            if done:
                return time.monotonic() - began
            if time.monotonic() >= deadline:
                tails = "\n".join(self.nodes[i].tail() for i in self.live())
                raise RuntimeError(f"Galera cluster not at size {n} within {timeout:g} s: {last}\n{tails}")
            time.sleep(_POLL)

    # -- failures ---------------------------------------------------------------------------
    def kill(self, i: int) -> None:
        """SIGKILL node i and everything it started, as a crash would; its files stay."""
        node = self.nodes[i]
        if node.proc is not None:
            single._kill_group(node.proc)

    def restart(self, i: int, timeout: float = 60) -> float:
        """Start node i again on its data directory; return once it has rejoined (the seconds it took)."""
        node = self.nodes[i]
        if node.running():
            raise RuntimeError(f"node {i} is running")
        began = time.monotonic()
        self._spawn(node)
        self._wait_synced(node, began + timeout)
        return time.monotonic() - began

    # -- stopping ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Kill every node (and whatever each started) and remove the directory. Twice is fine."""
        if self._stopped or os.getpid() != self._owner:
            return
        for node in self.nodes:
            if node.proc is not None:
                single._kill_group(node.proc)
        _kill_strays(self.directory)
        single._remove(self.directory)
        self._stopped = True

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:  # no password: reprs end up in logs
        return f"<galera.Cluster {self.nodes} in {self.directory}>"


def _hand_over(path: Path) -> None:
    """Make ``path`` the server's OS user's (as root), so the servers it runs as may write there."""
    if os.geteuid() != 0:
        return
    entry = pwd.getpwnam("mysql")
    os.chown(path, entry.pw_uid, entry.pw_gid)


def _kill_strays(directory: Path) -> None:
    """SIGKILL, by PID, any process still naming the cluster's directory (an SST's rsync daemon
    that left its node's process group): only processes this cluster started do."""
    mark = os.fsencode(str(directory))
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        if mark in cmdline:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def start(timeout: float = 90) -> Cluster:
    """A started cluster (the caller stops it)."""
    return Cluster().start(timeout)


__all__ = ["Cluster", "DATABASE", "missing", "start"]


if __name__ == "__main__":  # python -m tests.galera: start, show, stop (a smoke check of the harness)
    with start() as cluster:
        print(f"started in {cluster.start_seconds:.1f} s")
        for i in range(NODES):
            print(i, cluster.status(i, "wsrep_cluster_size", "wsrep_local_state_comment", "wsrep_cluster_status"))
