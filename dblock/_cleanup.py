"""Finishing, in the background, what a call could not confirm before its deadline.

A statement cut off by its deadline, or whose connection broke, may have
committed: an acquire may have granted a lease nobody will use, a release may
have ended the lease or not. The call itself has to return in time, so it
hands the rest to this thread, which retries the ending (by owner id: G6)
until it is confirmed or the lease would have expired anyway. A lease is thus
never leaked until its TTL because a reply was lost, as long as the database
comes back before then.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from .errors import DBLockError

log = logging.getLogger("dblock.cleanup")

RETRY = 0.5  # seconds between tries while the database stays away


class Cleanup:
    """One daemon thread per Locker, started on first use, that runs ``end`` jobs until each succeeds."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._jobs: list[tuple[str, Callable[[], object], float]] = []  # (what, end, give up at)
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def add(self, what: str, end: Callable[[], object], until: float) -> None:
        """Call ``end()`` until it returns (not raises), giving up at ``until`` (monotonic)."""
        if self._pid != os.getpid():
            self._reset()
        with self._cond:
            self._jobs.append((what, end, until))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dblock-cleanup", daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._jobs) if self._pid == os.getpid() else 0

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                jobs, self._jobs = self._jobs, []
            retry = []
            for what, end, until in jobs:
                if time.monotonic() >= until:
                    log.warning("gave up ending %s: its lease has expired by now anyway", what)
                    continue
                try:
                    end()
                except DBLockError as exc:
                    log.info("could not end %s yet (%s); retrying", what, exc)
                    retry.append((what, end, until))
                except Exception:  # noqa: BLE001 - a bug; keep the thread alive for the other jobs
                    log.exception("ending %s failed", what)
                else:
                    log.info("ended %s, which a call could not confirm in time", what)
            if retry:
                with self._cond:
                    self._jobs[:0] = retry
                    self._cond.wait(RETRY)
