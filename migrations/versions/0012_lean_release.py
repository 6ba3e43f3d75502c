"""A release and an acquire that cost what their common case needs (PostgreSQL).

- **A release is one UPDATE.** A writer's release was a CTE whose UPDATE only
  matched with nobody waiting, joined by ``UNION ALL`` to a call of
  ``<table>_handoff`` for a release with a line. With nobody waiting that
  shape cost about 20 us of server time more than the UPDATE alone
  (BENCHMARKS.md). The release is now the UPDATE that clears the lease, and
  its ``RETURNING`` calls ``<table>_hand_on`` only when the row counts
  waiters: the function runs in the same statement, under the row lock the
  UPDATE took, after the lease was cleared. It grants a live writer at the
  head of the line in one statement, or else walks the line (``<table>_admit``)
  as ``<table>_handoff`` did. A lease held with a minimum hold is released
  the same way.
- **An acquire's rare branches in a function.** The acquire was a
  conditional UPDATE, a read of the row for a miss, and an INSERT for a
  name's first grant, as CTEs that PostgreSQL started and ran on every call.
  The UPDATE stays the statement's common path; ``<table>_missed``, called
  only when it matched nothing, reports when the current lease ends, or
  makes a name's first grant (its row's INSERT). A grant saves about 17 us of
  server time.

``<table>_handoff`` stays for a dblock from before this migration that still
runs beside a new one, with a new body: once it has checked the caller's lease
under the row lock, it clears the lease and calls ``<table>_hand_on``, as a
release now does, so a hand-off is written once. A dblock from this migration
on needs both new functions: against older tables its acquire raises
``SchemaMissing``, which names the upgrade. A downgrade drops them and puts
0011's ``<table>_handoff`` back.

Revision ID: dblock_0012
Revises: dblock_0011
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import context, op

from dblock.migrate import backend, target
from dblock.schema import (
    lean_function_names,
    procs_table_name,
    queue_function_names,
    shared_queue_function_names,
    token_sequence_name,
    waiters_table_name,
)

revision = "dblock_0012"
down_revision = "dblock_0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if backend().caps.fair_queue:  # SQLite and MariaDB have statements of their own, and no line of waiters
        table, schema = target()
        for sql in _functions(table, schema):
            op.execute(sql)


def downgrade() -> None:
    if backend().caps.fair_queue:
        table, schema = target()
        quote = op.get_context().dialect.identifier_preparer.quote
        prefix = quote(schema) + "." if schema else ""
        op.execute(context.script.get_revision("dblock_0011").module._functions(table, schema)[1])  # handoff
        missed, hand_on = (prefix + quote(n) for n in lean_function_names(table))
        op.execute(f"DROP FUNCTION IF EXISTS {missed}(text, text, double precision, text)")
        op.execute(f"DROP FUNCTION IF EXISTS {hand_on}(text)")


def _functions(table: str, schema: str | None) -> list[str]:
    quote = op.get_context().dialect.identifier_preparer.quote
    prefix = quote(schema) + "." if schema else ""
    t = prefix + quote(table)
    w = prefix + quote(waiters_table_name(table))
    p = prefix + quote(procs_table_name(table))
    seq = (prefix + quote(token_sequence_name(table))).replace("'", "''")
    admit = prefix + quote(shared_queue_function_names(table)[0])
    missed, hand_on = (prefix + quote(n) for n in lean_function_names(table))
    handoff = prefix + quote(queue_function_names(table)[1])
    live = context.script.get_revision("dblock_0011").module.live("x", p)
    return [
        # missed: what an acquire returns when its UPDATE matched nothing (the statement calls
        # it only then). One row (false, NULL, NULL, wait): the name is held, its lease ends in
        # wait seconds by the database clock (<= 0 or NULL: it just ended). Or, for a name with
        # no row yet, its first grant: one row (true, token, expires_at, NULL). Zero rows: a
        # concurrent first acquire inserted the row just now (look again). Each statement
        # reads what was committed before it began, as a miss may: the row is only read.
        f"""
CREATE OR REPLACE FUNCTION {missed}(p_name text, p_owner text, p_ttl double precision, p_label text)
RETURNS TABLE (granted boolean, token bigint, expires_at timestamptz, wait double precision)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz, EXTRACT(EPOCH FROM k.expires_at - now())::float8
    FROM {t} AS k WHERE k.name = p_name;
    IF FOUND THEN
        RETURN;
    END IF;
    -- The token is drawn before the unique check: a row it collides with inserts nothing, and
    -- no prune removes that row meanwhile (its table lock waits for this statement, G2).
    RETURN QUERY INSERT INTO {t} AS k (name, owner, token, acquired_at, expires_at, label)
    VALUES (p_name, p_owner, nextval('{seq}'), now(), clock_timestamp() + p_ttl * interval '1 second', p_label)
    ON CONFLICT (name) DO NOTHING
    RETURNING true, k.token, k.expires_at, NULL::float8;
END $$""",
        # hand_on: called by a writer's release, in its RETURNING, after its UPDATE cleared the
        # lease of a row that counts waiters; that UPDATE holds the row lock. True if it granted
        # anyone. A statement of its own, so it sees every change committed before the row
        # lock; nobody changes the line meanwhile, as every function that does takes the row
        # lock first. When the head of the line is a live writer: out of the line, and granted
        # with a token drawn after the row lock (G2) and an expiry from clock_timestamp(), after
        # the waiter's last look was sent (G5). Any other line is admit's to walk.
        f"""
CREATE OR REPLACE FUNCTION {hand_on}(p_name text)
RETURNS boolean
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    tok bigint;
BEGIN
    WITH v AS (
        SELECT x.seq, x.owner, x.ttl, x.label FROM {w} AS x
        WHERE x.name = p_name AND x.seq = (SELECT min(y.seq) FROM {w} AS y WHERE y.name = p_name)
            AND NOT x.shared AND {live}
    ), d AS (
        DELETE FROM {w} AS x USING v WHERE x.name = p_name AND x.seq = v.seq
        RETURNING v.owner, v.ttl, v.label
    ), g AS (
        UPDATE {t} AS k SET owner = d.owner, token = nextval('{seq}'), acquired_at = now(),
            expires_at = clock_timestamp() + d.ttl * interval '1 second', label = d.label, waiting = k.waiting - 1
        FROM d WHERE k.name = p_name
        RETURNING k.token, k.owner, k.expires_at
    )
    SELECT g.token INTO tok FROM g,
        LATERAL pg_notify('dblock_' || left(g.owner, 16), g.owner || ' ' || g.token || ' ' || extract(epoch FROM g.expires_at));
    IF FOUND THEN
        RETURN true;
    END IF;
    RETURN {admit}(p_name, 0, NULL, true) > 0;
END $$""",
        # handoff: the release of a dblock from before 0012, when waiters are queued (0005's
        # contract): one row (token, notified) when owner's lease with that token ended (token:
        # the grant it handed over, if any); zero rows: not ours (G3). It ends the lease as
        # this dblock's release does, and hand_on hands the name on.
        f"""
CREATE OR REPLACE FUNCTION {handoff}(p_name text, p_owner text, p_token bigint)
RETURNS TABLE (token bigint, notified boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
BEGIN
    SELECT k.owner, k.token INTO l FROM {t} AS k WHERE k.name = p_name FOR UPDATE;
    IF NOT FOUND OR l.owner IS DISTINCT FROM p_owner OR l.token <> p_token THEN
        RETURN;
    END IF;
    UPDATE {t} AS k SET owner = NULL, expires_at = NULL WHERE k.name = p_name;
    IF {hand_on}(p_name) THEN
        -- As 0005's: the token of the grant it made (of the newest, when it admitted readers).
        RETURN QUERY SELECT k.token, true FROM {t} AS k WHERE k.name = p_name;
    ELSE
        RETURN QUERY SELECT p_token, false;
    END IF;
END $$""",
    ]
