"""Who this process is: the label operators see next to its leases, and its fair-queue id.

Both are made once per process and made again in a fork's child, which is
another process (another pid, and its waiters need a heartbeat of their own).
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Callable, Generic, Sequence, TypeVar

from ._redact import redact_command
from .schema import LABEL_LENGTH

T = TypeVar("T")


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
        if made is None or made[1] != os.getpid():
            made = self._made = (self._make(), os.getpid())
        return made[0]


def default_label() -> PerProcess[str]:
    """This process's label (``describe_process(sys.argv)``), made when first asked for."""
    return PerProcess(lambda: describe_process(sys.argv))


def queue_id() -> PerProcess[str]:
    """This process's liveness id in the fair queue (its heartbeat row)."""
    return PerProcess(lambda: secrets.token_hex(8))
