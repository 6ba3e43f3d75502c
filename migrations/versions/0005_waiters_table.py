"""Move the fair queue out of the lock row: one row per waiter, liveness per process.

The JSON array of 0004 was rewritten whole by every release and refreshed by
every waiter about once a second, so both cost O(waiters). Now (PostgreSQL):

- ``<table>_waiters``: one row per waiting acquire, keyed (name, seq) in
  arrival order; joining, leaving and being handed the lease touch one row.
- ``<table>_procs``: one row per Locker process with waiters; its heartbeat
  keeps it fresh, so waiters are not refreshed one by one.
- ``<table>.waiting``: how many waiter rows the name has. A release that finds
  0 is one plain UPDATE; otherwise it calls the hand-off function.
- Three functions, ``<table>_enqueue``, ``<table>_handoff`` and
  ``<table>_cancel``. Each first locks the name's row (FOR UPDATE), and every
  statement after that takes a fresh snapshot (PL/pgSQL in READ COMMITTED),
  so it sees every waiter that committed before it got the lock. A single SQL
  statement could not: after waiting for a row lock PostgreSQL re-reads the
  locked row but not other tables. One call is still one round trip.

Waiters queued in the old column are dropped: a dblock that upgrades has new
waiters, which queue again at their next look.

Revision ID: dblock_0005
Revises: dblock_0004
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from dblock.migrate import backend, target
from dblock.schema import procs_table_name, queue_function_names, token_sequence_name, waiters_table_name

revision = "dblock_0005"
down_revision = "dblock_0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table, schema = target()
    op.drop_column(table, "queue", schema=schema)
    # NOT NULL with a constant default: a catalog-only change on PostgreSQL 11+.
    op.add_column(table, sa.Column("waiting", sa.Integer, nullable=False, server_default=sa.text("0")), schema=schema)
    if not backend().caps.fair_queue:
        return  # no fair queue (SQLite): its waiters poll
    op.create_table(
        waiters_table_name(table),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("seq", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("owner", sa.String(32), nullable=False),
        sa.Column("ttl", sa.Float, nullable=False),
        sa.Column("label", sa.String(255), nullable=True),
        sa.Column("proc", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=True),
        sa.Column("start", sa.DateTime(timezone=True), nullable=True),
        sa.Column("until", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("name", "seq"),
        schema=schema,
    )
    op.create_table(
        procs_table_name(table),
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("until", sa.DateTime(timezone=True), nullable=False),
        schema=schema,
    )
    for sql in _functions(table, schema):
        op.execute(sql)


def downgrade() -> None:
    table, schema = target()
    if backend().caps.fair_queue:
        quote = op.get_context().dialect.identifier_preparer.quote
        prefix = quote(schema) + "." if schema else ""
        for name, args in zip(queue_function_names(table), _SIGNATURES):
            op.execute(f"DROP FUNCTION {prefix}{quote(name)}({args})")
        op.drop_table(procs_table_name(table), schema=schema)
        op.drop_table(waiters_table_name(table), schema=schema)
    op.drop_column(table, "waiting", schema=schema)
    op.add_column(table, sa.Column("queue", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True), schema=schema)


_SIGNATURES = (
    "text, text, float8, text, text, float8, int, timestamptz, float8, bigint",
    "text, text, bigint",
    "text, text, bigint",
)


def _functions(table: str, schema: str | None) -> list[str]:
    quote = op.get_context().dialect.identifier_preparer.quote
    prefix = quote(schema) + "." if schema else ""
    t = prefix + quote(table)
    w = prefix + quote(waiters_table_name(table))
    p = prefix + quote(procs_table_name(table))
    seq = (prefix + quote(token_sequence_name(table))).replace("'", "''")
    enqueue, handoff, cancel = (prefix + quote(n) for n in queue_function_names(table))
    # A waiter row ``v`` is live while its own deadline is ahead, its process's
    # heartbeat is fresh, and, when it names a listener session (pid, start),
    # that session still exists: a waiter whose process died is skipped at
    # once. backend_start reads NULL for another role's session without
    # pg_read_all_stats; then the pid alone counts.
    live = f"""(v.until IS NULL OR v.until > now())
            AND EXISTS (SELECT FROM {p} AS q WHERE q.id = v.proc AND q.until > now())
            AND (v.pid IS NULL OR EXISTS (
                SELECT FROM pg_stat_get_activity(v.pid) AS a
                WHERE a.backend_start IS NULL OR a.backend_start = v.start))"""
    ttl = "* interval '1 second'"
    # Every expiry counts from when it is computed, here after the row lock is had
    # (clock_timestamp(), not now(), the call's start); renewing never shortens one.
    # give: hand the lease to waiter row v (already deleted), with ``dropped`` rows gone
    # from the line in all. A fresh token drawn under the row lock (G2), the waiter's
    # own ttl and label. clock_timestamp(), not now(): this call began before it got
    # the row lock, maybe before the waiter's last attempt was sent, from which the
    # waiter trusts the lease (G5); the expiry must count from after that. The NOTIFY
    # goes to channel "dblock_" + the owner id's first 16 characters, which name the
    # waiter's listener: it wakes exactly that process and that waiter.
    give = f"""    UPDATE {t} AS k SET owner = v.owner, token = nextval('{seq}'), acquired_at = now(),
        expires_at = clock_timestamp() + v.ttl {ttl}, label = v.label, waiting = k.waiting - dropped
    WHERE k.name = p_name RETURNING k.owner, k.token, k.expires_at INTO g;
    PERFORM pg_notify('dblock_' || left(v.owner, 16), v.owner || ' ' || g.token || ' ' || extract(epoch FROM g.expires_at));"""
    return [
        # enqueue: a waiting acquire's attempt (see dblock/statements.py for the call).
        # Returns one row (granted, token, expires_at, wait, seq, ahead, at): granted, or
        # queued as ``seq`` with ``ahead`` waiters before it (counted up to 100), the
        # current lease ending in ``wait`` seconds, and ``at`` the database time of
        # this look (epoch seconds; no earlier than the client sent it).
        f"""
CREATE FUNCTION {enqueue}(p_name text, p_owner text, p_ttl float8, p_label text, p_proc text, p_lapse float8,
                          p_pid int, p_start timestamptz, p_until float8, p_seq bigint)
RETURNS TABLE (granted boolean, token bigint, expires_at timestamptz, wait float8, seq bigint, ahead int,
               at float8)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    v record;
    g record;
    f_seq bigint;
    f_owner text;
    dropped int := 0;
    me bigint := p_seq;
BEGIN
    -- Without a lock first: a look while another owner's lease runs and we are in
    -- line writes nothing; a name's first grant is an INSERT.
    SELECT k.owner, k.token, k.expires_at INTO l FROM {t} AS k WHERE k.name = p_name;
    IF NOT FOUND THEN
        INSERT INTO {t} AS k (name, owner, token, acquired_at, expires_at, label)
        VALUES (p_name, p_owner, nextval('{seq}'), now(), clock_timestamp() + p_ttl {ttl}, p_label)
        ON CONFLICT (name) DO NOTHING
        RETURNING k.token, k.expires_at INTO l;
        IF FOUND THEN
            RETURN QUERY SELECT true, l.token, l.expires_at, NULL::float8, NULL::bigint, 0, NULL::float8;
            RETURN;
        END IF;
    ELSIF me IS NOT NULL AND l.owner <> p_owner AND l.expires_at > now()
          AND EXISTS (SELECT FROM {w} AS x WHERE x.name = p_name AND x.seq = me) THEN
        RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz,
            extract(epoch FROM l.expires_at - now())::float8, me,
            (SELECT count(*)::int FROM (SELECT FROM {w} AS x WHERE x.name = p_name AND x.seq < me LIMIT 100) AS a),
            extract(epoch FROM now())::float8;
        RETURN;
    END IF;
    -- Under the row's lock: every statement from here on sees what committed before.
    SELECT k.owner, k.token, k.expires_at INTO l FROM {t} AS k WHERE k.name = p_name FOR UPDATE;
    IF l.owner = p_owner THEN
        -- Handed to us by a release we have not heard of yet, or granted by an
        -- attempt whose reply was lost (G6): the token is kept, the expiry renewed
        -- (never shortened: a cut-off call of ours may land after a later one).
        UPDATE {t} AS k SET expires_at = greatest(k.expires_at, clock_timestamp() + p_ttl {ttl}) WHERE k.name = p_name
        RETURNING k.token, k.expires_at INTO l;
        RETURN QUERY SELECT true, l.token, l.expires_at, NULL::float8, NULL::bigint, 0, NULL::float8;
        RETURN;
    END IF;
    IF l.owner IS NULL OR l.expires_at <= now() THEN
        -- Free: ours unless a live waiter is ahead. Dead ones at the head are dropped.
        FOR v IN SELECT x.* FROM {w} AS x WHERE x.name = p_name ORDER BY x.seq LOOP
            IF v.owner = p_owner OR ({live}) THEN
                f_seq := v.seq;
                f_owner := v.owner;
                EXIT;
            END IF;
            DELETE FROM {w} AS x WHERE x.name = p_name AND x.seq = v.seq;
            dropped := dropped + 1;
        END LOOP;
        IF f_seq IS NULL OR f_owner = p_owner THEN
            IF f_seq IS NOT NULL THEN
                DELETE FROM {w} AS x WHERE x.name = p_name AND x.seq = f_seq;
                dropped := dropped + 1;
            END IF;
            -- nextval() after the row lock: no later grant has a smaller token (G2).
            UPDATE {t} AS k SET owner = p_owner, token = nextval('{seq}'), acquired_at = now(),
                expires_at = clock_timestamp() + p_ttl {ttl}, label = p_label, waiting = k.waiting - dropped
            WHERE k.name = p_name RETURNING k.token, k.expires_at INTO l;
            RETURN QUERY SELECT true, l.token, l.expires_at, NULL::float8, NULL::bigint, 0, NULL::float8;
            RETURN;
        END IF;
        -- A live waiter is first, but asleep (its holder's lease ran out unreleased):
        -- hand it the lease as a release would, then join behind it.
        DELETE FROM {w} AS x WHERE x.name = p_name AND x.seq = f_seq RETURNING x.* INTO v;
        dropped := dropped + 1;
{give}
        dropped := 0;
        l := g;
    END IF;
    -- Held, or a live waiter is ahead: join the line (or keep our place in it).
    IF me IS NULL OR NOT EXISTS (SELECT FROM {w} AS x WHERE x.name = p_name AND x.seq = me) THEN
        INSERT INTO {w} AS x (name, owner, ttl, label, proc, pid, start, until)
        VALUES (p_name, p_owner, p_ttl, p_label, p_proc, p_pid, p_start, now() + p_until {ttl})
        RETURNING x.seq INTO me;
        dropped := dropped - 1;
    END IF;
    INSERT INTO {p} AS q (id, until) VALUES (p_proc, now() + p_lapse {ttl})
    ON CONFLICT (id) DO UPDATE SET until = excluded.until;
    IF dropped <> 0 THEN
        UPDATE {t} AS k SET waiting = k.waiting - dropped WHERE k.name = p_name;
    END IF;
    -- Joining needs no disk flush: were it lost in a crash the waiter would
    -- join again at its next look, and the release that hands it the lease
    -- flushes the WAL up to its own commit, this entry included.
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz,
        extract(epoch FROM l.expires_at - now())::float8, me,
        (SELECT count(*)::int FROM (SELECT FROM {w} AS x WHERE x.name = p_name AND x.seq < me LIMIT 100) AS a),
            extract(epoch FROM now())::float8;
END $$""",
        # handoff: a release when waiters are queued. Returns one row (token, notified)
        # when owner's lease with that token ended; zero rows: it was not ours (G3).
        f"""
CREATE FUNCTION {handoff}(p_name text, p_owner text, p_token bigint)
RETURNS TABLE (token bigint, notified boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    v record;
    g record;
    chosen boolean := false;
    dropped int := 0;
BEGIN
    SELECT k.owner, k.token INTO l FROM {t} AS k WHERE k.name = p_name FOR UPDATE;
    IF NOT FOUND OR l.owner IS DISTINCT FROM p_owner OR l.token <> p_token THEN
        RETURN;
    END IF;
    FOR v IN SELECT x.* FROM {w} AS x WHERE x.name = p_name ORDER BY x.seq LOOP
        DELETE FROM {w} AS x WHERE x.name = p_name AND x.seq = v.seq;
        dropped := dropped + 1;
        IF {live} THEN
            chosen := true;
            EXIT;
        END IF;
    END LOOP;
    IF NOT chosen THEN
        UPDATE {t} AS k SET owner = NULL, expires_at = NULL, waiting = k.waiting - dropped WHERE k.name = p_name;
        RETURN QUERY SELECT p_token, false;
        RETURN;
    END IF;
{give}
    RETURN QUERY SELECT g.token, true;
END $$""",
        # cancel: a waiter leaves (its seq, or every entry of its owner when seq is NULL).
        # Returns one row (granted, token, expires_at): granted means a release handed
        # it the lease first. Zero rows: the name has no row.
        f"""
CREATE FUNCTION {cancel}(p_name text, p_owner text, p_seq bigint)
RETURNS TABLE (granted boolean, token bigint, expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    v record;
    g record;
    dropped int;
BEGIN
    SELECT k.owner, k.token, k.expires_at INTO l FROM {t} AS k WHERE k.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF p_seq IS NOT NULL THEN
        DELETE FROM {w} AS x WHERE x.name = p_name AND x.seq = p_seq AND x.owner = p_owner;
    ELSE
        DELETE FROM {w} AS x WHERE x.name = p_name AND x.owner = p_owner;
    END IF;
    GET DIAGNOSTICS dropped = ROW_COUNT;
    IF l.owner IS DISTINCT FROM p_owner AND (l.owner IS NULL OR l.expires_at <= now()) THEN
        -- The lease ran out unreleased and the first waiter may be asleep: hand it over.
        FOR v IN SELECT x.* FROM {w} AS x WHERE x.name = p_name ORDER BY x.seq LOOP
            DELETE FROM {w} AS x WHERE x.name = p_name AND x.seq = v.seq;
            dropped := dropped + 1;
            IF {live} THEN
{give}
                dropped := 0;
                EXIT;
            END IF;
        END LOOP;
    ELSE
        PERFORM set_config('synchronous_commit', 'off', true);  -- only the queue changed (see enqueue)
    END IF;
    IF dropped > 0 THEN
        UPDATE {t} AS k SET waiting = k.waiting - dropped WHERE k.name = p_name;
    END IF;
    RETURN QUERY SELECT coalesce(l.owner = p_owner, false), l.token, l.expires_at;
END $$""",
    ]
