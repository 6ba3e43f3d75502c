"""A granted lease: its fencing token, and the verbs only its holder may use."""

from __future__ import annotations

import threading
import time
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, NamedTuple

from .errors import LeaseLost
from .renew import OnLost

if TYPE_CHECKING:
    from .locker import Locker


class LeaseInfo(NamedTuple):
    """One row of ``Locker.leases()``; ``remaining`` is computed by the database clock.

    ``label`` says who holds the lease ("host:pid command", or the Locker's
    ``label``); None for a grant made before dblock recorded labels.
    """

    name: str
    owner: str
    token: int
    acquired_at: datetime
    expires_at: datetime
    remaining: float
    label: str | None = None


class Lease:
    """A grant of lock ``name`` to this process.

    ``token`` is the fencing token: larger than every earlier grant's of the
    same name. Pass it to the resource you protect so that a write made after
    this lease was lost is refused (see the README, "Fencing tokens").

    ``lost`` is a ``threading.Event``, set once this holder learns that the
    lease is gone without its release: renewal (``start_renewal``) found it
    taken over or could not extend it in time, or ``extend`` found it taken.
    """

    __slots__ = (
        "_locker", "name", "owner", "token", "expires_at", "ttl", "lost",
        "_trusted_until", "_released", "_renewal", "__weakref__",
    )

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
        self.lost = threading.Event()
        self._renewal: object | None = None  # its place in the Locker's renewal schedule

    def remaining(self) -> float:
        """Seconds this client may still rely on the lease (0 once released, lost or run out)."""
        if self._released or self.lost.is_set():
            return 0.0
        return max(0.0, self._trusted_until - time.monotonic())

    def extend(self, ttl: float | None = None) -> None:
        """Push the expiry to (database now + ttl). Raises LeaseLost if someone else took the lock.

        It never shortens the lease: a later expiry already set stays (a late
        statement must not end a lease its holder still trusts).

        Works even after the TTL ran out, as long as no one else acquired in
        between: exclusivity was never broken.
        """
        self._locker._extend(self, ttl)

    def release(self) -> bool:
        """End the lease (and its renewal). True if this call ended it, False if it was already released or taken over."""
        try:
            return self._locker._release(self)
        finally:
            if self._renewal is not None:
                self._locker._renewer.drop(self._renewal)  # type: ignore[arg-type]

    def start_renewal(self, on_lost: OnLost | None = None) -> None:
        """Extend this lease every ttl/3 until it is released or lost.

        The Locker's renewal thread does it (one for all its leases, sending
        the extends that fall due together as one statement), and holds only a
        weak reference: renewal also stops when the lease is garbage-collected.
        If an extend finds the lease taken over, or the database does not
        answer before ``remaining()`` runs out, ``lost`` is set, ``remaining()``
        returns 0 and ``on_lost(lease)`` runs on a thread of its own. Stop your
        work there: the lock no longer protects it.
        """
        if on_lost is not None and not callable(on_lost):
            raise TypeError(f"on_lost must be a callable taking the lease, or None; not {type(on_lost).__name__}")
        if self._released or self.lost.is_set():
            raise LeaseLost(f"lease on {self.name!r} (token {self.token}) has ended; nothing to renew")
        if self._renewal is not None:
            raise RuntimeError(f"lease on {self.name!r} (token {self.token}) is already renewing")
        self._renewal = self._locker._renewer.add(self, on_lost)

    def _extended(self, expires_at: datetime, ttl: float, sent_at: float) -> None:
        self.expires_at = expires_at
        self.ttl = ttl
        self._trusted_until = sent_at + ttl

    def _lose(self) -> None:
        # Once lost, stays lost: an extend that lands late (after its renewal
        # gave up waiting) must not make the caller trust the lease again.
        self.lost.set()
        if self._renewal is not None:
            self._locker._renewer.drop(self._renewal)  # type: ignore[arg-type]

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._locker._exit(self, exc is not None)

    def __repr__(self) -> str:
        if self._released:
            state = "released"
        elif self.lost.is_set():
            state = "lost"
        else:
            state = f"remaining={self.remaining():.3f}s"
        return f"<Lease {self.name!r} token={self.token} {state}>"


__all__ = ["Lease", "LeaseInfo", "LeaseLost"]
