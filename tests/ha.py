"""A real high-availability PostgreSQL cluster for the HA tests: Patroni, etcd, three nodes.

``start()`` runs one etcd member (Debian's ``etcd-server``) and three Patroni
4 nodes (from PyPI, in the virtualenv ``tests/install-ha.sh`` builds from
Debian's python) managing three PostgreSQL nodes made from the machine's own
PostgreSQL binaries, all on free 127.0.0.1 ports, with their files in a
temporary directory (``/dev/shm`` where writable; ``fsync=off``, which is safe
while only processes are killed, never the machine). Patroni runs as the
``postgres`` OS user when the tests run as root (initdb refuses root).

Settings measured on this kind of machine (``HA-NOTES.md``): ttl 20, loop_wait
1, retry_timeout 5; ``primary_start_timeout: 0`` so that a SIGKILLed
postmaster fails over instead of restarting in place; ``synchronous_mode`` on
unless asked otherwise (``Cluster.set_synchronous`` toggles it live).

Patroni detaches the postmaster, which would be re-parented to PID 1 when
Patroni dies; this process becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``)
so orphans come back to it and are reaped. ``stop()`` kills every process whose
working directory lies in the cluster's directory (PostgreSQL's processes work
in their data directory), by PID, and removes the directory: no process or
port is left behind, and the system's own PostgreSQL on 5432 is never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import psycopg

VENV = Path(os.environ.get("DBLOCK_HA_VENV", "/opt/dblock-ha"))
INSTALL = "run `sh tests/install-ha.sh` as root (apt-get install etcd-server postgresql; Patroni from PyPI)"
PR_SET_CHILD_SUBREAPER = 36
NODES = 3
PASSWORD = "dblock-ha"  # the nodes trust loopback connections; Patroni wants one all the same
FIGURES: list[str] = []  # measured figures, printed at the end of the test run (conftest)


def missing() -> str | None:
    """Why the cluster cannot start here (a reason to skip), or None."""
    gaps = []
    if _etcd() is None:
        gaps.append("etcd (Debian: etcd-server)")
    if _pg_bin() is None:
        gaps.append("PostgreSQL server binaries (Debian: postgresql)")
    if not os.access(VENV / "bin" / "patroni", os.X_OK):
        gaps.append(f"Patroni in {VENV}")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            gaps.append("a postgres OS user to run the nodes as (initdb refuses root)")
    if not hasattr(os, "waitid") or not Path("/proc/self/stat").exists():
        gaps.append("Linux (/proc and a child subreaper)")
    if not gaps:
        return None
    return "HA cluster not available: missing " + ", ".join(gaps) + f"; {INSTALL}"


def _etcd() -> str | None:
    found = shutil.which("etcd")
    return found or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)


def _pg_bin() -> str | None:
    """The newest PostgreSQL server's bin directory (Debian: /usr/lib/postgresql/N/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[-3]))
    return str(Path(found[-1]).parent) if found else None


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class Node:
    def __init__(self, name: str, home: Path, pg_port: int, api_port: int) -> None:
        self.name = name
        self.home = home
        self.data = home / "data"
        self.pg_port = pg_port
        self.api_port = api_port
        self.api = f"http://127.0.0.1:{api_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(
            host="127.0.0.1", port=self.pg_port, user="postgres", dbname="postgres",
            connect_timeout=3, autocommit=True, **kwargs,
        )

    def sql(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        with self.connect() as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description is not None else []


class Cluster:
    """A running cluster. ``url`` is the multi-host URL that follows the primary."""

    def __init__(self, home: Path, user: str | None) -> None:
        self.home = home
        self.user = user
        self.scope = "dblock-" + home.name.rsplit("-", 1)[-1]
        ports = _free_ports(2 + 2 * NODES)
        self.etcd_client, self.etcd_peer = ports[0], ports[1]
        self.nodes = [
            Node(f"node{i}", home / f"node{i}", ports[2 + 2 * i], ports[3 + 2 * i]) for i in range(NODES)
        ]
        self.etcd: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        hosts = "&".join(f"host=127.0.0.1:{n.pg_port}" for n in self.nodes)
        self.url = f"postgresql+psycopg://postgres@/postgres?{hosts}&target_session_attrs=read-write"
        # The same in libpq's own keywords, for the tests' direct connections.
        self.dsn = (
            "host=" + ",".join("127.0.0.1" for _ in self.nodes)
            + " port=" + ",".join(str(n.pg_port) for n in self.nodes)
            + " user=postgres dbname=postgres target_session_attrs=read-write connect_timeout=3"
        )

    # -- life --------------------------------------------------------------
    def start(self, synchronous: bool = True, timeout: float = 90) -> None:
        _become_subreaper()
        self._reaper = threading.Thread(target=self._reap_loop, name="ha-reaper", daemon=True)
        self._reaper.start()
        etcd_dir = self.home / "etcd"
        etcd_dir.mkdir()
        etcd_log = open(etcd_dir / "etcd.log", "wb")
        self.etcd = subprocess.Popen(
            [
                _etcd() or "etcd", "--name", "e0", "--data-dir", str(etcd_dir / "data"),
                "--listen-client-urls", f"http://127.0.0.1:{self.etcd_client}",
                "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_client}",
                "--listen-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
                "--initial-cluster", f"e0=http://127.0.0.1:{self.etcd_peer}",
                "--initial-cluster-state", "new", "--log-level", "warn",
            ],
            stdout=etcd_log, stderr=subprocess.STDOUT, cwd=etcd_dir, start_new_session=True,
        )
        etcd_log.close()
        self._wait(lambda: self._etcd_ready(), 20, "etcd to answer")
        for node in self.nodes:
            self._start_node(node, synchronous)
        self.wait_healthy(synchronous, timeout=timeout)

    def _start_node(self, node: Node, synchronous: bool) -> None:
        node.home.mkdir(exist_ok=True)
        (node.home / "sock").mkdir(exist_ok=True)
        config = {
            "scope": self.scope,
            "namespace": "/dblock-tests/",
            "name": node.name,
            "log": {"level": "INFO"},
            "restapi": {"listen": f"127.0.0.1:{node.api_port}", "connect_address": f"127.0.0.1:{node.api_port}"},
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_client}"]},
            "bootstrap": {
                "dcs": {
                    "ttl": 20,
                    "loop_wait": 1,
                    "retry_timeout": 5,
                    "maximum_lag_on_failover": 1048576,
                    "primary_start_timeout": 0,
                    "synchronous_mode": synchronous,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "fsync": "off",
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_connections": 100,
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "wal_keep_size": "64MB",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.pg_port}",
                "data_dir": str(node.data),
                "bin_dir": _pg_bin(),
                "pgpass": str(node.home / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": PASSWORD},
                    "replication": {"username": "replicator", "password": PASSWORD},
                    "rewind": {"username": "postgres", "password": PASSWORD},
                },
                "parameters": {"unix_socket_directories": str(node.home / "sock")},
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
            },
        }
        path = node.home / "patroni.yml"
        path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        self._own(node.home)
        log = open(node.home / "patroni.log", "ab")
        node.proc = subprocess.Popen(
            [str(VENV / "bin" / "patroni"), str(path)],
            stdout=log, stderr=subprocess.STDOUT, cwd=node.home, start_new_session=True,
            **self._as_user(),
        )
        log.close()

    def _as_user(self) -> dict[str, Any]:
        if self.user is None:
            return {}
        entry = pwd.getpwnam(self.user)
        return {
            "user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": [],
            "env": {"PATH": "/usr/bin:/bin", "HOME": str(self.home), "LC_ALL": "C.UTF-8"},
        }

    def _own(self, path: Path) -> None:
        if self.user is None:
            return
        entry = pwd.getpwnam(self.user)
        for root, dirs, files in os.walk(path):
            os.chown(root, entry.pw_uid, entry.pw_gid)
            for f in files:
                os.chown(os.path.join(root, f), entry.pw_uid, entry.pw_gid)

    def stop(self) -> None:
        """Kill everything the cluster started, by PID, reap it, and remove its files."""
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
        for node in self.nodes:
            pid = node.postmaster_pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while True:
            left = self.processes()
            if not left or time.monotonic() > deadline:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            _reap()
            time.sleep(0.05)
        for node in self.nodes:
            if node.proc is not None:
                node.proc.wait()
        if self.etcd is not None:
            self.etcd.kill()
            self.etcd.wait()
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join()
        _reap()
        shutil.rmtree(self.home, ignore_errors=True)

    def processes(self) -> list[int]:
        """PIDs of the cluster's processes still alive: those working inside its directory."""
        found = []
        home = str(self.home)
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd")
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if (cwd == home or cwd.startswith(home + "/")) and state != "Z":
                found.append(int(entry))
        return found

    def _reap_loop(self) -> None:
        while not self._stop.wait(0.5):
            _reap()

    # -- looking -------------------------------------------------------------
    def rest(self, node: Node, path: str, method: str = "GET", body: Any = None, timeout: float = 5) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(node.api + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                text = reply.read().decode()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode()
            if method == "GET":
                return json.loads(text) if text.startswith("{") else None
            raise RuntimeError(f"{method} {path} on {node.name}: HTTP {exc.code}: {text}") from None
        return json.loads(text) if text.startswith(("{", "[")) else text

    def members(self) -> list[dict[str, Any]]:
        """Patroni's view of the cluster (GET /cluster), from the first node that answers."""
        for node in self.nodes:
            try:
                found = self.rest(node, "/cluster", timeout=2)
            except (OSError, ValueError):
                continue
            if found and found.get("members"):
                return list(found["members"])
        return []

    def node(self, name: str) -> Node:
        (found,) = [n for n in self.nodes if n.name == name]
        return found

    def leader(self) -> Node | None:
        for m in self.members():
            if m.get("role") == "leader" and m.get("state") == "running":
                return self.node(m["name"])
        return None

    def healthy(self, synchronous: bool) -> bool:
        members = self.members()
        leaders = [m for m in members if m.get("role") == "leader" and m.get("state") == "running"]
        replicas = [m for m in members if m.get("role") != "leader" and m.get("state") == "streaming"]
        if len(leaders) != 1 or len(replicas) != NODES - 1:
            return False
        if synchronous != any(m.get("role") == "sync_standby" for m in replicas):
            return False
        # The primary runs with the matching synchronous_standby_names and takes writes.
        try:
            ((names, ro),) = self.node(leaders[0]["name"]).sql(
                "SELECT current_setting('synchronous_standby_names'), pg_is_in_recovery()"
            )
        except psycopg.Error:
            return False
        return not ro and bool(names) == synchronous

    def wait_healthy(self, synchronous: bool = True, timeout: float = 60) -> Node:
        self._wait(lambda: self.healthy(synchronous), timeout, "a leader and every replica streaming"
                   + (" with a synchronous standby" if synchronous else ""))
        leader = self.leader()
        assert leader is not None
        return leader

    def _wait(self, ok: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            for node in self.nodes:
                if node.proc is not None and node.proc.poll() is not None:
                    raise RuntimeError(f"patroni {node.name} exited: {self.log_tail(node)}")
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n.name}\n{self.log_tail(n)}" for n in self.nodes)
                raise RuntimeError(f"HA cluster: timed out waiting for {what}; members {self.members()}\n{tails}")
            time.sleep(0.1)

    @staticmethod
    def log_tail(node: Node, lines: int = 15) -> str:
        try:
            return "\n".join((node.home / "patroni.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _etcd_ready(self) -> bool:
        if self.etcd is not None and self.etcd.poll() is not None:
            raise RuntimeError(f"etcd exited with {self.etcd.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.etcd_client}/health", timeout=1) as reply:
                return json.loads(reply.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    # -- faults and operations -------------------------------------------------
    def kill_primary(self) -> Node:
        """SIGKILL the primary's postmaster (Patroni lives on and fails over). Returns the old primary."""
        leader = self.leader()
        assert leader is not None, "no leader to kill"
        pid = leader.postmaster_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        return leader

    def switchover(self) -> Node:
        """A planned switchover (POST /switchover) to any eligible standby. Returns the old primary."""
        leader = self.leader()
        assert leader is not None
        self.rest(leader, "/switchover", "POST", {"leader": leader.name}, timeout=60)
        return leader

    def set_synchronous(self, on: bool, timeout: float = 60) -> None:
        """Turn Patroni's synchronous_mode on or off (PATCH /config) and wait until the primary follows."""
        for node in self.nodes:
            try:
                self.rest(node, "/config", "PATCH", {"synchronous_mode": on})
                break
            except OSError:
                continue
        self.wait_healthy(on, timeout)

    def timeline(self) -> int:
        leader = self.leader()
        assert leader is not None
        ((tli,),) = leader.sql("SELECT timeline_id FROM pg_control_checkpoint()")
        return int(tli)


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


_FOREIGN = ("postgres", "pg_", "initdb", "patroni", "etcd")


def _reap() -> None:
    """Reap zombies re-parented to us (postmasters and their children after a kill).

    Only processes the cluster made: a child of the test run started by a
    ``subprocess.Popen`` is left to its Popen, which must collect its status.
    """
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if ppid == me and state == "Z" and comm.startswith(_FOREIGN) and not comm.startswith("patroni"):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry), os.WNOHANG)


@contextlib.contextmanager
def start(synchronous: bool = True) -> Iterator[Cluster]:
    """Run the cluster until the block ends."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else None
    home = Path(tempfile.mkdtemp(prefix="dblock-ha-", dir=base))
    user = "postgres" if os.geteuid() == 0 else None
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(home, entry.pw_uid, entry.pw_gid)
    cluster = Cluster(home, user)
    try:
        cluster.start(synchronous)
        yield cluster
    finally:
        cluster.stop()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _replicas(cluster: Cluster) -> list[Node]:
    leader = cluster.leader()
    return [n for n in cluster.nodes if leader is None or n.name != leader.name]


def wait_replayed(cluster: Cluster, timeout: float = 30) -> None:
    """Wait until every replica has replayed the primary's WAL up to now."""
    leader = cluster.leader()
    assert leader is not None
    ((lsn,),) = leader.sql("SELECT pg_current_wal_lsn()::text")

    def caught_up() -> bool:
        try:
            return all(
                n.sql("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,))[0][0] for n in _replicas(cluster)
            )
        except psycopg.Error:
            return False

    cluster._wait(caught_up, timeout, f"replicas to replay up to {lsn}")


@contextlib.contextmanager
def standbys_stalled(cluster: Cluster) -> Iterator[list[int]]:
    """SIGSTOP the primary's WAL senders: from now on the primary's commits reach no standby (a
    replication link that went silent). Yields their PIDs; SIGCONT the ones still alive when the
    block ends. (Stopping the standbys' WAL receivers would not do: the kernel still takes the
    WAL into their sockets' buffers, and they read it all when they resume.)"""
    leader = cluster.leader()
    assert leader is not None
    senders = [pid for (pid,) in leader.sql("SELECT pid FROM pg_stat_replication")]
    assert len(senders) == NODES - 1, senders
    try:
        for pid in senders:
            os.kill(pid, signal.SIGSTOP)
        yield senders
    finally:
        for pid in senders:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def kill_primary_and_its_senders(cluster: Cluster, senders: list[int], timeout: float = 15) -> Node:
    """SIGKILL the primary's postmaster and its WAL senders (the primary's machine dies), and wait
    until they are gone: nothing more it wrote can reach a standby."""
    old = cluster.kill_primary()
    for pid in senders:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    cluster._wait(lambda: not any(_alive(p) for p in senders), timeout, "the old primary's WAL senders to exit")
    return old


def wait_new_leader(cluster: Cluster, old: Node, timeout: float = 60) -> Node:
    found: list[Node] = []

    def promoted() -> bool:
        leader = cluster.leader()
        if leader is None or leader.name == old.name:
            return False
        try:
            ((ro,),) = leader.sql("SELECT pg_is_in_recovery()")
        except psycopg.Error:
            return False
        found.append(leader)
        return not ro

    cluster._wait(promoted, timeout, f"a primary other than {old.name}")
    return found[-1]
