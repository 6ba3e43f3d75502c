"""dblock: a lease lock with fencing tokens, in the SQL database you already run."""

from .errors import DatabaseUnavailable, DBLockError, LeaseLost, LockNotAcquired, SchemaMissing
from .lease import Lease, LeaseInfo
from .locker import Locker

__all__ = [
    "DBLockError",
    "DatabaseUnavailable",
    "Lease",
    "LeaseInfo",
    "LeaseLost",
    "LockNotAcquired",
    "Locker",
    "SchemaMissing",
]
__version__ = "0.1.0"
