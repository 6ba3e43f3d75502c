"""A granted lease: its fencing token, and the verbs only its holder may use."""

from __future__ import annotations

import time
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, NamedTuple

from .errors import LeaseLost

if TYPE_CHECKING:
    from .locker import Locker


class LeaseInfo(NamedTuple):
    """One row of ``Locker.leases()``; ``remaining`` is computed by the database clock."""

    name: str
    owner: str
    token: int
    acquired_at: datetime
    expires_at: datetime
    remaining: float


class Lease:
    """A grant of lock ``name`` to this process.

    ``token`` is the fencing token: larger than every earlier grant's of the
    same name. Pass it to the resource you protect so that a write made after
    this lease was lost is refused (see the README, "Fencing tokens").
    """

    __slots__ = ("_locker", "name", "owner", "token", "expires_at", "ttl", "_trusted_until", "_released")

    def __init__(
        self,
        locker: Locker,
        name: str,
        owner: str,
        token: int,
        expires_at: datetime,
        ttl: float,
        sent_at: float,
    ) -> None:
        self._locker = locker
        self.name = name
        self.owner = owner
        self.token = token
        self.expires_at = expires_at  # database time, timezone-aware
        self.ttl = ttl
        # G5: trust the lease until (when the acquire was *sent*) + ttl on this
        # process's monotonic clock, never past the database's expiry.
        self._trusted_until = sent_at + ttl
        self._released = False

    def remaining(self) -> float:
        """Seconds this client may still rely on the lease (0 once released or run out)."""
        if self._released:
            return 0.0
        return max(0.0, self._trusted_until - time.monotonic())

    def extend(self, ttl: float | None = None) -> None:
        """Push the expiry to (database now + ttl). Raises LeaseLost if someone else took the lock.

        Works even after the TTL ran out, as long as no one else acquired in
        between: exclusivity was never broken.
        """
        self._locker._extend(self, ttl)

    def release(self) -> bool:
        """End the lease. True if this call ended it, False if it was already released or taken over."""
        return self._locker._release(self)

    def _extended(self, expires_at: datetime, ttl: float, sent_at: float) -> None:
        self.expires_at = expires_at
        self.ttl = ttl
        self._trusted_until = sent_at + ttl

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._locker._exit(self, exc is not None)

    def __repr__(self) -> str:
        state = "released" if self._released else f"remaining={self.remaining():.3f}s"
        return f"<Lease {self.name!r} token={self.token} {state}>"


__all__ = ["Lease", "LeaseInfo", "LeaseLost"]
