"""What both faces' Lockers share that is no logic of their own: the defaults, and making the schema."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sqlalchemy.engine import Engine

from . import backends
from ._core import DRIFT
from ._redact import display_url

if TYPE_CHECKING:
    from .migrate import Migrated

log = logging.getLogger("dblock.migrate")

DEFAULT_TTL = 30.0
DEFAULT_OP_TIMEOUT = 5.0
DEFAULT_MAX_CONNECTIONS = 10
# The clock allowance taken off every lease's trust: Redlock's, 1% of the ttl plus 2 ms.
DEFAULT_DRIFT, DEFAULT_DRIFT_FIXED = DRIFT

# At most this long (or op_timeout, if shorter) for close(), or a clean exit, to delete what a
# Locker's fair waiters wrote (their process's heartbeat row); past it the row lapses by itself.
QUIT_WITHIN = 2.0


def make_schema(engine: Engine, table: str, schema: str | None) -> Migrated:
    """``create_schema`` of both faces: dblock's migrations, and what the database needs first (WAL on SQLite)."""
    from . import migrate  # noqa: PLC0415 - Alembic loads only when the schema is made, not on every start

    with migrate.database_errors(engine, table):
        backends.of(engine).prepare_database(engine)
        migrated = migrate.upgrade(engine, table, schema)
    (log.info if migrated.changed else log.debug)("%s in %s", migrated, display_url(engine.url))
    return migrated
