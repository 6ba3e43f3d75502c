"""dblock: a lease lock with fencing tokens, in the SQL database you already run."""

from .errors import DatabaseUnavailable, DBLockError, FencedOut, LeaseLost, LockNotAcquired, SchemaMissing
from .fencing import check_lease, commit_guard, fence, fenced, fenced_update, fenced_upsert
from .lease import Lease, LeaseInfo
from .locker import Locker

__all__ = [
    "DBLockError",
    "DatabaseUnavailable",
    "FencedOut",
    "Lease",
    "LeaseInfo",
    "LeaseLost",
    "LockNotAcquired",
    "Locker",
    "SchemaMissing",
    "check_lease",
    "commit_guard",
    "fence",
    "fenced",
    "fenced_update",
    "fenced_upsert",
]
__version__ = "0.1.0"
