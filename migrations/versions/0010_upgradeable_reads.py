"""The upgradeable read lock: a reader that may become the writer without letting go.

- ``<table>_holders`` gains ``upgradeable`` (every backend): 0 for a reader or
  a semaphore holder, 1 for the name's upgradeable reader (at most one lives
  at a time, beside any number of readers), 2 for that reader while it asks to
  upgrade: no shared lease of the name is granted while it lives, so the
  readers it waits for drain and no new one joins.
- ``<table>_upgrade`` turns the upgradeable reader's lease into the name's
  exclusive (write) lease, with a token drawn after the row lock (G2), once it
  is the only live holder; until then it marks the holder 2 and answers how
  long the first other holder's lease runs. ``<table>_downgrade`` turns that
  write lease back into the upgradeable reader's lease (a new token), or,
  for a reader still asking, withdraws the ask; either way the line moves.
- PostgreSQL: ``<table>_waiters`` gains ``upgradeable`` (an upgradeable
  reader waiting in line); share_acquire and share_enqueue gain a signature
  that ends in ``p_upgradeable`` (the earlier ones stay, as calls of these
  for readers, so code of an earlier dblock keeps working); and the walk
  (admit) grants an upgradeable reader only while no other lives, stopping
  at it otherwise (first come, first served), grants nobody while one asks
  to upgrade, and gives the first of a new set of shared holders its own
  expiry (0008's kept a released holder's later one on the name's row, so a
  writer's try waited for a lease that had ended: seen in a trace of a real
  run, ``tests/test_model_trace.py``); and share_enqueue no longer answers a
  holder row of the caller's that ran out, unswept, as a grant (a reader
  beside a writer: found by ``model/queue.pml``). The three functions are 0008's and
  0009's, given whole here. SQLite (one trigger more) and MariaDB: the new
  column; their statements do the rest.

Revision ID: dblock_0010
Revises: dblock_0009
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from dblock.migrate import backend, target
from dblock.schema import (
    SHARED_OWNER,
    holders_table_name,
    procs_table_name,
    shared_function_names,
    shared_queue_function_names,
    token_sequence_name,
    upgrade_function_names,
    waiters_table_name,
)

revision = "dblock_0010"
down_revision = "dblock_0009"
branch_labels = None
depends_on = None

_SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"  # SQLite's clock as Unix seconds, as the statements read it

# The signatures 0008 gave share_acquire and share_enqueue. This migration adds ones that end
# in p_upgradeable boolean, and keeps these as calls of those (for code of an earlier dblock).
_ACQUIRE_ARGS = "text, text, float8, text, int"
_ENQUEUE_ARGS = "text, text, float8, text, int, text, float8, int, timestamptz, float8, bigint"


def upgrade() -> None:
    table, schema = target()
    op.add_column(
        holders_table_name(table),
        sa.Column("upgradeable", sa.SmallInteger, nullable=False, server_default="0"),
        schema=schema,
    )
    if backend().caps.triggers:
        # SQLite: an upgrade marks the upgradeable reader's row 3 with the write lease's expiry
        # (backends/sqlite.py); this makes the name's row that write lease, with the next token
        # (max + 1 under SQLite's one writer), and the name's holders, all ended or the upgrader, go.
        quote = op.get_context().dialect.identifier_preparer.quote
        t, h = quote(table), quote(holders_table_name(table))
        op.execute(f"""
CREATE TRIGGER {quote(holders_table_name(table) + '_upgrade')} AFTER UPDATE OF upgradeable ON {h}
WHEN NEW.upgradeable = 3 BEGIN
    UPDATE {t} SET owner = NEW.owner, token = (SELECT max(token) + 1 FROM {t}),
        acquired_at = {_SQLITE_NOW}, expires_at = NEW.expires_at, label = NEW.label
    WHERE name = NEW.name;
    DELETE FROM {h} WHERE name = NEW.name;
END""")
    if not backend().caps.fair_queue:
        return  # SQLite, MariaDB: their statements read the column
    op.add_column(
        waiters_table_name(table),
        sa.Column("upgradeable", sa.Boolean, nullable=False, server_default=sa.false()),
        schema=schema,
    )
    for sql in _functions(table, schema):
        op.execute(sql)


def downgrade() -> None:
    table, schema = target()
    if backend().caps.fair_queue:
        quote = op.get_context().dialect.identifier_preparer.quote
        prefix = quote(schema) + "." if schema else ""
        for name in upgrade_function_names(table):
            op.execute(f"DROP FUNCTION {prefix}{quote(name)}(text, text, bigint, float8)")
        enqueue, acquire = quote(shared_queue_function_names(table)[1]), quote(shared_function_names(table)[0])
        for args in (f"{_ENQUEUE_ARGS}, boolean", _ENQUEUE_ARGS):
            op.execute(f"DROP FUNCTION {prefix}{enqueue}({args})")
        for args in (f"{_ACQUIRE_ARGS}, boolean", _ACQUIRE_ARGS):
            op.execute(f"DROP FUNCTION {prefix}{acquire}({args})")
        # The functions as 0008 and 0009 left them, from those migrations' whole text.
        script = context.script
        made = script.get_revision("dblock_0008").module._functions(table, schema)
        op.execute(made[5])  # share_acquire
        op.execute(made[1])  # share_enqueue
        script.get_revision("dblock_0009").module.upgrade()  # 0009's admit
        op.drop_column(waiters_table_name(table), "upgradeable", schema=schema)
    elif backend().caps.triggers:
        quote = op.get_context().dialect.identifier_preparer.quote
        op.execute(f"DROP TRIGGER {quote(holders_table_name(table) + '_upgrade')}")
    op.drop_column(holders_table_name(table), "upgradeable", schema=schema)


def _functions(table: str, schema: str | None) -> list[str]:
    quote = op.get_context().dialect.identifier_preparer.quote
    prefix = quote(schema) + "." if schema else ""
    t = prefix + quote(table)
    h = prefix + quote(holders_table_name(table))
    w = prefix + quote(waiters_table_name(table))
    p = prefix + quote(procs_table_name(table))
    seq = (prefix + quote(token_sequence_name(table))).replace("'", "''")
    share_acquire = prefix + quote(shared_function_names(table)[0])
    admit, share_enqueue = (prefix + quote(n) for n in shared_queue_function_names(table))
    upgrade_fn, downgrade_fn = (prefix + quote(n) for n in upgrade_function_names(table))
    s = f"'{SHARED_OWNER}'"
    ttl = "* interval '1 second'"
    # A waiter row ``v`` is live while its own deadline is ahead, its process's heartbeat is
    # fresh, and, when it names a listener session (pid, start), that session still exists.
    live = f"""(v.until IS NULL OR v.until > now())
            AND EXISTS (SELECT FROM {p} AS q WHERE q.id = v.proc AND q.until > now())
            AND (v.pid IS NULL OR EXISTS (
                SELECT FROM pg_stat_get_activity(v.pid) AS a
                WHERE a.backend_start IS NULL OR a.backend_start = v.start))"""
    # How many waiters are ahead of ``me`` (counted to 100, along the primary key).
    ahead = f"(SELECT count(*)::int FROM (SELECT FROM {w} AS x WHERE x.name = p_name AND x.seq < me ORDER BY x.seq LIMIT 100) AS a)"
    # The NOTIFY to a waiter's listener: channel "dblock_" + the owner id's first 16
    # characters (its listener), payload "owner token expiry".
    notify = "PERFORM pg_notify('dblock_' || left(v.owner, 16), v.owner || ' ' || tok || ' ' || extract(epoch FROM e));"
    queued = f"""SELECT false, NULL::bigint, NULL::timestamptz,
        extract(epoch FROM least(l.expires_at,
            (SELECT min(x.expires_at) FROM {h} AS x WHERE x.name = p_name AND x.expires_at > now())) - now())::float8,
        me, {ahead}, extract(epoch FROM now())::float8"""
    return [
        # admit: 0009's walk, which also grants an upgradeable reader while no other lives (and
        # stops at it otherwise), grants nobody while one asks to upgrade, and no longer keeps a
        # released holder's expiry on the name's row when it admits the first of a new set.
        f"""
CREATE OR REPLACE FUNCTION {admit}(p_name text, p_dropped int, p_self text, p_free boolean)
RETURNS int
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    v record;
    dropped int := p_dropped;
    given int := 0;
    n int;  -- live shared holders
    m int;  -- the smallest limit among them (NULL: none binds)
    swept boolean := false;  -- holders that ran out are forgotten
    u int := 0;  -- the live upgradeable reader: 0 none, 1 one, 2 one asking to upgrade
    tok bigint;
    e timestamptz;
    last bigint := 0;  -- the walk's place in line (seq counts from 1)
BEGIN
    SELECT k.owner, k.expires_at INTO l FROM {t} AS k WHERE k.name = p_name;
    IF NOT p_free AND l.owner IS NOT NULL AND l.owner <> {s} AND l.expires_at > now() THEN
        n := NULL;  -- a writer holds: nobody in line can be granted
    ELSIF l.owner = {s} AND l.expires_at > now() THEN
        -- Holders that ran out are forgotten: their extend can no longer revive them.
        DELETE FROM {h} AS x WHERE x.name = p_name AND x.expires_at <= now();
        swept := true;
        SELECT count(*), min(x.lim), coalesce(max(x.upgradeable), 0) INTO n, m, u FROM {h} AS x WHERE x.name = p_name;
        IF u = 2 THEN
            n := NULL;  -- the upgradeable reader asks to upgrade: it goes before everyone in line
        END IF;
    ELSE
        -- No live holder: while any lives the row shows *shared with an expiry no earlier
        -- than its. (A writer's hand-over to a writer reads no holders at all.)
        n := 0;
    END IF;
    IF n IS NOT NULL THEN
        LOOP
            SELECT x.* INTO v FROM {w} AS x WHERE x.name = p_name AND x.seq > last ORDER BY x.seq LIMIT 1;
            EXIT WHEN NOT FOUND;
            last := v.seq;
            IF NOT (coalesce(v.owner = p_self, false) OR ({live})) THEN
                DELETE FROM {w} AS x WHERE x.name = p_name AND x.seq = v.seq;
                dropped := dropped + 1;
                CONTINUE;
            END IF;
            IF NOT v.shared THEN
                -- A writer: granted when nothing is held; either way the walk ends here.
                IF n = 0 THEN
                    DELETE FROM {w} AS x WHERE x.name = p_name AND x.seq = v.seq;
                    -- nextval() after the row lock: no later grant has a smaller token (G2).
                    -- clock_timestamp(), not now(): the expiry counts from after the row lock,
                    -- so after the waiter's last look was sent, from which it trusts (G5).
                    UPDATE {t} AS k SET owner = v.owner, token = nextval('{seq}'), acquired_at = now(),
                        expires_at = clock_timestamp() + v.ttl {ttl}, label = v.label,
                        waiting = k.waiting - dropped - 1
                    WHERE k.name = p_name RETURNING k.token, k.expires_at INTO tok, e;
                    dropped := 0;
                    given := given + 1;
                    IF NOT coalesce(v.owner = p_self, false) THEN
                        {notify}
                    END IF;
                END IF;
                EXIT;
            END IF;
            IF v.upgradeable AND u > 0 THEN
                EXIT;  -- one upgradeable reader at a time: this one waits, and those behind it
            END IF;
            -- A reader, or a semaphore waiter: the smallest limit of it and every live holder binds.
            IF n >= coalesce(v.lim, n + 1) OR n >= coalesce(m, n + 1) THEN
                EXIT;
            END IF;
            DELETE FROM {w} AS x WHERE x.name = p_name AND x.seq = v.seq;
            IF NOT swept THEN
                DELETE FROM {h} AS x WHERE x.name = p_name AND x.expires_at <= now();
                swept := true;
            END IF;
            tok := nextval('{seq}');
            e := clock_timestamp() + v.ttl {ttl};
            -- The name's row first: a writer whose release this is ends before the grant. Its
            -- expiry covers the live holders (n of them): with none, a released holder's is stale.
            UPDATE {t} AS k SET owner = {s}, token = tok, acquired_at = now(), label = NULL,
                expires_at = CASE WHEN n > 0 AND k.owner = {s} AND k.expires_at > now() THEN greatest(k.expires_at, e)
                                  ELSE e END,
                waiting = k.waiting - dropped - 1
            WHERE k.name = p_name;
            -- (A holder row of the same owner cannot be live here: a grant takes the waiter
            -- out of the line. Were one left, the grant notified is the one that stands.)
            INSERT INTO {h} AS x (name, owner, token, acquired_at, expires_at, label, lim, upgradeable)
            VALUES (p_name, v.owner, tok, now(), e, v.label, v.lim, CASE WHEN v.upgradeable THEN 1 ELSE 0 END)
            ON CONFLICT (name, owner) DO UPDATE SET token = excluded.token, acquired_at = excluded.acquired_at,
                expires_at = excluded.expires_at, label = excluded.label, lim = excluded.lim,
                upgradeable = excluded.upgradeable;
            dropped := 0;
            n := n + 1;
            m := least(m, v.lim);
            u := greatest(u, CASE WHEN v.upgradeable THEN 1 ELSE 0 END);
            given := given + 1;
            IF NOT coalesce(v.owner = p_self, false) THEN
                {notify}
            END IF;
        END LOOP;
    END IF;
    IF given > 0 THEN
        -- This transaction granted: it must commit durably (see share_enqueue).
        PERFORM set_config('dblock.granted', 'on', true);
    END IF;
    IF p_free AND given = 0 THEN
        UPDATE {t} AS k SET owner = NULL, expires_at = NULL, waiting = k.waiting - dropped WHERE k.name = p_name;
    ELSIF dropped <> 0 THEN
        UPDATE {t} AS k SET waiting = k.waiting - dropped WHERE k.name = p_name;
    END IF;
    RETURN given;
END $$""",
        # share_acquire: a newcomer's attempt (0008's, with p_upgradeable: one upgradeable
        # reader at a time, and no shared grant while it asks to upgrade).
        f"""
CREATE FUNCTION {share_acquire}(p_name text, p_owner text, p_ttl float8, p_label text, p_limit int,
    p_upgradeable boolean)
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
    IF l.waiting > 0 THEN
        -- Others wait: the line goes first (first come, first served). Whoever of it fits
        -- is granted now; while anyone is left in line, a newcomer waits too.
        PERFORM {admit}(p_name, 0, NULL, false);
        IF EXISTS (SELECT FROM {w} AS x WHERE x.name = p_name) THEN
            RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz, NULL::float8, NULL::int;
            RETURN;
        END IF;
        SELECT k.owner, k.token, k.expires_at, k.waiting INTO l FROM {t} AS k WHERE k.name = p_name;
        IF l.owner IS NOT NULL AND l.owner <> {s} AND l.expires_at > now() THEN
            RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz, extract(epoch FROM l.expires_at - now())::float8, NULL::int;
            RETURN;
        END IF;
    END IF;
    -- Holders that ran out are forgotten: their extend can no longer revive them.
    DELETE FROM {h} AS x WHERE x.name = p_name AND x.expires_at <= now();
    SELECT count(*), min(x.lim), min(x.expires_at) INTO n, m, e FROM {h} AS x WHERE x.name = p_name;
    -- One upgradeable reader at a time, and nobody joins beside one that asks to upgrade.
    IF EXISTS (SELECT FROM {h} AS x WHERE x.name = p_name
               AND x.upgradeable >= CASE WHEN p_upgradeable THEN 1 ELSE 2 END) THEN
        RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz, extract(epoch FROM e - now())::float8, NULL::int;
        RETURN;
    END IF;
    -- The smallest limit of the caller and every live holder binds (a reader has none).
    IF n >= coalesce(p_limit, n + 1) OR n >= coalesce(m, n + 1) THEN
        RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz, extract(epoch FROM e - now())::float8, NULL::int;
        RETURN;
    END IF;
    -- nextval() after the row lock: no later grant of the name has a smaller token (G2).
    tok := nextval('{seq}');
    e := clock_timestamp() + p_ttl {ttl};
    INSERT INTO {h} (name, owner, token, acquired_at, expires_at, label, lim, upgradeable)
    VALUES (p_name, p_owner, tok, now(), e, p_label, p_limit, CASE WHEN p_upgradeable THEN 1 ELSE 0 END);
    UPDATE {t} AS k SET owner = {s}, token = tok, acquired_at = now(), label = NULL,
        expires_at = CASE WHEN k.owner = {s} THEN greatest(k.expires_at, e) ELSE e END
    WHERE k.name = p_name;
    -- The slots this grant left free (NULL: no limit binds), for the waiter next in line.
    RETURN QUERY SELECT true, tok, e, NULL::float8, least(p_limit, m) - n - 1;
END $$""",
        # share_enqueue: a waiting shared attempt (0008's, with p_upgradeable).
        f"""
CREATE FUNCTION {share_enqueue}(p_name text, p_owner text, p_ttl float8, p_label text, p_limit int, p_proc text,
                                p_lapse float8, p_pid int, p_start timestamptz, p_until float8, p_seq bigint,
                                p_upgradeable boolean)
RETURNS TABLE (granted boolean, token bigint, expires_at timestamptz, wait float8, seq bigint, ahead int,
               at float8)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    r record;
    me bigint := p_seq;
    queued boolean;
    gave int := 0;
    tok bigint;
    e timestamptz;
BEGIN
    queued := me IS NOT NULL AND EXISTS (SELECT FROM {w} AS x WHERE x.name = p_name AND x.seq = me);
    IF NOT queued THEN
        -- A newcomer first tries as try_acquire does: granted if no writer holds, nobody
        -- waits and it fits. That call may grant others of the line (then dblock.granted is on).
        SELECT a.granted, a.token, a.expires_at INTO r FROM {share_acquire}(p_name, p_owner, p_ttl, p_label, p_limit, p_upgradeable) AS a;
        IF r.granted THEN
            RETURN QUERY SELECT true, r.token, r.expires_at, NULL::float8, NULL::bigint, 0, NULL::float8;
            RETURN;
        END IF;
    ELSE
        -- Without a lock first: a look while a writer holds and we are in line writes nothing.
        SELECT k.owner, k.expires_at INTO l FROM {t} AS k WHERE k.name = p_name;
        IF l.owner <> {s} AND l.expires_at > now() THEN
            RETURN QUERY {queued};
            RETURN;
        END IF;
    END IF;
    -- Under the row's lock: every statement from here on sees what committed before.
    SELECT k.owner, k.token, k.expires_at INTO l FROM {t} AS k WHERE k.name = p_name FOR UPDATE;
    IF l.owner = {s} THEN
        -- Handed to us by a release we have not heard of yet, or granted by an attempt
        -- whose reply was lost (G6): the token is kept, the expiry renewed (never shortened).
        UPDATE {h} AS x SET expires_at = greatest(x.expires_at, clock_timestamp() + p_ttl {ttl})
        WHERE x.name = p_name AND x.owner = p_owner RETURNING x.token, x.expires_at INTO tok, e;
        IF FOUND THEN
            UPDATE {t} AS k SET expires_at = greatest(k.expires_at, e) WHERE k.name = p_name;
            RETURN QUERY SELECT true, tok, e, NULL::float8, NULL::bigint, 0, NULL::float8;
            RETURN;
        END IF;
    END IF;
    INSERT INTO {p} AS q (id, until) VALUES (p_proc, now() + p_lapse {ttl})
    ON CONFLICT (id) DO UPDATE SET until = excluded.until;
    -- Join the line at its end (or keep our place in it); the walk below may grant us at once.
    IF NOT queued THEN
        INSERT INTO {w} AS x (name, owner, ttl, label, proc, pid, start, until, shared, lim, upgradeable)
        VALUES (p_name, p_owner, p_ttl, p_label, p_proc, p_pid, p_start, now() + p_until {ttl}, true, p_limit, p_upgradeable)
        RETURNING x.seq INTO me;
        UPDATE {t} AS k SET waiting = k.waiting + 1 WHERE k.name = p_name;
    END IF;
    IF l.owner IS NULL OR l.owner = {s} OR l.expires_at <= now() THEN
        gave := {admit}(p_name, 0, p_owner, false);
        -- Granted if the walk admitted us: a live holder row of ours. (One that ran out long ago,
        -- unswept, is no grant: found by model/queue.pml, where 0008's text answered it as one.)
        SELECT x.token, x.expires_at INTO tok, e FROM {h} AS x
        WHERE x.name = p_name AND x.owner = p_owner AND x.expires_at > now();
        IF FOUND THEN
            RETURN QUERY SELECT true, tok, e, NULL::float8, NULL::bigint, 0, NULL::float8;
            RETURN;
        END IF;
        SELECT k.owner, k.token, k.expires_at INTO l FROM {t} AS k WHERE k.name = p_name;
    END IF;
    IF gave = 0 AND current_setting('dblock.granted', true) IS DISTINCT FROM 'on' THEN
        -- Joining needs no disk flush (see enqueue); a call that granted anyone commits durably.
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    RETURN QUERY {queued};
END $$""",
        # upgrade: see dblock/backends/postgresql.py for the contract.
        f"""
CREATE FUNCTION {upgrade_fn}(p_name text, p_owner text, p_token bigint, p_ttl float8)
RETURNS TABLE (granted boolean, token bigint, expires_at timestamptz, wait float8)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    me record;
    n int;
    e timestamptz;
    tok bigint;
BEGIN
    SELECT k.owner INTO l FROM {t} AS k WHERE k.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF l.owner = p_owner THEN
        -- Upgraded by an attempt whose reply was lost (G6): the write lease stands, its
        -- expiry renewed, never shortened.
        UPDATE {t} AS k SET expires_at = greatest(k.expires_at, clock_timestamp() + p_ttl {ttl})
        WHERE k.name = p_name RETURNING k.token, k.expires_at INTO tok, e;
        RETURN QUERY SELECT true, tok, e, NULL::float8;
        RETURN;
    END IF;
    IF l.owner IS DISTINCT FROM {s} THEN
        RETURN;  -- the read lease ended, and a writer or nobody holds the name now
    END IF;
    -- Holders that ran out are forgotten: their extend can no longer revive them.
    DELETE FROM {h} AS x WHERE x.name = p_name AND x.expires_at <= now();
    SELECT x.label INTO me FROM {h} AS x
    WHERE x.name = p_name AND x.owner = p_owner AND x.token = p_token AND x.upgradeable > 0;
    IF NOT FOUND THEN
        RETURN;  -- released, ran out, or not the upgradeable reader's lease
    END IF;
    SELECT count(*), min(x.expires_at) INTO n, e FROM {h} AS x WHERE x.name = p_name AND x.owner <> p_owner;
    IF n > 0 THEN
        -- Others still read: nobody joins them from now on, and the caller looks again.
        UPDATE {h} AS x SET upgradeable = 2 WHERE x.name = p_name AND x.owner = p_owner AND x.upgradeable = 1;
        RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz, extract(epoch FROM e - now())::float8;
        RETURN;
    END IF;
    -- The only holder: its read lease becomes the write lease. nextval() after the row lock (G2);
    -- the expiry counts from after the row lock, so after the caller sent this (G5).
    DELETE FROM {h} AS x WHERE x.name = p_name AND x.owner = p_owner;
    UPDATE {t} AS k SET owner = p_owner, token = nextval('{seq}'), acquired_at = now(),
        expires_at = clock_timestamp() + p_ttl {ttl}, label = me.label
    WHERE k.name = p_name RETURNING k.token, k.expires_at INTO tok, e;
    RETURN QUERY SELECT true, tok, e, NULL::float8;
END $$""",
        # downgrade: see dblock/backends/postgresql.py for the contract.
        f"""
CREATE FUNCTION {downgrade_fn}(p_name text, p_owner text, p_token bigint, p_ttl float8)
RETURNS TABLE (token bigint, expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    e timestamptz;
    tok bigint;
BEGIN
    SELECT k.owner, k.token, k.label, k.waiting INTO l FROM {t} AS k WHERE k.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF l.owner = p_owner THEN
        -- The write lease (not taken over, even if its ttl ran out; whatever its token, which
        -- an upgrade whose reply was lost never told the caller) becomes the upgradeable
        -- reader's lease: a new token, after the row lock (G2).
        tok := nextval('{seq}');
        e := clock_timestamp() + p_ttl {ttl};
        UPDATE {t} AS k SET owner = {s}, token = tok, acquired_at = now(), expires_at = e, label = NULL
        WHERE k.name = p_name;
        INSERT INTO {h} AS x (name, owner, token, acquired_at, expires_at, label, lim, upgradeable)
        VALUES (p_name, p_owner, tok, now(), e, l.label, NULL, 1)
        ON CONFLICT (name, owner) DO UPDATE SET token = excluded.token, acquired_at = excluded.acquired_at,
            expires_at = excluded.expires_at, label = excluded.label, lim = NULL, upgradeable = 1;
    ELSIF l.owner = {s} THEN
        -- An ask to upgrade withdrawn, or a downgrade whose reply was lost (G6): the
        -- upgradeable reader's lease as it stands, readers welcome again.
        UPDATE {h} AS x SET upgradeable = 1
        WHERE x.name = p_name AND x.owner = p_owner AND x.upgradeable > 0 AND x.expires_at > now()
        RETURNING x.token, x.expires_at INTO tok, e;
        IF NOT FOUND THEN
            RETURN;
        END IF;
    ELSE
        RETURN;  -- released, or taken over
    END IF;
    IF l.waiting > 0 THEN
        PERFORM {admit}(p_name, 0, NULL, false);  -- readers in line may join now
    END IF;
    RETURN QUERY SELECT tok, e;
END $$""",
        # The earlier signatures, for code of an earlier dblock still running while this
        # migration runs: a reader's or semaphore holder's attempt, never the upgradeable one.
        f"""
CREATE OR REPLACE FUNCTION {share_acquire}(p_name text, p_owner text, p_ttl float8, p_label text, p_limit int)
RETURNS TABLE (granted boolean, token bigint, expires_at timestamptz, wait float8, free int)
LANGUAGE sql AS $$
SELECT * FROM {share_acquire}(p_name, p_owner, p_ttl, p_label, p_limit, false)
$$""",
        f"""
CREATE OR REPLACE FUNCTION {share_enqueue}(p_name text, p_owner text, p_ttl float8, p_label text, p_limit int,
                                           p_proc text, p_lapse float8, p_pid int, p_start timestamptz,
                                           p_until float8, p_seq bigint)
RETURNS TABLE (granted boolean, token bigint, expires_at timestamptz, wait float8, seq bigint, ahead int,
               at float8)
LANGUAGE sql AS $$
SELECT * FROM {share_enqueue}(p_name, p_owner, p_ttl, p_label, p_limit, p_proc, p_lapse, p_pid, p_start, p_until,
                              p_seq, false)
$$""",
    ]
