"""Automatic renewal: extend a lease every ttl/3 on a thread of its own.

The thread holds only a weak reference to its lease, sleeps on an Event, and
ends when the lease is released, lost or garbage-collected. When an extend
finds the lease taken over, or the database does not answer before the
lease's trusted time (``lease.remaining()``) runs out, the lease is marked
lost (``lease.lost`` is set, ``remaining()`` returns 0) and its ``on_lost``
callback runs on this thread.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from .errors import LeaseLost

if TYPE_CHECKING:
    from .lease import Lease

log = logging.getLogger("dblock.renew")

OnLost = Callable[["Lease"], object]

# After a failed extend, retry this many times per renewal interval.
_RETRIES_PER_INTERVAL = 3


class Renewal:
    """A lease's handle on its renewal thread."""

    __slots__ = ("_stop", "thread")

    def __init__(self, lease: Lease) -> None:
        stop = self._stop = threading.Event()
        # The callback wakes the thread when the lease is collected; it must
        # not close over the lease (or self) to keep the reference weak.
        ref = weakref.ref(lease, lambda _: stop.set())
        self.thread = threading.Thread(
            target=_renew,
            args=(ref, stop),
            name=f"dblock-renew {lease.name!r} token={lease.token} owner={lease.owner[:8]}",
            daemon=True,
        )
        self.thread.start()

    def stop(self) -> None:
        """Ask the thread to end; it does at its next wake-up, without waiting for an extend in flight."""
        self._stop.set()


def _renew(ref: weakref.ref[Lease], stop: threading.Event) -> None:
    lease = ref()
    if lease is None:
        return
    wait: float | None = _until_due(lease)
    del lease  # hold no strong reference while asleep
    while wait is not None and not stop.wait(wait):
        lease = ref()
        if lease is None:
            return
        wait = _step(lease)
        del lease
    log.debug("renewal thread ends")


def _step(lease: Lease) -> float | None:
    """One renewal: the seconds until the next one, or None when the thread should end."""
    interval = lease.ttl / 3
    trusted = lease.remaining()
    if trusted <= 0:
        _lose(lease, "its trusted time ran out before it could be extended")
        return None
    # The extend runs on a helper thread so that a database that hangs (not
    # refusing, just silent) cannot keep us from noticing the trust run out.
    try:
        call_within(lease.extend, trusted, f"dblock-extend {lease.name!r}")
    except Overdue:
        _lose(lease, f"the database did not answer within the {trusted:.3g} s the lease was still trusted")
        return None
    except LeaseLost:
        _lose(lease, "it was released or taken over by another owner")
        return None
    except Exception as exc:  # noqa: BLE001 - the database is unreachable or failing: retry while trusted
        left = lease.remaining()
        if left <= 0:
            _lose(lease, f"the database stayed unreachable until its trusted time ran out ({exc})")
            return None
        retry = min(interval / _RETRIES_PER_INTERVAL, left)
        log.warning(
            "could not extend lease on %r (token %s): %s; retrying in %.3g s (%.3g s of trust left)",
            lease.name, lease.token, exc, retry, left,
        )
        return retry
    log.debug("extended %r token=%s", lease.name, lease.token)
    return _until_due(lease)


def _until_due(lease: Lease) -> float:
    """Seconds until a third of the lease's trusted time is used up: then it is extended.

    Counted from the trust left, not from now, so a grant or an extend whose
    reply was slow is followed up sooner.
    """
    ttl = lease.ttl
    return min(ttl / 3, max(ttl / 30, lease.remaining() - 2 * ttl / 3))


def _lose(lease: Lease, why: str) -> None:
    if lease._released:
        return  # released meanwhile: the extend that raced the release found nothing, as it should
    lease._lose()
    log.error("lost the lease on %r (token %s): %s", lease.name, lease.token, why)
    on_lost = lease._on_lost
    if on_lost is not None:
        try:
            on_lost(lease)
        except Exception:  # the callback is the application's; report, don't die silently
            log.exception("on_lost callback for %r raised", lease.name)


T = TypeVar("T")


class Overdue(Exception):
    """``call_within``'s call did not finish in time."""


def call_within(call: Callable[[], T], timeout: float, name: str) -> T:
    """``call()`` on a daemon thread: its result or its exception, or Overdue after ``timeout`` s.

    On a timeout the call goes on in the background; its outcome is dropped.
    """
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    if not done.wait(max(timeout, 0.0)):
        raise Overdue(f"{name} did not finish within {timeout:.3g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
