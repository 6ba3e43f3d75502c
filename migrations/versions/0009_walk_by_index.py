"""The queue's walk reads the head of the line through the index, one entry at a time.

0008's admit (which every hand-over, cancel and newcomer's try runs) walked
the line with ``FOR v IN SELECT ... WHERE name = p_name ORDER BY seq``. A
PL/pgSQL FOR loop plans its query for the whole result, and with the
statistics of a waiters table that was short when last analyzed (a line
forms and drains faster than autovacuum looks) that plan is a bitmap scan of
every entry of the name plus a sort: a hand-over to the head of a line of
1,000 read all 1,000 rows (65 pages) to use one, 0.9 ms of a release's 1.0 ms
of server time in ``benchmarks/waiters.py`` at 1,000 waiters, so the release
grew with the line.

Now each step of the walk takes the next entry after the last one seen,
``ORDER BY seq LIMIT 1``, whose only sensible plan is a descent of the
primary key ``(name, seq)``: a hand-over reads the entries it grants or
skips, whatever the line's length and the statistics. Each step sees what
committed before it; nobody else can change this name's line meanwhile,
because every function that does takes the name's row lock first, and the
walk's caller holds it.

This replaces admit with that change (PostgreSQL; on SQLite it changes
nothing: its waiters poll). The text is 0008's own, edited here, so the two
cannot drift apart.

Revision ID: dblock_0009
Revises: dblock_0008
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import context, op

from dblock.migrate import backend, target
from dblock.schema import waiters_table_name

revision = "dblock_0009"
down_revision = "dblock_0008"
branch_labels = None
depends_on = None

# (0008's text, 0009's, how many times 0008 has it)
_EDITS = [
    ("    e timestamptz;\nBEGIN\n", "    e timestamptz;\n    last bigint := 0;  -- the walk's place in line (seq counts from 1)\nBEGIN\n", 1),
    (
        "        FOR v IN SELECT x.* FROM {w} AS x WHERE x.name = p_name ORDER BY x.seq LOOP\n",
        "        LOOP\n"
        "            SELECT x.* INTO v FROM {w} AS x WHERE x.name = p_name AND x.seq > last ORDER BY x.seq LIMIT 1;\n"
        "            EXIT WHEN NOT FOUND;\n"
        "            last := v.seq;\n",
        1,
    ),
]


def upgrade() -> None:
    if backend().caps.fair_queue:
        sql, waiters = _admit()
        for old, new, _ in _EDITS:
            sql = sql.replace(old.replace("{w}", waiters), new.replace("{w}", waiters))
        op.execute(sql)


def downgrade() -> None:
    if backend().caps.fair_queue:
        op.execute(_admit()[0])


def _admit() -> tuple[str, str]:
    """0008's admit function, as CREATE OR REPLACE, and the waiters table's name as it quotes it."""
    table, schema = target()
    created = context.script.get_revision("dblock_0008").module._functions(table, schema)[0]
    quote = op.get_context().dialect.identifier_preparer.quote
    waiters = (quote(schema) + "." if schema else "") + quote(waiters_table_name(table))
    for old, _, count in _EDITS:
        assert created.count(old.replace("{w}", waiters)) == count, "0008's admit is not the text this migration edits"
    return created.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1), waiters
