"""dblock's tables as SQLAlchemy metadata, and where the embedded default lives.

The migrations in ``migrations/`` create exactly these objects; a drift test
checks that the migrated database and this module agree.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Double,
    Float,
    Identity,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    Text,
    false,
    text,
)

from .errors import DBLockError

DEFAULT_TABLE = "locks"
OWNER_LENGTH = 32  # 32 hex digits: a random half per process, then a count (_process.new_owner)
LABEL_LENGTH = 255  # who holds a lease, for people: "host:pid command"


def token_sequence_name(table: str) -> str:
    return f"{table}_token_seq"


def version_table_name(table: str) -> str:
    """dblock's own Alembic version table: never the host app's ``alembic_version``."""
    return "alembic_version_dblock" if table == DEFAULT_TABLE else f"alembic_version_dblock_{table}"


# PostgreSQL keeps times as timestamptz and computes them with now(). SQLite has
# no time type, so there the columns hold Unix seconds (REAL) computed by SQLite;
# MariaDB holds Unix seconds too (DOUBLE), free of the session's time zone.
Timestamp = DateTime(timezone=True).with_variant(Float(), "sqlite").with_variant(Double(), "mariadb", "mysql")


def locks_table(table: str = DEFAULT_TABLE, schema: str | None = None, metadata: MetaData | None = None) -> Table:
    """The ``locks`` table.

    The row of a name stays when its lease ends (release clears owner and
    expires_at), so every grant after the first goes through the UPDATE path,
    where the token is drawn after the row lock is held (the documentation's "How it works").
    Only ``name`` is indexed on PostgreSQL, so grants and releases are HOT
    updates. SQLite takes the next token as max(token) + 1 inside its
    single-writer transaction and needs an index on token for that.
    ``label`` (migration 0003) says who took the latest grant, for operators;
    no statement compares it. ``waiting`` (migration 0005) counts the name's
    rows in the waiters table (PostgreSQL's fair queue): kept in this row so
    that a release, which holds this row's lock, sees a waiter that joined
    while it waited for the lock (a column of the locked row is re-read, a
    row of another table is not), and so a release with nobody waiting stays
    one plain UPDATE. Always 0 on SQLite.
    """
    md = metadata if metadata is not None else MetaData()
    t = Table(
        table,
        md,
        Column("name", String(255), primary_key=True),
        Column("owner", String(OWNER_LENGTH), nullable=True),
        Column("token", BigInteger, nullable=False),
        Column("acquired_at", Timestamp, nullable=False),
        Column("expires_at", Timestamp, nullable=True),
        Column("label", String(LABEL_LENGTH), nullable=True),
        Column("waiting", Integer, nullable=False, server_default=text("0")),
        schema=schema,
    )
    return t


def waiters_table_name(table: str) -> str:
    return f"{table}_waiters"


def procs_table_name(table: str) -> str:
    return f"{table}_procs"


def queue_function_names(table: str) -> tuple[str, str, str]:
    """PostgreSQL's queue functions for lock table ``table``: (enqueue, hand-off, cancel)."""
    return f"{table}_enqueue", f"{table}_handoff", f"{table}_cancel"


def lean_function_names(table: str) -> tuple[str, str]:
    """PostgreSQL's functions behind the acquire and release statements (migration 0012): (missed,
    hand_on). ``missed``: an acquire's miss report or a name's first grant; ``hand_on``: a writer's
    release with waiters hands the name on."""
    return f"{table}_missed", f"{table}_hand_on"


def waiters_table(table: str = DEFAULT_TABLE, schema: str | None = None, metadata: MetaData | None = None) -> Table:
    """PostgreSQL only: the fair queue, one row per waiting acquire, in arrival order (``seq``).

    Joining, leaving and being handed the lease each touch one row, so their
    cost does not grow with the queue. A waiter is live while its process's
    row in the procs table is fresh, its listener session (``pid`` started
    at ``start``; NULL when it polls) exists, and its own deadline (``until``)
    has not passed. Every change happens under the lock row's lock. Readers and
    semaphore waiters (``shared``, with the semaphore's ``lim``) wait in the same
    line as writers (migration 0008), and so does an upgradeable reader
    (``upgradeable``, migration 0010).
    """
    md = metadata if metadata is not None else MetaData()
    return Table(
        waiters_table_name(table),
        md,
        Column("name", String(255), nullable=False),
        Column("seq", BigInteger, Identity(always=True), nullable=False),
        Column("owner", String(OWNER_LENGTH), nullable=False),
        Column("ttl", Float, nullable=False),
        Column("label", String(LABEL_LENGTH), nullable=True),
        Column("proc", Text, nullable=False),
        Column("pid", Integer, nullable=True),
        Column("start", DateTime(timezone=True), nullable=True),
        Column("until", DateTime(timezone=True), nullable=True),
        Column("shared", Boolean, nullable=False, server_default=false()),
        Column("lim", Integer, nullable=True),
        Column("upgradeable", Boolean, nullable=False, server_default=false()),
        PrimaryKeyConstraint("name", "seq"),
        schema=schema,
    )


def procs_table(table: str = DEFAULT_TABLE, schema: str | None = None, metadata: MetaData | None = None) -> Table:
    """PostgreSQL only: a row per Locker process with waiters, fresh ``until`` while it lives.

    Its heartbeat refreshes one row however many threads wait, so a frozen
    process's waiters lapse together and a live one's cost no refreshes.
    """
    md = metadata if metadata is not None else MetaData()
    return Table(
        procs_table_name(table),
        md,
        Column("id", Text, primary_key=True),
        Column("until", DateTime(timezone=True), nullable=False),
        schema=schema,
    )


# The owner a name's lock row shows while shared leases (read locks, semaphore slots) hold it.
# Never a real owner (those are 32 hex digits), so no exclusive release or extend matches it.
SHARED_OWNER = "*shared"

# PostgreSQL (migration 0011): a listener session holds the advisory lock (LISTENER_LOCK, its pid)
# for as long as it lives, so a hand-off tells a live waiter's listener in O(1), by failing to
# take that lock shared, instead of reading every session's status. The two-int form, whose
# keys never meet pg_advisory_lock(bigint)'s; 0x64626c6b is "dblk".
LISTENER_LOCK = 0x64626C6B


def holders_table_name(table: str) -> str:
    return f"{table}_holders"


def shared_function_names(table: str) -> tuple[str, str, str]:
    """PostgreSQL's shared-lease functions for lock table ``table``: (acquire, release, extend)."""
    return f"{table}_share_acquire", f"{table}_share_release", f"{table}_share_extend"


def shared_queue_function_names(table: str) -> tuple[str, str]:
    """PostgreSQL's functions for shared waiters in the fair queue (migration 0008): (admit, share_enqueue)."""
    return f"{table}_admit", f"{table}_share_enqueue"


def upgrade_function_names(table: str) -> tuple[str, str]:
    """PostgreSQL's functions of the upgradeable read lock (migration 0010): (upgrade, downgrade)."""
    return f"{table}_upgrade", f"{table}_downgrade"


def holders_table(table: str = DEFAULT_TABLE, schema: str | None = None, metadata: MetaData | None = None) -> Table:
    """Shared leases (migration 0007): one row per read lock or semaphore slot held.

    ``lim`` is the limit the holder was granted under (NULL: a reader, no limit).
    ``upgradeable`` (migration 0010): 0 for a reader or a semaphore holder; 1 for
    the name's upgradeable reader (at most one lives at a time); 2 while that
    reader asks to upgrade, when no shared lease of the name is granted.
    While any of a name's holders is live, the name's row in the lock table has
    owner ``SHARED_OWNER``, the newest shared grant's token and an ``expires_at``
    no earlier than every live holder's: an exclusive (write) acquire sees the
    name held and waits, with no change to its statement. Every change to a
    name's holders happens under that row's lock.
    """
    md = metadata if metadata is not None else MetaData()
    return Table(
        holders_table_name(table),
        md,
        Column("name", String(255), nullable=False),
        Column("owner", String(OWNER_LENGTH), nullable=False),
        Column("token", BigInteger, nullable=False),
        Column("acquired_at", Timestamp, nullable=False),
        Column("expires_at", Timestamp, nullable=False),
        Column("label", String(LABEL_LENGTH), nullable=True),
        Column("lim", Integer, nullable=True),
        Column("upgradeable", SmallInteger, nullable=False, server_default=text("0")),
        PrimaryKeyConstraint("name", "owner"),
        schema=schema,
    )


def fences_table_name(table: str) -> str:
    """The fences table that goes with lock table ``table`` (``fences`` for ``locks``)."""
    return "fences" if table == DEFAULT_TABLE else f"{table}_fences"


def fences_table(table: str = DEFAULT_TABLE, schema: str | None = None, metadata: MetaData | None = None) -> Table:
    """``(resource, last_token)``: the newest fencing token each resource has accepted.

    For resources with no ``fence_token`` column of their own; ``dblock.fence``
    checks and bumps a row inside the caller's transaction.
    """
    md = metadata if metadata is not None else MetaData()
    return Table(
        fences_table_name(table),
        md,
        Column("resource", String(255), primary_key=True),
        Column("last_token", BigInteger, nullable=False),
        schema=schema,
    )


def token_index_name(table: str) -> str:
    """SQLite only: the index that makes max(token) a lookup, not a scan."""
    return f"ix_{table}_token"


def default_sqlite_path() -> Path:
    """The embedded default's file: one per user, whatever the working directory.

    ``$DBLOCK_HOME/locks.sqlite3`` when DBLOCK_HOME is set, otherwise the
    per-user data directory (Linux: ``~/.local/share/dblock/locks.sqlite3``,
    or under ``$XDG_DATA_HOME``; macOS: ``~/Library/Application Support/dblock``;
    Windows: ``%LOCALAPPDATA%\\dblock``).
    """
    home = os.environ.get("DBLOCK_HOME")
    base = Path(home) if home else platformdirs.user_data_path("dblock", appauthor=False)
    return base / "locks.sqlite3"


def prepare_default_sqlite_path() -> Path:
    """``default_sqlite_path()``, its directory created; a ``DBLockError`` naming the place if it cannot be.

    Checked before anything is written: a ``DBLOCK_HOME`` that names a file (or
    sits under one) is refused, not left to fail inside ``mkdir`` or SQLite.
    """
    path = default_sqlite_path()
    home = os.environ.get("DBLOCK_HOME")
    source = f"DBLOCK_HOME={home!r}" if home else "the per-user data directory"
    remedy = "set DBLOCK_HOME to a directory, or unset it" if home else "move it aside, or set DBLOCK_HOME"
    # The nearest part of the path that exists must be a directory (exists() is False below a file).
    existing = next((p for p in (path.parent, *path.parent.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise DBLockError(
            f"the embedded default needs a directory at {path.parent} ({source}), but {existing} is a file: {remedy}"
        )
    if path.is_dir():
        raise DBLockError(f"the embedded default's database {path} ({source}) is a directory, not a file: move it aside")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DBLockError(
            f"cannot create the embedded default's directory {path.parent} ({source}): {exc.strerror or exc}; {remedy}"
        ) from exc
    return path
