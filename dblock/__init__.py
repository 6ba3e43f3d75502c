"""dblock: a lease lock with fencing tokens, in the SQL database you already run.

The names below load on first use (PEP 562), so ``import dblock`` alone does not
import SQLAlchemy: the pytest plugin, which pytest loads on every run in an
environment where dblock is installed, costs nothing until a test uses it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    DatabaseUnavailable,
    DBLockError,
    FencedOut,
    LeaseLost,
    LockNotAcquired,
    Misconfigured,
    PermissionDenied,
    ReplicationWarning,
    SchemaMissing,
)

if TYPE_CHECKING:
    from ._election import Election, Leadership
    from ._lease_state import Leader
    from .aio import (
        AsyncElection,
        AsyncLeadership,
        AsyncLease,
        AsyncLeaseGroup,
        AsyncLocker,
        AsyncShared,
        AsyncUpgradeable,
        AsyncUpgradeableLease,
    )
    from .decorator import current_lease
    from .fencing import check_lease, commit_guard, fence, fenced, fenced_read, fenced_update, fenced_upsert
    from .lease import Lease, LeaseGroup, LeaseInfo, UpgradeableLease
    from .locker import Locker, Shared, Upgradeable

_LAZY = {
    "AsyncElection": ".aio",
    "AsyncLeadership": ".aio",
    "AsyncLease": ".aio",
    "Election": "._election",
    "Leader": "._lease_state",
    "Leadership": "._election",
    "AsyncLeaseGroup": ".aio",
    "AsyncLocker": ".aio",
    "AsyncShared": ".aio",
    "AsyncUpgradeable": ".aio",
    "AsyncUpgradeableLease": ".aio",
    "current_lease": ".decorator",
    "check_lease": ".fencing",
    "commit_guard": ".fencing",
    "fence": ".fencing",
    "fenced": ".fencing",
    "fenced_read": ".fencing",
    "fenced_update": ".fencing",
    "fenced_upsert": ".fencing",
    "Lease": ".lease",
    "LeaseGroup": ".lease",
    "LeaseInfo": ".lease",
    "Locker": ".locker",
    "Shared": ".locker",
    "Upgradeable": ".locker",
    "UpgradeableLease": ".lease",
}

__all__ = [
    "AsyncElection",
    "AsyncLeadership",
    "AsyncLease",
    "AsyncLeaseGroup",
    "AsyncLocker",
    "AsyncShared",
    "AsyncUpgradeable",
    "AsyncUpgradeableLease",
    "DBLockError",
    "DatabaseUnavailable",
    "Election",
    "FencedOut",
    "Leader",
    "Leadership",
    "Lease",
    "LeaseGroup",
    "LeaseInfo",
    "LeaseLost",
    "LockNotAcquired",
    "Locker",
    "Misconfigured",
    "PermissionDenied",
    "ReplicationWarning",
    "SchemaMissing",
    "Shared",
    "Upgradeable",
    "UpgradeableLease",
    "check_lease",
    "commit_guard",
    "current_lease",
    "fence",
    "fenced",
    "fenced_read",
    "fenced_update",
    "fenced_upsert",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
