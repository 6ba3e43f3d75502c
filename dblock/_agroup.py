"""Several names held together: acquired all or none, in one canonical order, released together.

Written once for both faces (``tools/async_to_sync.py`` writes ``_group.py``,
whose ``LeaseGroup`` the sync face hands out, from this module's ``AsyncLeaseGroup``).
The Locker's ``acquire_all``, ``try_acquire_all`` and ``lock_all`` make one.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import TYPE_CHECKING, Iterator

from .errors import LeaseLost

if TYPE_CHECKING:
    from ._alease import AsyncLease

log = logging.getLogger("dblock.release")


class AsyncLeaseGroup:
    """The leases of several names, granted together by ``acquire_all`` (or ``try_acquire_all``,
    ``lock_all``): all of them, or none.

    ``leases`` maps each name to its own lease, in the order they were taken
    (the names sorted, whatever order the caller gave): each has its own
    token, which fences writes to what that name protects. ``release()``
    ends them all; ``lost`` is True once any of them is known lost.
    """

    __slots__ = ("leases",)

    def __init__(self, leases: list[AsyncLease]) -> None:
        self.leases: dict[str, AsyncLease] = {lease.name: lease for lease in leases}

    @property
    def names(self) -> list[str]:
        """The names held, in the order they were taken."""
        return list(self.leases)

    @property
    def tokens(self) -> dict[str, int]:
        """Each name's fencing token."""
        return {name: lease.token for name, lease in self.leases.items()}

    @property
    def lost(self) -> bool:
        """True once any lease of the group is known lost (its ``lost`` event is set)."""
        return any(lease.lost.is_set() for lease in self.leases.values())

    def remaining(self) -> float:
        """Seconds the group can still be trusted: the least of its leases' ``remaining()``."""
        return min(lease.remaining() for lease in self.leases.values())

    def __getitem__(self, name: str) -> AsyncLease:
        return self.leases[name]

    def __iter__(self) -> Iterator[AsyncLease]:
        return iter(self.leases.values())

    def __len__(self) -> int:
        return len(self.leases)

    async def extend(self, ttl: float | None = None) -> None:
        """Extend every lease (see ``Lease.extend``). Raises LeaseLost if any was released or
        taken over; the others are extended all the same."""
        failed: list[LeaseLost] = []
        for lease in self.leases.values():
            try:
                await lease.extend(ttl)
            except LeaseLost as exc:
                failed.append(exc)
        if failed:
            raise LeaseLost(
                f"{len(failed)} of the group's {len(self.leases)} leases could not be extended: "
                + "; ".join(str(exc) for exc in failed)
            )

    async def release(self) -> bool:
        """End every lease, the last taken first. True if this call ended them all; False if
        any was already released or taken over. Every lease is released even when one
        release fails; the first failure is raised after."""
        return await release_all(list(self.leases.values()))

    async def __aenter__(self) -> AsyncLeaseGroup:
        for lease in self.leases.values():
            await lease.__aenter__()  # LeaseLost if one has ended: the block would run unprotected
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Release them all; raise LeaseLost if one was lost before the block ended (as a lease's
        with-block does: each lease's message, all of them when several were lost)."""
        lost: list[LeaseLost] = []
        failure: BaseException | None = None
        for lease in reversed(list(self.leases.values())):
            try:
                await lease.__aexit__(exc_type, exc, tb)
            except LeaseLost as error:
                lost.append(error)
            except Exception as error:  # noqa: BLE001 - release the rest first
                failure = failure or error
        if len(lost) == 1 and failure is None:
            raise lost[0]
        if lost:
            raise LeaseLost(
                f"{len(lost)} of the group's {len(self.leases)} leases were lost before the with-block ended: "
                + "; ".join(str(error) for error in reversed(lost))
            ) from failure
        if failure is not None:
            raise failure

    def __repr__(self) -> str:
        held = ", ".join(f"{name!r}: {lease.token}" for name, lease in self.leases.items())
        return f"<AsyncLeaseGroup {{{held}}}{' lost' if self.lost else ''}>"


async def release_all(leases: list[AsyncLease]) -> bool:
    """Release ``leases``, the last first; every one is tried, and the first failure raised after."""
    ended, failure = True, None
    for lease in reversed(leases):
        try:
            ended = await lease.release() and ended
        except Exception as exc:  # noqa: BLE001 - release the rest first
            log.warning("could not release %r (token %s) of a group: %s", lease.name, lease.token, exc)
            failure = failure or exc
    if failure is not None:
        raise failure
    return ended


__all__ = ["AsyncLeaseGroup", "release_all"]
