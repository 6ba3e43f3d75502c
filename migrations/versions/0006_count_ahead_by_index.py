"""Count the waiters ahead through the queue's index, whatever the other lines' lengths.

0005's enqueue counts the waiters ahead of the caller (up to 100) with a
subquery that had no ORDER BY. PL/pgSQL caches a generic plan for it, made
for an average name, and with one long line in the table (a name with
100,000 waiters) that plan is a sequential scan that stops after 100 rows:
on a short line it found too few and read the whole table, 16 ms and 1,800
buffers per call for a name with 10 waiters (benchmarks/queue_ops.py). In
``(name, seq)`` order the only plan is a walk of the primary key from the
line's head, which stops after at most 100 entries.

This replaces the enqueue function with that one change (PostgreSQL; on
SQLite it changes nothing: its waiters poll). The text is 0005's own,
edited here, so the two cannot drift apart.

Revision ID: dblock_0006
Revises: dblock_0005
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import context, op

from dblock.migrate import target

revision = "dblock_0006"
down_revision = "dblock_0005"
branch_labels = None
depends_on = None

_UNORDERED = "AND x.seq < me LIMIT 100) AS a)"
_ORDERED = "AND x.seq < me ORDER BY x.seq LIMIT 100) AS a)"


def upgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        op.execute(_enqueue().replace(_UNORDERED, _ORDERED))


def downgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        op.execute(_enqueue())


def _enqueue() -> str:
    """0005's enqueue function, as CREATE OR REPLACE."""
    table, schema = target()
    created = context.script.get_revision("dblock_0005").module._functions(table, schema)[0]
    assert created.count(_UNORDERED) == 2, "0005's enqueue is not the text this migration edits"
    return created.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
