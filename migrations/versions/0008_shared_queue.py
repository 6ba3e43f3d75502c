"""Readers and semaphore holders wait in the fair queue, in one line with writers.

0007 let shared waiters poll, and only a writer in line held new readers off.
Now (PostgreSQL; SQLite's waiters poll, as before):

- ``<table>_waiters`` gains ``shared`` (false: a writer, the exclusive lock)
  and ``lim`` (a semaphore waiter's limit; NULL for a reader or a writer).
  Readers, semaphore waiters and writers of a name wait in one line, in
  arrival order, across processes.
- ``<table>_admit`` (internal; its caller holds the name's row lock): walks
  the line from its head and grants each live waiter in turn while it fits:
  a writer when nothing is held; a reader or a semaphore waiter while no
  writer holds and the live holders stay below every limit. Dead waiters are
  dropped on the way; the walk stops at the first live waiter that does not
  fit, so nobody is passed over. Every grant draws its own token under the
  row lock (G2) and is NOTIFYed to its waiter's listener. So a writer's
  release admits every reader queued behind it (up to the next writer) in its
  one statement, and a semaphore holder's release hands its slot on.
- ``<table>_share_enqueue``: a waiting reader's or semaphore holder's
  attempt, the shared twin of ``<table>_enqueue``.
- The hand-off, cancel, enqueue, share_acquire and share_release functions are
  replaced (same signatures) to hand over through ``admit``. A newcomer's
  shared grant (try_acquire, polling) is refused while any live waiter is in
  line, as a writer's was in 0007: first come, first served.

Revision ID: dblock_0008
Revises: dblock_0007
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from dblock.migrate import backend, target
from dblock.schema import (
    SHARED_OWNER,
    holders_table_name,
    procs_table_name,
    queue_function_names,
    shared_function_names,
    shared_queue_function_names,
    token_sequence_name,
    waiters_table_name,
)

revision = "dblock_0008"
down_revision = "dblock_0007"
branch_labels = None
depends_on = None

_SIGNATURES = (
    "text, int, text, boolean",
    "text, text, float8, text, int, text, float8, int, timestamptz, float8, bigint",
)


def upgrade() -> None:
    if not backend().caps.fair_queue:
        return  # no fair queue (SQLite): its waiters poll
    table, schema = target()
    op.add_column(
        waiters_table_name(table),
        sa.Column("shared", sa.Boolean, nullable=False, server_default=sa.false()),
        schema=schema,
    )
    op.add_column(waiters_table_name(table), sa.Column("lim", sa.Integer, nullable=True), schema=schema)
    for sql in _functions(table, schema):
        op.execute(sql)


def downgrade() -> None:
    if not backend().caps.fair_queue:
        return
    table, schema = target()
    quote = op.get_context().dialect.identifier_preparer.quote
    prefix = quote(schema) + "." if schema else ""
    t, w = prefix + quote(table), prefix + quote(waiters_table_name(table))
    # Shared waiters leave the line (they wait again at their next look, by polling).
    op.execute(f"DELETE FROM {w} WHERE shared")
    op.execute(
        f"UPDATE {t} AS k SET waiting = (SELECT count(*) FROM {w} AS x WHERE x.name = k.name) WHERE k.waiting > 0"
    )
    # The functions as 0005, 0006 and 0007 left them, from those migrations' own text.
    script = context.script
    old = script.get_revision("dblock_0005").module._functions(table, schema)
    fixed = script.get_revision("dblock_0006").module
    enqueue = fixed._enqueue()
    for before, after, _ in fixed._EDITS:
        enqueue = enqueue.replace(before, after)
    shared = script.get_revision("dblock_0007").module._functions(table, schema)
    for sql in (enqueue, *old[1:3], *shared[0:2]):
        op.execute(sql.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
    for name, args in zip(shared_queue_function_names(table), _SIGNATURES):
        op.execute(f"DROP FUNCTION {prefix}{quote(name)}({args})")
    op.drop_column(waiters_table_name(table), "lim", schema=schema)
    op.drop_column(waiters_table_name(table), "shared", schema=schema)


def _functions(table: str, schema: str | None) -> list[str]:
    quote = op.get_context().dialect.identifier_preparer.quote
    prefix = quote(schema) + "." if schema else ""
    t = prefix + quote(table)
    h = prefix + quote(holders_table_name(table))
    w = prefix + quote(waiters_table_name(table))
    p = prefix + quote(procs_table_name(table))
    seq = (prefix + quote(token_sequence_name(table))).replace("'", "''")
    enqueue, handoff, cancel = (prefix + quote(n) for n in queue_function_names(table))
    share_acquire, share_release, _ = (prefix + quote(n) for n in shared_function_names(table))
    admit, share_enqueue = (prefix + quote(n) for n in shared_queue_function_names(table))
    # share_enqueue calls share_acquire, and both call admit: PL/pgSQL resolves calls when they run.
    s = f"'{SHARED_OWNER}'"
    ttl = "* interval '1 second'"
    # A waiter row ``v`` is live while its own deadline is ahead, its process's
    # heartbeat is fresh, and, when it names a listener session (pid, start),
    # that session still exists (0005's rule): a waiter whose process died is
    # skipped at once.
    live = f"""(v.until IS NULL OR v.until > now())
            AND EXISTS (SELECT FROM {p} AS q WHERE q.id = v.proc AND q.until > now())
            AND (v.pid IS NULL OR EXISTS (
                SELECT FROM pg_stat_get_activity(v.pid) AS a
                WHERE a.backend_start IS NULL OR a.backend_start = v.start))"""
    # How many waiters are ahead of ``me`` (counted to 100, along the primary key: 0006).
    ahead = f"(SELECT count(*)::int FROM (SELECT FROM {w} AS x WHERE x.name = p_name AND x.seq < me ORDER BY x.seq LIMIT 100) AS a)"
    # The NOTIFY to a waiter's listener: channel "dblock_" + the owner id's first 16
    # characters (its listener), payload "owner token expiry" (0005's).
    notify = "PERFORM pg_notify('dblock_' || left(v.owner, 16), v.owner || ' ' || tok || ' ' || extract(epoch FROM e));"
    queued = f"""SELECT false, NULL::bigint, NULL::timestamptz,
        extract(epoch FROM least(l.expires_at,
            (SELECT min(x.expires_at) FROM {h} AS x WHERE x.name = p_name AND x.expires_at > now())) - now())::float8,
        me, {ahead}, extract(epoch FROM now())::float8"""
    return [
        # admit: the caller holds p_name's row lock. Grants the line's head, and each live
        # waiter after it while it fits (see the module docstring); returns how many it granted.
        # p_dropped: entries the caller already took out of the line (the waiting count is
        # kept for them too); p_self: an owner whose own entry counts as live (the caller's);
        # p_free: the row's current lease has ended (a release): it is cleared if nobody takes it.
        f"""
CREATE FUNCTION {admit}(p_name text, p_dropped int, p_self text, p_free boolean)
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
    tok bigint;
    e timestamptz;
BEGIN
    SELECT k.owner, k.expires_at INTO l FROM {t} AS k WHERE k.name = p_name;
    IF NOT p_free AND l.owner IS NOT NULL AND l.owner <> {s} AND l.expires_at > now() THEN
        n := NULL;  -- a writer holds: nobody in line can be granted
    ELSIF l.owner = {s} AND l.expires_at > now() THEN
        -- Holders that ran out are forgotten: their extend can no longer revive them.
        DELETE FROM {h} AS x WHERE x.name = p_name AND x.expires_at <= now();
        swept := true;
        SELECT count(*), min(x.lim) INTO n, m FROM {h} AS x WHERE x.name = p_name;
    ELSE
        -- No live holder: while any lives the row shows *shared with an expiry no earlier
        -- than its. (A writer's hand-over to a writer reads no holders at all.)
        n := 0;
    END IF;
    IF n IS NOT NULL THEN
        FOR v IN SELECT x.* FROM {w} AS x WHERE x.name = p_name ORDER BY x.seq LOOP
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
            -- The name's row first: a writer whose release this is ends before the grant.
            UPDATE {t} AS k SET owner = {s}, token = tok, acquired_at = now(), label = NULL,
                expires_at = CASE WHEN k.owner = {s} AND k.expires_at > now() THEN greatest(k.expires_at, e) ELSE e END,
                waiting = k.waiting - dropped - 1
            WHERE k.name = p_name;
            -- (A holder row of the same owner cannot be live here: a grant takes the waiter
            -- out of the line. Were one left, the grant notified is the one that stands.)
            INSERT INTO {h} AS x (name, owner, token, acquired_at, expires_at, label, lim)
            VALUES (p_name, v.owner, tok, now(), e, v.label, v.lim)
            ON CONFLICT (name, owner) DO UPDATE SET token = excluded.token, acquired_at = excluded.acquired_at,
                expires_at = excluded.expires_at, label = excluded.label, lim = excluded.lim;
            dropped := 0;
            n := n + 1;
            m := least(m, v.lim);
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
        # share_enqueue: a waiting reader's or semaphore holder's attempt (p_limit NULL: a reader).
        # Returns one row as enqueue does (granted, token, expires_at, wait, seq, ahead, at).
        f"""
CREATE FUNCTION {share_enqueue}(p_name text, p_owner text, p_ttl float8, p_label text, p_limit int, p_proc text,
                                p_lapse float8, p_pid int, p_start timestamptz, p_until float8, p_seq bigint)
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
        SELECT a.granted, a.token, a.expires_at INTO r FROM {share_acquire}(p_name, p_owner, p_ttl, p_label, p_limit) AS a;
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
        INSERT INTO {w} AS x (name, owner, ttl, label, proc, pid, start, until, shared, lim)
        VALUES (p_name, p_owner, p_ttl, p_label, p_proc, p_pid, p_start, now() + p_until {ttl}, true, p_limit)
        RETURNING x.seq INTO me;
        UPDATE {t} AS k SET waiting = k.waiting + 1 WHERE k.name = p_name;
    END IF;
    IF l.owner IS NULL OR l.owner = {s} OR l.expires_at <= now() THEN
        gave := {admit}(p_name, 0, p_owner, false);
        SELECT x.token, x.expires_at INTO tok, e FROM {h} AS x WHERE x.name = p_name AND x.owner = p_owner;
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
        # enqueue: a waiting writer's attempt (0005's contract and signature). Now the
        # line's head goes first through admit, whatever kind it is.
        f"""
CREATE OR REPLACE FUNCTION {enqueue}(p_name text, p_owner text, p_ttl float8, p_label text, p_proc text,
                          p_lapse float8, p_pid int, p_start timestamptz, p_until float8, p_seq bigint)
RETURNS TABLE (granted boolean, token bigint, expires_at timestamptz, wait float8, seq bigint, ahead int,
               at float8)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    me bigint := p_seq;
    gave int := 0;
    queued boolean;
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
            extract(epoch FROM l.expires_at - now())::float8, me, {ahead}, extract(epoch FROM now())::float8;
        RETURN;
    END IF;
    -- Under the row's lock: every statement from here on sees what committed before.
    SELECT k.owner, k.token, k.expires_at, k.waiting INTO l FROM {t} AS k WHERE k.name = p_name FOR UPDATE;
    IF l.owner = p_owner THEN
        -- Handed to us by a release we have not heard of yet, or granted by an
        -- attempt whose reply was lost (G6): the token is kept, the expiry renewed
        -- (never shortened: a cut-off call of ours may land after a later one).
        UPDATE {t} AS k SET expires_at = greatest(k.expires_at, clock_timestamp() + p_ttl {ttl}) WHERE k.name = p_name
        RETURNING k.token, k.expires_at INTO l;
        RETURN QUERY SELECT true, l.token, l.expires_at, NULL::float8, NULL::bigint, 0, NULL::float8;
        RETURN;
    END IF;
    queued := me IS NOT NULL AND EXISTS (SELECT FROM {w} AS x WHERE x.name = p_name AND x.seq = me);
    IF l.owner IS NULL OR l.owner = {s} OR l.expires_at <= now() THEN
        -- Free (or run out unreleased: the first in line may be asleep), or held by
        -- readers: the line goes first, from its head (us, if we are first).
        IF l.waiting > 0 THEN
            gave := {admit}(p_name, 0, p_owner, false);
            SELECT k.owner, k.token, k.expires_at, k.waiting INTO l FROM {t} AS k WHERE k.name = p_name;
        END IF;
        IF l.owner = p_owner THEN
            RETURN QUERY SELECT true, l.token, l.expires_at, NULL::float8, NULL::bigint, 0, NULL::float8;
            RETURN;
        END IF;
        IF NOT queued AND (l.owner IS NULL OR l.expires_at <= now()) AND l.waiting = 0 THEN
            -- Free and nobody waits: ours. nextval() after the row lock (G2).
            UPDATE {t} AS k SET owner = p_owner, token = nextval('{seq}'), acquired_at = now(),
                expires_at = clock_timestamp() + p_ttl {ttl}, label = p_label
            WHERE k.name = p_name RETURNING k.token, k.expires_at INTO l;
            RETURN QUERY SELECT true, l.token, l.expires_at, NULL::float8, NULL::bigint, 0, NULL::float8;
            RETURN;
        END IF;
    END IF;
    -- Held, or a live waiter is ahead: join the line (or keep our place in it).
    IF NOT queued THEN
        INSERT INTO {w} AS x (name, owner, ttl, label, proc, pid, start, until)
        VALUES (p_name, p_owner, p_ttl, p_label, p_proc, p_pid, p_start, now() + p_until {ttl})
        RETURNING x.seq INTO me;
        UPDATE {t} AS k SET waiting = k.waiting + 1 WHERE k.name = p_name;
    END IF;
    INSERT INTO {p} AS q (id, until) VALUES (p_proc, now() + p_lapse {ttl})
    ON CONFLICT (id) DO UPDATE SET until = excluded.until;
    IF gave = 0 THEN
        -- Joining needs no disk flush: were it lost in a crash the waiter would join
        -- again at its next look. A call that handed the lease on commits durably (0006).
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    RETURN QUERY SELECT false, NULL::bigint, NULL::timestamptz,
        extract(epoch FROM l.expires_at - now())::float8, me, {ahead}, extract(epoch FROM now())::float8;
END $$""",
        # handoff: a writer's release when waiters are queued (0005's contract): one row
        # (token, notified) when owner's lease with that token ended (token: the grant it
        # handed over, if any); zero rows: not ours (G3).
        f"""
CREATE OR REPLACE FUNCTION {handoff}(p_name text, p_owner text, p_token bigint)
RETURNS TABLE (token bigint, notified boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    gave int;
BEGIN
    SELECT k.owner, k.token INTO l FROM {t} AS k WHERE k.name = p_name FOR UPDATE;
    IF NOT FOUND OR l.owner IS DISTINCT FROM p_owner OR l.token <> p_token THEN
        RETURN;
    END IF;
    gave := {admit}(p_name, 0, NULL, true);
    IF gave > 0 THEN
        -- As 0005's: the token of the grant it made (of the newest, when it admitted readers).
        RETURN QUERY SELECT k.token, true FROM {t} AS k WHERE k.name = p_name;
    ELSE
        RETURN QUERY SELECT p_token, false;
    END IF;
END $$""",
        # cancel: a waiter leaves, writer or not (0005's contract): its seq, or every entry of
        # its owner when seq is NULL. One row (granted, token, expires_at): granted means a
        # release handed it the lease (exclusive or shared) first. Zero rows: no such name.
        f"""
CREATE OR REPLACE FUNCTION {cancel}(p_name text, p_owner text, p_seq bigint)
RETURNS TABLE (granted boolean, token bigint, expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    dropped int;
    gave int := 0;
    tok bigint;
    e timestamptz;
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
    IF l.owner IS DISTINCT FROM p_owner AND (l.owner IS NULL OR l.owner = {s} OR l.expires_at <= now()) THEN
        -- The line may move: the lease ran out unreleased (the first waiter may be
        -- asleep), or the waiter that left held up those behind it.
        gave := {admit}(p_name, dropped, NULL, false);
    ELSIF dropped > 0 THEN
        UPDATE {t} AS k SET waiting = k.waiting - dropped WHERE k.name = p_name;
    END IF;
    IF gave = 0 THEN
        PERFORM set_config('synchronous_commit', 'off', true);  -- only the queue changed (see enqueue)
    END IF;
    IF l.owner = {s} THEN
        SELECT x.token, x.expires_at INTO tok, e FROM {h} AS x WHERE x.name = p_name AND x.owner = p_owner;
        IF FOUND THEN
            RETURN QUERY SELECT true, tok, e;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT coalesce(l.owner = p_owner, false), l.token, l.expires_at;
END $$""",
        *_shared(t, h, w, seq, share_acquire, share_release, admit, s, ttl),
    ]


def _shared(t: str, h: str, w: str, seq: str, acquire: str, release: str, admit: str, s: str, ttl: str) -> list[str]:
    """0007's share_acquire and share_release, handing over through admit."""
    return [
        # share_acquire: a newcomer's attempt (0007's contract and signature).
        f"""
CREATE OR REPLACE FUNCTION {acquire}(p_name text, p_owner text, p_ttl float8, p_label text, p_limit int)
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
        # share_release: one row (token, notified) when this call ended owner's shared lease;
        # zero rows: it was not held (released before, or a writer took the name over after it
        # ran out). A slot it frees, or the name when it was the last holder, goes to the line.
        f"""
CREATE OR REPLACE FUNCTION {release}(p_name text, p_owner text, p_token bigint)
RETURNS TABLE (token bigint, notified boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l record;
    e timestamptz;
    gave int := 0;
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
        IF l.waiting > 0 THEN
            gave := {admit}(p_name, 0, NULL, false);  -- a semaphore slot came free
        END IF;
    ELSIF l.waiting > 0 THEN
        gave := {admit}(p_name, 0, NULL, true);  -- the last holder out: the line's head takes the name
    ELSE
        UPDATE {t} AS k SET owner = NULL, expires_at = NULL WHERE k.name = p_name;
    END IF;
    RETURN QUERY SELECT p_token, gave > 0;
END $$""",
    ]
