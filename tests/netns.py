"""Network partitions for real: two network namespaces joined by a veth pair, and a PostgreSQL in one.

``pair()`` makes a *server* and a *client* namespace (unique names per run), joined by a
veth pair with addresses from 10.231.0.0/30 that exist only inside them
(``SERVER_ADDR`` on the server's end, ``CLIENT_ADDR`` on the client's). ``cut()`` sets the
server's end down: the client's packets are then dropped without a word (no RST, no ICMP,
no failed ARP look-up: each end knows the other's MAC address for good; its kernel
retransmits, a connect hangs) until ``heal()``. ``argv(ns, [...])`` runs a
command inside a namespace (``ip netns exec``). ``close()`` (the end of the ``with``
block) kills every process left in both namespaces and deletes them, which deletes the
veth pair too.

``postgresql(pair, directory)`` runs a throwaway PostgreSQL inside the server namespace,
listening on ``SERVER_ADDR`` and on a Unix socket in ``directory``: a Unix socket is
reached from any namespace, so the test process itself talks to the server through it
(``Server.unix_url``) while a client in the client namespace goes over the veth pair
(``Server.tcp_url``).

Needs root (``ip netns`` and ``ip link``): ``missing()`` says why it cannot run, or None.
``sweep()`` deletes what a process killed before its clean-up left behind.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterator, Sequence

SERVER_ADDR = "10.231.0.1"
CLIENT_ADDR = "10.231.0.2"
PREFIX = "dblock-net"  # every namespace this module makes is named PREFIX-<pid>-<random>-{srv,cli}
_DIR_PREFIX = "dblock-netpg-"  # and a server's directory _DIR_PREFIX<pid>-<random>


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def missing() -> str | None:
    """Why network namespaces cannot be used here (not root, no ``ip``, not permitted), or None."""
    if os.name != "posix" or os.geteuid() != 0:
        return "network partitions need root (ip netns, ip link)"
    if shutil.which("ip") is None:
        return "network partitions need the ip command: apt-get install iproute2"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns is not permitted here: {made.stderr.strip()}"
        veth = _ip("-n", probe, "link", "add", "dbprobe0", "type", "veth", "peer", "name", "dbprobe1", check=False)
        if veth.returncode != 0:
            return f"veth pairs are not permitted here: {veth.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class Pair:
    """Two namespaces joined by a veth pair; see the module's docstring."""

    def __init__(self, token: str) -> None:
        base = f"{PREFIX}-{os.getpid()}-{token}"
        self.server = f"{base}-srv"  # namespace names
        self.client = f"{base}-cli"
        self.server_dev = f"dbs{token}"  # interface names (15 characters at most)
        self.client_dev = f"dbc{token}"
        self.server_addr = SERVER_ADDR
        self.client_addr = CLIENT_ADDR

    def argv(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``ns`` (``self.server`` or ``self.client``)."""
        return ["ip", "netns", "exec", ns, *argv]

    def cut(self) -> None:
        """Drop every packet between the namespaces, silently, until ``heal()``."""
        _ip("-n", self.server, "link", "set", self.server_dev, "down")

    def heal(self) -> None:
        """Let packets through again (connections that survived the cut carry on)."""
        _ip("-n", self.server, "link", "set", self.server_dev, "up")
        self._pin()  # setting the link down flushed the server's entry

    def _pin(self) -> None:
        """Each end knows the other's MAC address for good: across a cut, no ARP look-up fails
        and reports "no route to host" to a connect or a send; packets are only dropped."""
        for ns, dev, addr, peer_ns, peer_dev in (
            (self.client, self.client_dev, SERVER_ADDR, self.server, self.server_dev),
            (self.server, self.server_dev, CLIENT_ADDR, self.client, self.client_dev),
        ):
            mac = json.loads(_ip("-j", "-n", peer_ns, "link", "show", "dev", peer_dev).stdout)[0]["address"]
            _ip("-n", ns, "neigh", "replace", addr, "lladdr", mac, "dev", dev, "nud", "permanent")

    def close(self) -> None:
        """Kill what runs in both namespaces and delete them (and the veth pair with them)."""
        for ns in (self.server, self.client):
            _remove(ns)


def _pids(ns: str) -> list[int]:
    listed = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in listed.stdout.split()] if listed.returncode == 0 else []


def _remove(ns: str) -> None:
    """Kill the processes inside ``ns`` (a namespace lives on while one does), then delete it."""
    for _ in range(50):
        pids = _pids(ns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    _ip("netns", "del", ns, check=False)


@contextlib.contextmanager
def pair() -> Iterator[Pair]:
    """A fresh ``Pair``, link up, deleted when the block ends (however it ends)."""
    made = Pair(secrets.token_hex(3))
    try:
        _ip("netns", "add", made.server)
        _ip("netns", "add", made.client)
        _ip("-n", made.server, "link", "add", made.server_dev, "type", "veth", "peer", "name", made.client_dev, "netns", made.client)
        for ns, dev, addr in ((made.server, made.server_dev, SERVER_ADDR), (made.client, made.client_dev, CLIENT_ADDR)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        made._pin()
        yield made
    finally:
        made.close()


def _gone(pid: str) -> bool:
    """Whether the process ``pid`` (digits from a name this module made) has ended."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, someone else's
    return False


def sweep() -> None:
    """Delete the namespaces (killing their processes) and the server directories of runs whose process is gone."""
    for line in _ip("netns", "list", check=False).stdout.split("\n"):
        name = line.split(" ")[0]
        if name.startswith(PREFIX + "-") and _gone(name[len(PREFIX) + 1 :].split("-")[0]):
            _remove(name)
    for parent in {"/dev/shm", tempfile.gettempdir()}:
        with contextlib.suppress(OSError):
            for entry in os.scandir(parent):
                if entry.name.startswith(_DIR_PREFIX) and _gone(entry.name[len(_DIR_PREFIX) :].split("-")[0]):
                    shutil.rmtree(entry.path, ignore_errors=True)


class Server:
    """A PostgreSQL inside the server namespace: ``tcp_url`` over the veth pair, ``unix_url`` from anywhere."""

    def __init__(self, directory: Path, port: int) -> None:
        self.directory = directory
        self.port = port
        self.tcp_url = f"postgresql+psycopg://postgres@{SERVER_ADDR}:{port}/postgres"
        self.unix_url = f"postgresql+psycopg://postgres@/postgres?host={directory}&port={port}"


def _bin() -> Path:
    """The directory of pgserver's PostgreSQL binaries (``pip install 'dblock[testing]'``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        pgserver = importlib.import_module("pgserver")
    return Path(str(pgserver.__file__)).parent / "pginstall" / "bin"


def _os_user() -> pwd.struct_passwd:
    """The user PostgreSQL runs as: it refuses root; pgserver's own user, made as its plugin makes it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")  # pgserver's import, on CI
        plugin = importlib.import_module("dblock.pytest_plugin")
        plugin._system_user_once("pgserver")
    return pwd.getpwnam("pgserver")


@contextlib.contextmanager
def postgresql(net: Pair, *, port: int = 5432, timeout: float = 60.0) -> Iterator[Server]:
    """A throwaway PostgreSQL (trust auth, user and database ``postgres``) in ``net.server``; stopped after."""
    import psycopg

    user = _os_user()
    bin_dir = _bin()
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    directory = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=shm))
    os.chmod(directory, 0o755)
    os.chown(directory, user.pw_uid, user.pw_gid)
    data = directory / "data"
    drop = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups"]
    proc: subprocess.Popen[bytes] | None = None
    log = directory / "postgres.log"
    try:
        subprocess.run(
            [*drop, str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
             "--locale=C", "--no-sync"],
            check=True, capture_output=True, timeout=120,
        )
        with open(data / "pg_hba.conf", "a") as hba:  # the client namespace's address, over the veth pair
            hba.write(f"host all all {CLIENT_ADDR}/32 trust\n")
        settings = {
            "listen_addresses": SERVER_ADDR,
            "port": str(port),
            "unix_socket_directories": str(directory),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
        }
        argv = [*drop, str(bin_dir / "postgres"), "-D", str(data)]
        for key, value in settings.items():
            argv += ["-c", f"{key}={value}"]
        with open(log, "wb") as out:
            # ip netns exec and setpriv both exec: proc.pid is the postmaster's
            proc = subprocess.Popen(net.argv(net.server, argv), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(host=str(directory), port=port, user="postgres", dbname="postgres", connect_timeout=5):
                    break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL in {net.server} did not start; its log:\n{log.read_text()[-2000:]}")
                time.sleep(0.1)
        yield Server(directory, port)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGQUIT)  # immediate shutdown: nothing to keep
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
