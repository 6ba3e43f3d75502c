"""The statements behind a lease's verbs, and what surrounds them: a Locker's side of its leases (internal).

Written once for both faces (``tools/async_to_sync.py`` writes ``_keeper.py``).
A Locker makes two keepers, one for the exclusive (write) lock's leases and one
for shared leases (read locks, semaphore slots), and each lease holds its own;
the lease keeps its state (``LeaseState``) and calls only these, so neither
reaches into the other's private names.
"""

from __future__ import annotations

import time
import weakref
from datetime import datetime
from typing import TYPE_CHECKING, Any, Sequence

from . import _core as core
from ._acompat import AMutex
from ._core import Extended, Grant, Miss
from .errors import DatabaseUnavailable

if TYPE_CHECKING:
    from ._aacquire import AsyncAcquirer
    from ._acleanup import AsyncCleanup
    from ._alease import AsyncLease
    from ._arenew import Renewal
    from ._averbs import AsyncVerbs
    from ._lease_state import LeaseState


class AsyncKeeper:
    """One Locker's side of its leases of one kind (``shared``): release, extend, renewal's batches."""

    __slots__ = (
        "locker", "renewer", "shared", "partner", "drift", "_verbs", "_cleanup", "_acquirer", "_entered",
        "_entered_lock", "_reentered",
    )

    def __init__(
        self, locker: Any, verbs: AsyncVerbs, cleanup: AsyncCleanup, acquirer: AsyncAcquirer, *, shared: bool
    ) -> None:
        self.locker = locker  # the Locker whose leases these are (``lease.locker``)
        self.renewer: Any = None  # the Locker's renewal of this kind of lease, set by the Locker
        self.shared = shared  # a reader's or semaphore holder's leases: the shared statements
        # The Locker's keeper of the other kind, set by the Locker: an upgradeable reader's lease
        # moves to it when it upgrades, and back when it downgrades.
        self.partner: AsyncKeeper | None = None
        self.drift = acquirer.drift  # the Locker's clock allowance, taken off its leases' trust
        self._verbs = verbs
        self._cleanup = cleanup
        self._acquirer = acquirer
        # Leases entered again by their owner key: how many acquires each still has to be released for.
        self._entered: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._entered_lock = AMutex()
        self._reentered = False  # some lease was ever entered again: until then a release looks at nothing

    def enter_again(self, lease: Any) -> bool:
        """Re-entry by an owner key: count one more acquire of ``lease``, if its holder may still rely
        on it (not ended, time left); False if not (then the database decides)."""
        with self._entered_lock:
            if lease.remaining() <= 0:
                return False
            self._entered[lease] = self._entered.get(lease, 1) + 1
            self._reentered = True
            return True

    def leave_inner(self, lease: Any) -> bool:
        """A release of ``lease``: True if it matches an inner acquire by its owner key (the lease
        stays, nothing is sent); False if it is the outermost (or the lease has ended)."""
        if not self._reentered:
            return False  # no lease of this Locker was ever entered again: a release's usual case, no lock taken
        with self._entered_lock:
            depth = self._entered.pop(lease, 1)
            if depth <= 1 or lease.remaining() <= 0:
                return False
            if depth > 2:
                self._entered[lease] = depth - 1
            return True

    async def release(
        self,
        name: str,
        owner: str,
        token: int,
        state: LeaseState,
        hold: float = 0.0,
        renewal: Renewal | None = None,
    ) -> bool:
        """End the lease, or keep it until ``hold`` s after its grant (``state.held_until``).

        True if this call ended it or set its hold. Marks ``state`` released
        first. A held lease keeps its owner, so an extend landing after the
        release would push its expiry out: an extend of it in flight (its
        ``renewal``) is waited for before the release goes out.
        """
        # Before the statement: a renewal extend that finds the row cleared by
        # this release must not take it for a loss.
        state.released = True
        deadline = self._verbs.deadline()
        if renewal is not None and core.holds(hold):
            await self.renewer.settle(renewal, deadline)
        key = {"name": name, "owner": owner, "token": token}
        shared = self.shared
        ended: bool | None = None
        try:
            outcome = await self._verbs.end(key, deadline, hold, shared=shared)
            ended = outcome.ended
        except DatabaseUnavailable:
            # Unconfirmed: keep ending it in the background until it would expire.
            self._cleanup.add(
                f"the lease on {name!r} (token {token})",
                lambda: self._verbs.end(key, self._verbs.deadline(), hold, shared=shared),
                time.monotonic() + state.ttl,
            )
            raise
        finally:
            state.hold.end(lost=ended is False)  # False: someone else ended it first (a takeover, a force release)
        state.held_until = outcome.held_until
        self._acquirer.released(name, held=outcome.held_until is not None)
        return outcome.ended

    async def extend(
        self, name: str, owner: str, token: int, ttl: float, deadline: float | None = None
    ) -> Extended | None:
        """Extend the lease by ``ttl`` s (database clock); None if it was released or taken over."""
        deadline = self._verbs.deadline() if deadline is None else deadline
        return await self._verbs.extend(name, owner, token, ttl, deadline, self.shared)

    async def holders(self, name: str) -> list[int]:
        """The tokens of the leases that hold ``name`` now (database clock), in order."""
        return sorted(info.token for info in await self._verbs.leases(name))

    # -- the upgradeable read lock -------------------------------------------------
    def pace(self) -> tuple[float, float]:
        """The Locker's pauses between looks (``poll_min``, ``poll_max``): an upgrade's wait uses them."""
        return self._acquirer.poll_min, self._acquirer.poll_max

    async def upgrade(
        self, name: str, owner: str, token: int, ttl: float, deadline: float
    ) -> tuple[Grant | Miss | None, float]:
        """One look of a wait to upgrade that ends at ``deadline`` (``AsyncVerbs.upgrade``)."""
        return await self._verbs.upgrade(name, owner, token, ttl, self._verbs.bound(deadline))

    async def downgrade(self, name: str, owner: str, token: int, ttl: float) -> tuple[Grant | None, float]:
        """Back to the upgradeable reader's lease, or its ask to upgrade withdrawn, and when it was sent
        (``AsyncVerbs.downgrade``)."""
        return await self._verbs.downgrade(name, owner, token, ttl, self._verbs.deadline())

    async def extend_many(
        self, leases: Sequence[AsyncLease], deadline: float
    ) -> tuple[float, list[datetime | None]]:
        """Renewal's extend: ``leases`` by their own ttl in one statement (``AsyncVerbs.extend_many``)."""
        batch = [(lease.name, lease.owner, lease.token, lease.ttl) for lease in leases]
        return await self._verbs.extend_many(batch, deadline, self.shared)
