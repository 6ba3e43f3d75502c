"""Automatic renewal for asyncio: one task per AsyncLocker extends all its renewing leases, in batches.

The twin of ``renew.py`` (the sync face's ``Renewer``), with the same rules and
the same decisions from ``_core``. A lease is extended when a third of its
trusted time is used up (every ttl/3 while the database answers). The
scheduler task keeps the renewing leases by weak reference in a heap ordered by
the moment each next needs attention: when it is due, or, while its extend is
in flight, when its trust runs out. It does no I/O itself. The leases due now,
with those due within a sixth of their ttl, go out as one statement
(``AsyncLocker._extend_many``) in a task of its own, bounded by the driver's
deadline: at most ``op_timeout``, never past the trust of the batch's least
trusted lease. So a database that hangs cannot keep the scheduler from
noticing a lease's trust run out, and an AsyncLocker renewing a hundred leases
sends about one statement per round instead of running a hundred tasks.
Leases extended together are due together again, so batches form by
themselves. Exclusive and shared leases are extended by different statements
(``extend_many``, ``share_extend_many``): each kind has a heap and batches of
its own, as the sync face's ``Keeper`` and ``SharedKeeper`` each have a Renewer.

A lease is lost when an extend finds it taken over (or released by force), or
when its trusted time (``lease.remaining()``) runs out before an extend
confirms it; failures in between (a refused connection, a statement cut off)
are retried while it is trusted. When lost, ``lease.lost`` is set,
``remaining()`` returns 0 and ``on_lost(lease)`` (a plain or async callable)
runs in a task of its own on the event loop, so a slow callback delays
nobody's renewal. A lease that is released, lost or garbage-collected leaves
the heap at its next turn; the tasks end when no lease is left to renew, and
``close`` (``AsyncLocker.aclose``) stops them.

Where it differs from ``renew.py``, and why: no lock (one event loop, and no
``await`` between reading the schedule and changing it); no fork check (an
event loop does not live on in a forked child); no linger before a task ends
(a task, unlike a thread, costs next to nothing to start again).
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import logging
import time
import weakref
from datetime import datetime
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from . import _core as core
from .renew import BATCH_MAX

if TYPE_CHECKING:
    from ._alease import AsyncLease, AsyncOnLost
    from .lease import LeaseState

log = logging.getLogger("dblock.renew")

# (leases, deadline, shared) -> (when the statement was sent, each lease's new expiry or None: not extended)
ExtendMany = Callable[[list["AsyncLease"], float, bool], Awaitable[tuple[float, Sequence["datetime | None"]]]]
# Runs a coroutine as the AsyncLocker's background work (which its aclose cancels).
Spawn = Callable[[Awaitable[Any]], "asyncio.Task[Any]"]


class _Entry:
    """A renewing lease's place in the schedule."""

    __slots__ = ("ref", "state", "shared", "wake", "busy", "done", "on_lost")

    def __init__(self, lease: AsyncLease, state: LeaseState, on_lost: AsyncOnLost | None) -> None:
        self.ref = weakref.ref(lease)
        self.state = state  # the lease's trust, which renewal reads and updates (it refers to no AsyncLease)
        self.shared = lease.shared  # which heap, and which statement extends it
        self.wake = 0.0  # monotonic time of its live heap item
        self.busy = False  # an extend of it is in flight
        self.done = False  # left the schedule
        self.on_lost = on_lost


Renewal = _Entry  # a renewing lease's place in the schedule, as the AsyncLease holds it


class AsyncRenewer:
    """An AsyncLocker's renewal: one scheduler task, and up to ``workers`` tasks sending extends."""

    def __init__(self, extend_many: ExtendMany, op_timeout: float, workers: int, spawn: Spawn) -> None:
        self._extend_many = extend_many
        self._op_timeout = op_timeout
        self._max_workers = workers
        self._spawn = spawn
        self._wake = asyncio.Event()  # the scheduler waits here
        self._settled = asyncio.Event()  # ``settle`` waits here for an extend in flight (a fresh one after each set)
        # The exclusive leases' heap and the shared leases': each kind's batches are statements of their own.
        self._heaps: tuple[list[tuple[float, int, _Entry]], ...] = ([], [])
        self._count = itertools.count()
        self._live = 0  # entries not done
        self._jobs: list[list[_Entry]] = []
        self._workers = 0
        self._scheduler: asyncio.Task[Any] | None = None

    # -- the lease's side ----------------------------------------------------
    def add(self, lease: AsyncLease, state: LeaseState, on_lost: AsyncOnLost | None) -> Renewal:
        entry = _Entry(lease, state, on_lost)
        self._live += 1
        self._push(entry, time.monotonic() + _until_due(lease))
        if self._scheduler is None:
            self._scheduler = self._spawn(self._schedule())
            self._scheduler.set_name("dblock-renew")
        else:
            self._wake.set()
        return entry

    def drop(self, entry: Renewal) -> None:
        """The lease ended (released or lost): take it out of the schedule now."""
        self._leave(entry)
        self._wake.set()

    async def settle(self, entry: Renewal, deadline: float) -> None:
        """Take the lease out of the schedule, and wait (until ``deadline``, monotonic) for an extend
        of it already sent: none lands after this returns, unless one was cut off by its own deadline
        (a statement the server may still run later). For a release that keeps the lease's owner.

        The extend is waited for, not cancelled: it carries the other leases of its batch too.
        """
        self._leave(entry)
        self._wake.set()
        while entry.busy:
            left = deadline - time.monotonic()
            if left <= 0:
                lease = entry.ref()
                log.warning(
                    "an extend of %r is still in flight as its release goes out: it may keep the lease up to "
                    "a ttl longer than its hold", "a lease" if lease is None else lease.name,
                )
                return
            await _wait(self._settled, left)

    def renewing(self) -> int:
        """How many leases this AsyncLocker renews now."""
        return self._live

    def close(self) -> None:
        """Stop renewing (``AsyncLocker.aclose``): every lease leaves the schedule and the scheduler task
        is cancelled; the leases stay granted until released or expired. Its send tasks and on_lost
        callbacks are the AsyncLocker's background work, which aclose cancels with the rest."""
        for heap in self._heaps:
            for _, _, entry in heap:
                self._leave(entry)
            heap.clear()
        for job in self._jobs:
            for entry in job:
                entry.busy = False  # never sent
        self._jobs.clear()
        if self._scheduler is not None:
            self._scheduler.cancel()
            self._scheduler = None  # a task cancelled before it ran never reaches its own finally

    # -- bookkeeping ----------------------------------------------------------------
    def _push(self, entry: _Entry, when: float) -> None:
        entry.wake = when
        heapq.heappush(self._heaps[entry.shared], (when, next(self._count), entry))

    def _leave(self, entry: _Entry) -> None:
        if not entry.done:
            entry.done = True
            self._live -= 1

    # -- the scheduler task --------------------------------------------------------
    async def _schedule(self) -> None:
        try:
            while True:
                self._wake.clear()  # whatever changes the schedule from here on wakes the wait below
                now = time.monotonic()
                lost: list[tuple[_Entry, str]] = []
                for heap in self._heaps:
                    batch = self._take(heap, now, lost)
                    if batch:
                        self._jobs.append(batch)
                        if self._workers < self._max_workers:
                            self._workers += 1
                            self._spawn(self._send()).set_name("dblock-extend")
                self._report(lost)
                if not self._live:
                    break
                tops = [heap[0][0] for heap in self._heaps if heap]
                await _wait(self._wake, min(tops) - now if tops else None)
            for heap in self._heaps:
                heap.clear()  # only items of entries that left: nothing is left to renew
        finally:
            if self._scheduler is asyncio.current_task():
                self._scheduler = None

    def _take(self, heap: list[tuple[float, int, _Entry]], now: float, lost: list[tuple[_Entry, str]]) -> list[_Entry]:
        """The entries of one kind (``heap``) to extend now; those whose trust ran out go to ``lost``."""
        batch: list[_Entry] = []
        while heap and len(batch) < BATCH_MAX:
            when, _, entry = heap[0]
            if entry.done or when != entry.wake:
                heapq.heappop(heap)  # a stale item
                continue
            if not core.renewal_due(when, now, entry.state.ttl, early=bool(batch) and not entry.busy):
                break  # not due yet (nor due soon enough to join the batch going out)
            heapq.heappop(heap)
            lease = entry.ref()
            if lease is None or entry.state.ended():
                self._leave(entry)
                continue
            left = entry.state.trusted_until - now
            if left <= 0:
                self._leave(entry)
                lost.append((entry, "the database did not answer before its trusted time ran out" if entry.busy
                             else "its trusted time ran out before it could be extended"))
            else:
                # Extend it now (unless it is in flight already), and look again when its trust would end.
                if not entry.busy:
                    entry.busy = True
                    batch.append(entry)
                self._push(entry, now + left)
        return batch

    # -- the send tasks --------------------------------------------------------------
    async def _send(self) -> None:
        try:
            while self._jobs:
                job = self._jobs.pop(0)
                try:
                    outcome = await self._extend(job)
                finally:  # also when cancelled: a release waiting in ``settle`` goes on
                    for entry in job:
                        entry.busy = False
                    self._settled.set()
                    self._settled = asyncio.Event()
                lost: list[tuple[_Entry, str]] = []
                for entry, when, why in outcome:
                    if entry.done:
                        continue
                    if when is None:
                        self._leave(entry)
                        if why:
                            lost.append((entry, why))
                    else:
                        self._push(entry, when)
                self._wake.set()
                self._report(lost)
        finally:
            self._workers -= 1

    async def _extend(self, job: list[_Entry]) -> list[tuple[_Entry, float | None, str]]:
        """Send one batch. Per entry: when it next needs a turn; or None, and why it is lost ("": it ended)."""
        now = time.monotonic()
        out: list[tuple[_Entry, float | None, str]] = []
        leases: list[AsyncLease] = []
        entries: list[_Entry] = []
        for entry in job:
            lease = entry.ref()
            if lease is None or entry.state.ended():
                out.append((entry, None, ""))
            elif entry.state.trusted_until <= now:
                out.append((entry, None, "its trusted time ran out before it could be extended"))
            else:
                leases.append(lease)
                entries.append(entry)
        if not leases:
            return out
        deadline = core.batch_deadline(now, self._op_timeout, [entry.state.trusted_until for entry in entries])
        error: Exception | None = None
        expiries: Sequence[datetime | None] = ()
        try:
            sent_at, expiries = await self._extend_many(leases, deadline, entries[0].shared)
        except Exception as exc:  # noqa: BLE001 - the database is unreachable or failing: retry while trusted
            error = exc
        else:
            for lease, entry, expires_at in zip(leases, entries, expiries):
                if expires_at is not None:
                    entry.state.extended(expires_at, lease.ttl, sent_at)
        now = time.monotonic()
        retrying = 0
        for i, (lease, entry) in enumerate(zip(leases, entries)):
            left = entry.state.trusted_until - now
            if entry.state.released:
                out.append((entry, None, ""))  # a release raced the extend: not a loss
            elif error is None and expiries[i] is None:
                out.append((entry, None, "it was released or taken over by another owner"))
            elif error is None:
                out.append((entry, now + _until_due(lease), ""))
            elif left <= 0:
                out.append((entry, None, f"the database stayed unreachable until its trusted time ran out ({error})"))
            else:
                retrying += 1
                out.append((entry, now + core.retry_after(lease.ttl, left), ""))
        if retrying:
            log.warning(
                "could not extend %d lease(s) (the first %r, token %s): %s; retrying while they are trusted",
                retrying, leases[0].name, leases[0].token, error,
            )
        else:
            log.debug("extended %d lease(s)", sum(e is not None for e in expiries))
        return out

    def _report(self, lost: list[tuple[_Entry, str]]) -> None:
        for entry, why in lost:
            lease = entry.ref()
            if lease is not None:
                _lose(lease, entry.state, entry.on_lost, why, self._spawn)


def _until_due(lease: AsyncLease) -> float:
    """Seconds until a third of the lease's trusted time is used up (see ``core.until_due``)."""
    return core.until_due(lease.ttl, lease.remaining())


def _lose(lease: AsyncLease, state: LeaseState, on_lost: AsyncOnLost | None, why: str, spawn: Spawn) -> None:
    if state.ended():
        return  # released meanwhile: the extend that raced the release found nothing, as it should
    # Once lost, stays lost. The entry has left the schedule already.
    state.lose()
    log.error("lost the lease on %r (token %s): %s", lease.name, lease.token, why)
    if on_lost is not None:
        spawn(_call_on_lost(on_lost, lease)).set_name(f"dblock-on-lost {lease.name!r}")


async def _call_on_lost(on_lost: AsyncOnLost, lease: AsyncLease) -> None:
    try:
        result = on_lost(lease)
        if inspect.isawaitable(result):
            await result
    except Exception:  # the callback is the application's; report, don't die silently
        log.exception("on_lost callback for %r raised", lease.name)


async def _wait(event: asyncio.Event, timeout: float | None) -> None:
    """``event.wait()`` for at most ``timeout`` s (None: until it is set); yields to the loop even at 0."""
    try:
        await asyncio.wait_for(event.wait(), None if timeout is None else max(timeout, 0.0))
    except asyncio.TimeoutError:
        pass


__all__ = ["AsyncRenewer", "ExtendMany", "Renewal", "Spawn"]
