"""Who this process is: its pid, the owner ids it draws, the label operators see next to its
leases, and its fair-queue id.

Each is made once per process and made again in a fork's child, which is
another process (another pid, and its waiters need a heartbeat of their own).
"""

from __future__ import annotations

import atexit
import itertools
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Generic, Sequence, TypeVar

from ._redact import redact_command
from .schema import LABEL_LENGTH

T = TypeVar("T")

# This process's pid and the random half of its owner ids, made again in a fork's child
# (os.register_at_fork runs before any other code there). The hot paths compare ``pid`` to
# tell a forked child (getpid() is a system call, and a pair of calls asked for it nine
# times), and an acquire draws its owner id from a count instead of 16 bytes of urandom.
pid = os.getpid()  # read as ``_process.pid``: an attribute, not a call, on the hot paths
_owner_prefix = secrets.token_hex(8)
_owner_count = itertools.count()


def _forked() -> None:
    global pid, _owner_prefix, _owner_count  # noqa: PLW0603 - the process's own state, renewed in the child
    pid = os.getpid()
    _owner_prefix = secrets.token_hex(8)
    _owner_count = itertools.count()


os.register_at_fork(after_in_child=_forked)


def new_owner() -> str:
    """A new owner id, 32 hex digits that no other acquire anywhere is given: 16 random ones,
    made once per process (and again in a fork's child), then a count (atomic: one C call).

    Owner ids must never repeat, as an acquire that presents a live lease's owner id is
    taken for a retry of that lease's acquire and given the lease; they need not be secret
    (every lease's owner id is in the table, for whoever may read it).
    """
    return f"{_owner_prefix}{next(_owner_count):016x}"


def describe_process(command: Sequence[str]) -> str:
    """A lease label: ``"host:pid command line"``, passwords masked, cut to fit the column."""
    words = [str(w).replace("\x00", "") for w in command if w is not None]
    if words:
        words[0] = Path(words[0]).name or words[0]
    # A command line may carry a database URL or password: user:***@, ?password=***, PGPASSWORD=***.
    line = redact_command(words) if words else "python"
    label = f"{socket.gethostname()}:{os.getpid()} {line}"
    # One readable line: no newlines or other control characters, valid UTF-8.
    label = "".join(c if c.isprintable() else " " for c in label).encode("utf-8", "replace").decode("utf-8")
    return label if len(label) <= LABEL_LENGTH else label[: LABEL_LENGTH - 3] + "..."


class PerProcess(Generic[T]):
    """A value made on first use in each process: ``make()`` runs again after a fork."""

    __slots__ = ("_make", "_made")

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._made: tuple[T, int] | None = None  # (value, pid it was made in): one assignment, thread-safe

    def get(self) -> T:
        made = self._made
        if made is None or made[1] != pid:
            made = self._made = (self._make(), pid)
        return made[0]


def default_label() -> PerProcess[str]:
    """This process's label (``describe_process(sys.argv)``), made when first asked for."""
    return PerProcess(lambda: describe_process(sys.argv))


def queue_id() -> PerProcess[str]:
    """This process's liveness id in the fair queue (its heartbeat row)."""
    return PerProcess(lambda: secrets.token_hex(8))


# -- what a clean exit tidies up ---------------------------------------------------------
# Work left for this process's clean exit (a Locker's heartbeat row in the fair queue, when
# the Locker was never closed): each piece gets ``bound`` seconds, run together on daemon
# threads, so a server that does not answer holds the exit up by at most the longest bound.
# Its owner withdraws a piece it did itself (close()); a fork's child runs none of its
# parent's (each piece names the pid that registered it).
_exit_work: dict[int, tuple[int, float, Callable[[float], None]]] = {}
_exit_lock = threading.Lock()
_exit_count = itertools.count()


def at_exit(bound: float, work: Callable[[float], None]) -> int:
    """Run ``work(deadline)`` at this process's clean exit, for at most ``bound`` seconds;
    the handle withdraws it (``done_at_exit``)."""
    handle = next(_exit_count)
    with _exit_lock:
        _exit_work[handle] = (pid, bound, work)
    return handle


def done_at_exit(handle: int) -> None:
    with _exit_lock:
        _exit_work.pop(handle, None)


def _run_at_exit() -> None:
    with _exit_lock:
        work = [(bound, fn) for owner, bound, fn in _exit_work.values() if owner == pid]
        _exit_work.clear()
    if not work:
        return
    start = time.monotonic()
    threads = []
    for bound, fn in work:
        thread = threading.Thread(target=_quietly, args=(fn, start + bound), name="dblock-exit", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # Python 3.12.0-3.12.1 start no thread at exit: then here, its connect bounded
            _quietly(fn, start + bound)
            continue
        threads.append((thread, start + bound))
    for thread, deadline in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _quietly(fn: Callable[[float], None], deadline: float) -> None:
    try:
        fn(deadline)
    except Exception:  # noqa: BLE001 - best effort: what it would have removed lapses by itself
        pass


atexit.register(_run_at_exit)
