"""A hand-off that runs fewer steps on the server (PostgreSQL).

``<table>_hand_on`` (migration 0012), which a writer's release calls when the
name has waiters, granted the head of the line in one statement of four
parts: a read of the head (two index lookups: the line's first ``seq``, then
its row), a DELETE joined to that read, an UPDATE of the lock row joined to
the DELETE, and a SELECT that sent the notification. Its body is now two
parts: a DELETE of the line's first row, found once by the index and then by
its row address (``ctid``), when that row is a live writer; and the UPDATE
that grants the name to the row it deleted, whose ``RETURNING`` sends the
notification. What it does is unchanged: the same head, the same liveness
check, the same grant, token and notification, and any other head still goes
to ``<table>_admit``'s walk. ``benchmarks/floor.py``: about 35-50 us less of
the server's time per hand-off between two processes taking turns
(BENCHMARKS.md).

Statements of dblock are unchanged: a dblock from 0012 on works against
tables at either revision. A downgrade puts 0012's body back.

Revision ID: dblock_0013
Revises: dblock_0012
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import context, op

from dblock.migrate import backend, target
from dblock.schema import (
    lean_function_names,
    procs_table_name,
    shared_queue_function_names,
    token_sequence_name,
    waiters_table_name,
)

revision = "dblock_0013"
down_revision = "dblock_0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if backend().caps.fair_queue:  # SQLite and MariaDB have no line of waiters in the database
        table, schema = target()
        for sql in _functions(table, schema):
            op.execute(sql)


def downgrade() -> None:
    if backend().caps.fair_queue:
        table, schema = target()
        op.execute(context.script.get_revision("dblock_0012").module._functions(table, schema)[1])  # hand_on


def _functions(table: str, schema: str | None) -> list[str]:
    quote = op.get_context().dialect.identifier_preparer.quote
    prefix = quote(schema) + "." if schema else ""
    t = prefix + quote(table)
    w = prefix + quote(waiters_table_name(table))
    p = prefix + quote(procs_table_name(table))
    seq = (prefix + quote(token_sequence_name(table))).replace("'", "''")
    admit = prefix + quote(shared_queue_function_names(table)[0])
    hand_on = prefix + quote(lean_function_names(table)[1])
    live = context.script.get_revision("dblock_0011").module.live("x", p)
    # hand_on: called by a writer's release, in its RETURNING, after its UPDATE cleared the
    # lease of a row that counts waiters; that UPDATE holds the row lock. True if it granted
    # anyone. A statement of its own, so it sees every change committed before the row lock;
    # nobody changes the line meanwhile, as every function that does takes the row lock
    # first (so the head's row address, read in the same statement, still names it). When
    # the head of the line is a live writer: out of the line, and granted with a token drawn
    # after the row lock (G2) and an expiry from clock_timestamp(), after the waiter's last
    # look was sent (G5). Any other line (or none) is admit's to walk.
    return [f"""
CREATE OR REPLACE FUNCTION {hand_on}(p_name text)
RETURNS boolean
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    tok bigint;
    sent text;
BEGIN
    WITH d AS (
        DELETE FROM {w} AS x
        WHERE x.ctid = (SELECT y.ctid FROM {w} AS y WHERE y.name = p_name ORDER BY y.seq LIMIT 1)
            AND x.name = p_name AND NOT x.shared AND {live}
        RETURNING x.owner, x.ttl, x.label
    )
    UPDATE {t} AS k SET owner = d.owner, token = nextval('{seq}'), acquired_at = now(),
        expires_at = clock_timestamp() + d.ttl * interval '1 second', label = d.label, waiting = k.waiting - 1
    FROM d WHERE k.name = p_name
    RETURNING k.token, pg_notify('dblock_' || left(k.owner, 16), k.owner || ' ' || k.token || ' ' || extract(epoch FROM k.expires_at))
    INTO tok, sent;
    IF FOUND THEN
        RETURN true;
    END IF;
    RETURN {admit}(p_name, 0, NULL, true) > 0;
END $$"""]
