"""Acquiring: one attempt, or waiting for a lease, and ending what an acquire that failed may have left.

Written once for both faces (``tools/async_to_sync.py`` writes ``_acquire.py``
from this module: a waiter is a task here, a thread there). Two ways to wait:

- **In the fair queue** (a backend with ``caps.fair_queue``, ``fair=True``):
  one entry per waiter, first come first served; a release hands the lease to
  the first live waiter in its own statement, and the listener (``notify``)
  wakes exactly that waiter. Readers and semaphore waiters wait in the same
  line as the name's writers. A waiter also looks on its own (a notification
  can be lost) and when the current lease is known to end.
- **In the local line**, polling with backoff (no fair queue, or ``fair=False``):
  waiters of this process for one name take turns, and only the head asks the
  database; never sleeping past the current lease's known end.

Both ride out an outage until their deadline (but not a ``Misconfigured``
database: waiting would not mend the URL), and a reply that never came
(the statement may have granted or queued us) is ended in the background
(``_cleanup``). What an acquire got is a ``Granted``: the faces make their
lease object of it.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING, Any, Callable

from . import _core as core
from ._acompat import ACancelled, aevent_wait, asleep
from ._await import AsyncHotspot
from ._core import OUTAGE_RETRY_MIN, Grant, Granted
from ._faults import Busy, OutOfTime
from ._process import new_owner
from .errors import DatabaseUnavailable, DBLockError, LockNotAcquired, Misconfigured

if True:  # ASYNC
    import asyncio

if TYPE_CHECKING:
    from ._acleanup import AsyncCleanup
    from ._averbs import AsyncVerbs
    from ._await import AsyncHeartbeat, AsyncListener

log = logging.getLogger("dblock.acquire")


class Try:
    """What an acquire has done so far: whether it sent anything (a failure or a cancellation
    must then clean up).

    ``limit``: what it asks for: False the exclusive lock, None a reader's
    lease, an int a semaphore's.
    """

    __slots__ = ("owner", "hold", "limit", "shared", "sent", "unsure", "label")

    def __init__(
        self, owner: str, hold: float = 0.0, limit: int | None | bool = False, label: str | None = None
    ) -> None:
        self.owner = owner
        self.label = label  # written with the grant (an election's value); None: the Locker's
        self.hold = hold  # the min_hold of the lease it gets
        self.limit = limit
        self.shared = core.shared_kind(limit)  # a shared lease's (reader, semaphore), not the exclusive lock's
        self.sent = False  # a statement went out: it may have queued us, or granted us the lease
        self.unsure = False  # an attempt went unanswered: it may grant us the lease even later


class AsyncAcquirer:
    """One Locker's acquiring and waiting: its local lines, and its share of the fair queue."""

    def __init__(
        self,
        verbs: AsyncVerbs,
        cleanup: AsyncCleanup,
        *,
        queued: bool,
        listener: AsyncListener | None,
        heartbeat: AsyncHeartbeat | None,
        poll_min: float,
        poll_max: float,
        drift: core.Drift,
    ) -> None:
        self.verbs = verbs
        self.cleanup = cleanup
        self.queued = queued  # waiters queue in the database (else in the local line, polling)
        self.listener = listener
        self.heartbeat = heartbeat
        self.poll_min = poll_min
        self.poll_max = poll_max
        self.drift = drift  # the clock allowance, taken off a handed lease's trust
        self.hot = AsyncHotspot()  # this process's waiters for the exclusive lock, per name (polling)
        self._outage_said: str | None = None  # the outage last logged: told once, not at every retry
        self.shared_hot = AsyncHotspot()  # and for shared leases, in lines of their own

    def new_try(
        self,
        hold: float = 0.0,
        limit: int | None | bool = False,
        *,
        waiting: bool = False,
        owner: str | None = None,
        label: str | None = None,
    ) -> Try:
        """A new acquire's state, with its owner id (a fair waiter's names this process's listener;
        ``owner``: the id an owner key stands for, ``_core.keyed_owner``)."""
        if owner is None and waiting and self.queued and self.listener is not None:
            owner = self.listener.owner_id()  # hand-offs to it are notified on the listener's channel
        return Try(new_owner() if owner is None else owner, hold, limit, label)

    # -- the ways to acquire -----------------------------------------------------------
    async def once(self, name: str, attempt: Try, ttl: float, deadline: float) -> Granted | None:
        """One attempt: the lease, or None if ``name`` is held."""
        granted, _ = await self.attempt(name, attempt, ttl, deadline)
        return granted

    async def wait(self, name: str, attempt: Try, ttl: float, timeout: float) -> Granted:
        """Wait up to ``timeout`` s for ``name`` (``LockNotAcquired`` when the time runs out)."""
        deadline = time.monotonic() + timeout
        if timeout <= 0:
            granted = await self.once(name, attempt, ttl, self.verbs.bound(deadline))
            if granted is None:
                raise LockNotAcquired(name, timeout)
            return granted
        if self.queued:
            return await self._in_queue(name, attempt, ttl, timeout, deadline)
        return await self._in_line(name, attempt, ttl, timeout, deadline)

    async def guarded(self, name: str, ttl: float, attempt: Try, work: Callable[..., Any], *args: Any) -> Any:
        """Run ``work(*args)`` (an acquire); if it fails in doubt, or is cancelled, end whatever it may
        have granted or queued (in the background, by owner id: G6)."""
        try:
            return await work(*args)
        except OutOfTime:
            raise  # nothing was sent
        except Misconfigured:
            # Its connect failed: this statement was not sent. An earlier one of the wait may
            # have gone unanswered (then end what it granted, should the database come back).
            if attempt.sent and attempt.unsure:
                self.abandon(name, attempt.owner, ttl, attempt.limit)
            raise
        except (DatabaseUnavailable, LockNotAcquired) as exc:
            if attempt.sent and (attempt.unsure or isinstance(exc, DatabaseUnavailable)):
                self.abandon(name, attempt.owner, ttl, attempt.limit)
            raise
        except ACancelled:
            if True:  # ASYNC
                if attempt.sent:
                    # Leave the queue, and end a lease that was granted or handed to us
                    # meanwhile; shielded, so a second cancellation cannot stop it halfway.
                    job = self.cleanup.now(lambda: self._forget_or_abandon(name, attempt.owner, ttl, attempt.limit))
                    try:
                        await asyncio.shield(job)
                    except asyncio.CancelledError:
                        pass  # cancelled again: the job goes on in the background
            raise

    def abandon(self, name: str, owner: str, ttl: float, limit: int | None | bool = False) -> None:
        """An attempt for ``owner`` went unanswered: end in the background whatever it granted.

        ``limit`` False: an exclusive attempt; None or an int: a shared one.
        """
        shared = core.shared_kind(limit)
        self.cleanup.add(
            f"a possible grant of {name!r} to owner {owner[:8]}",
            lambda: self.verbs.forget(name, owner, shared),
            time.monotonic() + ttl,
        )

    async def _forget_or_abandon(self, name: str, owner: str, ttl: float, limit: int | None | bool) -> None:
        try:
            await self.verbs.forget(name, owner, core.shared_kind(limit))
        except DBLockError:
            self.abandon(name, owner, ttl, limit)

    def released(self, name: str, held: bool) -> None:
        """This process released ``name`` (``held``: kept for its minimum hold): wake its local heads.

        Fair waiters, shared ones too, are handed the lease by the release itself.
        """
        if not self.queued:
            if not held:
                self.hot.released(name)
            self.shared_hot.released(name)

    # -- one attempt -------------------------------------------------------------------
    async def attempt(
        self, name: str, attempt: Try, ttl: float, deadline: float, *, waiting: bool = False
    ) -> tuple[Granted | None, float | None]:
        """One attempt: the lease, or None and the seconds until the holder's lease ends."""
        attempt.sent = True
        outcome, free, sent_at = await self.verbs.acquire(
            name, attempt.owner, ttl, attempt.limit, deadline, waiting=waiting, label=attempt.label
        )
        if not isinstance(outcome, Grant):
            return None, outcome.wait
        granted: Granted | None = Granted(outcome.token, outcome.expires_at, sent_at)
        if self._late(sent_at, ttl):
            granted = await self._refresh(name, attempt, ttl, outcome.token, deadline, waiting)  # a slow reply
            if granted is None:
                return None, None
        if attempt.shared:
            self.shared_hot.mark_full(name, free is not None and free <= 0)
        elif not self.queued:
            self.hot.mark_full(name, True)  # held here: the next in this process's line waits for our release
        log.debug("granted %r (limit %s) token=%s", name, attempt.limit, outcome.token)
        return granted, None

    # -- the local line ----------------------------------------------------------------
    async def _in_line(self, name: str, attempt: Try, ttl: float, timeout: float, deadline: float) -> Granted:
        """Poll with backoff; this process's waiters for ``name`` take turns (FIFO).

        Shared waiters (``attempt.limit`` None or an int) have a local line of their own.
        """
        shared = attempt.shared
        hot = self.shared_hot if shared else self.hot
        me = hot.join(name)
        promoted = not me.is_set()  # others were ahead in this process's line
        try:
            if not await aevent_wait(me, deadline - time.monotonic()):
                raise LockNotAcquired(name, timeout)  # never reached the head of the local line
            if promoted:
                me.clear()  # before looking at the line: a release from now on sets it again
                if hot.full(name):
                    # The waiter ahead of us was just granted the lock (or a semaphore's last
                    # free slot) and holds it still: asking now would only miss. Look after a
                    # pause, or at once when this process releases it.
                    pause = core.backoff(self.poll_min, None, random.random())
                    await aevent_wait(me, min(pause, max(deadline - time.monotonic(), 0)))
            delay, outage_delay = self.poll_min, OUTAGE_RETRY_MIN
            outage: DatabaseUnavailable | None = None  # the last attempt's failure, if it failed
            while True:
                me.clear()  # set again by a release in this process: try at once
                try:
                    granted, wait = await self.attempt(name, attempt, ttl, self.verbs.bound(deadline), waiting=True)
                    if outage is not None:
                        self._outage_said = None  # it ended: the next one is told again
                    outage, outage_delay = None, OUTAGE_RETRY_MIN
                except (Busy, OutOfTime):  # SQLite's other writer, or a busy pool, took all the time we had
                    granted, wait = None, None
                except Misconfigured:
                    raise  # not an outage: no wait mends it
                except DatabaseUnavailable as exc:  # ride it out until the deadline
                    granted, wait, outage, attempt.unsure = None, None, exc, True
                if granted is not None:
                    return granted
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._out_of_time(name, timeout, outage)  # guarded() ends an unanswered grant
                if outage is not None:
                    outage_delay = await self._outage(outage, name, outage_delay, deadline)
                    continue
                pause = core.backoff(delay, wait, random.random())
                delay = core.next_delay(delay, self.poll_max)
                log.debug("lock %r is held; retrying in %.3f s", name, min(pause, left))
                await aevent_wait(me, min(pause, left))
        finally:
            hot.leave(name, me)

    # -- the fair queue ----------------------------------------------------------------
    async def _in_queue(self, name: str, attempt: Try, ttl: float, timeout: float, deadline: float) -> Granted:
        """Fair waiting: join the queue, be handed the lease by a release.

        ``attempt.limit`` False: for the exclusive lock; None (a reader) or an
        int (a semaphore): for a shared lease, in the same line as the name's writers.
        """
        owner, verbs = attempt.owner, self.verbs
        listener, heartbeat = self.listener, self.heartbeat
        slot, ident = None, None
        if listener is not None and not listener.reaches(owner):
            listener = None  # an owner key's id: no hand-off is notified to it, so it looks by polling
        if listener is not None:
            slot, ident = await listener.register(owner, min(deadline, verbs.deadline()))
        # The last attempt that queued us: its send time (monotonic) and the database's time
        # when it ran, which is no earlier: together they place database times on our clock.
        queued_at: tuple[float, float] | None = None
        outage: DatabaseUnavailable | None = None  # the last attempt's failure, if it failed
        outage_delay = OUTAGE_RETRY_MIN
        seq: int | None = None  # our place in line, once queued
        if heartbeat is not None:
            heartbeat.enter()
        try:
            while True:
                left = deadline - time.monotonic()
                if listener is not None:
                    ident = listener.ident
                    if ident is None:  # not running (an outage killed it): start it again
                        await listener.revive(min(deadline, verbs.deadline()))
                        ident = listener.ident
                attempt.sent = True
                try:
                    outcome, sent_at = await verbs.enqueue(
                        name, owner, ttl, attempt.limit, ident, core.entry_lifetime(left), seq, verbs.bound(deadline),
                        label=attempt.label,
                    )
                    if outage is not None:
                        self._outage_said = None  # it ended: the next one is told again
                    if isinstance(outcome, Grant):
                        granted: Granted | None = Granted(outcome.token, outcome.expires_at, sent_at)
                        if self._late(sent_at, ttl):
                            granted = await self._refresh(
                                name, attempt, ttl, outcome.token, verbs.bound(deadline), waiting=True
                            )
                        if granted is not None:
                            return granted
                        outcome = None  # lost or ended before use: look again
                    outage, outage_delay = None, OUTAGE_RETRY_MIN
                except OutOfTime:  # nothing was sent: out of time, not an outage
                    if time.monotonic() >= deadline:
                        break
                    continue
                except Misconfigured:
                    raise  # not an outage: no wait mends it
                except DatabaseUnavailable as exc:  # ride it out until the deadline
                    outage = exc
                    if time.monotonic() >= deadline:
                        break
                    outage_delay = await self._outage(exc, name, outage_delay, deadline)
                    continue
                if outcome is None:
                    continue  # a concurrent first acquire created the row just now (or see above): look again
                wait, seq, ahead = outcome.wait, outcome.seq, outcome.ahead
                queued_at = (sent_at, outcome.at)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if listener is not None and slot is not None and ident is not None:
                    # Woken by a hand-off's notification, or looking in case one was lost.
                    pause = core.look_pause(self.poll_max, ahead, wait, random.random())
                    await listener.wait(slot, min(pause, left))
                    if slot.grant is not None:
                        token, expiry = slot.grant
                        try:
                            granted = await self._handed(name, attempt, ttl, Grant(token, expiry), queued_at, deadline)
                        except DatabaseUnavailable as exc:
                            # The lease is ours but could not be renewed for use: the next
                            # attempt (same owner, G6) takes it up again, or the wait's end
                            # leaves it; either way it is not leaked, and the wait rides on.
                            outage, granted = exc, None
                        if granted is not None:
                            return granted
                        slot.grant = None  # handed, then lost (or unconfirmed) before we could use it: wait on
                    slot.event.clear()
                else:
                    # Polling: nobody will wake us, and a lease handed to us sits unused until we look.
                    delay = core.poll_delay(self.poll_min, self.poll_max, ahead)
                    pause = core.backoff(delay, wait, random.random())
                    await asleep(min(pause, left))
                if pause >= left or time.monotonic() >= deadline:
                    break  # slept to the deadline (the sleep may end a hair early)
            # Out of time: leave the queue, unless a release handed us the lease first.
            try:
                handed = await verbs.cancel(name, owner, seq, verbs.bound(deadline))
            except DatabaseUnavailable as exc:
                self.abandon(name, owner, ttl, attempt.limit)  # our entry dies with its own deadline anyway
                attempt.sent = False
                failure = core.left_line_failed(exc, outage, queued_at is not None)
                raise self._out_of_time(name, timeout, failure) from exc
            if handed is not None:
                # A release handed us the lease, or an attempt whose reply was
                # lost granted it. Either way after the last attempt that came
                # back "queued" was sent, which then starts its trust (G5).
                try:
                    if queued_at is not None:
                        granted = await self._handed(name, attempt, ttl, handed, queued_at, deadline)
                        if granted is not None:
                            return granted
                    else:  # no such attempt: we cannot tell when it was granted, so end it (never used)
                        key = {"name": name, "owner": owner, "token": handed.token}
                        await verbs.end(key, verbs.bound(deadline), shared=attempt.shared)
                except DatabaseUnavailable as exc:
                    self.abandon(name, owner, ttl, attempt.limit)  # ours, unconfirmed: ended in the background
                    attempt.sent = False
                    raise self._out_of_time(name, timeout, exc) from exc
            attempt.sent = False  # out of the queue, nothing held: nothing to clean up
            raise self._out_of_time(name, timeout, outage)
        finally:
            if heartbeat is not None:
                heartbeat.leave()
            if listener is not None:
                listener.unregister(owner)

    async def _handed(
        self, name: str, attempt: Try, ttl: float, handed: Grant, queued_at: tuple[float, float], deadline: float
    ) -> Granted | None:
        """A lease a release handed us, or None if it was lost before we woke.

        Trusted until its database expiry placed on our clock (G5, see
        ``core.handed_trust``): our last queueing attempt was sent at ``sent``
        and ran at database time ``at``. If little of the ttl is left, one
        extend renews it; if meanwhile it expired and someone else took it
        over, the caller goes on waiting.
        """
        sent, at = queued_at
        now = time.monotonic()
        expires_at = handed.expires_at  # a notification's Unix seconds (made a datetime if read), or a datetime
        seconds = expires_at if isinstance(expires_at, float) else expires_at.timestamp()
        trusted = core.handed_trust(sent, at, seconds, now, ttl, self.drift)
        if core.needs_refresh(trusted, now, ttl):
            return await self._refresh(name, attempt, ttl, handed.token, self.verbs.bound(deadline), waiting=True)
        return Granted(handed.token, expires_at, trusted - ttl)  # the lease trusts sent_at + ttl

    def _late(self, sent_at: float, ttl: float) -> bool:
        """Whether a grant sent at ``sent_at`` came back with less than half its trusted time left
        (its reply was slow): then it is extended once before use (``_refresh``)."""
        now = time.monotonic()
        return core.needs_refresh(core.trusted_until(sent_at, ttl, self.drift), now, core.trust_span(ttl, self.drift))

    async def _refresh(
        self, name: str, attempt: Try, ttl: float, token: int, deadline: float, waiting: bool
    ) -> Granted | None:
        """A lease just granted or handed to ``attempt`` with less than half its ttl trusted (its reply
        was slow): extended once, so that it is trusted from the extend's send; None if it was lost
        meanwhile (taken over after it ran out), or if even the extend came back with no trust
        left: then it is ended (never used), and the caller tries again (``waiting``) or has nothing.

        Never hands over a lease the database holds and the caller could not rely on. Raises
        ``DatabaseUnavailable`` if the extend or the end failed, or found no time to be sent:
        the lease is ours then, in doubt, and the caller ends it (``guarded``) or takes it up
        again with its next attempt (same owner, G6).
        """
        owner, shared = attempt.owner, attempt.shared
        try:
            done = await self.verbs.extend(name, owner, token, ttl, deadline, shared)
            if done is None:
                return None
            if core.trusted_until(done.sent_at, ttl, self.drift) > time.monotonic():
                return Granted(token, done.expires_at, done.sent_at)
            log.log(
                logging.INFO if waiting else logging.WARNING,
                "the database answered too slowly to trust the lease on %r (ttl %g s) even after extending it: "
                "released unused%s", name, ttl, "; trying again" if waiting else "",
            )
            await self.verbs.end({"name": name, "owner": owner, "token": token}, deadline, shared=shared)
            return None
        except (Busy, OutOfTime) as exc:  # nothing sent, though the lease was granted: it is in doubt now
            attempt.unsure = True
            raise DatabaseUnavailable(
                f"lease on {name!r} was granted, but could not be extended before use ({exc})", sqlstate=exc.sqlstate
            ) from exc
        except DatabaseUnavailable:
            attempt.unsure = True
            raise

    # -- between attempts --------------------------------------------------------------
    async def _outage(self, exc: DatabaseUnavailable, name: str, delay: float, deadline: float) -> float:
        """Sleep out a moment of an outage (never past ``deadline``); the next pause."""
        pause, later = core.outage_pause(delay, deadline - time.monotonic(), random.random())
        said = str(exc)
        # Once per cause (the next retry of any wait of this Locker saying the same logs at DEBUG).
        level = logging.DEBUG if said == self._outage_said else logging.INFO
        self._outage_said = said
        log.log(level, "database unavailable while waiting for %r (%s); retrying in %.3f s", name, said, max(pause, 0))
        if pause > 0:
            await asleep(pause)
        return later

    @staticmethod
    def _out_of_time(name: str, timeout: float, outage: DatabaseUnavailable | None) -> Exception:
        if outage is None:
            return LockNotAcquired(name, timeout)
        return DatabaseUnavailable(
            f"lock {name!r} was not acquired within {timeout:g} s: the database was unavailable ({outage})",
            sqlstate=outage.sqlstate,
        )


__all__ = ["AsyncAcquirer", "Try"]
