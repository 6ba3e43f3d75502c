"""A granted lease: its fencing token, and the verbs only its holder may use.

Written once for both faces (``tools/async_to_sync.py`` writes ``_lease.py``,
whose ``Lease`` the sync face hands out, from this module's ``AsyncLease``).
"""

from __future__ import annotations

import logging
import random
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Union

from . import _core as core
from . import metrics
from ._acompat import AEvent, asleep
from ._core import Expiry, Grant
from ._lease_state import LeaseState, LeaseView
from ._validate import check_callbacks, check_timeout, check_trusted, check_ttl
from .errors import DBLockError, LeaseLost, LockNotAcquired

if TYPE_CHECKING:
    from ._akeeper import AsyncKeeper
    from ._arenew import Renewal

release_log = logging.getLogger("dblock.release")

# What renewal calls when it finds a lease lost: a plain callable (on asyncio also an async one).
AsyncOnLost = Callable[["AsyncLease"], Union[object, Awaitable[object]]]


class AsyncLease(LeaseView):
    """A grant of lock ``name`` to this process.

    ``token`` is the fencing token: larger than every earlier grant's of the
    same name. Pass it to the resource you protect so that a write made after
    this lease was lost is refused (see "Fencing your writes" in the documentation).
    A shared lease (``read_lock``, ``semaphore``; ``shared`` is True) has a
    token of its own, larger than every earlier grant of the name; several
    shared leases hold at once, so it orders this holder after every earlier
    writer, not against the other holders (see "Shared locks and semaphores" in the documentation).

    ``lost`` is an Event (asyncio's on the asyncio face, threading's on the
    sync one), set once this holder learns that the lease is gone without its
    release: renewal (``start_renewal``) found it taken over or could not
    extend it in time, or ``extend`` found it taken.

    ``min_hold``: seconds after the grant (database clock) before which a
    release keeps the lease instead of ending it (0: none); see ``release``.
    """

    __slots__ = (
        "_keeper", "name", "owner", "token", "_min_hold", "_state", "_renewal", "_ended_as", "__weakref__",
    )

    def __init__(
        self,
        locker: Any,
        name: str,
        owner: str,
        token: int,
        expires_at: Expiry,
        ttl: float,
        sent_at: float,
        min_hold: float = 0.0,
        keeper: AsyncKeeper | None = None,
    ) -> None:
        # The statements behind this lease's verbs: the exclusive lock's, or (``keeper``) the shared ones.
        self._keeper: AsyncKeeper = locker.keeper if keeper is None else keeper
        self.name = name
        self.owner = owner
        self.token = token
        self._min_hold = min_hold
        recorder = metrics.recorder
        hold = metrics.UNHELD if recorder is metrics.OFF else recorder.hold(locker.backend.name, name)
        self._state = LeaseState(expires_at, ttl, sent_at, self._keeper.drift, hold, AEvent)
        self._renewal: Renewal | None = None  # its place in the Locker's renewal schedule
        # Its first release's account (for ``__aexit__``): why the holder could no longer rely on it then
        # (None: it could), what the release said (None: unconfirmed), and the error if unconfirmed.
        self._ended_as: tuple[str | None, bool | None, str] | None = None

    @property
    def locker(self) -> Any:
        """The Locker that granted this lease (its ``engine``, ``table`` and ``schema`` say where it lives)."""
        return self._keeper.locker

    @property
    def shared(self) -> bool:
        """True for a read lock's or semaphore's lease; False for the exclusive (write) lock's."""
        return self._keeper.shared

    @property
    def renewing(self) -> bool:
        """True while renewal (``start_renewal``, ``renew=True``) keeps extending this lease."""
        return self._renewal is not None and not self._state.ended()

    @property
    def lost(self) -> AEvent:
        """Set once this holder learns that the lease is gone without its release."""
        return self._state.lost  # type: ignore[no-any-return]

    async def extend(self, ttl: float | None = None) -> None:
        """Push the expiry to (database now + ttl). Raises LeaseLost if someone else took the lock.

        It never shortens the lease: a later expiry already set stays (a late
        statement must not end a lease its holder still trusts).

        Works even after the TTL ran out, as long as no one else acquired in
        between: exclusivity was never broken. Not after ``release`` (LeaseLost,
        before any SQL): a lease kept for its ``min_hold`` must end on time.
        """
        ttl = self.ttl if ttl is None else check_trusted(check_ttl(ttl), self._state.drift)
        self._state.check_process(self.name, "extend")
        if self._state.released:
            raise LeaseLost(f"lease on {self.name!r} (token {self.token}) was released; not extended")
        done = await self._keeper.extend(self.name, self.owner, self.token, ttl)
        if done is None:
            if not self._state.released:
                self._lose("an extend found it released or taken over")
            raise LeaseLost(f"lease on {self.name!r} (token {self.token}) was released or taken over; not extended")
        self._state.extended(done.expires_at, ttl, done.sent_at)

    async def release(self) -> bool:
        """End the lease (and its renewal). True if this call ended it, False if it was already released or taken over.

        A lease acquired again with its owner key (re-entry) ends at the release
        that matches its first acquire: each earlier release returns True and
        ends nothing.

        With a ``min_hold`` that has not passed yet (by the database clock,
        counted from the grant), the lease is kept instead, under the same
        owner and token, and ends at grant + min_hold (``held_until``), sooner
        or later than its expiry was; renewal stops, waiters get it then. That
        also returns True, once: a later call returns False, sending nothing.
        Once the hold has passed, it ends now, as without one.
        """
        self._state.check_process(self.name, "release")
        if self._keeper.leave_inner(self):
            return True  # an owner key's inner acquire: the outermost release ends the lease
        if self._state.held_until is not None:
            return False  # kept for its hold by an earlier release: nothing left to end
        # The first release's account, for the with-block's verdict: why the holder could no longer rely on the lease.
        first = not self._state.released
        lapse = self._lapse(self._renewal is not None) if first else None
        try:
            ended = await self._keeper.release(
                self.name, self.owner, self.token, self._state, self._min_hold, self._renewal
            )
        except Exception as error:
            if first:
                self._ended_as = (lapse, None, str(error))
            raise
        finally:
            if self._renewal is not None:
                self._keeper.renewer.drop(self._renewal)
        if first:
            self._ended_as = (lapse, ended, "")
        return ended

    def start_renewal(
        self,
        on_lost: AsyncOnLost | None = None,
        *,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
    ) -> None:
        """Extend this lease every ttl/3 until it is released or lost.

        The Locker's renewal does it (one scheduler for all its leases, sending
        the extends that fall due together as one statement), and holds only a
        weak reference: renewal also stops when the lease is garbage-collected.
        If an extend finds the lease taken over, or the database does not
        answer before ``remaining()`` runs out, ``lost`` is set, ``remaining()``
        returns 0 and ``on_lost(lease)`` runs on its own (a thread; on asyncio
        a task, and it may be an async callable). Stop your work there: the
        lock no longer protects it.

        ``on_expiring(lease)`` is the warning before that: it runs (once, on its
        own worker, as ``on_lost``) when renewal has not extended the lease yet
        and only ``expiring_margin`` seconds of trust are left (default: a third
        of the ttl; never more than half of it), so the work can wind down before
        the lease is gone. It runs again after a later shortfall, once an extend
        has restored the lease's trust in between.
        """
        margin = check_callbacks(on_lost, on_expiring, expiring_margin)
        if self._state.ended():
            raise LeaseLost(f"lease on {self.name!r} (token {self.token}) has ended; nothing to renew")
        if self._renewal is not None:
            raise RuntimeError(f"lease on {self.name!r} (token {self.token}) is already renewing")
        self._renewal = self._keeper.renewer.add(self, self._state, on_lost, on_expiring, margin)

    def _lose(self, why: str) -> None:
        # Once lost, stays lost: an extend that lands late (after its renewal
        # gave up waiting) must not make the caller trust the lease again.
        self._state.lose(why)
        if self._renewal is not None:
            self._keeper.renewer.drop(self._renewal)

    async def __aenter__(self) -> AsyncLease:
        if self._state.ended():
            # The block would run unprotected: say so before it starts.
            raise LeaseLost(
                f"the lease on {self.name!r} (token {self.token}) has already "
                f"{'been released' if self._state.released else 'been lost'}: acquire the lock again for this block"
            )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Release the lease, and raise LeaseLost if it was lost while the block ran, that is before
        its first release (the block's end, or the block's own ``release()``): the holder found it
        lost (renewal, an extend), its trusted time had run out, or that release found it released
        or taken over. The lease is released all the same where it is still this holder's. The
        block's own exception, if it fails, goes on instead: the loss is told in a note on it and
        in the log."""
        what = f"lease on {self.name!r} (token {self.token})"
        failing = exc is not None
        released_before = self._state.released
        try:
            await self.release()
        except Exception as error:
            lapse = None if self._ended_as is None else self._ended_as[0]
            lost = self._lost_in_block(what, lapse, None, str(error))
            if failing:
                release_log.exception("could not release %r after an error in the with-block", self.name)
                _note(exc, lost)
                return
            if lost is None:  # nothing was lost: the release's own error is the news
                raise
            raise LeaseLost(lost) from error
        if self._ended_as is None:
            return  # the inner release of a lease its owner key entered again: the lease goes on
        lapse, ended, detail = self._ended_as
        if ended is False and not (failing or released_before):
            detail = await self._holders_now()
        lost = self._lost_in_block(what, lapse, ended, detail)
        if lost is None:
            return
        if failing:
            _note(exc, lost)
            return
        raise LeaseLost(lost)

    async def _holders_now(self) -> str:
        """Who holds the name now, for the message of a lease found released or taken over ("" if
        that cannot be read: it is only a detail)."""
        try:
            tokens = await self._keeper.holders(self.name)
        except Exception:  # noqa: BLE001 - the verdict stands without it
            return ""
        if not tokens:
            return "nobody holds the name now"
        return f"the name is held now by token{'s' if len(tokens) > 1 else ''} {', '.join(map(str, tokens))}"

    def __repr__(self) -> str:
        return f"<AsyncLease {self.name!r} token={self.token} {self._status()}>"


class AsyncUpgradeableLease(AsyncLease):
    """The upgradeable reader's lease (``locker.upgradeable_lock``): a read lease that can become
    the write lease of its name without letting go (``upgrade``), and back (``downgrade``).

    At most one upgradeable reader holds a name at a time, beside any number of readers; it
    excludes writers as every reader does. ``shared`` says which it is now; ``token`` is the
    token of what it is now, a new one after each change. Releasing ends whichever it is.
    """

    __slots__ = ()

    async def upgrade(self, timeout: float | None = None) -> AsyncUpgradeableLease:
        """Become the name's write lease: wait up to ``timeout`` s (default: the Locker's) for the
        other readers to leave, while no new reader joins them; LockNotAcquired after, and the
        lease stays the upgradeable reader's, readers welcome again. Returns this lease, now the
        writer, with a new token larger than every earlier grant of the name (fence writes with
        it). LeaseLost if the read lease ended first. A lease that writes already is returned as it is.
        """
        timeout = self._keeper.locker.timeout if timeout is None else check_timeout(timeout)
        self._check_live("upgrade")
        if not self.shared:
            return self
        keeper = self._keeper
        deadline = time.monotonic() + timeout
        delay, poll_max = keeper.pace()
        asked = False  # a look has told the database to let no new reader in
        try:
            while True:
                # Out of renewal while the look runs: no extend of the read lease lands after it changed.
                renewing = self._pause_renewal()
                try:
                    outcome, sent_at = await keeper.upgrade(self.name, self.owner, self.token, self.ttl, deadline)
                except BaseException:
                    asked = True  # unsure what the look did: withdraw (or go back) below
                    self._resume_renewal(renewing)
                    raise
                if isinstance(outcome, Grant):
                    self._become(outcome, self._partner(), sent_at)
                self._resume_renewal(renewing)
                if outcome is None:
                    self._lose("an upgrade found it released or taken over")
                    raise LeaseLost(f"lease on {self.name!r} (token {self.token}) ended before it could upgrade")
                if isinstance(outcome, Grant):
                    return self
                asked = True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LockNotAcquired(self.name, timeout, "other readers still hold it")
                if self.remaining() <= 0:
                    raise LeaseLost(f"lease on {self.name!r} (token {self.token}) ran out while it waited to upgrade")
                pause = core.backoff(delay, outcome.wait, random.random())
                delay = core.next_delay(delay, poll_max)
                await asleep(min(pause, left, self.remaining()))
        except BaseException:
            if asked:
                await self._withdraw()
            raise

    async def downgrade(self) -> AsyncUpgradeableLease:
        """Back from the write lease to the upgradeable reader's lease: readers may join again
        (those waiting in line are admitted). Returns this lease, shared again, with a new token.
        LeaseLost if the write lease was released or taken over. A reader's lease is returned as it is.
        """
        self._check_live("downgrade")
        if self.shared:
            return self
        renewing = self._pause_renewal()
        try:
            back, sent_at = await self._keeper.downgrade(self.name, self.owner, self.token, self.ttl)
        except BaseException:
            self._resume_renewal(renewing)
            raise
        if back is None:
            self._lose("a downgrade found it released or taken over")
            raise LeaseLost(f"lease on {self.name!r} (token {self.token}) was released or taken over; not downgraded")
        self._become(back, self._partner(), sent_at)
        self._resume_renewal(renewing)
        return self

    # -- between the two kinds ---------------------------------------------------------
    def _check_live(self, verb: str) -> None:
        self._state.check_process(self.name, verb)
        if self._state.ended():
            raise LeaseLost(f"lease on {self.name!r} (token {self.token}) has ended; nothing to {verb}")

    def _partner(self) -> AsyncKeeper:
        partner = self._keeper.partner
        assert partner is not None, "the Locker pairs its keepers"
        return partner

    def _become(self, granted: Grant, keeper: AsyncKeeper, sent_at: float) -> None:
        """Now the lease ``granted`` (a new token and expiry, trusted from ``sent_at``), of ``keeper``'s kind."""
        self.token = granted.token
        self._keeper = keeper
        self._state.extended(granted.expires_at, self.ttl, sent_at)

    def _pause_renewal(self) -> tuple[AsyncOnLost | None, AsyncOnLost | None, float | None] | None:
        """Take the lease out of renewal (None: it was not renewing), so that no extend of what it
        is now lands after it changed; what ``_resume_renewal`` needs to put it back."""
        renewal, self._renewal = self._renewal, None
        if renewal is None:
            return None
        self._keeper.renewer.drop(renewal)
        return renewal.on_lost, renewal.on_expiring, renewal.margin

    def _resume_renewal(self, renewing: tuple[AsyncOnLost | None, AsyncOnLost | None, float | None] | None) -> None:
        if renewing is not None and self._renewal is None and not self._state.ended():
            on_lost, on_expiring, margin = renewing
            self._renewal = self._keeper.renewer.add(self, self._state, on_lost, on_expiring, margin)

    async def _withdraw(self) -> None:
        """After a wait to upgrade that ended without the write lease: readers welcome again (or, if
        an unanswered look did upgrade, back to the reader's lease, with the token it got)."""
        try:
            back, sent_at = await self._keeper.downgrade(self.name, self.owner, self.token, self.ttl)
        except DBLockError as exc:  # the wait's own error is the one to raise: this one is logged
            release_log.warning(
                "could not withdraw the ask to upgrade %r (%s): new readers wait until this lease ends or is released",
                self.name, exc,
            )
            return
        if back is None:
            self._lose("withdrawing its ask to upgrade found it released or taken over")
        elif back.token != self.token:
            self._become(back, self._keeper, sent_at)


def _note(exc: BaseException | None, lost: str | None) -> None:
    """A with-block failing with ``exc`` lost its lease too: say so in the log, and on ``exc`` (a note, Python 3.11+)."""
    if exc is None or lost is None:
        return
    release_log.warning("%s (the block raised %s)", lost, type(exc).__name__)
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(f"dblock: {lost}")


__all__ = ["AsyncLease", "AsyncOnLost", "AsyncUpgradeableLease"]
