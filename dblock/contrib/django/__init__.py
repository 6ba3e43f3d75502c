"""dblock for Django: ``"dblock.contrib.django"`` in ``INSTALLED_APPS``.

- ``manage.py migrate`` creates dblock's tables (its own Alembic migrations, run
  by a Django migration of app ``dblock``); ``migrate dblock zero`` removes them.
- ``locker(alias="default", **options)``: the process's Locker on a database of
  ``settings.DATABASES``.
- ``fenced_update(queryset, lease, **values)``: ``queryset.update(**values)``
  that a newer lease's stamp refuses (``FencedOut``); ``FenceTokenField`` is
  the column it checks.
- ``manage.py dblock run|status|release ... [--database ALIAS]``: dblock's
  command line on that database.

The names load on first use, so listing the app costs Django's start-up no
SQLAlchemy import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .database import close_lockers, database_url, locker
    from .fencing import fenced_update
    from .fields import FenceTokenField

_LAZY = {
    "close_lockers": ".database",
    "database_url": ".database",
    "locker": ".database",
    "fenced_update": ".fencing",
    "FenceTokenField": ".fields",
}

__all__ = ["FenceTokenField", "close_lockers", "database_url", "fenced_update", "locker"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
