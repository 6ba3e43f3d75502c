"""What both faces' leases share: the row ``leases()`` lists, a lease's changing state, and its read-only view."""

from __future__ import annotations

import threading
import time
import weakref
from datetime import datetime, timezone
from typing import Any, Callable, NamedTuple

from . import metrics
from . import _process as process
from ._core import Drift, Expiry, trusted_until, when


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


_MAKING = threading.Lock()  # LeaseState.lost: one Event per lease, whoever asks first


class LeaseState:
    """What changes in a lease over its life (internal, not API).

    Kept apart from the Lease so that the Locker's renewal can read and update
    it while holding the Lease itself only by weak reference; it refers to no
    Lease. Only the Lease and its renewal change it.
    """

    __slots__ = (
        "_expires_at", "ttl", "drift", "trusted_until", "released", "_lost", "_event", "hold", "held_until", "pid",
        "why",
    )

    def __init__(
        self,
        expires_at: Expiry,
        ttl: float,
        sent_at: float,
        drift: Drift,
        hold: metrics.Hold,
        event: Callable[[], Any] = threading.Event,
    ) -> None:
        self._expires_at = expires_at  # database time: a datetime, or Unix seconds until first read
        self.ttl = ttl
        self.drift = drift  # the clock allowance taken off the trust of every grant and extend
        # G5: trusted until (when the acquire was *sent*) + ttl on this process's monotonic
        # clock, less the clock allowance: never past the database's expiry.
        self.trusted_until = trusted_until(sent_at, ttl, drift)
        self.released = False
        # ``lost``, made on first use (most leases end without anyone asking): a threading.Event,
        # or what ``event`` makes (an AsyncLease's: an asyncio.Event).
        self._lost: Any = None
        self._event = event
        self.hold = hold  # times the hold for dblock.metrics; ended by a release or a loss, once
        self.held_until: datetime | None = None  # set by a release that kept the lease for its min_hold
        self.pid = process.pid  # the process granted it: a forked child may not end or extend it
        self.why: str | None = None  # once lost: how the holder learned it (the first account kept)

    def check_process(self, name: str, verb: str) -> None:
        """Refuse ``verb`` in a forked child: the lease is its parent's, which may still be using it."""
        if self.pid != process.pid:
            raise RuntimeError(
                f"the lease on {name!r} belongs to process {self.pid}, the parent of this forked one: "
                f"only it may {verb} the lease; acquire a lease of the child's own"
            )

    @property
    def lost(self) -> Any:
        """The Event set once the holder learns that the lease is gone without its release."""
        lost = self._lost
        if lost is None:
            with _MAKING:  # two threads asking at once get the same Event
                lost = self._lost
                if lost is None:
                    lost = self._lost = self._event()
        return lost

    def is_lost(self) -> bool:
        """``lost.is_set()``, making no Event for a lease nobody has lost."""
        lost = self._lost
        return lost is not None and bool(lost.is_set())

    def lose(self, why: str | None = None) -> None:
        """The holder learned that the lease is gone without its release (``why``: how, in a few words)."""
        if self.why is None:
            self.why = why
        self.lost.set()
        self.hold.end(lost=True)

    @property
    def expires_at(self) -> datetime:
        """The database expiry, timezone-aware (made from Unix seconds on first read)."""
        value = self._expires_at
        if isinstance(value, datetime):
            return value
        value = self._expires_at = when(value)
        return value

    def extended(self, expires_at: Expiry, ttl: float, sent_at: float) -> None:
        """An extend sent at ``sent_at`` set the database expiry ``expires_at``."""
        self._expires_at = expires_at
        self.ttl = ttl
        self.trusted_until = trusted_until(sent_at, ttl, self.drift)

    def ended(self) -> bool:
        """Released or lost: nothing left to trust or renew."""
        return self.released or self.is_lost()


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

    def _lapse(self, renewing: bool) -> str | None:
        """Before the lease's first release (a with-block's end, or a release inside it): why the holder
        can no longer rely on the lease (it was found lost, or its trusted time ran out); None while it
        still can, or once released."""
        state = self._state
        if state.released:
            return None
        if state.is_lost():
            return state.why or "it was found lost"
        late = time.monotonic() - state.trusted_until
        if late < 0:
            return None
        at = datetime.fromtimestamp(time.time() - late, timezone.utc)
        return (
            f"its trusted time ran out at {at:%H:%M:%S}.{at.microsecond // 1000:03d} UTC, {late:.3f} s before "
            f"the block ended (ttl {state.ttl:g} s{'' if renewing else ', not renewed'})"
        )

    @staticmethod
    def _lost_in_block(what: str, lapse: str | None, ended: bool | None, detail: str = "") -> str | None:
        """The with-block's verdict after its release, as LeaseLost's message; None if the lease
        protected the block to its end. ``lapse``: what ``_lapse`` said before the release;
        ``ended``: what the release said (None: it could not be confirmed, ``detail`` says why;
        False: the lease was released or taken over, ``detail`` says who holds the name now)."""
        if lapse is None and ended is not False:
            return None
        said = [lapse] if lapse is not None else []
        if ended is False:
            said.append("the release found it released or taken over" + (f": {detail}" if detail else ""))
        elif ended:
            said.append("nobody else was granted it meanwhile, and it is released")
        else:
            said.append(f"its release could not be confirmed ({detail}) and goes on in the background")
        return f"{what} was lost before the with-block ended: " + "; ".join(said)

    def _status(self) -> str:
        if self._state.released:
            held = self._state.held_until
            return "released" if held is None else f"released, held until {held.isoformat()}"
        if self._state.is_lost():
            return "lost"
        return f"remaining={self.remaining():.3f}s"


class Leader(NamedTuple):
    """Who leads an election (``election.leader()``, ``observe()``): the value it proclaims,
    its term (its lease's fencing token, larger than every earlier leader's) and since when
    it leads (database clock)."""

    value: str
    term: int
    since: datetime


class HeldHere:
    """The exclusive leases a Locker granted, by name, each with the thread or task that acquired it,
    so that a wait for a name its own thread (or task) still holds can say so: dblock's locks are
    not re-entrant, and such a wait ends only when that lease is released or expires.

    Weak references only, with no callbacks (a grant makes no closure and a lease's end runs
    nothing): entries whose lease is gone or over are dropped when their name is looked up or
    has more than 8 of them, and all of them whenever the table has doubled since the last
    sweep, so it stays within about twice the leases that may still be relied on.
    """

    SWEEP_AT = 64  # the least size at which a sweep runs

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, list[tuple[weakref.ref[Any], weakref.ref[Any]]]] = {}
        self._sweep_at = self.SWEEP_AT

    def add(self, name: str, lease: Any, worker: Any) -> None:
        if worker is None:
            return  # no task: nothing to tell apart
        entry = (weakref.ref(lease), weakref.ref(worker))
        with self._lock:
            entries = self._by_name.get(name)
            if entries is None:
                self._by_name[name] = [entry]
                if len(self._by_name) >= self._sweep_at:
                    self._sweep()
            else:
                entries.append(entry)
                if len(entries) > 8:  # a name taken again and again: at most one exclusive lease is live
                    entries[:] = [entry for entry in entries if _relied_on(entry)]

    def holding(self, name: str, worker: Any) -> Any | None:
        """A lease on ``name`` that ``worker`` acquired and may still rely on, or None."""
        with self._lock:
            entries = self._by_name.pop(name, [])
            kept = [entry for entry in entries if _relied_on(entry)]
            if kept:
                self._by_name[name] = kept
        for lease_ref, worker_ref in kept:
            if worker is not None and worker_ref() is worker:
                return lease_ref()
        return None

    def _sweep(self) -> None:
        # Under the lock.
        for name, entries in list(self._by_name.items()):
            kept = [entry for entry in entries if _relied_on(entry)]
            if kept:
                self._by_name[name] = kept
            else:
                del self._by_name[name]
        self._sweep_at = max(self.SWEEP_AT, 2 * len(self._by_name))

    def __len__(self) -> int:
        """How many names have entries (tests)."""
        return len(self._by_name)


def _relied_on(entry: tuple[weakref.ref[Any], weakref.ref[Any]]) -> bool:
    lease = entry[0]()
    return lease is not None and entry[1]() is not None and lease.remaining() > 0


