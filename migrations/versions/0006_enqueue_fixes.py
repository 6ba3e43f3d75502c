"""Two fixes to the enqueue function: count the waiters ahead through the index, and keep
a hand-off made on a waiter's look durable.

1. 0005's enqueue counts the waiters ahead of the caller (up to 100) with a
   subquery that had no ORDER BY. PL/pgSQL caches a generic plan for it, made
   for an average name, and with lines of mixed lengths in the table that plan
   is a sequential scan that stops after 100 rows: on a short line it found
   too few and read the whole table, 16 ms and 1,800 buffers per call for a
   name with 10 waiters next to one with 100,000 (benchmarks/queue_ops.py). In
   ``(name, seq)`` order the only plan is a walk of the primary key from the
   line's head, which stops after at most 100 entries.
2. A look that finds the lease run out unreleased hands it to the first live
   waiter, then joins the line itself; joining sets ``synchronous_commit`` off
   for the transaction (a lost entry is simply made again), and so the grant
   committed without waiting for the disk, or for a synchronous standby: a
   crash or a failover could lose a grant its new holder had been told of, and
   draw its token again (G1, G2). Now the joining call commits durably when it
   handed the lease over (tests/test_ha.py shows it with the standbys stalled).

This replaces the enqueue function with those changes (PostgreSQL; on SQLite
it changes nothing: its waiters poll). The text is 0005's own, edited here,
so the two cannot drift apart.

Revision ID: dblock_0006
Revises: dblock_0005
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import context, op

from dblock.migrate import backend, target

revision = "dblock_0006"
down_revision = "dblock_0005"
branch_labels = None
depends_on = None

# (0005's text, 0006's, how many times 0005 has it)
_EDITS = [
    ("AND x.seq < me LIMIT 100) AS a)", "AND x.seq < me ORDER BY x.seq LIMIT 100) AS a)", 2),
    ("    me bigint := p_seq;\n", "    me bigint := p_seq;\n    gave boolean := false;  -- this call handed the lease over\n", 1),
    ("        dropped := 0;\n        l := g;\n", "        dropped := 0;\n        gave := true;\n        l := g;\n", 1),
    (
        "    PERFORM set_config('synchronous_commit', 'off', true);\n    RETURN QUERY SELECT false",
        "    IF NOT gave THEN  -- a hand-off must be as durable as a release's\n"
        "        PERFORM set_config('synchronous_commit', 'off', true);\n    END IF;\n    RETURN QUERY SELECT false",
        1,
    ),
]


def upgrade() -> None:
    if backend().caps.fair_queue:
        sql = _enqueue()
        for old, new, _ in _EDITS:
            sql = sql.replace(old, new)
        op.execute(sql)


def downgrade() -> None:
    if backend().caps.fair_queue:
        op.execute(_enqueue())


def _enqueue() -> str:
    """0005's enqueue function, as CREATE OR REPLACE."""
    table, schema = target()
    created = context.script.get_revision("dblock_0005").module._functions(table, schema)[0]
    for old, _, count in _EDITS:
        assert created.count(old) == count, "0005's enqueue is not the text this migration edits"
    return created.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
