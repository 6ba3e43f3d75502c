"""A granted lease: its fencing token, and the verbs only its holder may use."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple

from . import metrics
from ._core import trusted_until
from ._validate import check_ttl
from .errors import LeaseLost
from .renew import OnLost, Renewal

if TYPE_CHECKING:
    from .locker import Locker

release_log = logging.getLogger("dblock.release")


class LeaseInfo(NamedTuple):
    """One row of ``Locker.leases()``; ``remaining`` is computed by the database clock.

    ``label`` says who holds the lease ("host:pid command", or the Locker's
    ``label``); None for a grant made before dblock recorded labels.
    ``shared`` marks a reader's or semaphore holder's lease (several may
    hold the name at once), ``limit`` the semaphore limit it was granted under.
    """

    name: str
    owner: str
    token: int
    acquired_at: datetime
    expires_at: datetime
    remaining: float
    label: str | None = None
    shared: bool = False  # a read lock's or semaphore's lease (False: the exclusive, write lock's)
    limit: int | None = None  # a semaphore holder's limit (None: a reader, or an exclusive lease)


class LeaseState:
    """What changes in a lease over its life (internal, not API).

    Kept apart from the Lease so that the Locker's renewal can read and update
    it while holding the Lease itself only by weak reference; it refers to no
    Lease. Only the Lease and its renewal change it.
    """

    __slots__ = ("expires_at", "ttl", "trusted_until", "released", "lost", "hold", "held_until")

    def __init__(
        self, expires_at: datetime, ttl: float, trusted_until: float, hold: metrics.Hold, lost: Any = None
    ) -> None:
        self.expires_at = expires_at  # database time, timezone-aware
        self.ttl = ttl
        # G5: trusted until (when the acquire was *sent*) + ttl on this
        # process's monotonic clock, never past the database's expiry.
        self.trusted_until = trusted_until
        self.released = False
        # A threading.Event; an AsyncLease passes an asyncio.Event.
        self.lost = threading.Event() if lost is None else lost
        self.hold = hold  # times the hold for dblock.metrics; ended by a release or a loss, once
        self.held_until: datetime | None = None  # set by a release that kept the lease for its min_hold

    def lose(self) -> None:
        """The holder learned that the lease is gone without its release."""
        self.lost.set()
        self.hold.end(lost=True)

    def extended(self, expires_at: datetime, ttl: float, sent_at: float) -> None:
        """An extend sent at ``sent_at`` set the database expiry ``expires_at``."""
        self.expires_at = expires_at
        self.ttl = ttl
        self.trusted_until = trusted_until(sent_at, ttl)

    def ended(self) -> bool:
        """Released or lost: nothing left to trust or renew."""
        return self.released or self.lost.is_set()


class LeaseView:
    """What both faces' leases (``Lease``, ``aio.AsyncLease``) read from their ``LeaseState``.

    A base of no state of its own (its subclasses define ``_state``,
    ``_min_hold``, ``name`` and ``token``), so the read-only properties,
    ``remaining()``, the repr and the with-block's verdict are written once.
    """

    __slots__ = ()
    _state: LeaseState
    _min_hold: float
    name: str
    token: int

    @property
    def expires_at(self) -> datetime:
        """The lease's expiry by the database clock (timezone-aware), as of its grant or last extend."""
        return self._state.expires_at

    @property
    def ttl(self) -> float:
        """The lease's time to live, in seconds, as of its grant or last extend."""
        return self._state.ttl

    @property
    def min_hold(self) -> float:
        """Seconds after the grant before which ``release`` keeps the lease (0: it ends at release)."""
        return self._min_hold

    @property
    def held_until(self) -> datetime | None:
        """After a ``release`` that kept the lease for its ``min_hold``: when it ends, by the
        database clock (timezone-aware). None before, and after a release that ended it."""
        return self._state.held_until

    def remaining(self) -> float:
        """Seconds this client may still rely on the lease (0 once released, lost or run out)."""
        if self._state.ended():
            return 0.0
        return max(0.0, self._state.trusted_until - time.monotonic())

    def _lost_in_block(self, ended: bool, released_before: bool, failing: bool) -> LeaseLost | None:
        """The with-block's verdict after its release: LeaseLost if the lease was lost before the
        block ended (not when the block is failing anyway, or released the lease itself)."""
        if ended or released_before or failing:
            return None
        return LeaseLost(
            f"lease on {self.name!r} (token {self.token}) was lost before the with-block ended: "
            "another owner may have acquired it"
        )

    def _status(self) -> str:
        if self._state.released:
            held = self._state.held_until
            return "released" if held is None else f"released, held until {held.isoformat()}"
        if self._state.lost.is_set():
            return "lost"
        return f"remaining={self.remaining():.3f}s"


class Lease(LeaseView):
    """A grant of lock ``name`` to this process.

    ``token`` is the fencing token: larger than every earlier grant's of the
    same name. Pass it to the resource you protect so that a write made after
    this lease was lost is refused (see the README, "Fencing tokens").
    A shared lease (``Locker.read_lock``, ``Locker.semaphore``; ``shared`` is
    True) has a token of its own, larger than every earlier grant of the name;
    several shared leases hold at once, so it orders this holder after every
    earlier writer, not against the other holders (README, "Shared locks").

    ``lost`` is a ``threading.Event``, set once this holder learns that the
    lease is gone without its release: renewal (``start_renewal``) found it
    taken over or could not extend it in time, or ``extend`` found it taken.

    ``min_hold``: seconds after the grant (database clock) before which a
    release keeps the lease instead of ending it (0: none); see ``release``.
    """

    __slots__ = ("_keeper", "name", "owner", "token", "_min_hold", "_state", "_renewal", "__weakref__")

    def __init__(
        self,
        locker: Locker,
        name: str,
        owner: str,
        token: int,
        expires_at: datetime,
        ttl: float,
        sent_at: float,
        min_hold: float = 0.0,
        keeper: Any = None,
    ) -> None:
        # The statements behind this lease's verbs: the exclusive lock's, or (``keeper``) the shared ones.
        self._keeper = locker.keeper if keeper is None else keeper
        self.name = name
        self.owner = owner
        self.token = token
        self._min_hold = min_hold
        hold = metrics.recorder.hold(locker.backend.name, name)
        self._state = LeaseState(expires_at, ttl, trusted_until(sent_at, ttl), hold)
        self._renewal: Renewal | None = None  # its place in the Locker's renewal schedule

    @property
    def locker(self) -> Locker:
        """The Locker that granted this lease (its ``engine``, ``table`` and ``schema`` say where it lives)."""
        return self._keeper.locker

    @property
    def shared(self) -> bool:
        """True for a read lock's or semaphore's lease; False for the exclusive (write) lock's."""
        return bool(getattr(self._keeper, "shared", False))

    @property
    def lost(self) -> threading.Event:
        """Set once this holder learns that the lease is gone without its release."""
        return self._state.lost

    def extend(self, ttl: float | None = None) -> None:
        """Push the expiry to (database now + ttl). Raises LeaseLost if someone else took the lock.

        It never shortens the lease: a later expiry already set stays (a late
        statement must not end a lease its holder still trusts).

        Works even after the TTL ran out, as long as no one else acquired in
        between: exclusivity was never broken. Not after ``release`` (LeaseLost,
        before any SQL): a lease kept for its ``min_hold`` must end on time.
        """
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        if self._state.released:
            raise LeaseLost(f"lease on {self.name!r} (token {self.token}) was released; not extended")
        done = self._keeper.extend(self.name, self.owner, self.token, ttl)
        if done is None:
            if not self._state.released:
                self._lose()
            raise LeaseLost(f"lease on {self.name!r} (token {self.token}) was released or taken over; not extended")
        self._state.extended(done.expires_at, ttl, done.sent_at)

    def release(self) -> bool:
        """End the lease (and its renewal). True if this call ended it, False if it was already released or taken over.

        With a ``min_hold`` that has not passed yet (by the database clock,
        counted from the grant), the lease is kept instead, under the same
        owner and token, and ends at grant + min_hold (``held_until``), sooner
        or later than its expiry was; renewal stops, waiters get it then. That
        also returns True, once: a later call returns False, sending nothing.
        Once the hold has passed, it ends now, as without one.
        """
        if self._state.held_until is not None:
            return False  # kept for its hold by an earlier release: nothing left to end
        try:
            return self._keeper.release(self.name, self.owner, self.token, self._state, self._min_hold, self._renewal)
        finally:
            if self._renewal is not None:
                self._keeper.renewer.drop(self._renewal)

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
        if self._state.ended():
            raise LeaseLost(f"lease on {self.name!r} (token {self.token}) has ended; nothing to renew")
        if self._renewal is not None:
            raise RuntimeError(f"lease on {self.name!r} (token {self.token}) is already renewing")
        self._renewal = self._keeper.renewer.add(self, self._state, on_lost)

    def _lose(self) -> None:
        # Once lost, stays lost: an extend that lands late (after its renewal
        # gave up waiting) must not make the caller trust the lease again.
        self._state.lose()
        if self._renewal is not None:
            self._keeper.renewer.drop(self._renewal)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """Release; raise LeaseLost if the lease was lost before the block ended (unless it is failing)."""
        failing = exc is not None
        released_before = self._state.released
        try:
            ended = self.release()
        except Exception:
            if not failing:
                raise
            release_log.exception("could not release %r after an error in the with-block", self.name)
            return
        lost = self._lost_in_block(ended, released_before, failing)
        if lost is not None:
            raise lost

    def __repr__(self) -> str:
        return f"<Lease {self.name!r} token={self.token} {self._status()}>"


__all__ = ["Lease", "LeaseInfo", "LeaseLost"]
