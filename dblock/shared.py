"""Shared leases: a read/write lock's readers and counting semaphores (issue 16).

``Locker.semaphore(name, limit=N)`` and ``Locker.readers(name)`` return a
``Shared``: the Locker's verbs bound to one name and one limit. The grant rule,
the tokens and the waiting live in ``statements.py`` and the Locker; this is
only the handle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ParamSpec, TypeVar

from ._validate import check_renew, check_timeout, check_ttl

if TYPE_CHECKING:
    from .lease import Lease
    from .locker import Locker, _LockContext
    from .renew import OnLost

P = ParamSpec("P")
R = TypeVar("R")


class Shared:
    """Shared leases of one name: at most ``limit`` at once (None: a read lock's readers, no limit).

    Every lease it grants excludes the exclusive (write) lock of the same name,
    and has a token of its own, larger than every earlier grant of the name.
    """

    __slots__ = ("locker", "name", "limit")

    def __init__(self, locker: Locker, name: str, limit: int | None) -> None:
        self.locker, self.name, self.limit = locker, name, limit

    def try_acquire(self, *, ttl: float | None = None, renew: bool = False, on_lost: OnLost | None = None) -> Lease | None:
        """One attempt: a Lease, or None if a writer holds the name, a writer waits in the fair queue, or it is full."""
        return self.locker._share_try(self.name, self.limit, ttl, renew, on_lost)

    def acquire(
        self, *, ttl: float | None = None, timeout: float | None = None, renew: bool = False, on_lost: OnLost | None = None
    ) -> Lease:
        """Wait up to ``timeout`` seconds (polling with backoff, never past a known expiry); LockNotAcquired after."""
        return self.locker._share_acquire(self.name, self.limit, ttl, timeout, renew, on_lost)

    def lock(
        self, *, ttl: float | None = None, timeout: float | None = None, renew: bool = False, on_lost: OnLost | None = None
    ) -> _LockContext:
        """``with sem.lock() as lease:`` acquires, and releases on exit (also on error)."""
        from .locker import _LockContext  # noqa: PLC0415 - the Locker's module imports this one

        check_renew(renew, on_lost)
        return _LockContext(
            self.locker,
            self.name,
            None if ttl is None else check_ttl(ttl),
            None if timeout is None else check_timeout(timeout),
            renew,
            on_lost,
            acquire=self.acquire,
        )

    def __repr__(self) -> str:
        kind = "readers" if self.limit is None else f"semaphore limit={self.limit}"
        return f"<Shared {self.name!r} {kind}>"


__all__ = ["Shared"]
