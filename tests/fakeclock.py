"""A throwaway PostgreSQL whose clock the test steps: the server runs under libfaketime.

``start()`` makes a cluster with ``initdb`` in a temporary directory (``/dev/shm``
where writable; ``fsync=off``, safe while the machine itself does not crash) and
starts ``postgres`` on a free 127.0.0.1 port with libfaketime preloaded
(``LD_PRELOAD``) and ``FAKETIME_TIMESTAMP_FILE`` naming a file of this
directory, read again on every clock call (``FAKETIME_NO_CACHE=1``):
``step("+1h")`` writes it, and the server's wall clock (``now()``, lease
expiries) jumps by that much from then on, in every backend, as an NTP step
would. Its monotonic clock is left alone (``FAKETIME_DONT_FAKE_MONOTONIC=1``),
as a step leaves it. Only the server runs under libfaketime; the test's
process keeps the real clock.

The binaries are Debian's (``/usr/lib/postgresql/N/bin``) or, without them,
the pgserver wheel's (a test dependency). PostgreSQL refuses to run as root:
as root the server runs as the ``postgres`` OS user (Debian's package makes
it), else as ``pgserver`` (the plugin's). ``stop()`` ends the postmaster it
started, by its pid, and removes the directory, on every path.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import psycopg

from dblock.pytest_plugin import memory_dir

# Where Debian (and Ubuntu) put the preload library (package libfaketime), on each architecture.
LIBRARY_GLOBS = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)
INSTALL = "run `sh tests/install-faketime.sh` as root (Debian: apt-get install libfaketime faketime)"


def library() -> str | None:
    """The libfaketime preload library's path, or None."""
    given = os.environ.get("DBLOCK_LIBFAKETIME")
    if given:
        return given if os.path.exists(given) else None
    for pattern in LIBRARY_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def _bin() -> Path | None:
    """A PostgreSQL server's bin directory: Debian's newest, else the pgserver wheel's."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    try:
        import pgserver  # noqa: PLC0415 - optional: dblock[testing]
    except ImportError:
        return None
    wheel = Path(pgserver.__file__).parent / "pginstall" / "bin"
    return wheel if (wheel / "postgres").exists() else None


def _user() -> str | None:
    """Whom the server runs as: None (this process's user) unless root, then an OS user of its own."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "pgserver"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    return None


def missing() -> str | None:
    """Why a server under libfaketime cannot run here (a reason to skip), or None."""
    if not os.path.exists("/proc/self") or not hasattr(os, "geteuid"):
        return "libfaketime preloads into Linux processes only"
    gaps = []
    if library() is None:
        gaps.append(f"libfaketime ({INSTALL})")
    if _bin() is None:
        gaps.append("PostgreSQL server binaries (Debian: postgresql; or pip install 'dblock[testing]')")
    if os.geteuid() == 0 and _user() is None:
        gaps.append("an OS user other than root to run PostgreSQL as (initdb refuses root): postgres or pgserver")
    return "a PostgreSQL under libfaketime cannot start here: missing " + ", ".join(gaps) if gaps else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SteppedServer:
    """A PostgreSQL whose wall clock ``step`` moves; ``url`` reaches it as its superuser."""

    def __init__(self, clock: str = "+0") -> None:
        self.start_clock = clock  # libfaketime's offset (and rate: "+0 x1.2") from the start
        self.home = Path(tempfile.mkdtemp(prefix="dblock-faketime-", dir=memory_dir()))
        self.data = self.home / "data"
        self.clock = self.home / "faketime"  # the offset the server's clock runs at, e.g. "+1h"
        self.log = self.home / "server.log"
        self.port = _free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self.proc: subprocess.Popen[bytes] | None = None
        self._user = _user()

    def start(self) -> None:
        bin_dir = _bin()
        lib = library()
        assert bin_dir is not None and lib is not None, missing()
        self.clock.write_text(self.start_clock + "\n")
        os.chmod(self.home, 0o755)  # the server's user reads the clock file and writes its data here
        self.clock.chmod(0o644)
        if self._user is not None:
            entry = pwd.getpwnam(self._user)
            os.chown(self.home, entry.pw_uid, entry.pw_gid)
        run: dict[str, Any] = {"user": self._user} if self._user is not None else {}
        subprocess.run(
            [str(bin_dir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
             "--locale=C", "--no-sync"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.home, **run,
        )
        env = dict(os.environ)
        env.update(
            LD_PRELOAD=lib,
            FAKETIME_TIMESTAMP_FILE=str(self.clock),
            FAKETIME_NO_CACHE="1",  # every clock call reads the file: a step takes effect at once
            FAKETIME_DONT_FAKE_MONOTONIC="1",  # a step moves the wall clock only, as NTP's does
        )
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(bin_dir / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.home),
                 "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off", "-c", "max_connections=40"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.home, start_new_session=True, **run,
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                with self.connect():
                    return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL under libfaketime did not start:\n{self.log.read_text()}") from None
                time.sleep(0.1)

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", connect_timeout=5, autocommit=True
        )

    def offset(self) -> float:
        """Seconds the server's wall clock runs ahead of this process's (negative: behind)."""
        with self.connect() as conn:
            before = time.time()
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
            after = time.time()
        assert row is not None
        return float(row[0]) - (before + after) / 2

    def step(self, offset: str, seconds: float) -> None:
        """Step the server's wall clock to ``offset`` from the true time (libfaketime's form: "+1h",
        "-30m", "+0"), which is ``seconds``; return once the server reads its clock so."""
        self.clock.write_text(offset + "\n")
        deadline = time.monotonic() + 30
        while abs(self.offset() - seconds) > 60:
            if time.monotonic() > deadline:
                raise AssertionError(f"the server's clock did not step to {offset}: it is {self.offset():+.0f} s off")
            time.sleep(0.05)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        try:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGQUIT)  # immediate shutdown: the postmaster ends its backends
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: the postmaster and its children
                    proc.wait(timeout=30)
        finally:
            shutil.rmtree(self.home, ignore_errors=True)


def running(clock: str = "+0") -> Iterator[SteppedServer]:
    """A started ``SteppedServer`` (its clock at first ``clock``), stopped and removed afterwards
    (a fixture's body)."""
    server = SteppedServer(clock)
    try:
        server.start()
        yield server
    finally:
        server.stop()
