"""Finishing, in the background, what a call could not confirm before its deadline.

Written once for both faces (``tools/async_to_sync.py`` writes ``_cleanup.py``
from this module: a task here, a daemon thread there).

A statement cut off by its deadline, or whose connection broke, may have
committed: an acquire may have granted a lease nobody will use, a release may
have ended the lease or not. The call itself has to return in time, so it
hands the rest to this worker, which retries the ending (by owner id: G6)
until it is confirmed or the lease would have expired anyway. A lease is thus
never leaked until its TTL because a reply was lost, as long as the database
comes back before then.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from . import _process as process
from ._acompat import AEvent, AMutex, Worker, aevent_wait, ajoin, aspawn, astop
from .errors import DBLockError

if True:  # ASYNC
    import asyncio

log = logging.getLogger("dblock.cleanup")

RETRY = 0.5  # seconds between tries while the database stays away


class AsyncCleanup:
    """One background worker per Locker, started on first use, that runs ``end`` jobs until each succeeds."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = AMutex()
        self._jobs: list[tuple[str, Callable[[], Any], float]] = []  # (what, end, give up at)
        self._wake = AEvent()  # a new job: look now rather than after RETRY
        self._worker: Worker | None = None
        self._pid = process.pid
        if True:  # ASYNC
            self._now: set[asyncio.Task[None]] = set()

    def add(self, what: str, end: Callable[[], Any], until: float) -> None:
        """Call ``end()`` until it returns (not raises), giving up at ``until`` (monotonic)."""
        if self._pid != process.pid:
            self._reset()
        with self._lock:
            self._jobs.append((what, end, until))
            if self._worker is None:
                self._worker = aspawn(self._run, name="dblock-cleanup")
        self._wake.set()

    if True:  # ASYNC

        def now(self, work: Callable[[], Any]) -> asyncio.Task[None]:
            """Run ``work()`` at once, as its own task, which ``close`` waits for too."""
            task = asyncio.get_running_loop().create_task(work())
            self._now.add(task)
            task.add_done_callback(self._now.discard)
            return task

    def pending(self) -> int:
        """How many endings are still to be confirmed."""
        with self._lock:
            return len(self._jobs) if self._pid == process.pid else 0

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            with self._lock:
                jobs, self._jobs = self._jobs, []
                if not jobs:
                    self._worker = None
                    return
            retry = []
            for what, end, until in jobs:
                if time.monotonic() >= until:
                    log.warning("gave up ending %s: its lease has expired by now anyway", what)
                    continue
                try:
                    await end()
                except DBLockError as exc:
                    log.info("could not end %s yet (%s); retrying", what, exc)
                    retry.append((what, end, until))
                except Exception:  # noqa: BLE001 - a bug; keep the worker alive for the other jobs
                    log.exception("ending %s failed", what)
                else:
                    log.info("ended %s, which a call could not confirm in time", what)
            if retry:
                with self._lock:
                    self._jobs[:0] = retry
                await aevent_wait(self._wake, RETRY)

    async def close(self, timeout: float) -> None:
        """Give the endings still running up to ``timeout`` s to finish, then stop."""
        if self._pid != process.pid:
            return
        if True:  # ASYNC
            if self._now:
                await asyncio.wait(list(self._now), timeout=timeout)
        with self._lock:
            worker = self._worker
        await ajoin(worker, timeout)
        await astop(worker, 0)
