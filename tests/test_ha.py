"""dblock across PostgreSQL failovers, on a real Patroni + etcd cluster of three nodes (tests/ha.py).

Clients use one multi-host URL (``host=a&host=b&host=c`` with
``target_session_attrs=read-write``) and find the new primary by themselves.
The primary's postmaster is SIGKILLed (an unplanned failover), and later a
planned switchover runs, while client processes race for a lock with tiny TTLs
and increment a fenced counter. Everything is checked against what the new
primary holds: the audit of every lock-row change and the counter's log,
replicated from the old primary.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import psycopg
import pytest

import dblock
from dblock import DBLockError, Locker

from . import ha
from .conftest import Db
from .docs import samples
from .test_guarantees import assert_race_was_safe

pytestmark = [pytest.mark.ha, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
# The documented bound for a waiting acquire (docs/failures.md): timeout + 2.5 s. A second of slack for a busy machine.
WAIT_BOUND = 2.5 + 1.0


class HaDb(Db):
    """A Db whose direct connections follow the primary (libpq's multi-host keywords)."""

    def __init__(self, cluster: ha.Cluster, table: str) -> None:
        super().__init__("postgresql", cluster.url, table)
        self.cluster = cluster

    def connect(self):  # type: ignore[no-untyped-def]
        return psycopg.connect(self.cluster.dsn, autocommit=True)

    def drop(self) -> None:
        for locker in self.lockers:
            locker.close()
        t = self.table
        self.query(
            f"DROP TABLE IF EXISTS {t}_audit, {t}_counter, {t}_writes, {t}, {t}_fences, {t}_waiters, {t}_procs,"
            f" alembic_version_dblock_{t} CASCADE"
        )
        self.query(f"DROP SEQUENCE IF EXISTS {t}_token_seq")


@pytest.fixture
def hdb(ha_cluster: ha.Cluster) -> Iterator[HaDb]:
    ha_cluster.wait_healthy(True)
    d = HaDb(ha_cluster, "t_" + secrets.token_hex(6))
    Locker(d.url, table=d.table).create_schema()
    yield d
    if ha_cluster.healthy(True) or ha_cluster.leader() is not None:
        d.drop()


# -- the database's own record -------------------------------------------------
def install_audit(db: Db) -> None:
    """Every change of a lock row, in order, with the database's clock and the node that made it.

    Columns op, old_token and new_token are those of test_guarantees' audit, so
    its checks read this one too. ``handoff``: the change was made by a
    release handing the lease to a waiter (the hand-off function; since 0012,
    hand_on, which the release's RETURNING calls after its own change, recorded
    after hand_on's: an AFTER trigger fires as its statement ends).
    """
    t = db.table
    db.query(
        f"CREATE TABLE {t}_audit (seq bigserial PRIMARY KEY, op text, name text, old_owner text, new_owner text,"
        " old_token bigint, new_token bigint, old_expires timestamptz, expires_at timestamptz,"
        " txnow timestamptz, at timestamptz, port int, handoff boolean)"
    )
    db.query(
        f"""CREATE FUNCTION {t}_audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          IF TG_OP = 'INSERT' THEN
            INSERT INTO {t}_audit (op, name, new_owner, new_token, expires_at, txnow, at, port, handoff)
            VALUES ('I', NEW.name, NEW.owner, NEW.token, NEW.expires_at, now(), clock_timestamp(),
                    inet_server_port(), false);
          ELSIF TG_OP = 'UPDATE' THEN
            INSERT INTO {t}_audit (op, name, old_owner, new_owner, old_token, new_token, old_expires, expires_at,
                                   txnow, at, port, handoff)
            VALUES ('U', NEW.name, OLD.owner, NEW.owner, OLD.token, NEW.token, OLD.expires_at, NEW.expires_at,
                    now(), clock_timestamp(), inet_server_port(),
                    strpos(current_query(), '_handoff(') > 0 OR strpos(current_query(), '_hand_on(') > 0);
          END IF;
          RETURN NULL;
        END $$"""
    )
    db.query(
        f"CREATE TRIGGER {t}_audit_tr AFTER INSERT OR UPDATE ON {t} FOR EACH ROW EXECUTE FUNCTION {t}_audit_fn()"
    )


@dataclass
class Change:
    seq: int
    op: str
    name: str
    old_owner: str | None
    new_owner: str | None
    old_token: int | None
    new_token: int | None
    old_expires: datetime | None
    expires_at: datetime | None
    txnow: datetime
    at: datetime
    port: int
    handoff: bool

    @property
    def grant(self) -> bool:
        return self.new_owner is not None and (self.op == "I" or self.new_token != self.old_token)


def audit_of(db: HaDb, name: str) -> HaDb:
    """A Db whose ``<table>_audit`` is the audit of one lock name (a view), for test_guarantees' checks."""
    view = HaDb(db.cluster, f"{db.table}_{name}")
    assert name.isidentifier()  # spliced as a literal: DDL takes no parameters
    db.query(f"CREATE VIEW {view.table}_audit AS SELECT * FROM {db.table}_audit WHERE name = '{name}' ORDER BY seq")
    return view


def audit(db: Db) -> list[Change]:
    return [Change(*row) for row in db.query(f"SELECT * FROM {db.table}_audit ORDER BY seq")]


def overlaps_by_database_clock(changes: list[Change]) -> list[str]:
    """G1 by the database's clock: a grant while another lease of the name was live.

    A lease is live from its grant until it is released, or else until its
    expiry (extends move it). A grant is allowed when the name's previous
    lease was released, had expired by the granting transaction's clock, or is
    the lease its holder's release hands over in that very statement.
    """
    found = []
    current: dict[str, tuple[int, datetime | None, bool]] = {}  # name -> (token, expires_at, ended)
    for c in changes:
        previous = current.get(c.name)
        if c.grant:
            if previous is not None and not previous[2] and not c.handoff:
                token, expires, _ = previous
                if expires is not None and c.txnow < expires:
                    found.append(
                        f"{c.name}: token {c.new_token} granted at {c.txnow} while token {token} ran until {expires}"
                    )
            current[c.name] = (int(c.new_token or 0), c.expires_at, False)
        elif previous is not None and c.new_token == previous[0]:
            if c.new_owner is None:
                current[c.name] = (previous[0], previous[1], True)  # released
            else:
                current[c.name] = (previous[0], c.expires_at, False)  # extended (or a retried grant)
    return found


def windows(changes: list[Change]) -> list[tuple[int, int, float]]:
    """(old port, new port, seconds) for each change of the node that grants: the last grant on
    the old primary to the first grant on the new one, by the database's clock."""
    grants = [c for c in changes if c.grant]
    return [
        (a.port, b.port, (b.at - a.at).total_seconds()) for a, b in zip(grants, grants[1:]) if a.port != b.port
    ]


def create_counter(db: Db) -> None:
    t = db.table
    db.query(f"CREATE TABLE {t}_counter (id int PRIMARY KEY, n int NOT NULL, fence_token bigint NOT NULL DEFAULT 0)")
    db.query(f"CREATE TABLE {t}_writes (id text PRIMARY KEY, token bigint NOT NULL, seq bigserial)")
    db.query(f"INSERT INTO {t}_counter (id, n) VALUES (1, 0)")


# -- client processes ------------------------------------------------------------
class Workers:
    """ha_worker.py processes started together, stopped on demand."""

    def __init__(self, db: Db, count: int, race_ttl: float, counter_ttl: float, wait_timeout: float) -> None:
        command = [
            sys.executable, str(HERE / "ha_worker.py"), db.url, db.table,
            repr(race_ttl), "4", repr(counter_ttl), "2", repr(wait_timeout),
        ]
        self.procs = [
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(count)
        ]
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line == "ready\n", f"a worker did not start: {line!r} {p.stderr.read() if p.stderr else ''}"
        self.start_at = time.monotonic() + 0.05
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(repr(self.start_at) + "\n")
            p.stdin.flush()

    def stop(self, timeout: float = 60) -> list[dict[str, Any]]:
        reports = []
        try:
            for p in self.procs:
                assert p.stdin is not None
                p.stdin.write("stop\n")
                p.stdin.flush()
            for p in self.procs:
                out, err = p.communicate(timeout=timeout)
                assert p.returncode == 0, err[-3000:]
                reports.append(json.loads(out))
        finally:
            self.kill()
        return reports

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


# -- the failover scenario ---------------------------------------------------------------------
def test_failover_and_switchover_keep_every_guarantee(ha_cluster: ha.Cluster, hdb: HaDb) -> None:
    """3 processes x 4 threads race for "hot" with 5 ms TTLs (try_acquire), and 3 x 2 threads
    wait for "counter" (fair queue) and make fenced increments, often after pausing past their
    TTL, while the primary's postmaster is SIGKILLed; once the cluster has healed, a planned
    switchover follows. Under synchronous replication, from the new primary's replicated audit:

    - G1: no grant of a name while its previous lease was live, by the database's clock; and no
      two clients trusted a lease of "hot" at the same moment (their own clocks);
    - G2: every grant's token above the previous grant's, across both changes of primary, and
      every token a client was given is in the audit (no acknowledged grant was lost);
    - the counter equals the number of logged increments; every increment a client saw commit
      is there, none that was refused or never sent is; the fence only ever let tokens grow;
    - every client process kept working (grants after each change of primary);
    - no waiting acquire outlived its timeout (+ the documented 2.5 s).
    """
    install_audit(hdb)
    create_counter(hdb)
    workers = Workers(hdb, 3, race_ttl=0.005, counter_ttl=0.2, wait_timeout=2.0)
    try:
        sleep_until(workers.start_at + 3)
        old = ha_cluster.kill_primary()
        killed = time.monotonic()
        after_failover = ha_cluster.wait_healthy(True, timeout=60)
        healed = time.monotonic()
        sleep_until(healed + 2)
        ha_cluster.switchover()
        after_switchover = ha_cluster.wait_healthy(True, timeout=60)
        switched = time.monotonic()
        sleep_until(switched + 2)
        reports = workers.stop()
    finally:
        workers.kill()
    assert after_failover.name != old.name
    assert after_switchover.name != after_failover.name

    changes = audit(hdb)
    grants = [g for r in reports for g in r["grants"]]
    # G2 and client-side G1: test_guarantees' checks, on the replicated audit of "hot" alone
    # (G2 is per name; grants of two names draw from one sequence and may commit out of order).
    assert_race_was_safe(audit_of(hdb, "hot"), grants)
    assert overlaps_by_database_clock(changes) == []
    counter_tokens = [c.new_token for c in changes if c.grant and c.name == "counter"]
    assert all(a < b for a, b in zip(counter_tokens, counter_tokens[1:])), "counter grants' tokens did not grow"

    # The counter: no lost, no double-applied increment; the fence never went back.
    ((n,),) = hdb.query(f"SELECT n FROM {hdb.table}_counter")
    logged = hdb.query(f"SELECT id, token FROM {hdb.table}_writes ORDER BY seq")
    writes = [w for r in reports for w in r["writes"]]
    ok = {w[0] for w in writes if w[3] == "ok"}
    doubt = {w[0] for w in writes if w[3] == "doubt"}
    refused = sum(1 for w in writes if w[3] == "fenced")
    ids = [i for i, _ in logged]
    assert n == len(logged), f"counter {n} but {len(logged)} increments logged"
    assert ok <= set(ids), f"{len(ok - set(ids))} acknowledged increments lost"
    assert set(ids) <= ok | doubt, "an increment that was refused (or never sent) was applied"
    logged_tokens = [tok for _, tok in logged]
    assert all(a <= b for a, b in zip(logged_tokens, logged_tokens[1:])), "the fence accepted an older token"
    assert refused > 0, "no stale write was refused: the counter's holders never overran their TTL"

    # Every process kept working through both changes of primary.
    for i, r in enumerate(reports):
        received = [g[1] for g in r["grants"]]
        assert any(killed < t < healed for t in received) or any(t > healed for t in received), i
        assert any(t > switched for t in received), f"process {i} got no grant after the switchover"
        assert any(w[3] == "ok" and w[2] > killed for w in r["writes"]), f"process {i} wrote nothing after the failover"
    # No wait outlived its timeout.
    waits = [w for r in reports for w in r["waits"]]
    overrun = max(ended - started - timeout for started, ended, timeout, _ in waits)
    assert overrun <= WAIT_BOUND, f"a wait outlived its timeout by {overrun:.2f} s"

    gaps = windows(changes)
    ports = {n.pg_port: n.name for n in ha_cluster.nodes}
    assert len(gaps) >= 2, gaps
    errors = sum(len(r["errors"]) for r in reports)
    outcomes = [w[3] for w in waits]
    ha.FIGURES.append(
        f"synchronous failover + switchover: {len(grants)} race grants, {len(ok)} fenced increments, "
        f"{refused} stale writes refused, {len(doubt)} in doubt ({len(set(ids) & doubt)} of them applied); "
        f"race errors {errors}; waits {outcomes.count('granted')} granted, {outcomes.count('timeout')} timed out, "
        f"{outcomes.count('unavailable')} unavailable, worst overrun {overrun:+.2f} s"
    )
    for a, b, seconds in gaps:
        ha.FIGURES.append(f"  no grants from {ports.get(a, a)} to {ports.get(b, b)}: {seconds:.2f} s (database clock)")


# -- what a promoted standby knows: synchronous against asynchronous replication ------------------
@pytest.mark.parametrize("synchronous", [True, False], ids=["synchronous", "asynchronous"])
def test_tokens_after_promoting_a_standby_that_fell_behind(ha_cluster: ha.Cluster, hdb: HaDb, synchronous: bool) -> None:
    """The standbys stop receiving WAL (the primary's WAL senders are SIGSTOPped), clients keep taking
    leases from the primary, then its postmaster is SIGKILLed and Patroni promotes a standby.

    Asynchronous replication: the primary answers every grant at once, the promoted standby has
    none of them, nor the sequence's advance, and hands out again a token that a client was
    already given: G2 (and with it the fence) is broken. This is what docs/high-availability.md states and
    what create_schema() warns about.

    Synchronous replication: no grant is answered while no standby confirms it (each try is cut
    off at op_timeout, DatabaseUnavailable: it may or may not have committed, and a client
    treats it as not granted); after the promotion every token is above every token a client
    was given.
    """
    if not synchronous:
        ha_cluster.set_synchronous(False)
    try:
        locker = hdb.locker(op_timeout=1)
        given: list[int] = []
        for _ in range(5):
            lease = locker.try_acquire("x", ttl=60)
            assert lease is not None
            given.append(lease.token)
            lease.release()
        ha.wait_replayed(ha_cluster)
        replicated = max(given)
        cut_off = 0
        with ha.standbys_stalled(ha_cluster) as senders:
            # Past the sequence's 32 values logged ahead, so the standbys' copy of it falls behind.
            for _ in range(3 if synchronous else 100):
                try:
                    lease = locker.try_acquire("x", ttl=60)
                except dblock.DatabaseUnavailable:
                    cut_off += 1
                    continue
                assert lease is not None
                given.append(lease.token)
                lease.release()
            old = ha.kill_primary_and_its_senders(ha_cluster, senders)
        ha.wait_new_leader(ha_cluster, old)
        after = fresh_grant(hdb, "x")
        again = [t for t in given if t >= after]
        if synchronous:
            assert cut_off == 3 and max(given) == replicated, "a grant was answered that no standby had confirmed"
            assert again == [], f"token {after} was already given to a client (G2 broken)"
        else:
            assert cut_off == 0 and len(given) == 105
            assert after in given, f"expected a reissued token: got {after}, the old primary gave up to {max(given)}"
        ha.FIGURES.append(
            f"{'synchronous' if synchronous else 'asynchronous'}, standbys behind, primary killed: clients were "
            f"given tokens up to {max(given)} ({len(given) - 5} while the standbys received nothing, {cut_off} "
            f"grants cut off unanswered); the promoted standby's next grant: token {after}"
            + (f", handed out twice ({len(again)} tokens given before are >= it)" if again else ", above all of them")
        )
    finally:
        if not synchronous:
            ha_cluster.set_synchronous(True)
        ha_cluster.wait_healthy(True)


def fresh_grant(db: HaDb, name: str, timeout: float = 30) -> int:
    """The token of a grant of ``name`` by a new client on the current primary (the lease is released)."""
    locker = Locker(db.url, table=db.table)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                lease = locker.acquire(name, ttl=60, timeout=5)
                lease.release()
                return lease.token
            except DBLockError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        locker.close()


def test_create_schema_warns_when_replication_is_asynchronous(ha_cluster: ha.Cluster, hdb: HaDb, pg_url: str) -> None:
    """The server tells whether its standbys confirm commits: create_schema() (and so `dblock
    migrate`) warns with ReplicationWarning when they do not, and says nothing under synchronous
    replication or on a server without standbys."""
    locker = hdb.locker()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails
        locker.create_schema()
        single = Db("postgresql", pg_url, hdb.table)
        try:
            single.locker().create_schema()  # a server without standbys: nothing to say
        finally:
            single.drop()
    ha_cluster.set_synchronous(False)
    try:
        with pytest.warns(dblock.ReplicationWarning, match=r"streams to 2 standby\(s\) asynchronously"):
            locker.create_schema()
        out = subprocess.run(
            [sys.executable, "-m", "dblock", "--url", hdb.url, "--table", hdb.table, "migrate"],
            capture_output=True, text=True, timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "asynchronously" in out.stderr and "fencing token again" in out.stderr
    finally:
        ha_cluster.set_synchronous(True)


# -- renewal and `dblock run` across a failover -------------------------------------------------
def test_renewal_and_dblock_run_ride_through_a_failover(ha_cluster: ha.Cluster, hdb: HaDb) -> None:
    """Renewing leases (in this process) and a `dblock run` (its own process) hold locks while the
    primary's postmaster is SIGKILLed. A renewing lease either survives, its extend landing on
    the new primary within the lease's trust, or is reported lost (lease.lost, on_lost once),
    never both and never silently: a lease not reported lost is live on the new primary under
    its own owner and token, and one reported lost is renewed no more. Leases whose trust
    outlasts the failover by far survive; so does `dblock run`, whose command finishes and
    whose exit status is the command's."""
    locker = hdb.locker(op_timeout=1)
    lost_calls: dict[str, int] = {}

    def on_lost(lease: dblock.Lease) -> None:
        lost_calls[lease.name] = lost_calls.get(lease.name, 0) + 1

    # ttl 9: extended every 3 s, so at least 6 s of trust remain when the primary dies.
    leases = {ttl: locker.acquire(f"renewed-{ttl}", ttl=ttl, renew=True, on_lost=on_lost) for ttl in (1.0, 2.0, 9.0)}
    run = subprocess.Popen(
        [
            sys.executable, "-m", "dblock", "--url", hdb.url, "--table", hdb.table, "run", "job", "--ttl", "9",
            "--", sys.executable, "-c", "import time; print('started', flush=True); time.sleep(9); print('done')",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert run.stdout is not None and run.stdout.readline() == "started\n"
        old = ha_cluster.kill_primary()
        ha.wait_new_leader(ha_cluster, old)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, err
    assert out == "done\n"
    time.sleep(4)  # every renewal had its turn on the new primary
    rows = {r[0]: r for r in hdb.query(f"SELECT name, owner, token, expires_at > now() FROM {hdb.table}")}
    outcome = []
    for ttl, lease in leases.items():
        name, owner, token, live = rows[lease.name]
        if lease.lost.is_set():
            assert lost_calls.get(lease.name) == 1, "lost, but on_lost did not run exactly once"
            assert lease.remaining() == 0
            # 4 s after the failover, a lease still being extended would be live under its owner.
            assert not (owner == lease.owner and live), "a lease reported lost is still being extended"
            outcome.append(f"ttl {ttl:g} s: reported lost")
        else:
            assert lease.name not in lost_calls
            assert (owner, token, live) == (lease.owner, lease.token, True), "kept by the client, not by the database"
            lease.extend()
            outcome.append(f"ttl {ttl:g} s: survived")
    assert not leases[9.0].lost.is_set(), "a lease with 6 s of trust left did not survive a failover"
    assert [r for r in locker.leases() if r.name == "job"] == [], "dblock run did not release its lease"
    for lease in leases.values():
        lease.release()
    ha.FIGURES.append(f"renewing leases across a failover: {', '.join(outcome)}; dblock run --ttl 9: exited 0")


def test_readme_url_finds_the_primary(ha_cluster: ha.Cluster, hdb: HaDb) -> None:
    """The multi-host example of docs/high-availability.md, with the cluster's nodes in place of db1..db3: whichever
    node is primary, the Locker finds it (the first host named is a standby here)."""
    ((_, block),) = samples("high-availability.md")
    leader = ha_cluster.wait_healthy(True)
    order = sorted(ha_cluster.nodes, key=lambda n: n.name == leader.name)  # the primary last
    for i, node in enumerate(order, 1):
        block = block.replace(f"db{i}:5432", f"127.0.0.1:{node.pg_port}")
    block = block.replace("app@/app", "postgres@/postgres").replace("Locker(", f"Locker(table={hdb.table!r}, url=", 1)
    namespace: dict[str, Any] = {"Locker": Locker}
    exec(compile(block, "docs/high-availability.md", "exec"), namespace)
    locker = namespace["locker"]
    try:
        lease = locker.try_acquire("readme")
        assert lease is not None
        assert hdb.query(f"SELECT inet_server_port() FROM {hdb.table} WHERE name = 'readme'") == [(leader.pg_port,)]
        lease.release()
    finally:
        locker.close()


# -- the fair queue's hand-off on a waiter's look (fixed by migration 0006) ---------------------
def test_a_hand_off_made_by_a_waiters_look_waits_for_the_standby(ha_cluster: ha.Cluster, hdb: HaDb) -> None:
    """A lease that ran out unreleased is handed to the first live waiter by whichever waiter
    looks first. When that is a waiter further back, its enqueue call hands the lease over and
    then joins the line. Joining alone commits with synchronous_commit off; with a hand-off in
    the same transaction it must not (0005 did): the grant would be visible (and NOTIFYed)
    before any standby had it, and a failover could lose a lease its new holder was told of:
    another client granted the name (G1), maybe with the same token (G2).

    Here the standbys receive nothing (the primary's WAL senders are stopped); a grant must
    then stay invisible until one confirms it. The first waiter is a process SIGSTOPped while
    in line (alive by its heartbeat for a few seconds more), the holder's lease runs out, and
    a second waiter looks.
    """
    holder = hdb.locker()
    held = holder.acquire("g", ttl=2.0)
    first = subprocess.Popen(
        [sys.executable, str(HERE / "wait_worker.py"), hdb.url, hdb.table, "g", "30"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while hdb.query(f"SELECT count(*) FROM {hdb.table}_waiters WHERE name = 'g'") != [(1,)]:
            assert time.monotonic() < deadline, "the first waiter did not join the line"
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)
        time.sleep(max(0.0, held.remaining()) + 0.05)  # the holder's lease ran out, unreleased
        leader = ha_cluster.leader()
        assert leader is not None
        with ha.standbys_stalled(ha_cluster):
            second = hdb.locker(op_timeout=1)
            with pytest.raises(DBLockError):
                second.acquire("g", timeout=0.3)  # its look hands the lease to the first waiter
            ((token,),) = leader.sql(f"SELECT token FROM {hdb.table} WHERE name = 'g'")
            visible = token != held.token
        first.send_signal(signal.SIGCONT)
        out, _ = first.communicate(timeout=30)
        assert out.startswith("granted")
        assert not visible, "a hand-off was visible on the primary while no standby had it"
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.wait()
