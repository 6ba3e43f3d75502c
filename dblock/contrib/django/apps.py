"""The app for ``INSTALLED_APPS``: ``"dblock.contrib.django"``, label ``dblock``."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig


class DBLockConfig(AppConfig):
    name = "dblock.contrib.django"
    label = "dblock"  # `manage.py migrate dblock`, `manage.py dblock status`
    verbose_name = "dblock"

    def ready(self) -> None:
        _close_lockers_before_dropping_test_databases()


def _close_lockers_before_dropping_test_databases() -> None:
    """Django's test runner drops each test database at the end (``destroy_test_db``); PostgreSQL
    refuses while a connection is open to it, and the Lockers of ``locker()`` keep theirs. So
    they are closed first, as Django closes its own connections: the user need not."""
    from django.db.backends.base.creation import BaseDatabaseCreation

    destroy = BaseDatabaseCreation.destroy_test_db
    if getattr(destroy, "closes_dblock_lockers", False):
        return  # set up already (ready() may run more than once)

    def destroy_test_db(self: BaseDatabaseCreation, *args: Any, **kwargs: Any) -> Any:
        from .database import close_lockers

        close_lockers()
        return destroy(self, *args, **kwargs)

    destroy_test_db.closes_dblock_lockers = True  # type: ignore[attr-defined]
    destroy_test_db.__doc__ = destroy.__doc__
    BaseDatabaseCreation.destroy_test_db = destroy_test_db
