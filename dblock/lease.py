"""A granted lease: its fencing token, and the verbs only its holder may use.

``Lease`` is written once for both faces: ``_alease.py`` is the source and
``_lease.py`` its generated sync twin (``tools/async_to_sync.py``); what both
faces' leases share (``LeaseInfo``, ``LeaseState``, ``LeaseView``) is in
``_lease_state.py``. This module keeps the names importable where they were.
"""

from __future__ import annotations

from ._group import LeaseGroup
from ._lease import Lease, UpgradeableLease
from ._lease_state import LeaseInfo, LeaseState, LeaseView
from .errors import LeaseLost
from .renew import OnLost, Renewal

__all__ = ["Lease", "LeaseGroup", "LeaseInfo", "LeaseLost", "LeaseState", "LeaseView", "OnLost", "Renewal",
           "UpgradeableLease"]
