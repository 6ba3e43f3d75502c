"""Hand-offs in fewer steps, and a waiter's listener found alive in O(1) (PostgreSQL).

- **The common hand-over in one statement.** A writer's release with a line
  (``<table>_handoff``) ran the whole walk (``<table>_admit``): a look at the
  name's row, then for the head of the line one statement each to read it,
  check it, take it out and grant it. When the head is a live writer (what a
  line of writers always has) the walk's first step grants it and ends, so
  handoff now does that step itself, in one statement under the row lock it
  already holds: take the head out of the line if it is a live writer, and
  grant it the name with a token drawn after the row lock and an expiry from
  ``clock_timestamp()``, as the walk would. Any other head (a reader, an
  upgradeable reader, a semaphore waiter, a dead waiter) goes to the walk as
  before. ``benchmarks/floor.py``: the release that hands over takes about
  a third less server time (BENCHMARKS.md).
- **Liveness in O(1).** A waiter that names its listener session was checked
  with ``pg_stat_get_activity(pid)``, which copies the status of every
  session of the server first, so each hand-off grew with the server's
  sessions. A listener session now holds the advisory lock
  ``(LISTENER_LOCK, its pid)`` while it lives (taken where dblock's code reads
  its pid), and the check first tries that lock shared: failing, the session
  is alive, in one lookup. Where it succeeds (the session is gone, or it is a
  listener of a dblock from before this migration, which holds no such lock)
  the old check decides, so waiters of older processes keep their places.
  The shared lock taken so lasts until the hand-off commits.

admit and handoff are 0010's and 0008's, given whole here with these changes.

Revision ID: dblock_0011
Revises: dblock_0010
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import context, op

from dblock.migrate import backend, target
from dblock.schema import (
    LISTENER_LOCK,
    SHARED_OWNER,
    holders_table_name,
    procs_table_name,
    queue_function_names,
    shared_queue_function_names,
    token_sequence_name,
    waiters_table_name,
)

revision = "dblock_0011"
down_revision = "dblock_0010"
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
        script = context.script
        op.execute(script.get_revision("dblock_0010").module._functions(table, schema)[0])  # admit
        handoff = script.get_revision("dblock_0008").module._functions(table, schema)[3]
        op.execute(handoff)


def live(x: str, p: str) -> str:
    """Whether the waiter row ``x`` is live: its own deadline is ahead, its process's heartbeat
    (in ``p``) is fresh, and, when it names a listener session (pid, start), that session
    exists: it holds its advisory lock, or (a listener of a dblock before 0011, or a session
    gone) the server's list of sessions has it."""
    return f"""({x}.until IS NULL OR {x}.until > now())
            AND EXISTS (SELECT FROM {p} AS q WHERE q.id = {x}.proc AND q.until > now())
            AND ({x}.pid IS NULL OR NOT pg_try_advisory_xact_lock_shared({LISTENER_LOCK}, {x}.pid) OR EXISTS (
                SELECT FROM pg_stat_get_activity({x}.pid) AS a
                WHERE a.backend_start IS NULL OR a.backend_start = {x}.start))"""


def _functions(table: str, schema: str | None) -> list[str]:
    quote = op.get_context().dialect.identifier_preparer.quote
    prefix = quote(schema) + "." if schema else ""
    t = prefix + quote(table)
    h = prefix + quote(holders_table_name(table))
    w = prefix + quote(waiters_table_name(table))
    p = prefix + quote(procs_table_name(table))
    seq = (prefix + quote(token_sequence_name(table))).replace("'", "''")
    admit = prefix + quote(shared_queue_function_names(table)[0])
    handoff = prefix + quote(queue_function_names(table)[1])
    s = f"'{SHARED_OWNER}'"
    ttl = "* interval '1 second'"
    # The NOTIFY to a waiter's listener: channel "dblock_" + the owner id's first 16
    # characters (its listener), payload "owner token expiry".
    notify = "PERFORM pg_notify('dblock_' || left(v.owner, 16), v.owner || ' ' || tok || ' ' || extract(epoch FROM e));"
    return [
        # admit: the caller holds p_name's row lock. 0010's walk (it grants the line's head,
        # and each live reader or semaphore waiter behind it that fits), with a waiter's
        # listener found alive in O(1) (see live).
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
            IF NOT (coalesce(v.owner = p_self, false) OR ({live('v', p)})) THEN
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
        # handoff: a writer's release when waiters are queued (0005's contract): one row
        # (token, notified) when owner's lease with that token ended (token: the grant it
        # handed over, if any); zero rows: not ours (G3). A live writer at the head of the
        # line is granted here, in one statement; any other line is admit's to walk.
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
    -- A writer's lease ends, so nothing else is held (readers hold under {s}). A statement
    -- of its own, so it sees every change committed before the row lock; nobody changes
    -- the line meanwhile, as every function that does takes the row lock first. The walk's
    -- first step, when the head is a live writer: out of the line, and granted with a token
    -- drawn after the row lock (G2) and an expiry from clock_timestamp(), after the
    -- waiter's last look was sent (G5).
    RETURN QUERY
    WITH v AS (
        SELECT x.seq, x.owner, x.ttl, x.label FROM {w} AS x
        WHERE x.name = p_name AND x.seq = (SELECT min(y.seq) FROM {w} AS y WHERE y.name = p_name)
            AND NOT x.shared AND {live('x', p)}
    ), d AS (
        DELETE FROM {w} AS x USING v WHERE x.name = p_name AND x.seq = v.seq
        RETURNING v.owner, v.ttl, v.label
    ), g AS (
        UPDATE {t} AS k SET owner = d.owner, token = nextval('{seq}'), acquired_at = now(),
            expires_at = clock_timestamp() + d.ttl {ttl}, label = d.label, waiting = k.waiting - 1
        FROM d WHERE k.name = p_name
        RETURNING k.token, k.owner, k.expires_at
    )
    SELECT g.token, true FROM g,
        LATERAL pg_notify('dblock_' || left(g.owner, 16), g.owner || ' ' || g.token || ' ' || extract(epoch FROM g.expires_at));
    IF FOUND THEN
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
    ]
