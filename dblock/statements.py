"""The SQL dblock sends, built once per Locker. No connections in here.

Each statement has a contract comment: its binds, the rows it returns and
what zero rows means. Identifiers are validated plain names, quoted by the
dialect. Every write is a compare-and-swap on (name, owner, token).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Dialect

from .schema import token_sequence_name


@dataclass(frozen=True)
class Statements:
    dialect: str
    acquire: str
    holder: str | None  # SQLite only: PostgreSQL's acquire reports the holder itself
    release: str
    released: str
    extend: str
    leases: str
    prune: str
    prune_lock: str | None  # runs before prune, in its transaction
    enqueue: str | None = None  # PostgreSQL only: fair waiting (take it, or queue up)
    cancel: str | None = None  # PostgreSQL only: leave the queue
    owned: str | None = None  # SQLite only: the token owner holds (PostgreSQL uses cancel)


def build(dialect: Dialect, table: str, schema: str | None) -> Statements:
    quote = dialect.identifier_preparer.quote
    qualified = (quote(schema) + "." if schema else "") + quote(table)
    if dialect.name == "postgresql":
        seq = (quote(schema) + "." if schema else "") + quote(token_sequence_name(table))
        return _postgresql(qualified, seq)
    if dialect.name == "sqlite":
        return _sqlite(qualified)
    raise ValueError(f"dblock has no statements for the {dialect.name} dialect")


def _postgresql(t: str, seq: str) -> Statements:
    ttl = "now() + %(ttl)s * interval '1 second'"
    # acquire
    # binds: name, owner (this attempt's random id), ttl (seconds, float),
    #   label (who asks, for operators; written with the grant, never compared)
    # returns one row (granted, token, expires_at, wait):
    #   granted: token and database expiry of the lease. If owner already holds
    #     the row (a retry after a lost reply, G6) the token is kept, not redrawn.
    #   not granted: wait = seconds until the current lease ends, by the
    #     database clock (<= 0 or NULL: it just ended; try again soon).
    # zero rows: the name had no row and a concurrent first acquire created it.
    # Shape: the conditional UPDATE is the common path; when the lock is held
    # it matches nothing and writes no WAL (a miss is read-only). nextval() runs
    # in UPDATE's SET, which PostgreSQL re-evaluates (EvalPlanQual) after it
    # waited for a competing grant's row lock, so a late grant never writes a
    # token drawn before an earlier grant's (G2). The INSERT only runs for a name
    # that has no row yet; ON CONFLICT DO NOTHING makes a racing first insert a miss.
    acquire = f"""
WITH cur AS (
    SELECT expires_at FROM {t} WHERE name = %(name)s
), upd AS (
    UPDATE {t} AS l SET
        token = CASE WHEN l.owner = %(owner)s THEN l.token ELSE nextval('{seq}') END,
        acquired_at = CASE WHEN l.owner = %(owner)s THEN l.acquired_at ELSE now() END,
        owner = %(owner)s,
        expires_at = {ttl},
        label = %(label)s
    WHERE l.name = %(name)s
      AND (l.owner IS NULL OR l.expires_at <= now() OR l.owner = %(owner)s)
    RETURNING l.token, l.expires_at
), ins AS (
    INSERT INTO {t} (name, owner, token, acquired_at, expires_at, label)
    SELECT %(name)s, %(owner)s, nextval('{seq}'), now(), {ttl}, %(label)s
    WHERE NOT EXISTS (SELECT FROM cur)
    ON CONFLICT (name) DO NOTHING
    RETURNING token, expires_at
)
SELECT true AS granted, token, expires_at, NULL::float8 AS wait FROM upd
UNION ALL SELECT true, token, expires_at, NULL FROM ins
UNION ALL SELECT false, NULL, NULL, EXTRACT(EPOCH FROM expires_at - now())::float8 FROM cur
ORDER BY granted DESC
LIMIT 1"""
    # A queue entry (fair waiting, see enqueue) is fresh while its deadline
    # "d" (database epoch seconds) is ahead, and live if also, when it names a
    # listener session "p" (pid) started at "s", that session still exists: a
    # waiter whose process died is skipped at once. backend_start reads NULL
    # for another role's session without pg_read_all_stats; then the pid alone
    # counts. The session check costs a pg_stat_get_activity() call, so it runs
    # only on the way to the first live entry: a function scan returns the
    # array's elements in order and LIMIT 1 stops at the first that passes.
    # Dead entries behind it are dropped when they reach the front.
    fresh = "(q.e->>'d')::float8 > extract(epoch FROM now())"
    live = f"""{fresh}
          AND (q.e->>'p' IS NULL OR EXISTS (
              SELECT FROM pg_stat_get_activity((q.e->>'p')::int) AS a
              WHERE a.backend_start IS NULL OR a.backend_start = (q.e->>'s')::timestamptz))"""
    first_live = f"""SELECT q.e, q.i FROM jsonb_array_elements(l.queue) WITH ORDINALITY AS q(e, i)
              WHERE {live} LIMIT 1"""
    # release
    # binds: name, owner, token
    # returns one row (token, notified) when this call ended the lease: nobody
    #   else had taken it since, even if its TTL had run out.
    # zero rows: already released, or taken over by another owner (G3).
    # The row stays (DESIGN.md §3): only the lease is cleared, or, when fair
    # waiters are queued, handed in the same statement to the first live one:
    # a fresh token (drawn under the row lock, G2), its own ttl and label, and
    # a NOTIFY with payload "owner token expiry-epoch" on channel "dblock_"
    # + the owner id's first 16 characters, which name the waiter's listener
    # (dblock._wait), so it wakes exactly that process and that waiter. Dead entries ahead of it are dropped.
    release = f"""
WITH r AS (
    UPDATE {t} AS l SET (owner, token, acquired_at, expires_at, label, queue) = (
        SELECT n.e->>'o',
               CASE WHEN n.e IS NULL THEN l.token ELSE nextval('{seq}') END,
               CASE WHEN n.e IS NULL THEN l.acquired_at ELSE now() END,
               -- clock_timestamp(), not now(): now() is when this statement
               -- started, which can be before the waiter's entry was sent when
               -- the release waited for the row lock behind that entry's
               -- enqueue. The waiter trusts from that send (G5), so the expiry
               -- must count from after it: from when the lock was held.
               clock_timestamp() + (n.e->>'t')::float8 * interval '1 second',
               CASE WHEN n.e IS NULL THEN l.label ELSE n.e->>'l' END,
               CASE WHEN n.i IS NOT NULL  -- the entries after the one served; none live: none kept
                   THEN nullif(jsonb_path_query_array(l.queue, '$[$k to last]', jsonb_build_object('k', n.i)), '[]')
               END
        FROM (SELECT) AS one LEFT JOIN LATERAL ({first_live}) AS n ON true)
    WHERE l.name = %(name)s AND l.owner = %(owner)s AND l.token = %(token)s
    RETURNING l.owner, l.token, l.expires_at
)
SELECT token, CASE WHEN owner IS NOT NULL
    THEN pg_notify('dblock_' || left(owner, 16), owner || ' ' || token || ' ' || extract(epoch FROM expires_at))
    END IS NULL
FROM r"""
    # released (only after a release whose reply was lost)
    # binds: name, owner, token
    # returns one row when the lease with this token ended and nobody took the
    # name since; zero rows: it was taken over (or the row pruned).
    released = f"""
SELECT token FROM {t} WHERE name = %(name)s AND token = %(token)s AND owner IS NULL"""
    # extend
    # binds: name, owner, token, ttl
    # returns one row (expires_at): the new expiry, now() + ttl by the database clock.
    # zero rows: the lease was released or another owner acquired since (G3).
    extend = f"""
UPDATE {t} SET expires_at = {ttl}
WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s
RETURNING expires_at"""
    # leases
    # binds: none
    # returns a row per unexpired lease: name, owner, token, acquired_at,
    #   expires_at, remaining (seconds, database clock), label (NULL for a
    #   grant made before migration 0003). Zero rows: nothing held.
    leases = f"""
SELECT name, owner, token, acquired_at, expires_at,
       EXTRACT(EPOCH FROM expires_at - now())::float8, label
FROM {t} WHERE owner IS NOT NULL AND expires_at > now()
ORDER BY name"""
    # prune
    # binds: age (seconds)
    # deletes rows whose last grant and lease both ended more than age ago;
    # returns their names. The global sequence keeps tokens growing for a
    # name that comes back (G2).
    prune = f"""
DELETE FROM {t}
WHERE acquired_at < now() - %(age)s * interval '1 second'
  AND (owner IS NULL OR expires_at < now() - %(age)s * interval '1 second')
RETURNING name"""
    # prune_lock: a first insert draws its token before its unique check; were
    # the row it then collides with pruned meanwhile, it would insert a token
    # below that row's (G2). SHARE ROW EXCLUSIVE waits for acquires in flight
    # (they hold ROW EXCLUSIVE from before they draw) and holds new ones off
    # until the prune commits. Pruning is rare; acquires never wait on each other here.
    prune_lock = f"LOCK TABLE {t} IN SHARE ROW EXCLUSIVE MODE"
    # enqueue (fair waiting)
    # binds: name, owner, ttl, label, pid and start (this process's listener
    #   session, or NULL when it polls), lapse (seconds until the entry dies
    #   unless refreshed by the next enqueue of the same owner)
    # returns one row (granted, token, expires_at, wait, ahead), as acquire:
    #   granted when the lock is free (or expired) and no live entry is queued
    #   ahead of owner, or when owner already holds it (a hand-off it has not
    #   heard of yet, or a retry: the token is kept, the expiry renewed).
    #   Not granted: owner's entry is now in the queue (appended, or refreshed
    #   in place so it keeps its turn), wait tells when the current lease ends
    #   and ahead how many live waiters are before owner.
    # zero rows: the name had no row and a concurrent first acquire created it.
    # Every input is a column of the one row, read under its row lock: a
    # concurrent release or enqueue makes this UPDATE wait and then re-evaluate
    # (EvalPlanQual) against the committed row, so no entry is ever lost and a
    # token is drawn only after the wait (G2).
    enqueue = f"""
WITH upd AS (
    UPDATE {t} AS l SET (owner, token, acquired_at, expires_at, label, queue) = (
        SELECT CASE WHEN s.ok THEN %(owner)s ELSE l.owner END,
               CASE WHEN s.ok AND l.owner IS DISTINCT FROM %(owner)s THEN nextval('{seq}') ELSE l.token END,
               CASE WHEN s.ok AND l.owner IS DISTINCT FROM %(owner)s THEN now() ELSE l.acquired_at END,
               CASE WHEN s.ok THEN {ttl} ELSE l.expires_at END,
               CASE WHEN s.ok THEN %(label)s ELSE l.label END,
               CASE WHEN s.ok THEN nullif(s.others, '[]')
                    -- queued already: refresh the entry where it stands (it keeps its turn)
                    WHEN jsonb_path_exists(l.queue, '$[*] ? (@.o == $me)', s.v) THEN (
                        SELECT jsonb_set(k.kept, ARRAY[(x.i - 1)::text], s.me)
                        FROM (SELECT jsonb_path_query_array(l.queue, '$[*] ? (@.d > $now || @.o == $me)', s.v)
                              AS kept) AS k,
                             jsonb_array_elements(k.kept) WITH ORDINALITY AS x(e, i)
                        WHERE x.e->>'o' = %(owner)s)
                    ELSE s.others || s.me END
        FROM (SELECT CASE WHEN l.owner = %(owner)s THEN true
                          WHEN l.owner IS NULL OR l.expires_at <= now()
                          THEN coalesce((SELECT f.e->>'o' FROM ({first_live}) AS f) = %(owner)s, true)
                          ELSE false END AS ok,
                     -- the fresh entries but ours, in order (jsonpath: one pass in C)
                     jsonb_path_query_array(coalesce(l.queue, '[]'), '$[*] ? (@.d > $now && @.o != $me)', m.v)
                         AS others,
                     m.me, m.v
              FROM (SELECT jsonb_build_object('o', %(owner)s::text, 't', %(ttl)s::float8, 'l', %(label)s::text,
                               'p', %(pid)s::int, 's', %(start)s::text,
                               'd', extract(epoch FROM now())::float8 + %(lapse)s::float8) AS me,
                           jsonb_build_object('now', extract(epoch FROM now())::float8, 'me', %(owner)s::text) AS v
                   ) AS m) AS s)
    WHERE l.name = %(name)s
    RETURNING l.owner = %(owner)s AS granted, l.token, l.expires_at,
              EXTRACT(EPOCH FROM l.expires_at - now())::float8 AS wait,
              (SELECT q.i - 1 FROM jsonb_array_elements(l.queue) WITH ORDINALITY AS q(e, i)
               WHERE q.e->>'o' = %(owner)s) AS ahead
), ins AS (
    INSERT INTO {t} (name, owner, token, acquired_at, expires_at, label)
    SELECT %(name)s, %(owner)s, nextval('{seq}'), now(), {ttl}, %(label)s
    WHERE NOT EXISTS (SELECT FROM {t} WHERE name = %(name)s)
    ON CONFLICT (name) DO NOTHING
    RETURNING true, token, expires_at, NULL::float8, NULL::bigint
)
SELECT g.* FROM (SELECT * FROM upd UNION ALL SELECT * FROM ins) AS g
-- Joining the queue needs no disk flush: were it lost in a crash the waiter
-- would queue again at its next poll, and the release that hands it the lease
-- flushes the WAL up to its own commit, this entry included. A grant keeps
-- the server's setting (durable, or a synchronous standby's).
WHERE g.granted OR set_config('synchronous_commit', 'off', true) IS NOT NULL"""
    # cancel (a fair waiter gives up)
    # binds: name, owner
    # returns one row (granted, token, expires_at, _): owner's entry is gone from
    #   the queue; granted means a release handed owner the lease first (the
    #   caller keeps it). Zero rows: the name has no row.
    cancel = f"""
UPDATE {t} AS l SET queue = nullif(jsonb_path_query_array(l.queue, '$[*] ? (@.d > $now && @.o != $me)',
    jsonb_build_object('now', extract(epoch FROM now())::float8, 'me', %(owner)s::text)), '[]')
WHERE l.name = %(name)s
RETURNING l.owner = %(owner)s, l.token, l.expires_at,
    set_config('synchronous_commit', 'off', true)  -- only the queue changed (see enqueue)"""
    return Statements(
        "postgresql", acquire, None, release, released, extend, leases, prune, prune_lock, enqueue, cancel
    )


# SQLite's clock as Unix seconds; 'now' is fixed for the whole statement.
_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
# SQLite's 'now' is truncated to whole milliseconds (and the julianday
# arithmetic adds ~25 us of rounding), so it can read up to ~1 ms behind the
# real time. Expiries are pushed 2 ms later so that the database's expiry is
# never earlier than (client's send time + ttl), which the client trusts (G5).
_EXPIRES = f"({_NOW} + :ttl + 0.002)"


def _sqlite(t: str) -> Statements:
    # acquire
    # binds: name, owner, ttl, label
    # returns one row (token, expires_at) when granted; zero rows when held
    #   (then `holder` tells how long the current lease has left).
    # SQLite runs one writer at a time and this statement takes the write lock
    # before it reads, so max(token) + 1 is larger than every token granted
    # before it. prune never deletes the row that holds the maximum, so the
    # maximum never goes down (G2).
    acquire = f"""
INSERT INTO {t} (name, owner, token, acquired_at, expires_at, label)
VALUES (:name, :owner, (SELECT coalesce(max(token), 0) + 1 FROM {t}), {_NOW}, {_EXPIRES}, :label)
ON CONFLICT (name) DO UPDATE SET
    token = CASE WHEN owner = excluded.owner THEN token ELSE (SELECT max(token) + 1 FROM {t}) END,
    acquired_at = CASE WHEN owner = excluded.owner THEN acquired_at ELSE excluded.acquired_at END,
    owner = excluded.owner,
    expires_at = excluded.expires_at,
    label = excluded.label
WHERE owner IS NULL OR expires_at <= excluded.acquired_at OR owner = excluded.owner
RETURNING token, expires_at"""
    # holder
    # binds: name
    # returns one row (wait): seconds until the current lease ends; NULL if free.
    # zero rows: the name has no row.
    holder = f"SELECT expires_at - {_NOW} FROM {t} WHERE name = :name"
    # release, released, extend, leases, prune: the same contracts as PostgreSQL's above.
    release = f"""
UPDATE {t} SET owner = NULL, expires_at = NULL
WHERE name = :name AND owner = :owner AND token = :token
RETURNING token"""
    released = f"SELECT token FROM {t} WHERE name = :name AND token = :token AND owner IS NULL"
    extend = f"""
UPDATE {t} SET expires_at = {_EXPIRES}
WHERE name = :name AND owner = :owner AND token = :token
RETURNING expires_at"""
    leases = f"""
SELECT name, owner, token, acquired_at, expires_at, expires_at - {_NOW}, label
FROM {t} WHERE owner IS NOT NULL AND expires_at > {_NOW}
ORDER BY name"""
    prune = f"""
DELETE FROM {t}
WHERE acquired_at < {_NOW} - :age
  AND (owner IS NULL OR expires_at < {_NOW} - :age)
  AND token < (SELECT max(token) FROM {t})
RETURNING name"""
    # owned (after an acquire whose reply was lost)
    # binds: name, owner
    # returns one row (token) when owner holds the name; zero rows: it does not.
    owned = f"SELECT token FROM {t} WHERE name = :name AND owner = :owner"
    return Statements("sqlite", acquire, holder, release, released, extend, leases, prune, None, owned=owned)
