"""The SQL dblock sends, built once per Locker. No connections in here.

Each statement has a contract comment: its binds, the rows it returns and
what zero rows means. Identifiers are validated plain names, quoted by the
dialect. Every write is a compare-and-swap on (name, owner, token).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sqlalchemy.engine import Dialect

from .schema import (
    SHARED_OWNER,
    holders_table_name,
    procs_table_name,
    queue_function_names,
    shared_function_names,
    shared_queue_function_names,
    token_sequence_name,
    waiters_table_name,
)


@dataclass(frozen=True)
class Statements:
    dialect: str
    acquire: str
    holder: str | None  # SQLite only: PostgreSQL's acquire reports the holder itself
    release: str
    release_held: str  # release of a lease with a minimum hold (min_hold > 0)
    released: str
    extend: str
    extend_many: str  # renewal: many leases in one statement
    leases: str
    prune: str
    prune_lock: str | None  # runs before prune, in its transaction
    enqueue: str | None = None  # PostgreSQL only: fair waiting (take it, or queue up)
    cancel: str | None = None  # PostgreSQL only: leave the queue
    beat: str | None = None  # PostgreSQL only: this process's waiters are alive
    owned: str | None = None  # SQLite only: the token owner holds (PostgreSQL uses cancel)
    waiters: str | None = None  # PostgreSQL only: how many wait in each name's fair queue
    # Shared leases (read locks and semaphore slots, migration 0007): one statement per verb.
    share_acquire: str = ""
    share_release: str = ""
    share_released: str = ""
    share_extend: str = ""
    share_extend_many: str = ""
    share_owned: str = ""  # the token owner's shared lease has (clean-up after a lost reply)
    share_prune: str = ""  # after prune: forget shared leases that ended long ago
    share_holder: str | None = None  # SQLite only: how long a missed shared acquire should wait
    share_enqueue: str | None = None  # PostgreSQL only: fair waiting for a shared lease (migration 0008)


def build(dialect: Dialect, table: str, schema: str | None) -> Statements:
    quote = dialect.identifier_preparer.quote
    qualified = (quote(schema) + "." if schema else "") + quote(table)
    if dialect.name == "postgresql":
        prefix = quote(schema) + "." if schema else ""
        enqueue, handoff, cancel = (prefix + quote(n) for n in queue_function_names(table))
        exclusive = _postgresql(
            qualified, prefix + quote(token_sequence_name(table)), prefix + quote(procs_table_name(table)),
            enqueue, handoff, cancel, prefix + quote(waiters_table_name(table)),
        )
        shared = _postgresql_shared(
            qualified, prefix + quote(holders_table_name(table)), *(prefix + quote(n) for n in shared_function_names(table))
        )
        share_enqueue_fn = prefix + quote(shared_queue_function_names(table)[1])
        return replace(exclusive, **shared, share_enqueue=_share_enqueue(share_enqueue_fn))
    if dialect.name == "sqlite":
        return replace(_sqlite(qualified), **_sqlite_shared(qualified, quote(holders_table_name(table))))
    raise ValueError(f"dblock has no statements for the {dialect.name} dialect")


def _postgresql(
    t: str, seq: str, procs: str, enqueue_fn: str, handoff_fn: str, cancel_fn: str, queue: str
) -> Statements:
    # A new expiry: from the moment it is computed, no earlier than the client's
    # send time, from which the client trusts the lease (G5).
    ttl = "clock_timestamp() + %(ttl)s * interval '1 second'"
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
        -- Ours already (a retry): never shorten it, see extend.
        expires_at = CASE WHEN l.owner = %(owner)s THEN greatest(l.expires_at, {ttl}) ELSE {ttl} END,
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
    # release
    # binds: name, owner, token
    # returns one row (token, handed) when this call ended the lease: nobody
    #   else had taken it since, even if its TTL had run out.
    # zero rows: already released, or taken over by another owner (G3).
    # The row stays (DESIGN.md §3): only the lease is cleared. With nobody
    # waiting (waiting = 0, a column of this row, so PostgreSQL re-reads it
    # after waiting for the row lock) that is this one UPDATE. Otherwise the
    # hand-off function (migration 0005) runs instead, in the same statement:
    # it grants the first live waiter a fresh token under the row lock (G2)
    # and NOTIFYs exactly that waiter's listener; when readers or semaphore
    # waiters are first in line, each of them up to the next writer that fits,
    # a token each (migration 0008).
    release = f"""
WITH r AS (
    UPDATE {t} SET owner = NULL, expires_at = NULL
    WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s AND waiting = 0
    RETURNING token
)
SELECT token, false FROM r
UNION ALL
SELECT h.token, h.notified FROM {handoff_fn}(%(name)s, %(owner)s, %(token)s::bigint) AS h
WHERE NOT EXISTS (SELECT FROM r)"""
    # release_held (a release of a lease granted with min_hold > 0)
    # binds: name, owner, token, hold (seconds after the grant the lease is kept)
    # returns one row (token, handed, held_until) when (name, owner, token) still
    #   matched, as release does (zero rows: already released, or taken over):
    #   held_until NULL: the hold had passed (acquired_at + hold <= now()), so
    #     this call ended the lease exactly as release does, hand-off included.
    #   held_until set: the hold has not passed. The lease is kept (owner, token
    #     and label unchanged) and now ends at acquired_at + hold by the database
    #     clock, whatever its expiry was: sooner if its ttl or an extend reached
    #     past the hold (the work is done), later if the hold is longer than the
    #     ttl, or if the lease ran out while nobody took it. Nothing is handed
    #     over: a fair waiter gets the lease at that expiry, as after a holder
    #     that died (the first few in line look then). A late extend of the same
    #     lease would still push the expiry out; the Lease sends none after this.
    # One UPDATE: its WHERE re-reads waiting after a row lock, as release's does.
    hold = "l.acquired_at + %(hold)s * interval '1 second'"
    release_held = f"""
WITH r AS (
    UPDATE {t} AS l SET
        owner = CASE WHEN {hold} > now() THEN l.owner END,
        expires_at = CASE WHEN {hold} > now() THEN {hold} END
    WHERE l.name = %(name)s AND l.owner = %(owner)s AND l.token = %(token)s
      AND (l.waiting = 0 OR {hold} > now())
    RETURNING l.token, l.expires_at
)
SELECT token, false, expires_at FROM r
UNION ALL
SELECT h.token, h.notified, NULL FROM {handoff_fn}(%(name)s, %(owner)s, %(token)s::bigint) AS h
WHERE NOT EXISTS (SELECT FROM r)"""
    # released (only after a release whose reply was lost)
    # binds: name, owner, token
    # returns one row when the lease with this token ended and nobody took the
    # name since; zero rows: it was taken over (or the row pruned).
    released = f"""
SELECT token FROM {t} WHERE name = %(name)s AND token = %(token)s AND owner IS NULL"""
    # extend
    # binds: name, owner, token, ttl
    # returns one row (expires_at): the new expiry, now + ttl by the database clock,
    #   or the current one if that is later: an extend never shortens a lease.
    #   PostgreSQL computes the SET before it waits for a row lock, and a
    #   statement the client cut off may run on the server later still; were it
    #   to overwrite a later extend's expiry with its earlier one, the lease
    #   would end before its holder stopped trusting it (G5). greatest() reads
    #   the row as it is when written.
    # zero rows: the lease was released or another owner acquired since (G3).
    extend = f"""
UPDATE {t} SET expires_at = greatest(expires_at, {ttl})
WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s
RETURNING expires_at"""
    # extend_many (renewal: the leases due now, in one statement)
    # binds: names, owners, tokens, ttls: arrays of one length, a lease each
    #   (sorted by name, so concurrent batches take row locks in one order)
    # returns a row (name, token, expires_at) per lease extended, with the same
    #   contract as extend; a lease with no row was released or taken over.
    extend_many = f"""
UPDATE {t} AS l SET expires_at = greatest(l.expires_at, clock_timestamp() + b.ttl * interval '1 second')
FROM unnest(%(names)s::text[], %(owners)s::text[], %(tokens)s::bigint[], %(ttls)s::float8[])
    AS b(name, owner, token, ttl)
WHERE l.name = b.name AND l.owner = b.owner AND l.token = b.token
RETURNING l.name, l.token, l.expires_at"""
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
    # deletes rows whose last grant and lease both ended more than age ago and
    # that nobody waits for; returns their names. The global sequence keeps
    # tokens growing for a name that comes back (G2). Also forgets processes
    # whose waiters' heartbeat stopped more than age ago.
    prune = f"""
WITH gone AS (DELETE FROM {procs} WHERE until < now() - %(age)s * interval '1 second')
DELETE FROM {t}
WHERE acquired_at < now() - %(age)s * interval '1 second'
  AND (owner IS NULL OR expires_at < now() - %(age)s * interval '1 second')
  AND waiting = 0
RETURNING name"""
    # prune_lock: a first insert draws its token before its unique check; were
    # the row it then collides with pruned meanwhile, it would insert a token
    # below that row's (G2). SHARE ROW EXCLUSIVE waits for acquires in flight
    # (they hold ROW EXCLUSIVE from before they draw) and holds new ones off
    # until the prune commits. Pruning is rare; acquires never wait on each other here.
    prune_lock = f"LOCK TABLE {t} IN SHARE ROW EXCLUSIVE MODE"
    # enqueue (fair waiting): one call of the enqueue function (migration 0005)
    # binds: name, owner, ttl, label; proc (this Locker process's liveness id)
    #   and lapse (seconds its heartbeat row stays fresh); pid and start (this
    #   process's listener session, or NULL when it polls); until (seconds
    #   left of the wait, NULL for ever); seq (our place in line from the last
    #   attempt, or NULL)
    # returns one row (granted, token, expires_at, wait, seq, ahead):
    #   granted when the lock is free (or expired) and no live waiter is ahead
    #   of owner, or when owner already holds it (a hand-off it has not heard
    #   of yet, or a retry after a lost reply: the token is kept, the expiry renewed).
    #   Not granted: owner waits in line as seq; wait tells when the current
    #   lease ends and ahead how many waiters are before owner (counted to 100).
    #   A look while another owner's lease runs and owner is in line writes nothing.
    enqueue = f"""
SELECT * FROM {enqueue_fn}(%(name)s, %(owner)s, %(ttl)s::float8, %(label)s, %(proc)s, %(lapse)s::float8,
    %(pid)s::int, %(start)s::timestamptz, %(until)s::float8, %(seq)s::bigint)"""
    # cancel (a fair waiter gives up, or the clean-up after a lost reply)
    # binds: name, owner, seq (NULL: every entry of owner)
    # returns one row (granted, token, expires_at): owner's entry is gone from
    #   the queue; granted means a release handed owner the lease first (the
    #   caller keeps it). Zero rows: the name has no row.
    cancel = f"SELECT * FROM {cancel_fn}(%(name)s, %(owner)s, %(seq)s::bigint)"
    # beat: this Locker process's waiters are alive for lapse more seconds
    # binds: proc, lapse. Returns one row. Needs no disk flush (see enqueue).
    beat = f"""
WITH b AS (
    INSERT INTO {procs} (id, until) VALUES (%(proc)s, now() + %(lapse)s::float8 * interval '1 second')
    ON CONFLICT (id) DO UPDATE SET until = excluded.until
    RETURNING id
)
SELECT set_config('synchronous_commit', 'off', true) FROM b"""
    # waiters (operators: dblock status)
    # binds: none
    # returns a row per name with live waiters: name, count. Live as the hand-off
    #   judges it, less the listener-session check: the waiter's own deadline has
    #   not passed and its process's heartbeat row is fresh. Reads only.
    #   Zero rows: nobody waits.
    waiters = f"""
SELECT w.name, count(*)::int FROM {queue} AS w JOIN {procs} AS p ON p.id = w.proc
WHERE p.until > now() AND (w.until IS NULL OR w.until > now())
GROUP BY w.name"""
    return Statements(
        "postgresql", acquire, None, release, release_held, released, extend, extend_many, leases, prune, prune_lock,
        enqueue, cancel, beat=beat, waiters=waiters,
    )


# SQLite's clock as Unix seconds; 'now' is fixed for the whole statement.
SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
# SQLite's 'now' is truncated to whole milliseconds (and the julianday
# arithmetic adds ~25 us of rounding), so it can read up to ~1 ms behind the
# real time. Expiries are pushed 2 ms later so that the database's expiry is
# never earlier than (client's send time + ttl), which the client trusts (G5).
_EXPIRES = f"({SQLITE_NOW} + :ttl + 0.002)"


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
VALUES (:name, :owner, (SELECT coalesce(max(token), 0) + 1 FROM {t}), {SQLITE_NOW}, {_EXPIRES}, :label)
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
    holder = f"SELECT expires_at - {SQLITE_NOW} FROM {t} WHERE name = :name"
    # release, released, extend, leases, prune: the same contracts as PostgreSQL's above.
    release = f"""
UPDATE {t} SET owner = NULL, expires_at = NULL
WHERE name = :name AND owner = :owner AND token = :token
RETURNING token"""
    # release_held: release_held's contract above; SQLite has no queue to hand over to.
    hold = f"acquired_at + :hold > {SQLITE_NOW}"
    release_held = f"""
UPDATE {t} SET
    owner = CASE WHEN {hold} THEN owner END,
    expires_at = CASE WHEN {hold} THEN acquired_at + :hold END
WHERE name = :name AND owner = :owner AND token = :token
RETURNING token, 0, expires_at"""
    released = f"SELECT token FROM {t} WHERE name = :name AND token = :token AND owner IS NULL"
    extend = f"""
UPDATE {t} SET expires_at = {_EXPIRES}
WHERE name = :name AND owner = :owner AND token = :token
RETURNING expires_at"""
    # binds: batch, a JSON array of [name, owner, token, ttl] arrays.
    extend_many = f"""
UPDATE {t} SET expires_at = {SQLITE_NOW} + b.ttl + 0.002
FROM (
    SELECT json_extract(value, '$[0]') AS b_name, json_extract(value, '$[1]') AS b_owner,
           json_extract(value, '$[2]') AS b_token, json_extract(value, '$[3]') AS ttl
    FROM json_each(:batch)
) AS b
WHERE name = b.b_name AND owner = b.b_owner AND token = b.b_token
RETURNING name, token, expires_at"""
    leases = f"""
SELECT name, owner, token, acquired_at, expires_at, expires_at - {SQLITE_NOW}, label
FROM {t} WHERE owner IS NOT NULL AND expires_at > {SQLITE_NOW}
ORDER BY name"""
    prune = f"""
DELETE FROM {t}
WHERE acquired_at < {SQLITE_NOW} - :age
  AND (owner IS NULL OR expires_at < {SQLITE_NOW} - :age)
  AND token < (SELECT max(token) FROM {t})
RETURNING name"""
    # owned (after an acquire whose reply was lost)
    # binds: name, owner
    # returns one row (token) when owner holds the name; zero rows: it does not.
    owned = f"SELECT token FROM {t} WHERE name = :name AND owner = :owner"
    return Statements(
        "sqlite", acquire, holder, release, release_held, released, extend, extend_many, leases, prune, None, owned=owned
    )


def _share_enqueue(fn: str) -> str:
    # share_enqueue (fair waiting for a shared lease, migration 0008)
    # binds: enqueue's, and limit (NULL: a reader)
    # returns one row as enqueue does (granted, token, expires_at, wait, seq, ahead, at):
    #   readers, semaphore waiters and writers of a name wait in one line, in
    #   arrival order; each call first grants whoever of the line's head fits
    #   (this caller too). Not granted: wait is when the first live holder's
    #   lease ends. A look while a writer holds and owner is in line writes nothing.
    return f"""
SELECT * FROM {fn}(%(name)s, %(owner)s, %(ttl)s::float8, %(label)s, %(limit)s::int, %(proc)s, %(lapse)s::float8,
    %(pid)s::int, %(start)s::timestamptz, %(until)s::float8, %(seq)s::bigint)"""


# -- shared leases (read locks and semaphores, migration 0007) --------------------------
# A shared lease is a row of the holders table: (name, owner) with its own token
# and expiry, and lim, the limit it was granted under (NULL for a reader). While
# any is live the name's row in the lock table shows owner SHARED_OWNER, the
# newest shared grant's token and an expiry no earlier than every live
# holder's, so the exclusive statements above (a write lock is the exclusive
# lock) see the name held until the last reader leaves or runs out. Every
# change to a name's holders happens under that row's lock (PostgreSQL: the
# share functions lock it first; SQLite: one writer at a time).
_SHARED = f"'{SHARED_OWNER}'"


def _postgresql_shared(t: str, h: str, acquire_fn: str, release_fn: str, extend_fn: str) -> dict[str, str]:
    # share_acquire
    # binds: name, owner, ttl, label, limit (NULL: a reader, no limit of its own)
    # returns one row (granted, token, expires_at, wait, free):
    #   granted: a fresh token drawn after the name's row lock (G2: larger than
    #     every earlier grant of the name, shared or exclusive) and the database
    #     expiry; owner already holding it (a retry, G6) keeps its token.
    #   not granted: a writer holds the name (wait: seconds until its lease
    #     ends), a live writer waits in the fair queue (wait NULL: readers let
    #     it go first), or as many live holders as the smallest limit of the
    #     caller and of every live holder (wait: until the first of them ends).
    #   free: on a grant, the slots it left (the smallest live limit less the
    #     live holders; NULL when no limit binds), so a waiter next in line
    #     knows whether to look at once. NULL on a miss.
    #   Since migration 0008 readers and semaphore waiters queue too (share_enqueue):
    #   while any live waiter is in line a newcomer is refused (wait NULL), after
    #   the call has granted whoever of the line fits (a lease that ran out unreleased).
    # A miss behind a writer reads only; other misses lock the row.
    share_acquire = (
        f"SELECT * FROM {acquire_fn}(%(name)s, %(owner)s, %(ttl)s::float8, %(label)s, %(limit)s::int)"
    )
    # share_release
    # binds: name, owner, token
    # returns one row (token, notified) when this call ended the shared lease;
    #   the slot it frees (or the name, when it was the last holder) goes to
    #   the fair queue's head and each waiter after it that fits (NOTIFY), or
    #   the name is freed. Zero rows: already released, or the lease
    #   ran out and was forgotten or taken over (G3).
    share_release = f"SELECT * FROM {release_fn}(%(name)s, %(owner)s, %(token)s::bigint)"
    # share_released (after a release whose reply was lost)
    # binds: name, owner, token. One row: the shared lease is gone; zero rows: it is still there.
    share_released = f"""
SELECT %(token)s::bigint WHERE NOT EXISTS (
    SELECT FROM {h} WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s::bigint)"""
    # share_extend
    # binds: name, owner, token, ttl
    # returns one row (expires_at): now + ttl by the database clock, or the
    #   current expiry if later. Zero rows: released, or it ran out and another
    #   grant of the name came since (which forgets it, or a writer took over).
    share_extend = f"SELECT * FROM {extend_fn}(%(name)s, %(owner)s, %(token)s::bigint, %(ttl)s::float8)"
    # share_extend_many: extend_many's contract, for shared leases.
    share_extend_many = f"""
SELECT b.name, b.token, e.expires_at
FROM unnest(%(names)s::text[], %(owners)s::text[], %(tokens)s::bigint[], %(ttls)s::float8[])
    AS b(name, owner, token, ttl)
CROSS JOIN LATERAL {extend_fn}(b.name, b.owner, b.token, b.ttl) AS e"""
    return dict(
        share_acquire=share_acquire, share_release=share_release, share_released=share_released,
        share_extend=share_extend, share_extend_many=share_extend_many, leases=_leases(t, h, "now()"),
        # share_prune: binds age (seconds); deletes the holders whose lease ended more than age
        #   ago (nothing live, and nothing an extend may still revive for long); returns a row each.
        share_prune=f"DELETE FROM {h} WHERE expires_at < now() - %(age)s * interval '1 second' RETURNING name",
        # share_owned: binds name, owner; one row (token) when owner holds a shared lease of name.
        share_owned=f"SELECT token FROM {h} WHERE name = %(name)s AND owner = %(owner)s",
    )


def _leases(t: str, h: str, now: str) -> str:
    # leases (both dialects; replaces the exclusive-only listing)
    # binds: none
    # returns a row per unexpired lease, exclusive or shared: name, owner, token,
    #   acquired_at, expires_at, remaining (seconds, database clock), label,
    #   shared (false: exclusive/write), lim (a semaphore holder's limit; NULL
    #   for readers and exclusive leases). Zero rows: nothing held.
    remaining = (
        f"EXTRACT(EPOCH FROM {{0}}.expires_at - {now})::float8" if now == "now()" else f"{{0}}.expires_at - {now}"
    )
    false, true = ("false", "true") if now == "now()" else ("0", "1")
    return f"""
SELECT l.name, l.owner, l.token, l.acquired_at, l.expires_at, {remaining.format("l")}, l.label, {false}, NULL
FROM {t} AS l WHERE l.owner IS NOT NULL AND l.owner <> {_SHARED} AND l.expires_at > {now}
UNION ALL
SELECT x.name, x.owner, x.token, x.acquired_at, x.expires_at, {remaining.format("x")}, x.label, {true}, x.lim
FROM {h} AS x JOIN {t} AS l ON l.name = x.name AND l.owner = {_SHARED}
WHERE x.expires_at > {now}
ORDER BY 1, 3"""


def _sqlite_shared(t: str, h: str) -> dict[str, str]:
    # share_acquire
    # binds: name, owner, ttl, label, limit
    # returns one row (token, expires_at, free) when granted; zero rows when not
    #   (then share_holder tells how long to wait). The same grant rule as
    #   PostgreSQL's, less the fair queue (SQLite's writers poll): no live
    #   writer, and fewer live holders than the caller's limit and every live
    #   holder's. The token is max(token) + 1 over the lock table, inside
    #   SQLite's single-writer transaction; the grant trigger (migration 0007)
    #   writes it into the name's row, so the next grant, of any kind, draws above it (G2).
    #   Not a retry-safe upsert: a second attempt with the same owner is a miss.
    live = f"(SELECT count(*) FROM {h} WHERE name = :name AND expires_at > {SQLITE_NOW})"
    share_acquire = f"""
INSERT INTO {h} (name, owner, token, acquired_at, expires_at, label, lim)
SELECT :name, :owner, (SELECT coalesce(max(token), 0) + 1 FROM {t}), {SQLITE_NOW}, {_EXPIRES}, :label, :limit
WHERE NOT EXISTS (
    SELECT 1 FROM {t} WHERE name = :name AND owner IS NOT NULL AND owner <> {_SHARED} AND expires_at > {SQLITE_NOW})
  AND (:limit IS NULL OR {live} < :limit)
  AND NOT EXISTS (SELECT 1 FROM {h} WHERE name = :name AND expires_at > {SQLITE_NOW} AND lim <= {live})
ON CONFLICT (name, owner) DO NOTHING
RETURNING token, expires_at,
    (SELECT min(lim) - count(*) FROM {h} WHERE name = :name AND expires_at > {SQLITE_NOW})"""
    # share_holder
    # binds: name. One row (wait): seconds until a live writer's lease ends, or
    #   else until the first live holder's ends; NULL when nothing holds the name.
    share_holder = f"""
SELECT coalesce(
    (SELECT expires_at FROM {t} WHERE name = :name AND owner <> {_SHARED} AND expires_at > {SQLITE_NOW}),
    (SELECT min(expires_at) FROM {h} WHERE name = :name AND expires_at > {SQLITE_NOW})) - {SQLITE_NOW}"""
    # share_release, share_released, share_extend, share_extend_many: PostgreSQL's contracts
    # above (share_released: one row when the lease is gone); a release hands nothing over.
    share_release = f"""
DELETE FROM {h} WHERE name = :name AND owner = :owner AND token = :token
  AND EXISTS (SELECT 1 FROM {t} WHERE name = :name AND owner = {_SHARED})
RETURNING token"""
    share_released = f"""
SELECT :token WHERE NOT EXISTS (SELECT 1 FROM {h} WHERE name = :name AND owner = :owner AND token = :token)"""
    share_extend = f"""
UPDATE {h} SET expires_at = max(expires_at, {_EXPIRES})
WHERE name = :name AND owner = :owner AND token = :token
  AND EXISTS (SELECT 1 FROM {t} WHERE name = :name AND owner = {_SHARED})
RETURNING expires_at"""
    share_extend_many = f"""
UPDATE {h} SET expires_at = max(expires_at, {SQLITE_NOW} + b.ttl + 0.002)
FROM (
    SELECT json_extract(value, '$[0]') AS b_name, json_extract(value, '$[1]') AS b_owner,
           json_extract(value, '$[2]') AS b_token, json_extract(value, '$[3]') AS ttl
    FROM json_each(:batch)
) AS b
WHERE name = b.b_name AND owner = b.b_owner AND token = b.b_token
  AND EXISTS (SELECT 1 FROM {t} AS l WHERE l.name = b.b_name AND l.owner = {_SHARED})
RETURNING name, token, expires_at"""
    return dict(
        share_acquire=share_acquire, share_release=share_release, share_released=share_released,
        share_extend=share_extend, share_extend_many=share_extend_many, leases=_leases(t, h, SQLITE_NOW),
        share_holder=share_holder, share_owned=f"SELECT token FROM {h} WHERE name = :name AND owner = :owner",
        share_prune=f"DELETE FROM {h} WHERE expires_at < {SQLITE_NOW} - :age RETURNING name",
    )
