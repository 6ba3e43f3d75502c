"""The internal failures of a lock statement, shared by both faces' drivers and every backend."""

from __future__ import annotations

import shlex

from sqlalchemy.exc import DBAPIError

from ._redact import MASK
from .errors import DatabaseUnavailable, SchemaMissing
from .schema import DEFAULT_TABLE


class Busy(DatabaseUnavailable):
    """SQLite stayed write-locked by another connection for the whole time allowed."""


class OutOfTime(DatabaseUnavailable):
    """The call's deadline came before its statement could be sent (no connection free in time,
    or no time left): nothing reached the database, so nothing is in doubt."""

    timed_out = True


class Outdated(SchemaMissing):
    """A statement found one of dblock's objects missing (a function, a column) that a table of an
    older dblock lacks: the table may be of an older dblock, or not there at all (the driver asks)."""


def no_table(where: str, table: str, schema: str | None, sqlstate: str | None = None) -> SchemaMissing:
    """dblock's table is not in this database: the message says so, and the command that makes it."""
    return SchemaMissing(
        f"dblock's table {table!r} does not exist in {where}: {missing_schema_hint(where, table, schema)}",
        sqlstate=sqlstate,
    )


def outdated(where: str, table: str, schema: str | None, reason: str, sqlstate: str | None = None) -> Outdated:
    """dblock's table lacks what this dblock needs (``reason``, the database's words)."""
    return Outdated(
        f"dblock's table {table!r} in {where} is from an older dblock ({reason}): "
        f"{missing_schema_hint(where, table, schema, upgrade=True)}",
        sqlstate=sqlstate,
    )


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


def missing_schema_hint(where: str, table: str, schema: str | None, upgrade: bool = False) -> str:
    """What to do about a missing (or, ``upgrade``, an old) table: the command that makes it in
    this very database (``where``, the URL as printed), with the Locker's own table and schema."""
    command = ["dblock", "migrate", "--url", where]
    if table != DEFAULT_TABLE:
        command += ["--table", table]
    if schema is not None:
        command += ["--schema", schema]
    password = " (your password in place of ***)" if MASK in where else ""
    return (
        f"run `{shlex.join(command)}`{password}, or call create_schema() on this Locker, "
        f"{'to upgrade it' if upgrade else 'first'}"
    )
