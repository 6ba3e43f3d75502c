"""dblock's exceptions: one base, a few leaves, all exported from ``dblock``.

Every one of them pickles with its attributes (``__reduce__`` rebuilds it from
its message and attributes), so it survives multiprocessing pools,
``concurrent.futures`` and task queues that carry exceptions between processes.
"""

from __future__ import annotations

from typing import Any


class DBLockError(Exception):
    """Base class of every error dblock raises on purpose.

    ``sqlstate`` is the database's five-character error code (PostgreSQL's
    SQLSTATE, e.g. ``"42501"`` for a missing privilege) when the error came
    from the database and it gave one; None otherwise.
    """

    def __init__(self, message: str = "", *, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the message, then its attributes restored: subclasses
        # whose __init__ takes other arguments pickle without code of their own.
        return (_rebuild, (type(self), str(self)), self.__dict__)


def _rebuild(cls: type[DBLockError], message: str) -> DBLockError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    return exc


class LockNotAcquired(DBLockError, TimeoutError):
    """A blocking acquire ran out of time while someone else held the lock.

    Also a ``TimeoutError`` (as filelock's ``Timeout`` and asyncio's timeouts are), so
    ``except TimeoutError`` catches it; ``name`` and ``timeout`` say which lock and how long.
    """

    def __init__(self, name: str, timeout: float, note: str = "") -> None:
        held_by = note or "it is held by another owner"
        super().__init__(f"lock {name!r} was not acquired within {timeout:g} s: {held_by}")
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
    """The database could not be reached or did not answer in time.

    Raised when connecting fails, when a statement outlives its time limit
    (the server is silent, frozen or unreachable), or when a wait's deadline
    passes while the database is down.
    """


class Misconfigured(DatabaseUnavailable):
    """The database cannot be reached as the URL says, and waiting will not change that.

    Its host name does not resolve, nothing listens at its address (and this
    Locker never reached a server there), the server refused the user or the
    password, the database does not exist, or the SQLite file cannot be opened
    (a directory, or in a directory that does not exist). Every call raises it
    as soon as its connect fails, within ``op_timeout``, whatever the call's
    own ``timeout``: a waiting acquire does not wait it out as it would an
    outage. The message names the cause; a password in it is masked.

    A subclass of ``DatabaseUnavailable``, so ``except DatabaseUnavailable``
    catches it too.
    """


class PermissionDenied(DBLockError):
    """The database role lacks a privilege dblock needs; the message names it."""


class ReplicationWarning(UserWarning):
    """The server has standbys, but commits do not wait for one to confirm them (asynchronous
    replication): a standby promoted after a failover may lack grants a client was told of, and
    hand out a token again. dblock's guarantees across a failover need synchronous replication."""
