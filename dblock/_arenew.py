"""Automatic renewal: one scheduler per AsyncLocker extends all its renewing leases, in batches.

Written once for both faces (``tools/async_to_sync.py`` writes ``renew.py``,
the sync ``Renewer``, from this module: tasks here, daemon threads there).

A lease is extended when a third of its trusted time is used up (every ttl/3
while the database answers). The scheduler keeps the renewing leases by weak
reference in a heap per kind, ordered by the moment each next needs attention:
when it is due, or, while its extend is in flight, when its trust runs out. It
does no I/O itself. The leases of one kind due now, with those due within a
sixth of their ttl, go out as one statement (``extend_many``; exclusive and
shared leases are extended by different statements, so each kind has a heap
and batches of its own), sent by a worker in the background and bounded by
the driver's deadline: at most ``op_timeout``, never past the trust of the
batch's least trusted lease. So a database that hangs cannot keep the
scheduler from noticing a lease's trust run out, and one AsyncLocker renewing
a hundred leases sends about one statement per round, on at most ``workers``
connections, instead of running a hundred workers. Leases extended together
are due together again, so batches form by themselves.

A lease is lost when an extend finds it taken over (or released by force), or
when its trusted time (``lease.remaining()``) runs out before an extend
confirms it; failures in between (a refused connection, a statement cut off)
are retried while it is trusted. When lost, ``lease.lost`` is set,
``remaining()`` returns 0 and ``on_lost(lease)`` runs on a worker of its own
(asyncio: a task on the event loop, and the callable may be plain or async;
sync: a thread), so a slow callback delays nobody's renewal. A lease that is
released, lost or garbage-collected leaves the heap at its next turn; the
workers end when no lease is left to renew, and ``aclose`` stops them.

Where the faces differ: a thread lingers ``LINGER`` idle seconds before it
ends, as it costs more to start again than a task, which ends at once; the
event loop holds tasks only weakly, so the asyncio face keeps its own and
cancels them at ``aclose``; an async ``on_lost`` is awaited. The lock (a pair
in ``_acompat``) is a no-op on one event loop, where nothing between its
``with`` lines awaits, and the fork check matters to threads only (an event
loop does not live on in a forked child).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
import weakref
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from . import _core as core
from . import _process as process
from ._acompat import AEvent, AMutex, Worker, aevent_wait, aspawn, astop, running
from ._alease import AsyncOnLost  # on_lost's type, importable from dblock.renew as before

if True:  # ASYNC
    import asyncio
    import inspect
else:
    from ._within import Overdue, call_within  # importable from dblock.renew as before
    from .errors import LeaseLost  # importable from dblock.renew as before

if TYPE_CHECKING:
    from ._alease import AsyncLease
    from ._lease_state import LeaseState

log = logging.getLogger("dblock.renew")

# A worker with nothing to do ends after this many seconds.
if True:  # ASYNC
    LINGER = 0.0  # a task costs next to nothing to start again
else:
    LINGER = 5.0

# At most this many leases per statement.
BATCH_MAX = 500


class ExtendMany(Protocol):
    """Sends one batch of renewal's extends (a protocol, so that one definition serves both faces)."""

    async def __call__(
        self, leases: list[AsyncLease], deadline: float, shared: bool, /
    ) -> tuple[float, Sequence[datetime | None]]:
        """Extend ``leases`` (all of one kind: ``shared``) by their own ttl in one statement: when it was
        sent, and each lease's new expiry or None (not extended: released or taken over)."""
        ...


class _Entry:
    """A renewing lease's place in the schedule."""

    __slots__ = ("ref", "state", "shared", "wake", "busy", "done", "on_lost", "on_expiring", "margin", "warned")

    def __init__(
        self,
        lease: AsyncLease,
        state: LeaseState,
        on_lost: AsyncOnLost | None,
        on_expiring: AsyncOnLost | None = None,
        margin: float | None = None,
    ) -> None:
        self.ref = weakref.ref(lease)
        self.state = state  # the lease's trust, which renewal reads and updates (it refers to no AsyncLease)
        self.shared = lease.shared  # which heap, and which statement extends it
        self.wake = 0.0  # monotonic time of its live heap item
        self.busy = False  # an extend of it is in flight
        self.done = False  # left the schedule
        self.on_lost = on_lost
        self.on_expiring = on_expiring  # called once its trust left falls to the margin unextended
        self.margin = margin  # seconds of trust left that warn; None: a third of the ttl
        self.warned = False  # on_expiring called, and the trust not restored since

    def warn_at(self) -> float | None:
        """When (monotonic) its trust falls to the warning margin, if a warning is still to come."""
        if self.on_expiring is None or self.warned:
            return None
        return self.state.trusted_until - core.expiring_margin(self.margin, self.state.ttl, self.state.drift)


Renewal = _Entry  # a renewing lease's place in the schedule, as the AsyncLease holds it


class AsyncRenewer:
    """One AsyncLocker's renewal: one scheduler, and up to ``workers`` workers sending batches of extends.

    ``extend_many(leases, deadline, shared)`` sends one batch (all of one kind).
    """

    def __init__(self, extend_many: ExtendMany, op_timeout: float, workers: int) -> None:
        self._extend_many = extend_many
        self._op_timeout = op_timeout
        self._max_workers = workers
        if True:  # ASYNC
            # Every task this renewal started and that has not ended: the loop holds them only weakly.
            self._tasks: set[asyncio.Task[None]] = set()
        self._reset()

    def _reset(self) -> None:
        self._lock = AMutex()  # over everything below
        self._wake = AEvent()  # the scheduler waits here
        self._work = AEvent()  # idle workers wait here; set, under the lock, when a batch is queued
        self._settled = AEvent()  # ``settle`` waits here for an extend in flight (a fresh one after each set)
        # The exclusive leases' heap and the shared leases': each kind's batches are statements of their own.
        self._heaps: tuple[list[tuple[float, int, _Entry]], ...] = ([], [])
        self._count = itertools.count()
        self._live = 0  # entries not done
        self._jobs: list[list[_Entry]] = []
        self._idle = 0  # workers waiting for a batch
        self._workers = 0  # workers started and not ended
        self._scheduler: Worker | None = None
        # The scheduler and workers started since the last reset or close: one of another era ends.
        self._era = object()
        self._pid = process.pid

    # -- the lease's side ----------------------------------------------------
    def add(
        self,
        lease: AsyncLease,
        state: LeaseState,
        on_lost: AsyncOnLost | None,
        on_expiring: AsyncOnLost | None = None,
        margin: float | None = None,
    ) -> Renewal:
        if self._pid != process.pid:
            # Forked: the parent's threads are not here, and its leases are not ours to renew.
            self._reset()
        entry = _Entry(lease, state, on_lost, on_expiring, margin)
        with self._lock:
            self._live += 1
            self._push(entry, time.monotonic() + _until_due(lease, state))
            if not running(self._scheduler):
                self._scheduler = self._start(partial(self._schedule, self._era), "dblock-renew")
            else:
                self._wake.set()
        return entry

    def drop(self, entry: Renewal) -> None:
        """The lease ended (released or lost): take it out of the schedule now."""
        if self._pid != process.pid:
            return
        with self._lock:
            self._leave(entry)
        self._wake.set()  # with nothing left to renew, the scheduler ends

    async def settle(self, entry: Renewal, deadline: float) -> None:
        """Take the lease out of the schedule, and wait (until ``deadline``, monotonic) for an extend
        of it already sent: none lands after this returns, unless one was cut off by its own deadline
        (a statement the server may still run later). For a release that keeps the lease's owner.

        The extend is waited for, not cancelled: it carries the other leases of its batch too.
        """
        if self._pid != process.pid:
            return
        with self._lock:
            self._leave(entry)
        self._wake.set()
        while True:
            with self._lock:
                if not entry.busy:
                    return
                settled = self._settled  # set once the extends in flight now have come back
            left = deadline - time.monotonic()
            if left <= 0:
                lease = entry.ref()
                log.warning(
                    "an extend of %r is still in flight as its release goes out: it may keep the lease up to "
                    "a ttl longer than its hold", "a lease" if lease is None else lease.name,
                )
                return
            await aevent_wait(settled, left)

    def renewing(self) -> int:
        """How many leases this AsyncLocker renews now."""
        with self._lock:
            return self._live if self._pid == process.pid else 0

    async def aclose(self, timeout: float) -> None:
        """Stop renewing (``AsyncLocker.aclose``): every lease leaves the schedule, and the scheduler
        ends, waited for up to ``timeout`` s; the leases stay granted until released or expired. On
        asyncio the workers sending extends and running on_lost callbacks are cancelled too."""
        if self._pid != process.pid:
            return
        with self._lock:
            for heap in self._heaps:
                for _, _, entry in heap:
                    self._leave(entry)
                heap.clear()
            for job in self._jobs:
                for entry in job:
                    entry.busy = False  # never sent
            self._jobs.clear()
            self._era = object()  # the scheduler and idle workers end at their next look
            scheduler, self._scheduler = self._scheduler, None
            self._ended()
        self._wake.set()
        self._work.set()
        if True:  # ASYNC
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)
        await astop(scheduler, timeout)

    # -- bookkeeping, under the lock ---------------------------------------------
    def _push(self, entry: _Entry, when: float) -> None:
        warn = entry.warn_at()
        if warn is not None:
            when = min(when, warn)  # a turn when its trust falls to the margin: time to warn
        entry.wake = when
        heapq.heappush(self._heaps[entry.shared], (when, next(self._count), entry))

    def _leave(self, entry: _Entry) -> None:
        if not entry.done:
            entry.done = True
            self._live -= 1

    def _ended(self) -> None:
        """Extends came back (or never went out): wake whoever ``settle`` waits for one of them."""
        self._settled.set()
        self._settled = AEvent()

    def _start(self, work: Callable[[], Any], name: str) -> Worker:
        worker = aspawn(work, name)
        if True:  # ASYNC
            self._tasks.add(worker)
            worker.add_done_callback(self._tasks.discard)
        return worker

    # -- the scheduler -------------------------------------------------------------
    async def _schedule(self, era: object) -> None:
        lost: list[tuple[_Entry, str]] = []
        expiring: list[_Entry] = []
        while True:
            self._report(lost)
            self._warn(expiring)
            self._wake.clear()  # whatever changes the schedule from here on wakes the waits below
            with self._lock:
                if self._era is not era:
                    return  # closed, or forked
                now = time.monotonic()
                lost, expiring = [], []
                for heap in self._heaps:
                    batch = self._take(heap, now, lost, expiring)
                    if batch:
                        self._queue(batch, era)
                live = self._live
                tops = [heap[0][0] for heap in self._heaps if heap]
            if lost or expiring:
                continue  # report them, and look again: reporting took time
            if live:
                await aevent_wait(self._wake, min(tops) - now if tops else None)
                continue
            # Nothing left to renew: end, unless a lease comes while it lingers.
            if await aevent_wait(self._wake, LINGER):
                continue
            with self._lock:
                if self._era is era and not self._live:
                    for heap in self._heaps:
                        heap.clear()  # only items of entries that left
                    self._scheduler = None
                    return

    def _take(
        self,
        heap: list[tuple[float, int, _Entry]],
        now: float,
        lost: list[tuple[_Entry, str]],
        expiring: list[_Entry],
    ) -> list[_Entry]:
        """The entries of one kind (``heap``) to extend now; those whose trust ran out go to ``lost``,
        those whose trust fell to their warning margin unextended to ``expiring``."""
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
                warn = entry.warn_at()
                if warn is not None and warn <= now:
                    entry.warned = True
                    expiring.append(entry)
                elif entry.warned and left > core.expiring_margin(entry.margin, entry.state.ttl, entry.state.drift):
                    entry.warned = False  # extended since: a new shortfall warns again
                # Extend it now (unless it is in flight already), and look again when its trust would end.
                if not entry.busy:
                    entry.busy = True
                    batch.append(entry)
                self._push(entry, now + left)
        return batch

    def _queue(self, batch: list[_Entry], era: object) -> None:
        """Hand a batch to an idle worker, or to a new one while fewer than ``workers`` run."""
        self._jobs.append(batch)
        if self._idle < len(self._jobs) and self._workers < self._max_workers:
            self._workers += 1
            self._start(partial(self._send, era), "dblock-extend")
        self._work.set()

    # -- the workers sending batches ---------------------------------------------------
    async def _send(self, era: object) -> None:
        try:
            while True:
                with self._lock:
                    if self._era is not era:
                        return  # closed, or forked
                    job = self._jobs.pop(0) if self._jobs else None
                    if job is None:
                        self._work.clear()  # under the lock, as ``_queue`` sets it
                        self._idle += 1
                if job is None:
                    woken = await aevent_wait(self._work, LINGER)
                    with self._lock:
                        self._idle -= 1
                        if not woken and not self._jobs:
                            return
                    continue
                outcome: list[tuple[_Entry, float | None, str]] = []
                lost: list[tuple[_Entry, str]] = []
                try:
                    outcome = await self._extend(job)
                finally:  # also when cancelled: a release waiting in ``settle`` goes on
                    with self._lock:
                        for entry in job:
                            entry.busy = False
                        for entry, when, why in outcome:
                            if entry.done:
                                continue
                            if when is None:
                                self._leave(entry)
                                if why:
                                    lost.append((entry, why))
                            else:
                                self._push(entry, when)
                        self._ended()
                    self._wake.set()
                self._report(lost)
        finally:
            with self._lock:
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
                out.append((entry, now + _until_due(lease, entry.state), ""))
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

    # -- warnings and losses ----------------------------------------------------------------
    def _warn(self, expiring: list[_Entry]) -> None:
        """Run each lease's on_expiring on a worker of its own (outside the lock)."""
        for entry in expiring:
            lease = entry.ref()
            if lease is None or entry.state.ended() or entry.on_expiring is None:
                continue
            log.warning(
                "the lease on %r (token %s) has %.3f s of trust left and could not be extended yet",
                lease.name, lease.token, lease.remaining(),
            )
            self._start(partial(_call_back, entry.on_expiring, lease, "on_expiring"), f"dblock-on-expiring {lease.name!r}")

    def _report(self, lost: list[tuple[_Entry, str]]) -> None:
        """Mark the leases lost, and run each one's on_lost on a worker of its own (outside the lock)."""
        for entry, why in lost:
            lease = entry.ref()
            if lease is None or entry.state.ended():
                continue  # collected; or released meanwhile: the extend that raced the release found nothing
            # Once lost, stays lost. The entry has left the schedule already.
            entry.state.lose(f"renewal gave it up: {why}")
            log.error("lost the lease on %r (token %s): %s", lease.name, lease.token, why)
            if entry.on_lost is not None:
                self._start(partial(_call_back, entry.on_lost, lease, "on_lost"), f"dblock-on-lost {lease.name!r}")


def _until_due(lease: AsyncLease, state: LeaseState) -> float:
    """Seconds until a third of the lease's trusted time is used up (see ``core.until_due``)."""
    return core.until_due(lease.ttl, lease.remaining(), state.drift)


async def _call_back(callback: AsyncOnLost, lease: AsyncLease, what: str) -> None:
    try:
        if True:  # ASYNC
            result = callback(lease)
            if inspect.isawaitable(result):
                await result
        else:
            callback(lease)
    except Exception:  # the callback is the application's; report, don't die silently
        log.exception("%s callback for %r raised", what, lease.name)


if True:  # ASYNC
    __all__ = ["BATCH_MAX", "LINGER", "AsyncRenewer", "ExtendMany", "Renewal"]
else:
    __all__ = [
        "BATCH_MAX", "LINGER", "ExtendMany", "LeaseLost", "OnLost", "Overdue", "Renewal", "Renewer", "call_within",
    ]
