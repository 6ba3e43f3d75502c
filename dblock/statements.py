"""Moved: every statement now lives with its database, in ``dblock/backends/``.

Kept so that ``dblock.statements`` still imports: ``build`` gives the
statements of a table as a backend makes them.
"""

from __future__ import annotations

from sqlalchemy.engine import Dialect

from . import backends
from .backends.base import QueueStatements, Statements
from .backends.sqlite import SQLITE_NOW

__all__ = ["SQLITE_NOW", "QueueStatements", "Statements", "build"]


def build(dialect: Dialect, table: str, schema: str | None) -> Statements:
    """The lock statements of ``table`` on ``dialect``'s database (``Backend.statements``)."""
    return backends.of(dialect).statements(dialect, table, schema)
