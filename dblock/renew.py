"""Automatic renewal: one thread per Locker extends all its renewing leases, in batches.

A lease is extended when a third of its trusted time is used up (every ttl/3
while the database answers). The scheduler thread keeps the renewing leases by
weak reference in a heap ordered by the moment each next needs attention: when
it is due, or, while its extend is in flight, when its trust runs out. It does
no I/O itself. The leases due now, with those due within a sixth of their ttl,
go out as one statement (``Keeper.extend_many``) on a worker thread, bounded
by the driver's deadline: at most ``op_timeout``, never past the trust of the
batch's least trusted lease. So a database that hangs cannot keep the
scheduler from noticing a lease's trust run out, and a Locker renewing a
hundred leases sends about one statement per round instead of running a
hundred threads. Leases extended together are due together again, so batches
form by themselves.

A lease is lost when an extend finds it taken over (or released by force), or
when its trusted time (``lease.remaining()``) runs out before an extend
confirms it; failures in between (a refused connection, a statement cut off)
are retried while it is trusted. When lost, ``lease.lost`` is set,
``remaining()`` returns 0 and ``on_lost(lease)`` runs on a thread of its own,
so a slow callback delays nobody's renewal. A lease that is released, lost or
garbage-collected leaves the heap at its next turn; the threads end when no
lease is left to renew.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from datetime import datetime
from typing import TYPE_CHECKING, Callable, Sequence

from . import _core as core
from ._within import Overdue, call_within  # importable here as before
from .errors import LeaseLost

if TYPE_CHECKING:
    from .lease import Lease, LeaseState

log = logging.getLogger("dblock.renew")

OnLost = Callable[["Lease"], object]
# (leases, deadline) -> (when the statement was sent, each lease's new expiry or None: not extended)
ExtendMany = Callable[[list["Lease"], float], tuple[float, Sequence["datetime | None"]]]

# At most this many leases per statement.
BATCH_MAX = 500
# Threads with nothing to do end after this many seconds.
LINGER = 5.0


class _Entry:
    """A renewing lease's place in the schedule."""

    __slots__ = ("ref", "state", "wake", "busy", "done", "on_lost")

    def __init__(self, lease: Lease, state: LeaseState, on_lost: OnLost | None) -> None:
        self.ref = weakref.ref(lease)
        self.state = state  # the lease's trust, which renewal reads and updates (it refers to no Lease)
        self.wake = 0.0  # monotonic time of its live heap item
        self.busy = False  # an extend of it is in flight
        self.done = False  # left the schedule
        self.on_lost = on_lost


Renewal = _Entry  # a renewing lease's place in the schedule, as the Lease holds it


class Renewer:
    """A Locker's renewal: one scheduler thread, and up to ``workers`` threads sending extends."""

    def __init__(self, extend_many: ExtendMany, op_timeout: float, workers: int) -> None:
        self._extend_many = extend_many
        self._op_timeout = op_timeout
        self._max_workers = workers
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the scheduler waits here
        self._work = threading.Condition(self._lock)  # idle workers wait here
        self._settled = threading.Condition(self._lock)  # ``settle`` waits here for an extend in flight
        self._heap: list[tuple[float, int, _Entry]] = []
        self._count = itertools.count()
        self._live = 0  # entries not done
        self._jobs: list[list[_Entry]] = []
        self._idle = 0
        self._workers = 0
        self._scheduler: threading.Thread | None = None
        self._pid = os.getpid()

    # -- the lease's side ----------------------------------------------------
    def add(self, lease: Lease, state: LeaseState, on_lost: OnLost | None) -> Renewal:
        if self._pid != os.getpid():
            # Forked: the parent's threads are not here, and its leases are not ours to renew.
            self._reset()
        entry = _Entry(lease, state, on_lost)
        with self._lock:
            self._live += 1
            self._push(entry, time.monotonic() + _until_due(lease))
            if self._scheduler is None:
                self._scheduler = threading.Thread(target=self._schedule, name="dblock-renew", daemon=True)
                self._scheduler.start()
            else:
                self._wake.notify()
        return entry

    def drop(self, entry: Renewal) -> None:
        """The lease ended (released or lost): take it out of the schedule now."""
        if self._pid != os.getpid():
            return
        with self._lock:
            self._leave(entry)
            self._wake.notify()

    def settle(self, entry: Renewal, deadline: float) -> None:
        """Take the lease out of the schedule, and wait (until ``deadline``, monotonic) for an extend
        of it already sent: none lands after this returns, unless one was cut off by its own deadline
        (a statement the server may still run later). For a release that keeps the lease's owner."""
        if self._pid != os.getpid():
            return
        with self._lock:
            self._leave(entry)
            self._wake.notify()
            while entry.busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    lease = entry.ref()
                    log.warning(
                        "an extend of %r is still in flight as its release goes out: it may keep the lease up to "
                        "a ttl longer than its hold", "a lease" if lease is None else lease.name,
                    )
                    return
                self._settled.wait(left)

    def renewing(self) -> int:
        """How many leases this Locker renews now."""
        with self._lock:
            return self._live if self._pid == os.getpid() else 0

    # -- bookkeeping, under the lock ---------------------------------------------
    def _push(self, entry: _Entry, when: float) -> None:
        entry.wake = when
        heapq.heappush(self._heap, (when, next(self._count), entry))

    def _leave(self, entry: _Entry) -> None:
        if not entry.done:
            entry.done = True
            self._live -= 1

    # -- the scheduler thread ------------------------------------------------------
    def _schedule(self) -> None:
        pid = self._pid
        lost: list[tuple[_Entry, str]] = []
        while True:
            _report(lost)
            with self._lock:
                if self._pid != pid:
                    return
                now = time.monotonic()
                lost = []
                batch = self._take(now, lost)
                if batch:
                    self._jobs.append(batch)
                    if self._idle < len(self._jobs) and self._workers < self._max_workers:
                        self._workers += 1
                        threading.Thread(target=self._send, name="dblock-extend", daemon=True).start()
                    else:
                        self._work.notify()
                if lost:
                    continue
                if self._heap:
                    self._wake.wait(self._heap[0][0] - now)
                elif not self._wake.wait(LINGER) and not self._heap:
                    self._scheduler = None
                    return

    def _take(self, now: float, lost: list[tuple[_Entry, str]]) -> list[_Entry]:
        """The entries to extend now; those whose trust ran out go to ``lost``."""
        batch: list[_Entry] = []
        heap = self._heap
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

    # -- the worker threads --------------------------------------------------------
    def _send(self) -> None:
        pid = self._pid
        while True:
            with self._lock:
                while not self._jobs:
                    self._idle += 1
                    woken = self._work.wait(LINGER)
                    self._idle -= 1
                    if self._pid != pid:
                        return
                    if not woken and not self._jobs:
                        self._workers -= 1
                        return
                job = self._jobs.pop(0)
            outcome = self._extend(job)
            lost = []
            with self._lock:
                for entry, when, why in outcome:
                    entry.busy = False
                    if entry.done:
                        continue
                    if when is None:
                        self._leave(entry)
                        if why:
                            lost.append((entry, why))
                    else:
                        self._push(entry, when)
                self._wake.notify()
                self._settled.notify_all()
            _report(lost)

    def _extend(self, job: list[_Entry]) -> list[tuple[_Entry, float | None, str]]:
        """Send one batch. Per entry: when it next needs a turn; or None, and why it is lost ("": it ended)."""
        now = time.monotonic()
        out: list[tuple[_Entry, float | None, str]] = []
        leases: list[Lease] = []
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
            sent_at, expiries = self._extend_many(leases, deadline)
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


def _report(lost: list[tuple[_Entry, str]]) -> None:
    for entry, why in lost:
        lease = entry.ref()
        if lease is not None:
            _lose(lease, entry.state, entry.on_lost, why)


def _until_due(lease: Lease) -> float:
    """Seconds until a third of the lease's trusted time is used up (see ``core.until_due``)."""
    return core.until_due(lease.ttl, lease.remaining())


def _lose(lease: Lease, state: LeaseState, on_lost: OnLost | None, why: str) -> None:
    if state.ended():
        return  # released meanwhile: the extend that raced the release found nothing, as it should
    # Once lost, stays lost. The entry has left the schedule already.
    state.lose()
    log.error("lost the lease on %r (token %s): %s", lease.name, lease.token, why)
    if on_lost is not None:
        threading.Thread(
            target=_call_on_lost, args=(on_lost, lease), name=f"dblock-on-lost {lease.name!r}", daemon=True
        ).start()


def _call_on_lost(on_lost: OnLost, lease: Lease) -> None:
    try:
        on_lost(lease)
    except Exception:  # the callback is the application's; report, don't die silently
        log.exception("on_lost callback for %r raised", lease.name)


__all__ = ["LeaseLost", "OnLost", "Renewal", "Renewer", "call_within", "Overdue"]
