"""Shared leases: read locks and counting semaphores.

A holders table, one row per shared lease: ``(name, owner)`` is the key, with
the lease's own ``token``, ``acquired_at``, ``expires_at``, ``label`` and the
limit it was granted under (``lim``, NULL for a reader).

The name's row in the lock table is the one place every grant of the name is
serialised, shared or exclusive: while shared leases are live it shows owner
``*shared`` (``dblock.schema.SHARED_OWNER``, never a real owner), the newest
shared grant's token and an expiry no earlier than every live holder's. The
exclusive acquire (a write lock is the exclusive lock), the fair queue's
functions and the release hand-off therefore treat the name as held until the
last reader leaves or runs out, with no change to their text. A write grant
draws its token after that row's lock (G2), so it is larger than every earlier
grant of the name, reader or writer.

PostgreSQL: three functions (acquire, release, extend) that each lock the
name's row first, then read the holders with a fresh snapshot (a PL/pgSQL
statement sees what committed before it): the count of live holders is exact
when the grant is made. SQLite: triggers keep the lock row in step with the
holders table, each statement running in SQLite's single-writer transaction.

Revision ID: dblock_0007
Revises: dblock_0006
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from dblock.migrate import backend, target
from dblock.schema import (
    SHARED_OWNER,
    holders_table_name,
    procs_table_name,
    queue_function_names,
    shared_function_names,
    token_sequence_name,
    waiters_table_name,
)

revision = "dblock_0007"
down_revision = "dblock_0006"
branch_labels = None
depends_on = None

_SIGNATURES = ("text, text, float8, text, int", "text, text, bigint", "text, text, bigint, float8")
_SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"


def upgrade() -> None:
    table, schema = target()
    ts = sa.DateTime(timezone=True).with_variant(sa.Float(), "sqlite").with_variant(sa.Double(), "mariadb", "mysql")
    op.create_table(
        holders_table_name(table),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("owner", sa.String(32), nullable=False),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("acquired_at", ts, nullable=False),
        sa.Column("expires_at", ts, nullable=False),
        sa.Column("label", sa.String(255), nullable=True),
        sa.Column("lim", sa.Integer, nullable=True),
        sa.PrimaryKeyConstraint("name", "owner"),
        schema=schema,
        **backend().table_options,
    )
    # With a fair queue (PostgreSQL), functions that also hand a name to waiting readers and
    # slots; without one (SQLite), triggers that keep the leases row's token and expiry in step.
    caps = backend().caps
    # MariaDB: neither; its statements keep the name's row in step in one transaction each.
    statements = _functions(table, schema) if caps.fair_queue else _triggers(table) if caps.triggers else []
    for sql in statements:
        op.execute(sql)


def downgrade() -> None:
    table, schema = target()
    quote = op.get_context().dialect.identifier_preparer.quote
    if backend().caps.fair_queue:
        prefix = quote(schema) + "." if schema else ""
        for name, args in zip(shared_function_names(table), _SIGNATURES):
            op.execute(f"DROP FUNCTION {prefix}{quote(name)}({args})")
    elif backend().caps.triggers:
        for suffix in ("grant", "release", "extend"):
            op.execute(f"DROP TRIGGER {quote(holders_table_name(table) + '_' + suffix)}")
    op.drop_table(holders_table_name(table), schema=schema)


def _functions(table: str, schema: str | None) -> list[str]:
    quote = op.get_context().dialect.identifier_preparer.quote
    prefix = quote(schema) + "." if schema else ""
    t = prefix + quote(table)
    h = prefix + quote(holders_table_name(table))
    w = prefix + quote(waiters_table_name(table))
    p = prefix + quote(procs_table_name(table))
    seq = (prefix + quote(token_sequence_name(table))).replace("'", "''")
    acquire, release, extend = (prefix + quote(n) for n in shared_function_names(table))
    handoff = prefix + quote(queue_function_names(table)[1])
    s = f"'{SHARED_OWNER}'"
    ttl = "* interval '1 second'"
    # A live writer in the fair queue (as the hand-off judges it, less the listener
    # session check): new shared grants wait behind it, so a writer is not starved.
    writer_waits = f"""EXISTS (SELECT FROM {w} AS v JOIN {p} AS q ON q.id = v.proc
            WHERE v.name = p_name AND q.until > now() AND (v.until IS NULL OR v.until > now()))"""
    return [
        # acquire: returns one row (granted, token, expires_at, wait).
        f"""
CREATE FUNCTION {acquire}(p_name text, p_owner text, p_ttl float8, p_label text, p_limit int)
RETURNS TABLE (granted boolean, token bigint, expires_at timestamptz, wait float8, free int)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    n int;
    m int;
    e timestamptz;
    tok bigint;
BEGIN
    -- A look first, reading only: a miss plain to see (a writer holds) writes nothing.
    SELECT k.owner, k.expires_at INTO l FROM {t} AS k WHERE k.name = p_name;
    IF FOUND AND l.owner IS NOT NULL AND l.owner <> {s} AND l.expires_at > now() THEN
        RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz, extract(epoch FROM l.expires_at - now())::float8, NULL::int;
        RETURN;
    END IF;
    IF NOT FOUND THEN
        -- A free row with token 0 (below every grant); the grant below draws its own token.
        INSERT INTO {t} AS k (name, owner, token, acquired_at, expires_at)
        VALUES (p_name, NULL, 0, now(), NULL) ON CONFLICT (name) DO NOTHING;
    END IF;
    -- Under the row's lock: every statement from here on sees what committed before.
    SELECT k.owner, k.token, k.expires_at, k.waiting INTO l FROM {t} AS k WHERE k.name = p_name FOR UPDATE;
    IF l.owner = {s} THEN
        -- Ours already (a retry after a lost reply, G6): the token is kept, the expiry renewed.
        UPDATE {h} AS x SET expires_at = greatest(x.expires_at, clock_timestamp() + p_ttl {ttl})
        WHERE x.name = p_name AND x.owner = p_owner RETURNING x.token, x.expires_at INTO tok, e;
        IF FOUND THEN
            UPDATE {t} AS k SET expires_at = greatest(k.expires_at, e) WHERE k.name = p_name;
            RETURN QUERY SELECT true, tok, e, NULL::float8, NULL::int;
            RETURN;
        END IF;
    END IF;
    IF l.owner IS NOT NULL AND l.owner <> {s} AND l.expires_at > now() THEN
        RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz, extract(epoch FROM l.expires_at - now())::float8, NULL::int;
        RETURN;
    END IF;
    IF l.waiting > 0 AND {writer_waits} THEN
        RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz, NULL::float8, NULL::int;
        RETURN;
    END IF;
    -- Holders that ran out are forgotten: their extend can no longer revive them.
    DELETE FROM {h} AS x WHERE x.name = p_name AND x.expires_at <= now();
    SELECT count(*), min(x.lim), min(x.expires_at) INTO n, m, e FROM {h} AS x WHERE x.name = p_name;
    -- The smallest limit of the caller and every live holder binds (a reader has none).
    IF n >= coalesce(p_limit, n + 1) OR n >= coalesce(m, n + 1) THEN
        RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz, extract(epoch FROM e - now())::float8, NULL::int;
        RETURN;
    END IF;
    -- nextval() after the row lock: no later grant of the name has a smaller token (G2).
    tok := nextval('{seq}');
    e := clock_timestamp() + p_ttl {ttl};
    INSERT INTO {h} (name, owner, token, acquired_at, expires_at, label, lim)
    VALUES (p_name, p_owner, tok, now(), e, p_label, p_limit);
    UPDATE {t} AS k SET owner = {s}, token = tok, acquired_at = now(), label = NULL,
        expires_at = CASE WHEN k.owner = {s} THEN greatest(k.expires_at, e) ELSE e END
    WHERE k.name = p_name;
    -- The slots this grant left free (NULL: no limit binds), for the waiter next in line.
    RETURN QUERY SELECT true, tok, e, NULL::float8, least(p_limit, m) - n - 1;
END $$""",
        # release: one row (token, notified) when this call ended owner's shared lease; zero rows:
        # it was not held (released before, or a writer took the name over after it ran out).
        f"""
CREATE FUNCTION {release}(p_name text, p_owner text, p_token bigint)
RETURNS TABLE (token bigint, notified boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    e timestamptz;
BEGIN
    SELECT k.owner, k.token, k.waiting INTO l FROM {t} AS k WHERE k.name = p_name FOR UPDATE;
    IF NOT FOUND OR l.owner IS DISTINCT FROM {s} THEN
        RETURN;
    END IF;
    DELETE FROM {h} AS x WHERE x.name = p_name AND x.owner = p_owner AND x.token = p_token;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT max(x.expires_at) INTO e FROM {h} AS x WHERE x.name = p_name AND x.expires_at > now();
    IF e IS NOT NULL THEN
        UPDATE {t} AS k SET expires_at = e WHERE k.name = p_name;
        RETURN QUERY SELECT p_token, false;
    ELSIF l.waiting > 0 THEN
        -- The last reader out hands the name to the first live writer in line (and NOTIFYs it).
        RETURN QUERY SELECT p_token, x.notified FROM {handoff}(p_name, {s}, l.token) AS x;
    ELSE
        UPDATE {t} AS k SET owner = NULL, expires_at = NULL WHERE k.name = p_name;
        RETURN QUERY SELECT p_token, false;
    END IF;
END $$""",
        # extend: one row (expires_at) when owner's shared lease was extended (never shortened);
        # zero rows: released, or forgotten after it ran out and another grant of the name came.
        f"""
CREATE FUNCTION {extend}(p_name text, p_owner text, p_token bigint, p_ttl float8)
RETURNS TABLE (expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    e timestamptz;
BEGIN
    SELECT k.owner INTO l FROM {t} AS k WHERE k.name = p_name FOR UPDATE;
    IF NOT FOUND OR l.owner IS DISTINCT FROM {s} THEN
        RETURN;
    END IF;
    UPDATE {h} AS x SET expires_at = greatest(x.expires_at, clock_timestamp() + p_ttl {ttl})
    WHERE x.name = p_name AND x.owner = p_owner AND x.token = p_token RETURNING x.expires_at INTO e;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE {t} AS k SET expires_at = greatest(k.expires_at, e) WHERE k.name = p_name;
    RETURN QUERY SELECT e;
END $$""",
    ]


def _triggers(table: str) -> list[str]:
    quote = op.get_context().dialect.identifier_preparer.quote
    t, h = quote(table), quote(holders_table_name(table))
    s = f"'{SHARED_OWNER}'"
    return [
        # A shared grant: forget holders that ran out, and mark the name's row shared with the
        # grant's token (SQLite's next token is max(token) + 1 over the lock table, so this keeps
        # it above every shared grant) and an expiry no earlier than every live holder's.
        f"""
CREATE TRIGGER {quote(holders_table_name(table) + '_grant')} AFTER INSERT ON {h} BEGIN
    DELETE FROM {h} WHERE name = NEW.name AND owner <> NEW.owner AND expires_at <= NEW.acquired_at;
    INSERT INTO {t} (name, owner, token, acquired_at, expires_at, label)
    VALUES (NEW.name, {s}, NEW.token, NEW.acquired_at, NEW.expires_at, NULL)
    ON CONFLICT (name) DO UPDATE SET owner = {s}, token = excluded.token, acquired_at = excluded.acquired_at,
        expires_at = CASE WHEN owner = {s} AND expires_at > excluded.expires_at THEN expires_at
                          ELSE excluded.expires_at END,
        label = NULL;
END""",
        # A holder leaves: the name's row keeps the latest live expiry, or is free when none is left.
        f"""
CREATE TRIGGER {quote(holders_table_name(table) + '_release')} AFTER DELETE ON {h} BEGIN
    UPDATE {t} SET
        owner = CASE WHEN (SELECT max(expires_at) FROM {h} WHERE name = OLD.name AND expires_at > {_SQLITE_NOW})
                     IS NULL THEN NULL ELSE owner END,
        expires_at = (SELECT max(expires_at) FROM {h} WHERE name = OLD.name AND expires_at > {_SQLITE_NOW})
    WHERE name = OLD.name AND owner = {s};
END""",
        f"""
CREATE TRIGGER {quote(holders_table_name(table) + '_extend')} AFTER UPDATE OF expires_at ON {h} BEGIN
    UPDATE {t} SET expires_at = max(expires_at, NEW.expires_at) WHERE name = OLD.name AND owner = {s};
END""",
    ]
