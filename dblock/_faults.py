"""The internal failures of a lock statement, shared by both faces' drivers and every backend."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError

from .errors import DatabaseUnavailable

_MISSING_SCHEMA_HINT = "run `dblock migrate` or call Locker.create_schema() first"


class Busy(DatabaseUnavailable):
    """SQLite stayed write-locked by another connection for the whole time allowed."""


class OutOfTime(DatabaseUnavailable):
    """The call's deadline came before its statement could be sent (no connection free in time,
    or no time left): nothing reached the database, so nothing is in doubt."""

    timed_out = True


def pool_busy(size: int, where: str, owner: str) -> OutOfTime:
    """A checkout that found every connection busy until the call's deadline."""
    return OutOfTime(
        f"all {size} of this {owner}'s connections to {where} stayed busy "
        f"until the call's deadline (see {owner}(max_connections=...))"
    )


def first_line(exc: BaseException) -> str:
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        exc = exc.orig
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def missing_schema_hint(upgrade: bool = False) -> str:
    """What to do about a missing (or, ``upgrade``, an old) table."""
    return _MISSING_SCHEMA_HINT.replace("first", "to upgrade it") if upgrade else _MISSING_SCHEMA_HINT
