"""dblock for asyncio: ``AsyncLocker`` and ``AsyncLease``, and fenced writes on async connections.

The same locks, tokens, guarantees and statements as ``Locker``: both faces
are one source (``_alocker.py`` and its rooms; the sync face is generated from
it by ``tools/async_to_sync.py``) and differ only in how they wait. Here a
waiter is a coroutine, not a thread: fair waiters sleep on an
``asyncio.Event`` that the AsyncLocker's one listener task sets when a release
hands them the lease; renewal is one task per AsyncLocker, batching the
extends that fall due together (``_arenew``); ``lease.lost`` is an
``asyncio.Event``; ``on_lost`` runs on the event loop. PostgreSQL goes through
psycopg's ``AsyncConnection``, SQLite through ``aiosqlite``.

Cancelling a waiting or acquiring task (``task.cancel()``, ``asyncio.timeout``)
leaves the queue, and a grant that raced the cancellation is released before
the ``CancelledError`` propagates: nothing is leaked.

An AsyncLocker belongs to one event loop (the one it is first used on).
"""

from __future__ import annotations

from typing import Any

from ._aelection import AsyncElection, AsyncLeadership
from ._agroup import AsyncLeaseGroup
from ._alease import AsyncLease, AsyncOnLost, AsyncUpgradeableLease
from ._alocker import AsyncLocker, AsyncShared, AsyncUpgradeable

__all__ = [
    "AsyncElection", "AsyncLeadership", "AsyncLease", "AsyncLeaseGroup", "AsyncLocker", "AsyncOnLost", "AsyncShared",
    "AsyncUpgradeable", "AsyncUpgradeableLease",
    "check_lease", "commit_guard", "fence", "fenced", "fenced_read", "fenced_session", "fenced_update", "fenced_upsert",
]
# Fenced writes on AsyncConnection / AsyncSession (``aio_fencing``), loaded on first use;
# ``fenced`` (which only builds a statement) is the sync module's own.
_FENCING = {name: ".aio_fencing" for name in __all__[9:]} | {"fenced": ".fencing"}


def __getattr__(name: str) -> Any:
    module = _FENCING.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    value = getattr(importlib.import_module(module, __package__), name)
    globals()[name] = value
    return value
