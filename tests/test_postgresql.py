"""What PostgreSQL promises beyond the guarantees: one round trip, read-only misses, autocommit."""

from __future__ import annotations

import time
import dataclasses
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text

from dblock import Locker, LockNotAcquired

from .conftest import Db, libpq_dsn, wait_for, warm_waiting
from .pgproxy import PgProxy


def test_one_round_trip_per_operation(pg: Db, proxy: PgProxy) -> None:
    locker = Locker(proxy.url, table=pg.table)
    warm = locker.try_acquire("warm")  # first use on a connection prepares each statement
    warm.extend()
    warm.release()
    held = locker.try_acquire("held")
    proxy.reset()

    def trips(call) -> int:
        before = proxy.round_trips
        call()
        return proxy.round_trips - before

    box = {}
    assert trips(lambda: box.setdefault("lease", locker.try_acquire("x", ttl=30))) == 1
    assert trips(lambda: box["lease"].extend(ttl=30)) == 1
    assert trips(lambda: box["lease"].release()) == 1
    assert trips(lambda: locker.try_acquire("held")) == 1  # a miss, with the holder's expiry
    assert proxy.queries == 0, "a simple-protocol statement (BEGIN/COMMIT?) was sent"
    held.release()
    locker.close()


def _wal_bytes(conn: psycopg.Connection, work) -> int:
    (before,) = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
    work()
    (delta,) = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (before,)).fetchone()
    return int(delta)


@pytest.mark.parametrize("variant", ["dblock", "broken: plain upsert"])
def test_failed_attempts_write_no_wal(pg: Db, variant: str) -> None:
    """100 misses on a held lock leave the WAL where it was (background noise aside).

    The broken variant, the naive ON CONFLICT DO UPDATE ... WHERE, locks the row
    on every miss and writes WAL each time: this test tells the two apart.
    """
    locker = pg.locker()
    holder = pg.locker().try_acquire("held", ttl=60)
    if variant != "dblock":
        t, seq = pg.table, f"{pg.table}_token_seq"
        naive = f"""
        INSERT INTO {t} (name, owner, token, acquired_at, expires_at)
        VALUES (%(name)s, %(owner)s, nextval('{seq}'), now(), now() + %(ttl)s * interval '1 second')
        ON CONFLICT (name) DO UPDATE SET owner = EXCLUDED.owner, token = nextval('{seq}'),
            acquired_at = now(), expires_at = EXCLUDED.expires_at
        WHERE {t}.owner IS NULL OR {t}.expires_at <= now()
        RETURNING true, token, expires_at, NULL::float8"""
        locker.backend.sql = dataclasses.replace(locker.backend.sql, acquire=naive)
    locker.try_acquire("warm")  # connect and prepare outside the measurement
    with psycopg.connect(libpq_dsn(pg.url), autocommit=True) as conn:
        written = _wal_bytes(conn, lambda: [locker.try_acquire("held") for _ in range(100)])
    if variant == "dblock":
        assert written < 1500, f"100 failed attempts wrote {written} bytes of WAL"
    else:
        assert written > 5000, "the naive upsert should have written WAL on every miss"
    holder.release()


def test_a_grant_and_a_release_with_nobody_waiting_run_no_function(pg: Db) -> None:
    """The acquire's and the release's common paths are their UPDATE alone (0012); a miss calls
    missed (a read), and a release with a waiter in line calls hand_on, which grants that
    waiter itself. Counted by the server (track_functions), each case in a transaction rolled back."""
    from .test_waiting import join_queue_in

    locker = pg.locker()
    sql, t = locker.backend.sql, pg.table
    locker.try_acquire("n").release()  # the name's row: from here on a grant is the UPDATE's
    conn = psycopg.connect(libpq_dsn(pg.url))  # transactions: the server counts each one's calls
    try:
        conn.execute("SET LOCAL track_functions = 'pl'")
    except psycopg.errors.InsufficientPrivilege:
        conn.close()
        pytest.skip("track_functions may only be set by a superuser, which DBLOCK_TEST_URL's role is not")
    conn.rollback()

    def counted() -> dict[str, int]:
        # This session's calls not yet reported, which may include earlier transactions': a difference.
        rows = conn.execute(
            "SELECT funcname, calls FROM pg_stat_xact_user_functions WHERE funcname LIKE %s", (t + "\\_%",)
        ).fetchall()
        return {name.removeprefix(t + "_"): n for name, n in rows}

    def calls(case: Any) -> dict[str, int]:
        conn.execute("SET LOCAL track_functions = 'pl'")
        before = counted()
        case()
        after = counted()
        conn.rollback()
        return {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}

    def grant(owner: str) -> Any:
        binds = {"name": "n", "owner": owner, "ttl": 60.0, "label": "test"}
        return conn.execute(sql.acquire, binds).fetchone()

    def grant_and_release() -> None:
        granted, token, _, _ = grant("a" * 32)
        assert granted
        assert conn.execute(sql.release, {"name": "n", "owner": "a" * 32, "token": token}).fetchall() == [(token, False)]

    def miss() -> None:
        assert grant("a" * 32)[0] is True
        assert grant("b" * 32)[0] is False

    def hand_on() -> None:
        _, token, _, _ = grant("a" * 32)
        join_queue_in(conn, pg, "n", "next", 60)
        assert conn.execute(sql.release, {"name": "n", "owner": "a" * 32, "token": token}).fetchall() == [(token, True)]
        assert conn.execute(f"SELECT owner FROM {t} WHERE name = 'n'").fetchall() == [("next",)]

    try:
        assert calls(grant_and_release) == {}
        assert calls(miss) == {"missed": 1}
        assert calls(hand_on) == {"hand_on": 1}
    finally:
        conn.close()


def test_grants_are_hot_updates(pg: Db) -> None:
    """Only the primary key is indexed, so a grant or release never touches an index."""
    locker = pg.locker()
    for _ in range(50):
        locker.try_acquire("hot").release()
    indexes = pg.query("SELECT indexdef FROM pg_indexes WHERE tablename = %s", (pg.table,))
    assert len(indexes) == 1 and "(name)" in indexes[0][0]


def test_lock_statements_ignore_the_callers_transaction(pg: Db) -> None:
    """A caller's open transaction neither hides nor rolls back a grant."""
    engine = create_engine(pg.url)
    locker = Locker(engine, table=pg.table)
    with engine.connect() as conn:
        conn.begin()
        conn.execute(text("SELECT 1"))
        lease = locker.try_acquire("tx", ttl=60)
        # visible to everyone else at once ...
        assert pg.query(f"SELECT token FROM {pg.table} WHERE name = 'tx'") == [(lease.token,)]
        # ... and to the caller's own transaction
        assert conn.execute(text(f"SELECT token FROM {pg.table} WHERE name = 'tx'")).scalar() == lease.token
        conn.rollback()
    assert pg.query(f"SELECT owner FROM {pg.table} WHERE name = 'tx'") == [(lease.owner,)]
    assert lease.release() is True
    locker.close()
    engine.dispose()


def test_held_locks_do_not_drain_the_callers_pool(pg: Db) -> None:
    engine = create_engine(pg.url, pool_size=1, max_overflow=0, pool_timeout=2)
    locker = Locker(engine, table=pg.table)
    leases = [locker.try_acquire(f"n{i}") for i in range(5)]
    with engine.connect() as conn:  # the app's only pooled connection is still free
        assert conn.execute(text("SELECT 1")).scalar() == 1
    for lease in leases:
        lease.release()
    locker.close()
    engine.dispose()


def test_schema_option(pg: Db) -> None:
    schema = "s_" + pg.table
    locker = Locker(pg.url, table="locks", schema=schema)
    locker.create_schema()
    try:
        lease = locker.try_acquire("x")
        assert lease is not None
        assert pg.query(f"SELECT token FROM {schema}.locks") == [(lease.token,)]
        assert pg.query(f"SELECT version_num FROM {schema}.alembic_version_dblock")
    finally:
        locker.close()
        pg.query(f"DROP SCHEMA {schema} CASCADE")


def test_postgresql_url_without_driver_means_psycopg(pg: Db) -> None:
    plain = pg.url.replace("postgresql+psycopg://", "postgresql://", 1)
    locker = Locker(plain, table=pg.table)
    assert locker.engine.dialect.driver == "psycopg"
    assert locker.try_acquire("plain") is not None
    locker.close()


def test_tokens_grow_and_leases_survive_a_database_crash(pg: Db, pg_server) -> None:
    """An immediate (crash) restart of PostgreSQL: granted leases persist, tokens never go back."""
    from pgserver._commands import pg_ctl

    locker = pg.locker()
    held = locker.try_acquire("held", ttl=120)
    for _ in range(5):
        last = locker.try_acquire("churn")
        last.release()
    pg_ctl(["-m", "immediate", "-w", "restart"], pgdata=pg_server.pgdata, user=pg_server.system_user)
    # The pooled connection died with the server: dblock reconnects and retries.
    after = locker.try_acquire("churn")
    assert after is not None and after.token > last.token
    assert locker.try_acquire("held") is None  # the committed grant survived
    assert held.release() is True
    assert locker.try_acquire("held").token > after.token


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "polling"])
def test_waiter_sleeps_until_the_known_expiry_not_the_backoff(pg: Db, proxy: PgProxy, fair: bool) -> None:
    """With a 60 s backoff, a waiter still takes a lock that expires in 0.2 s, in 2-3 attempts."""
    pg.locker().try_acquire("exp", ttl=0.2)
    locker = Locker(proxy.url, table=pg.table, poll_min=60, poll_max=60, fair=fair)
    warm_waiting(pg, locker)
    before = proxy.round_trips
    lease = locker.acquire("exp", timeout=30)
    assert lease is not None
    assert proxy.round_trips - before <= 3  # a miss that learns the expiry, then the grant
    locker.close()


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "polling"])
def test_timeout_is_honoured_with_a_long_backoff(pg: Db, proxy: PgProxy, fair: bool) -> None:
    """A 60 s backoff never makes a 0.1 s timeout wait longer: the last attempt is at the deadline."""
    pg.locker().try_acquire("long", ttl=60)
    locker = Locker(proxy.url, table=pg.table, poll_min=60, poll_max=60, fair=fair)
    warm_waiting(pg, locker)
    before = proxy.round_trips
    with pytest.raises(LockNotAcquired):
        locker.acquire("long", timeout=0.1)
    # The first attempt, and the one at the deadline (fair: leaving the queue).
    assert proxy.round_trips - before == 2
    locker.close()


@pytest.mark.parametrize("variant", ["dblock", "broken: prune without the table lock"])
def test_g2_prune_cannot_slip_under_a_first_insert(pg: Db, variant: str) -> None:
    """A first insert draws its token, then stalls; a competing grant and a prune of its
    row happen meanwhile. The stalled insert must not land a token below the competitor's.

    The stall is a trigger waiting on an advisory lock the test holds. dblock's prune
    waits for the stalled acquire (table lock); the broken variant deletes the row
    under it and the late insert writes the smaller token.
    """
    import threading

    from .test_guarantees import audited_grants, install_audit, inversions

    t, seq = pg.table, f"{pg.table}_token_seq"
    install_audit(pg)
    pg.query(
        f"""CREATE FUNCTION {t}_stall() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          IF NEW.owner <> 'A' AND pg_try_advisory_xact_lock(7001) THEN
            PERFORM pg_advisory_lock_shared(7002);  -- held exclusively by the test
            PERFORM pg_advisory_unlock_shared(7002);
          END IF;
          RETURN NEW;
        END $$"""
    )
    pg.query(f"CREATE TRIGGER {t}_stall_tr BEFORE INSERT ON {t} FOR EACH ROW EXECUTE FUNCTION {t}_stall()")
    locker = pg.locker()
    if variant != "dblock":
        import dataclasses

        locker.backend.sql = dataclasses.replace(locker.backend.sql, prune_lock=None)
    gate = psycopg.connect(libpq_dsn(pg.url), autocommit=True)
    gate.execute("SELECT pg_advisory_lock(7002)")
    watcher = psycopg.connect(libpq_dsn(pg.url), autocommit=True)

    def waiting(kind: str, text_like: str) -> bool:
        return bool(
            watcher.execute(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = %s AND query LIKE %s",
                (kind, text_like),
            ).fetchall()
        )

    stalled: list = []
    b = threading.Thread(target=lambda: stalled.append(locker.try_acquire("fresh", ttl=60)))
    pruned: list = []
    p = threading.Thread(target=lambda: pruned.append(locker.prune(older_than=60)))
    b.start()
    try:
        # The acquire's statement (its first insert runs in the missed function it calls).
        wait_for(lambda: waiting("Lock", "%WITH upd%"), what="the first insert to stall after drawing its token")
        # A competing first grant of the same name, already expired, then a prune.
        pg.query(
            f"INSERT INTO {t} (name, owner, token, acquired_at, expires_at)"
            f" VALUES ('fresh', 'A', nextval('{seq}'), now() - interval '1 hour', now() - interval '1 hour')"
        )
        p.start()
        wait_for(lambda: bool(pruned) or waiting("Lock", "%LOCK TABLE%"), what="the prune to finish or wait")
    finally:
        gate.execute("SELECT pg_advisory_unlock(7002)")  # a stalled statement must not outlive a failed test
        b.join(30)
        if p.ident is not None:  # started
            p.join(30)
        gate.close()
        watcher.close()
    grants = audited_grants(pg)
    if variant == "dblock":
        assert inversions(grants) == []
    else:
        assert inversions(grants), "the broken variant should have inserted a smaller token"


def test_retry_survives_every_pooled_connection_dying(pg: Db) -> None:
    """After a restart or failover all idle connections are dead: the retry must use a new one."""
    locker = pg.locker()
    conns = [locker._driver._checkout(time.monotonic() + 5) for _ in range(3)]
    pids = [c.raw.info.backend_pid for c in conns]
    for c in conns:
        locker._driver._checkin(c)
    pg.query("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,))
    wait_for(
        lambda: not pg.query("SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)),
        what="the backends to exit",
    )
    lease = locker.try_acquire("after-restart")
    assert lease is not None and lease.release() is True


def test_tokens_of_every_size_share_one_prepared_statement(pg: Db, proxy: PgProxy) -> None:
    """Every int is sent as a bigint: psycopg would send int2 below 32,768 and int4 above, and a
    prepared statement is keyed by its parameters' types, so releases whose tokens cross that
    line would prepare the release again, a round trip more."""
    locker = Locker(proxy.url, table=pg.table)
    pg.query(f"SELECT setval('{pg.table}_token_seq', 32757)")
    leases = [locker.try_acquire(f"n{i}", ttl=60) for i in range(20)]
    assert [lease.token for lease in leases] == list(range(32758, 32778))  # 10 below 32,768, 10 above
    proxy.reset()
    for lease in leases:
        assert lease.release()
    assert proxy.round_trips == 20 + 1  # one round trip each, and one to prepare the release
    locker.close()


# -- statements through libpq ----------------------------------------------------------
PROBE = """SELECT %(a)s::text AS a, %(b)s::bigint AS b, %(c)s::float8 AS c,
    '2026-11-29 12:00:00.123456+00'::timestamptz AS at, NULL::float8 AS none,
    %(b)s > 0 AS yes, %(a)s || '%%' AS pct, 1.5::numeric AS num, ARRAY[%(a)s] AS arr"""


def _prepared(conn: psycopg.Connection) -> dict[str, str]:
    return dict(conn.execute("SELECT name, statement FROM pg_prepared_statements").fetchall())


@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "unprepared"])
def test_a_statement_through_libpq_reads_as_through_psycopgs_cursor(pg: Db, prepare: bool) -> None:
    """dblock sends its statements through libpq with psycopg's adaptation, not psycopg's cursor:
    the same binds give the same rows, of the same types; a key used twice is one bind, and
    ``%%`` is a percent sign. Prepared, the name is the text's digest and says so on the server."""
    backend = pg.locker(prepare=prepare).backend
    params = {"a": "x", "b": 40_000, "c": 2.5}
    with backend.connect(time.monotonic() + 5) as raw:  # a connection as dblock opens them, its adapters
        expected = raw.cursor().execute(PROBE, params).fetchall()
        session = backend.cursor(raw)
        got = backend.execute(session, PROBE, params)
        assert got == expected and [type(v) for v in got[0]] == [type(v) for v in expected[0]]
        assert got[0][6] == "x%" and got[0][3].tzinfo is not None
        names = [name for name in _prepared(raw) if name.startswith("dblock_")]
        if prepare:
            (name,) = names
            assert "$1::text" in _prepared(raw)[name] and "$2::bigint" in _prepared(raw)[name]
            assert backend.execute(session, PROBE, {**params, "b": 1}) != got  # by name again: every int a bigint
            assert [n for n in _prepared(raw) if n.startswith("dblock_")] == [name]
            ((sql, types),) = session.prepared
            other = pg.locker().backend  # another client: the same name; other types, another
            assert other._plan(PROBE).name(types) == name.encode()
            assert other._plan(PROBE).name((*types[:-1], 700)) != name.encode()
        else:
            assert names == []


def test_a_statement_another_client_prepared_under_its_name_runs(pg: Db) -> None:
    """Behind a transaction pooler a session may hold a statement another client prepared there.
    Its name is the statement's own (the digest of its text and bind types), so finding it
    prepared already is no error: the call runs it, the same text."""
    locker = pg.locker()
    backend = locker.backend
    with psycopg.connect(libpq_dsn(pg.url), autocommit=True) as raw:
        other = backend.cursor(raw)  # "another client": prepares PROBE on this session
        first = backend.execute(other, PROBE, {"a": "y", "b": 1, "c": 0.5})
        session = backend.cursor(raw)  # this client's first call on the session
        assert backend.execute(session, PROBE, {"a": "y", "b": 1, "c": 0.5})[0][:3] == first[0][:3]
        assert len([n for n in _prepared(raw) if n.startswith("dblock_")]) == 1


def test_a_lone_percent_sign_in_a_statement_is_refused_before_it_is_sent(pg: Db) -> None:
    locker = pg.locker()
    with psycopg.connect(libpq_dsn(pg.url), autocommit=True) as raw:
        with pytest.raises(ValueError, match="lone %"):
            locker.backend.execute(locker.backend.cursor(raw), "SELECT 5 % 2", {})
        assert _prepared(raw) == {}


def test_a_statement_whose_prepare_failed_is_prepared_again_next_time(pg: Db) -> None:
    """A prepare that fails (here: the table is not there yet) leaves the statement not
    prepared on the connection: the next call prepares it again and runs it, rather than
    sending a name the server never knew."""
    locker = pg.locker()
    backend = locker.backend
    statement = f"SELECT count(*) FROM {pg.table}_later WHERE %(a)s::text IS NOT NULL"
    with backend.connect(time.monotonic() + 5) as raw:
        session = backend.cursor(raw)
        with pytest.raises(psycopg.errors.UndefinedTable):
            backend.execute(session, statement, {"a": "x"})
        assert session.prepared == {}
        pg.query(f"CREATE TABLE {pg.table}_later (id int)")
        try:
            assert backend.execute(session, statement, {"a": "x"}) == [(0,)]
        finally:
            pg.query(f"DROP TABLE {pg.table}_later")
