"""dblock's exceptions: one base, a few leaves, all exported from ``dblock``."""

from __future__ import annotations


class DBLockError(Exception):
    """Base class of every error dblock raises on purpose."""


class LockNotAcquired(DBLockError):
    """A blocking acquire ran out of time while someone else held the lock."""

    def __init__(self, name: str, timeout: float) -> None:
        super().__init__(f"lock {name!r} was not acquired within {timeout:g} s: it is held by another owner")
        self.name = name
        self.timeout = timeout


class LeaseLost(DBLockError):
    """The lease was released or taken over by another owner; this holder no longer holds it."""


class FencedOut(DBLockError):
    """A fenced write was refused: a newer lease already wrote the resource. Nothing was written.

    ``token`` is the refused token, ``resource`` names what refused it (a table,
    a fences-table resource), and ``newer`` is the token that won, when known.
    """

    def __init__(self, message: str, *, token: int, resource: str, newer: int | None = None) -> None:
        super().__init__(message)
        self.token = token
        self.resource = resource
        self.newer = newer


class SchemaMissing(DBLockError):
    """dblock's table (or its token sequence) does not exist in this database."""


class DatabaseUnavailable(DBLockError):
    """The database could not be reached, or the connection broke and a retry failed too."""
