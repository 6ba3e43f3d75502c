"""Locker: the app-wide factory of leases on one database.

``Locker`` is written once for both faces: ``_alocker.py`` is the source and
``_locker.py`` its generated sync twin (``tools/async_to_sync.py``). This module
keeps every name importable where it was.
"""

from __future__ import annotations

from ._core import EXPIRY_LOOKERS as EXPIRY_LOOKERS, FALLBACK_MAX as FALLBACK_MAX, GRACE as GRACE  # as before
from ._core import OUTAGE_RETRY_MAX as OUTAGE_RETRY_MAX  # importable here as before
from ._core import Extended as Extended
from ._defaults import DEFAULT_MAX_CONNECTIONS, DEFAULT_OP_TIMEOUT, DEFAULT_TTL, make_schema
from ._keeper import Keeper
from ._locker import Attempt, Locker, Shared, Upgradeable
from ._process import describe_process as describe_process  # importable here as before

__all__ = [
    "DEFAULT_MAX_CONNECTIONS", "DEFAULT_OP_TIMEOUT", "DEFAULT_TTL", "Attempt", "Keeper", "Locker", "Shared",
    "Upgradeable", "make_schema",
]
