"""The backend contract (issue 23, DESIGN.md §10): each lock statement's promise, checked on every backend.

Each test sends a backend's statements through the backend alone, as the
faces do (``backend.connect``, ``backend.cursor``, ``backend.execute`` with
``backend.sql.X``), decodes the rows with the backend's own decoders and
checks the outcome against the table itself, read back with a plain SELECT,
and against the database's clock (a lease has run out when ``sql.leases`` no
longer lists it). No Locker verb runs the statement under test, so a backend
added later is held to the same promises by adding it to the ``db`` fixture
(and to ``WRITES`` below).

Promises only some databases make are gated on the capability that carries
them (``backend.caps``), never on the database's name.
"""

from __future__ import annotations

import secrets
import threading
import time
from datetime import timedelta
from typing import Any, Iterator, Sequence

import pytest

from dblock._core import Ended, Grant, Miss, Queued, when
from dblock.backends import Backend, Statements
from dblock.schema import holders_table_name

from .conftest import ALL_BACKENDS, Db, wait_for

BACKENDS = ALL_BACKENDS

# What "wrote nothing" is measured by, per backend (a backend added later adds its own):
# a marker that moves with every write. PostgreSQL: the WAL insert position, which any
# client's write moves (so the check samples a quiet window); SQLite: total_changes() of
# the connection the statements run on.
WRITES = {
    "postgresql": "SELECT pg_current_wal_insert_lsn()::text",
    "sqlite": "SELECT total_changes()",
    # MariaDB: InnoDB's redo log position, which any client's write moves (as PostgreSQL's WAL).
    "mariadb": "SELECT variable_value FROM information_schema.global_status WHERE variable_name = 'INNODB_LSN_CURRENT'",
}
TRIES = 5  # windows sampled for a quiet one, where another client may write meanwhile
TINY = 0.05  # seconds: a ttl that runs out while the test polls the database clock


class Wire:
    """One connection of a backend, opened and used as the faces use it."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.raw = backend.connect(time.monotonic() + 30)
        self.cursor = backend.cursor(self.raw)

    @property
    def sql(self) -> Statements:  # read on every call, as the faces do
        return self.backend.sql

    def run(self, sql: str, **binds: Any) -> list[Sequence[Any]]:
        return self.backend.execute(self.cursor, sql, binds)

    def acquire(self, name: str, owner: str, ttl: float = 60.0) -> Grant | Miss:
        binds = {"name": name, "owner": owner, "ttl": ttl, "label": "contract"}
        rows = self.run(self.sql.acquire, **binds)
        holder = self.run(self.sql.holder, **binds) if self.sql.holder is not None and not rows else []
        return self.backend.acquired(rows, holder)

    def grant(self, name: str, owner: str, ttl: float = 60.0) -> Grant:
        outcome = self.acquire(name, owner, ttl)
        assert isinstance(outcome, Grant), outcome
        return outcome

    def share(
        self, name: str, owner: str, limit: int | None = None, ttl: float = 60.0, *, upgradeable: bool = False
    ) -> tuple[Grant | Miss, int | None]:
        binds = {
            "name": name, "owner": owner, "ttl": ttl, "label": "contract", "limit": limit, "upgradeable": upgradeable
        }
        rows = self.run(self.sql.share_acquire, **binds)
        holder = self.run(self.sql.share_holder, **binds) if self.sql.share_holder is not None and not rows else []
        return self.backend.share_acquired(rows, holder)

    def share_grant(
        self, name: str, owner: str, limit: int | None = None, ttl: float = 60.0, *, upgradeable: bool = False
    ) -> Grant:
        outcome, _ = self.share(name, owner, limit, ttl, upgradeable=upgradeable)
        assert isinstance(outcome, Grant), outcome
        return outcome

    def release(self, name: str, owner: str, token: int) -> Ended:
        return self.backend.ended(self.run(self.sql.release, name=name, owner=owner, token=token), held=False)

    def extend(self, name: str, owner: str, token: int, ttl: float) -> list[Sequence[Any]]:
        return self.run(self.sql.extend, name=name, owner=owner, token=token, ttl=ttl)

    def leases(self) -> dict[str, list[Sequence[Any]]]:
        """The live leases by name, as ``sql.leases`` lists them (by the database's clock)."""
        listed: dict[str, list[Sequence[Any]]] = {}
        for row in self.run(self.sql.leases):
            listed.setdefault(row[0], []).append(row)
        return listed

    def wait_expired(self, name: str) -> None:
        """Poll the database until its clock says every lease of ``name`` has run out."""
        wait_for(lambda: name not in self.leases(), what=f"the lease on {name!r} to run out by the database clock")

    def let_clock_pass(self, seconds: float) -> None:
        """Return once the database's clock has moved at least ``seconds`` past its time now."""
        clock = "clock-" + secrets.token_hex(4)
        self.grant(clock, owner(), ttl=seconds)
        self.wait_expired(clock)

    def writes(self) -> Any:
        return self.run(WRITES[self.backend.name])[0][0]

    def close(self) -> None:
        self.raw.close()


@pytest.fixture
def wire(db: Db) -> Iterator[Wire]:
    # A Locker's backend is built as Locker.__init__ builds it:
    # backends.of(engine)(engine, table, schema, where, prepare=...). Only its backend is used.
    w = Wire(db.locker().backend)
    yield w
    w.close()


def owner() -> str:
    return secrets.token_hex(16)


def row(db: Db, name: str) -> tuple[Any, ...] | None:
    """The name's whole row in the lock table (every column), or None."""
    rows = db.query(f"SELECT * FROM {db.table} WHERE name = %s", (name,))
    return rows[0] if rows else None


def expiry(db: Db, name: str) -> Any:
    return db.query(f"SELECT expires_at FROM {db.table} WHERE name = %s", (name,))[0][0]


def holder_expiry(db: Db, name: str, holder: str) -> Any:
    sql = f"SELECT expires_at FROM {holders_table_name(db.table)} WHERE name = %s AND owner = %s"
    return db.query(sql, (name, holder))[0][0]


def needs_fair_queue(backend: Backend) -> None:
    if not backend.caps.fair_queue:
        pytest.skip(f"{backend.title}: caps.fair_queue is False (no fair queue, waiters poll)")


def queue_binds(name: str, who: str, until: float | None = None, seq: int | None = None) -> dict[str, Any]:
    return {
        "name": name, "owner": who, "ttl": 60.0, "label": "contract", "proc": "proc-" + who[:8], "lapse": 60.0,
        "pid": None, "start": None, "until": until, "seq": seq,
    }


# -- acquire ----------------------------------------------------------------------------
def test_acquire_miss_writes_nothing(db: Db, wire: Wire) -> None:
    """A miss (acquire of a held name) writes nothing: the row is unchanged in every column and
    the backend's write marker (PostgreSQL: the WAL position; SQLite: total_changes()) stays put."""
    a = owner()
    wire.grant("x", a)
    before = row(db, "x")
    quiet = False
    for _ in range(TRIES):  # another client's write moves PostgreSQL's WAL too: one quiet window suffices
        mark = wire.writes()
        for _ in range(3):
            outcome = wire.acquire("x", owner(), ttl=1)
            # wait: the holder's time left (SQLite pushes expiries 2 ms past the ttl)
            assert isinstance(outcome, Miss) and outcome.wait is not None and 0 < outcome.wait < 61
        if wire.writes() == mark:
            quiet = True
            break
    assert row(db, "x") == before
    assert quiet, f"every one of {TRIES} windows of 3 missed acquires moved the write marker"


def test_share_acquire_miss_behind_a_writer_writes_nothing(db: Db, wire: Wire) -> None:
    """A reader's miss behind a live writer reads only: row and write marker unchanged."""
    wire.grant("x", owner())
    before = row(db, "x")
    quiet = False
    for _ in range(TRIES):
        mark = wire.writes()
        for _ in range(3):
            outcome, free = wire.share("x", owner())
            assert isinstance(outcome, Miss) and outcome.wait is not None and outcome.wait > 0 and free is None
        if wire.writes() == mark:
            quiet = True
            break
    assert row(db, "x") == before
    assert quiet, f"every one of {TRIES} windows of 3 missed share_acquires moved the write marker"


def test_acquire_grants_a_name_with_no_row(db: Db, wire: Wire) -> None:
    """The first grant of a name writes its row: owner, the granted token and expiry."""
    a = owner()
    assert row(db, "x") is None
    grant = wire.grant("x", a)
    assert db.query(f"SELECT owner, token FROM {db.table} WHERE name = %s", ("x",)) == [(a, grant.token)]
    assert when(expiry(db, "x")) == grant.expires_at
    assert "x" in wire.leases()


def test_acquire_grants_a_released_name_a_larger_token(db: Db, wire: Wire) -> None:
    """A free (released) name is granted to a new owner, with a token above the last grant's (G2)."""
    a, b = owner(), owner()
    first = wire.grant("x", a)
    assert wire.release("x", a, first.token) == Ended(True)
    second = wire.grant("x", b)
    assert second.token > first.token
    assert db.query(f"SELECT owner, token FROM {db.table} WHERE name = %s", ("x",)) == [(b, second.token)]


def test_acquire_grants_an_expired_lease_a_larger_token(db: Db, wire: Wire) -> None:
    """Once a lease ran out by the database's clock, another owner is granted it, with a larger token."""
    first = wire.grant("x", owner(), ttl=TINY)
    assert isinstance(wire.acquire("x", owner()), Miss)
    wire.wait_expired("x")
    second = wire.grant("x", owner())
    assert second.token > first.token


def test_acquire_after_prune_draws_a_larger_token(db: Db, wire: Wire) -> None:
    """A name whose row was pruned gets, when it comes back, a token above every earlier grant (G2)."""
    a = owner()
    first = wire.grant("x", a)
    assert wire.release("x", a, first.token) == Ended(True)
    wire.let_clock_pass(2 * TINY)  # (its lease is a grant too, with a larger token)
    floor = wire.backend.caps.prune_floor
    if floor:  # a name granted within the floor is kept: age x's grant past it
        db.query(f"UPDATE {db.table} SET acquired_at = acquired_at - {db.seconds(floor + 1)} WHERE name = 'x'")
    (highest,) = db.query(f"SELECT max(token) FROM {db.table}")[0]
    sql = wire.sql
    if sql.prune_lock is None:
        pruned = wire.run(sql.prune, age=TINY)
    else:  # prune_lock runs first, in prune's transaction (as Driver.run runs ``before``)
        with wire.raw.transaction():
            wire.run(sql.prune_lock)
            pruned = wire.run(sql.prune, age=TINY)
    assert ("x",) in [tuple(r) for r in pruned]
    assert row(db, "x") is None
    again = wire.grant("x", owner())
    assert again.token > highest > first.token


def test_tokens_grow_across_names(db: Db, wire: Wire) -> None:
    """One token sequence per table: each grant, of any name, draws above every earlier grant."""
    tokens = [wire.grant(name, owner()).token for name in ("a", "b", "c", "a2")]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_acquire_retry_by_the_same_owner_keeps_token_and_expiry(db: Db, wire: Wire) -> None:
    """A same-owner retry (G6) is granted the same token, and never shortens the lease."""
    a = owner()
    grant = wire.grant("x", a)
    assert len(wire.extend("x", a, grant.token, ttl=600)) == 1
    far = expiry(db, "x")
    retry = wire.grant("x", a, ttl=1)
    assert retry.token == grant.token
    assert expiry(db, "x") >= far
    assert retry.expires_at >= when(far)


# -- release, released ------------------------------------------------------------------
def test_release_compares_name_owner_token(db: Db, wire: Wire) -> None:
    """Release ends a lease only for its (name, owner, token): anything else changes nothing (G3);
    a second release ends nothing."""
    a = owner()
    grant = wire.grant("x", a)
    before = row(db, "x")
    assert wire.release("x", owner(), grant.token) == Ended(False)
    assert wire.release("x", a, grant.token + 1) == Ended(False)
    assert wire.release("y", a, grant.token) == Ended(False)
    assert row(db, "x") == before
    assert wire.release("x", a, grant.token) == Ended(True)
    assert db.query(f"SELECT owner, expires_at, token FROM {db.table} WHERE name = %s", ("x",)) == [
        (None, None, grant.token)
    ]
    assert "x" not in wire.leases()
    assert wire.release("x", a, grant.token) == Ended(False)


def test_released_tells_an_ended_lease_from_a_taken_over_one(db: Db, wire: Wire) -> None:
    """``released`` after a release returns one row; after a takeover, zero rows."""
    a, b = owner(), owner()
    grant = wire.grant("x", a, ttl=TINY)
    assert wire.run(wire.sql.released, name="x", owner=a, token=grant.token) == []  # still held
    assert wire.release("x", a, grant.token) == Ended(True)
    assert len(wire.run(wire.sql.released, name="x", owner=a, token=grant.token)) == 1
    again = wire.grant("x", a, ttl=TINY)
    wire.wait_expired("x")
    wire.grant("x", b)
    assert wire.run(wire.sql.released, name="x", owner=a, token=again.token) == []


def test_release_held_keeps_the_lease_until_the_hold_ends(db: Db, wire: Wire) -> None:
    """With its minimum hold still ahead, release_held keeps the lease (owner and token) until
    acquired_at + hold by the database clock."""
    a = owner()
    grant = wire.grant("x", a, ttl=60)
    rows = wire.run(wire.sql.release_held, name="x", owner=a, token=grant.token, hold=600)
    ended = wire.backend.ended(rows, held=True)
    assert ended.ended and ended.held_until is not None
    ((who, token, acquired_at, expires_at),) = db.query(
        f"SELECT owner, token, acquired_at, expires_at FROM {db.table} WHERE name = %s", ("x",)
    )
    assert (who, token) == (a, grant.token)
    assert abs(when(expires_at) - when(acquired_at) - timedelta(seconds=600)) < timedelta(milliseconds=1)
    assert ended.held_until == when(expires_at)
    assert [r[2] for r in wire.leases()["x"]] == [grant.token]


def test_release_held_after_the_hold_ends_the_lease(db: Db, wire: Wire) -> None:
    """With its minimum hold passed, release_held ends the lease exactly as release does."""
    a = owner()
    grant = wire.grant("x", a, ttl=60)
    wire.let_clock_pass(TINY)
    rows = wire.run(wire.sql.release_held, name="x", owner=a, token=grant.token, hold=TINY)
    assert wire.backend.ended(rows, held=True) == Ended(True)
    assert db.query(f"SELECT owner, expires_at FROM {db.table} WHERE name = %s", ("x",)) == [(None, None)]
    assert len(wire.run(wire.sql.released, name="x", owner=a, token=grant.token)) == 1


# -- extend -----------------------------------------------------------------------------
def test_extend_compares_name_owner_token(db: Db, wire: Wire) -> None:
    """Extend changes a lease only for its (name, owner, token): anything else, zero rows and no change (G3)."""
    a = owner()
    grant = wire.grant("x", a, ttl=10)
    before = row(db, "x")
    assert wire.extend("x", owner(), grant.token, ttl=600) == []
    assert wire.extend("x", a, grant.token + 1, ttl=600) == []
    assert wire.extend("y", a, grant.token, ttl=600) == []
    assert row(db, "x") == before
    ((new,),) = wire.extend("x", a, grant.token, ttl=600)
    assert when(new) > grant.expires_at
    assert expiry(db, "x") == new


def test_relabel_compares_name_owner_token_and_keeps_the_lease(db: Db, wire: Wire) -> None:
    """Relabel (an election's value) changes only the label of the lease (name, owner, token), and
    returns its grant time; anything else, zero rows and no change."""
    me = owner()
    g = wire.grant("lbl", me)

    def relabel(who: str, token: int, label: str) -> list[Sequence[Any]]:
        return wire.run(wire.sql.relabel, name="lbl", owner=who, token=token, label=label, channel="dblock_e_test")

    assert relabel(owner(), g.token, "stranger") == []  # not the owner: nothing changed
    assert relabel(me, g.token + 1, "stranger") == []
    (row,) = relabel(me, g.token, "leader value")
    ((_, holder, token, *_, label, _, _),) = wire.leases()["lbl"]
    assert (holder, token, label) == (me, g.token, "leader value")  # same lease, same term, new label
    assert when(row[0]) == when(wire.leases()["lbl"][0][3])  # the lease's acquired_at
    wire.release("lbl", me, g.token)
    assert relabel(me, g.token, "after") == []  # released: nothing changed


def test_extend_never_shortens(db: Db, wire: Wire) -> None:
    """An extend with a shorter ttl than the lease has left keeps its expiry."""
    a = owner()
    grant = wire.grant("x", a, ttl=60)
    before = expiry(db, "x")
    ((new,),) = wire.extend("x", a, grant.token, ttl=1)
    assert when(new) >= when(before)
    assert expiry(db, "x") >= before


def test_extend_many_never_shortens(db: Db, wire: Wire) -> None:
    """extend_many (renewal) never shortens a lease, and reports None for a lease it did not extend."""
    a = owner()
    grant = wire.grant("x", a, ttl=60)
    before = expiry(db, "x")
    leases = [("x", a, grant.token, 1.0), ("y", a, grant.token, 1.0)]  # y: no such lease
    rows = wire.run(wire.sql.extend_many, **wire.backend.batch(leases))
    new, missing = wire.backend.extended(rows, [("x", grant.token), ("y", grant.token)])
    assert new is not None and new >= when(before)
    assert missing is None
    assert expiry(db, "x") >= before


def test_share_extend_never_shortens(db: Db, wire: Wire) -> None:
    """share_extend never shortens a shared lease."""
    r = owner()
    grant = wire.share_grant("x", r, ttl=60)
    before = holder_expiry(db, "x", r)
    ((new,),) = wire.run(wire.sql.share_extend, name="x", owner=r, token=grant.token, ttl=1)
    assert when(new) >= when(before)
    assert holder_expiry(db, "x", r) >= before


def test_share_extend_many_never_shortens(db: Db, wire: Wire) -> None:
    """share_extend_many never shortens a shared lease, and reports None for a lease it did not extend."""
    r = owner()
    grant = wire.share_grant("x", r, ttl=60)
    before = holder_expiry(db, "x", r)
    leases = [("x", r, grant.token, 1.0), ("y", r, grant.token, 1.0)]  # y: no such lease
    rows = wire.run(wire.sql.share_extend_many, **wire.backend.batch(leases))
    new, missing = wire.backend.extended(rows, [("x", grant.token), ("y", grant.token)])
    assert new is not None and new >= when(before)
    assert missing is None
    assert holder_expiry(db, "x", r) >= before


def test_extend_revives_a_lapsed_lease_nobody_took(db: Db, wire: Wire) -> None:
    """Extend succeeds on a lease whose ttl ran out if nobody acquired it since (DESIGN §4)."""
    a = owner()
    grant = wire.grant("x", a, ttl=TINY)
    wire.wait_expired("x")
    ((new,),) = wire.extend("x", a, grant.token, ttl=60)
    assert when(new) > grant.expires_at
    (listed,) = wire.leases()["x"]
    assert (listed[1], listed[2]) == (a, grant.token) and listed[5] > 0


def test_extend_fails_after_a_takeover(db: Db, wire: Wire) -> None:
    """Once another owner took a lapsed lease, the old holder's extend and release change nothing."""
    a = owner()
    grant = wire.grant("x", a, ttl=TINY)
    wire.wait_expired("x")
    taken = wire.grant("x", owner())
    before = row(db, "x")
    assert wire.extend("x", a, grant.token, ttl=60) == []
    assert wire.release("x", a, grant.token) == Ended(False)
    assert row(db, "x") == before
    assert [r[2] for r in wire.leases()["x"]] == [taken.token]


# -- shared leases ----------------------------------------------------------------------
def test_share_acquire_grants_several_readers(db: Db, wire: Wire) -> None:
    """Readers (limit NULL) share a name: each is granted, with its own larger token."""
    readers = [owner() for _ in range(3)]
    tokens = [wire.share_grant("x", r).token for r in readers]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert sorted((r[1], r[2]) for r in wire.leases()["x"]) == sorted(zip(readers, tokens))


def test_acquire_misses_while_a_reader_holds(db: Db, wire: Wire) -> None:
    """A writer's acquire misses while a reader holds the name; after the last reader leaves it is granted."""
    r = owner()
    read = wire.share_grant("x", r)
    outcome = wire.acquire("x", owner())
    assert isinstance(outcome, Miss) and outcome.wait is not None and outcome.wait > 0
    assert len(wire.run(wire.sql.share_release, name="x", owner=r, token=read.token)) == 1
    assert wire.grant("x", owner()).token > read.token


def test_share_release_compares_name_owner_token(db: Db, wire: Wire) -> None:
    """share_release ends a shared lease only for its (name, owner, token); a second release ends nothing."""
    r = owner()
    grant = wire.share_grant("x", r)
    release = wire.sql.share_release
    assert wire.run(release, name="x", owner=owner(), token=grant.token) == []
    assert wire.run(release, name="x", owner=r, token=grant.token + 1) == []
    assert wire.run(release, name="y", owner=r, token=grant.token) == []
    assert wire.run(wire.sql.share_released, name="x", owner=r, token=grant.token) == []
    assert "x" in wire.leases()
    assert len(wire.run(release, name="x", owner=r, token=grant.token)) == 1
    assert "x" not in wire.leases()
    assert len(wire.run(wire.sql.share_released, name="x", owner=r, token=grant.token)) == 1
    assert wire.run(release, name="x", owner=r, token=grant.token) == []


def test_semaphore_limit_is_respected(db: Db, wire: Wire) -> None:
    """With limit 2, two holders are granted (free slots 1, then 0) and a third misses until one leaves."""
    s1, s2, s3 = owner(), owner(), owner()
    first, free1 = wire.share("x", s1, limit=2)
    second, free2 = wire.share("x", s2, limit=2)
    assert isinstance(first, Grant) and isinstance(second, Grant) and (free1, free2) == (1, 0)
    third, _ = wire.share("x", s3, limit=2)
    assert isinstance(third, Miss)
    assert len(wire.leases()["x"]) == 2
    assert len(wire.run(wire.sql.share_release, name="x", owner=s1, token=first.token)) == 1
    assert wire.share_grant("x", s3, limit=2).token > second.token


def test_a_shared_grant_forgets_every_holder_it_did_not_count(db: Db, wire: Wire) -> None:
    """A shared grant forgets every holder it did not count as live, even one whose lease ran out
    while the grant waited for a row lock: that holder's extend then answers zero rows, so no
    extend brings a holder back beside a grant that took its slot (one holder more than a limit)."""
    reader, lapsing, stale, late = owner(), owner(), owner(), owner()
    wire.share_grant("x", reader)  # a reader: no limit of its own, live throughout
    lapsing_grant = wire.share_grant("x", lapsing, ttl=2.0)
    wire.share_grant("x", stale, ttl=TINY)
    wire.let_clock_pass(2 * TINY)  # stale has run out, and nobody forgot it yet
    blocker = None
    if db.backend != "sqlite":  # a server: hold stale's row, which the grant must forget, so it waits there
        h = holders_table_name(db.table)
        blocker = db.connect()
        lock = f"SELECT token FROM {h} WHERE name = 'x' AND owner = %s FOR UPDATE"
        if db.backend == "mariadb":
            cur = blocker.cursor()
            cur.execute("BEGIN")
            cur.execute(lock, (stale,))
        else:
            blocker.execute("BEGIN")
            blocker.execute(lock, (stale,))
    outcome: list[Grant | Miss] = []
    contender = Wire(wire.backend)
    asking = threading.Thread(target=lambda: outcome.append(contender.share("x", late, limit=2)[0]))
    asking.start()
    try:
        if blocker is not None:
            # MariaDB lists the block's statement that runs (its DELETE), PostgreSQL the function call.
            like = f"%{h}%<=%" if db.backend == "mariadb" else "%" + wire.sql.share_acquire.split("(")[0].strip() + "%"
            wait_for(lambda: db.lock_waits(like), what="the grant to wait for the stale holder's row")
            live = f"SELECT 1 FROM {h} WHERE name = 'x' AND owner = %s AND expires_at > {db.now}"
            assert db.query(live, (lapsing,)), "the lapsing lease ran out before the grant began: nothing tested"
            wait_for(lambda: not db.query(live, (lapsing,)), what="the lapsing lease to run out by the database clock")
            blocker.commit() if db.backend == "mariadb" else blocker.execute("COMMIT")
        else:
            wire.let_clock_pass(2.0)
    finally:
        if blocker is not None:
            blocker.close()
        asking.join(30)
        contender.close()
    assert not asking.is_alive()
    extended = wire.run(wire.sql.share_extend, name="x", owner=lapsing, token=lapsing_grant.token, ttl=60)
    (granted,) = outcome
    if isinstance(granted, Grant):  # the grant counted the lapsing lease out: it forgot it
        assert extended == []
    live_holders = [r[1] for r in wire.leases()["x"]]
    assert late not in live_holders or len(live_holders) <= 2, live_holders


def test_shared_grants_draw_larger_tokens(db: Db, wire: Wire) -> None:
    """Shared grants (readers, semaphore holders) draw tokens above every earlier grant, and so
    does the writer after them (DESIGN §11)."""
    w = owner()
    tokens = [wire.grant("x", w).token]
    assert wire.release("x", w, tokens[0]) == Ended(True)
    holders = [(owner(), None), (owner(), None), (owner(), 5)]
    tokens += [wire.share_grant("x", h, limit).token for h, limit in holders]
    for (h, _), token in zip(holders, tokens[1:]):
        assert len(wire.run(wire.sql.share_release, name="x", owner=h, token=token)) == 1
    tokens.append(wire.grant("x", owner()).token)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


# -- the upgradeable read lock (upgrade, downgrade) -----------------------------------------
def upgrade(wire: Wire, name: str, who: str, token: int, ttl: float = 60.0) -> Grant | Miss | None:
    """One upgrade, decoded as the verbs decode it: the write lease, a miss (with its wait), or None."""
    rows = wire.run(wire.sql.upgrade, name=name, owner=who, token=token, ttl=ttl)
    if not rows:
        return None
    granted, token_, expires_at, wait = rows[0]
    return Grant(int(token_), when(expires_at)) if granted else Miss(None if wait is None else float(wait))


def downgrade(wire: Wire, name: str, who: str, token: int, ttl: float = 60.0) -> Grant | None:
    rows = wire.run(wire.sql.downgrade, name=name, owner=who, token=token, ttl=ttl)
    return Grant(int(rows[0][0]), when(rows[0][1])) if rows else None


def kinds(wire: Wire, name: str) -> list[tuple[str, bool]]:
    """(owner, shared) of each live lease of ``name``, as ``sql.leases`` lists them."""
    return sorted((r[1], bool(r[7])) for r in wire.leases().get(name, []))


def test_one_upgradeable_reader_at_a_time_beside_readers(db: Db, wire: Wire) -> None:
    """An upgradeable reader is a reader: readers join it, a writer does not; a second upgradeable misses."""
    u, r = owner(), owner()
    up = wire.share_grant("x", u, upgradeable=True)
    assert wire.share_grant("x", r).token > up.token
    second, _ = wire.share("x", owner(), upgradeable=True)
    assert isinstance(second, Miss) and second.wait is not None and second.wait > 0
    assert isinstance(wire.acquire("x", owner()), Miss)
    assert kinds(wire, "x") == sorted([(u, True), (r, True)])


def test_upgrade_of_the_only_holder_makes_the_write_lease(db: Db, wire: Wire) -> None:
    """Alone, the upgradeable reader's lease becomes the write lease in one statement: a token above
    every earlier grant, the name's row its own, no holder left; readers and writers then miss."""
    u = owner()
    up = wire.share_grant("x", u, upgradeable=True)
    write = upgrade(wire, "x", u, up.token)
    assert isinstance(write, Grant) and write.token > up.token
    (highest,) = db.query(f"SELECT max(token) FROM {db.table}")[0]
    assert write.token >= highest
    assert kinds(wire, "x") == [(u, False)]
    assert db.query(f"SELECT count(*) FROM {holders_table_name(db.table)} WHERE name = %s", ("x",)) == [(0,)]
    assert isinstance(wire.share("x", owner())[0], Miss) and isinstance(wire.acquire("x", owner()), Miss)
    assert wire.release("x", u, write.token) == Ended(True)  # the write lease is an exclusive lease
    assert wire.grant("x", owner()).token > write.token


def test_upgrade_beside_readers_misses_and_lets_no_new_reader_in(db: Db, wire: Wire) -> None:
    """Beside a reader, upgrade misses (wait: until that reader's lease ends) and from then on no shared
    lease is granted; once the reader leaves, the next look upgrades."""
    u, r = owner(), owner()
    up = wire.share_grant("x", u, upgradeable=True)
    read = wire.share_grant("x", r, ttl=30)
    missed = upgrade(wire, "x", u, up.token)
    assert isinstance(missed, Miss) and missed.wait is not None and 0 < missed.wait <= 30.01
    refused, _ = wire.share("x", owner())
    assert isinstance(refused, Miss)  # a reader arriving now waits for the upgrade
    assert isinstance(wire.share("x", owner(), limit=5)[0], Miss)  # a semaphore holder too
    assert isinstance(upgrade(wire, "x", u, up.token), Miss)  # asking again changes nothing
    assert len(wire.run(wire.sql.share_release, name="x", owner=r, token=read.token)) == 1
    write = upgrade(wire, "x", u, up.token)
    assert isinstance(write, Grant) and write.token > read.token
    assert kinds(wire, "x") == [(u, False)]


def test_downgrade_withdraws_an_ask_to_upgrade(db: Db, wire: Wire) -> None:
    """downgrade by the upgradeable reader that asked: its lease as it is (same token), readers welcome again."""
    u, r = owner(), owner()
    up = wire.share_grant("x", u, upgradeable=True)
    wire.share_grant("x", r)
    assert isinstance(upgrade(wire, "x", u, up.token), Miss)
    back = downgrade(wire, "x", u, up.token)
    assert back is not None and back.token == up.token
    assert wire.share_grant("x", owner()).token > up.token


def test_downgrade_turns_the_write_lease_back_into_the_upgradeable_read(db: Db, wire: Wire) -> None:
    """downgrade of the write lease: the upgradeable reader's lease again, with a new, larger token;
    readers join it, a writer and a second upgradeable reader do not; it may upgrade again."""
    u = owner()
    up = wire.share_grant("x", u, upgradeable=True)
    write = upgrade(wire, "x", u, up.token)
    assert isinstance(write, Grant)
    back = downgrade(wire, "x", u, write.token)
    assert back is not None and back.token > write.token
    assert kinds(wire, "x") == [(u, True)]
    reader = owner()
    assert wire.share_grant("x", reader).token > back.token
    assert isinstance(wire.acquire("x", owner()), Miss)
    assert isinstance(wire.share("x", owner(), upgradeable=True)[0], Miss)
    assert len(wire.run(wire.sql.share_release, name="x", owner=reader, token=back.token + 1)) == 1
    again = upgrade(wire, "x", u, back.token)
    assert isinstance(again, Grant) and again.token > back.token + 1


def test_only_the_upgradeable_readers_own_live_lease_upgrades_or_downgrades(db: Db, wire: Wire) -> None:
    """Zero rows, and nothing changed, for: a plain reader's lease, another owner, a wrong token, a
    released lease, a lease that ran out; and downgrade of a write lease taken over or released."""
    u, r = owner(), owner()
    up = wire.share_grant("x", u, upgradeable=True)
    read = wire.share_grant("x", r)
    assert upgrade(wire, "x", r, read.token) is None  # a plain reader cannot upgrade
    assert upgrade(wire, "x", owner(), up.token) is None
    assert upgrade(wire, "x", u, up.token + 100) is None
    assert downgrade(wire, "x", owner(), up.token) is None
    assert kinds(wire, "x") == sorted([(u, True), (r, True)])
    assert wire.share("x", owner())[0].__class__ is Grant  # no ask was left behind
    assert len(wire.run(wire.sql.share_release, name="x", owner=u, token=up.token)) == 1
    assert upgrade(wire, "x", u, up.token) is None and downgrade(wire, "x", u, up.token) is None
    gone = owner()
    short = wire.share_grant("y", gone, ttl=TINY, upgradeable=True)
    wire.wait_expired("y")
    assert upgrade(wire, "y", gone, short.token) is None  # ran out: forgotten, never revived as a writer
    w = owner()
    lapsed = upgrade(wire, "z", w, wire.share_grant("z", w, upgradeable=True, ttl=60).token)
    assert isinstance(lapsed, Grant)
    assert wire.release("z", w, lapsed.token) == Ended(True)
    assert downgrade(wire, "z", w, lapsed.token) is None  # released: nothing to go back to
    assert "z" not in wire.leases()


def test_an_upgrade_retried_after_a_lost_reply_gets_the_same_write_lease(db: Db, wire: Wire) -> None:
    """Where a statement may be cut off (and so sent again), a second upgrade by the owner that holds
    the write lease already gets that lease back, same token, expiry never shortened."""
    if not wire.backend.caps.cut_statements:
        pytest.skip(f"{wire.backend.title} never cuts a statement off, so never sends an upgrade again")
    u = owner()
    up = wire.share_grant("x", u, upgradeable=True)
    first = upgrade(wire, "x", u, up.token, ttl=60)
    again = upgrade(wire, "x", u, up.token, ttl=1)
    assert isinstance(first, Grant) and isinstance(again, Grant)
    assert again.token == first.token and again.expires_at >= first.expires_at


# -- owned, leases ----------------------------------------------------------------------
def test_owned_reports_the_holders_token(db: Db, wire: Wire) -> None:
    """``owned`` (after a lost reply) gives the token the owner holds; for a stranger, None."""
    a = owner()
    grant = wire.grant("x", a)
    owned = wire.backend.owned
    assert owned(wire.run(wire.sql.owned, name="x", owner=a, seq=None)) == grant.token
    assert owned(wire.run(wire.sql.owned, name="x", owner=owner(), seq=None)) is None
    assert owned(wire.run(wire.sql.owned, name="nothing", owner=a, seq=None)) is None


def test_share_owned_reports_the_holders_token(db: Db, wire: Wire) -> None:
    """``share_owned`` gives the token of the owner's shared lease; for a stranger, None."""
    r = owner()
    grant = wire.share_grant("x", r)
    owned = wire.backend.owned
    assert owned(wire.run(wire.sql.share_owned, name="x", owner=r, seq=None)) == grant.token
    assert owned(wire.run(wire.sql.share_owned, name="x", owner=owner(), seq=None)) is None


def test_leases_lists_exactly_the_live_leases(db: Db, wire: Wire) -> None:
    """``leases`` lists every live lease, exclusive and shared, with time remaining, and nothing else."""
    x, r, s = owner(), owner(), owner()
    held = wire.grant("x", x)
    read = wire.share_grant("r", r)
    slot = wire.share_grant("s", s, limit=3)
    wire.grant("lapsed", owner(), ttl=TINY)
    gone = owner()
    assert wire.release("released", gone, wire.grant("released", gone).token) == Ended(True)
    wire.wait_expired("lapsed")
    rows = wire.run(wire.sql.leases)
    assert sorted((n, o, t, bool(shared), lim) for n, o, t, _, _, _, _, shared, lim in rows) == [
        ("r", r, read.token, True, None),
        ("s", s, slot.token, True, 3),
        ("x", x, held.token, False, None),
    ]
    assert all(0 < remaining < 61 for *_, remaining, _, _, _ in rows)
    # leases_of: the same rows, of one name only; nothing for a lapsed, released or unknown name.
    def but_remaining(listed: list[Sequence[Any]]) -> list[tuple[Any, ...]]:  # the clock moved between reads
        return [(*row[:5], *row[6:]) for row in listed]

    for name in ("x", "r", "s", "lapsed", "released", "never"):
        one = wire.run(wire.sql.leases_of, name=name)
        assert but_remaining(one) == but_remaining([row for row in rows if row[0] == name]), name


# -- the fair queue (caps.fair_queue) ---------------------------------------------------
def test_fair_queue_enqueue_then_cancel(db: Db, wire: Wire) -> None:
    """A waiter enqueued behind a holder is in line until it cancels; then a release hands nothing over."""
    needs_fair_queue(wire.backend)
    a, b = owner(), owner()
    grant = wire.grant("x", a)
    queued = wire.backend.enqueued(wire.run(wire.backend.queue.enqueue, **queue_binds("x", b)))
    assert isinstance(queued, Queued) and queued.ahead == 0 and queued.wait is not None and queued.wait > 0
    assert [tuple(r) for r in wire.run(wire.backend.queue.waiters)] == [("x", 1)]
    cancelled = wire.run(wire.backend.queue.cancel, name="x", owner=b, seq=queued.seq)
    assert wire.backend.cancelled(cancelled) is None
    assert wire.run(wire.backend.queue.waiters) == []
    rows = wire.run(wire.sql.release, name="x", owner=a, token=grant.token)
    assert wire.backend.ended(rows, held=False) == Ended(True) and not rows[0][1]
    assert db.query(f"SELECT owner FROM {db.table} WHERE name = %s", ("x",)) == [(None,)]


def test_fair_queue_release_hands_to_the_first_live_waiter(db: Db, wire: Wire) -> None:
    """A release hands the lease, in the same statement, to the first live waiter in line (passing a
    waiter whose wait ran out), with a fresh token above every earlier grant."""
    needs_fair_queue(wire.backend)
    a, dead, b, c = owner(), owner(), owner(), owner()
    grant = wire.grant("x", a)
    queue = wire.backend.queue
    for who, until in ((dead, TINY), (b, None), (c, None)):
        assert isinstance(wire.backend.enqueued(wire.run(queue.enqueue, **queue_binds("x", who, until))), Queued)
    wire.let_clock_pass(TINY)  # dead's wait is over: it is no longer live
    rows = wire.run(wire.sql.release, name="x", owner=a, token=grant.token)
    assert wire.backend.ended(rows, held=False) == Ended(True) and rows[0][1]  # handed over
    ((who, token),) = db.query(f"SELECT owner, token FROM {db.table} WHERE name = %s", ("x",))
    (highest,) = db.query(f"SELECT max(token) FROM {db.table}")[0]
    assert who == b and token > grant.token and token == highest
    handed = wire.backend.cancelled(wire.run(queue.cancel, name="x", owner=b, seq=None))
    assert handed is not None and handed.token == token
    assert [tuple(r) for r in wire.run(queue.waiters)] == [("x", 1)]  # c still waits


def test_fair_queue_walk_with_an_upgradeable_reader(db: Db, wire: Wire) -> None:
    """The line and the upgradeable reader: a writer's release admits the upgradeable reader queued behind
    it with the readers around it, but a second upgradeable reader stops the walk (those behind it wait
    too); readers queued while the upgradeable reader asks to upgrade stay in line when others leave,
    and are admitted when it comes back down."""
    needs_fair_queue(wire.backend)
    queue = wire.backend.queue

    def line_up(who: str, *, upgradeable: bool = False) -> Grant | Queued | None:
        binds = {**queue_binds("x", who), "limit": None, "upgradeable": upgradeable}
        return wire.backend.enqueued(wire.run(queue.share_enqueue, **binds))

    def holding(who: str) -> bool:
        return any(r[1] == who for r in wire.leases().get("x", []))

    w, u1, r1, u2, r2 = owner(), owner(), owner(), owner(), owner()
    write = wire.grant("x", w)
    for who, up in ((u1, True), (r1, False), (u2, True), (r2, False)):
        assert isinstance(line_up(who, upgradeable=up), Queued)
    rows = wire.run(wire.sql.release, name="x", owner=w, token=write.token)
    assert wire.backend.ended(rows, held=False) == Ended(True) and rows[0][1]
    assert holding(u1) and holding(r1) and not holding(u2) and not holding(r2)  # the walk stopped at u2
    assert [tuple(r) for r in wire.run(queue.waiters)] == [("x", 2)]
    # u1 asks to upgrade beside r1; r1 leaves; u2 and r2 stay in line; u1 upgrades.
    (u1_token,) = [r[2] for r in wire.leases()["x"] if r[1] == u1]
    (r1_token,) = [r[2] for r in wire.leases()["x"] if r[1] == r1]
    assert isinstance(upgrade(wire, "x", u1, u1_token), Miss)
    assert len(wire.run(wire.sql.share_release, name="x", owner=r1, token=r1_token)) == 1
    assert not holding(u2) and not holding(r2)
    write = upgrade(wire, "x", u1, u1_token)
    assert isinstance(write, Grant)
    back = downgrade(wire, "x", u1, write.token)  # readers welcome again: the line moves, up to u2
    assert back is not None and holding(u1) and not holding(u2) and not holding(r2)
    assert len(wire.run(wire.sql.share_release, name="x", owner=u1, token=back.token)) == 1
    assert holding(u2) and holding(r2)  # the last holder out: u2 and the reader behind it
    assert wire.run(queue.waiters) == []


def test_fair_queue_a_look_never_takes_a_holder_row_that_ran_out_for_a_grant(db: Db, wire: Wire) -> None:
    """model/queue.pml's counterexample, on the real functions: a reader granted by a hand-off it never
    heard of lets its lease run out; a writer takes the name (which sweeps no holders), the reader queues
    again behind a second writer, and its look, walking the line once the first writer's lease ran out,
    hands the name to that writer. The look must not answer the reader's old, ended row as its grant
    (0008's text did: a reader trusting a lease beside a writer)."""
    needs_fair_queue(wire.backend)
    queue = wire.backend.queue
    a, dead, r, a2, b = owner(), owner(), owner(), owner(), owner()

    def share_look(seq: int | None = None) -> Grant | Queued | None:
        binds = {**queue_binds("x", r, seq=seq), "ttl": TINY, "limit": None, "upgradeable": False}
        return wire.backend.enqueued(wire.run(queue.share_enqueue, **binds))

    first = wire.grant("x", a)
    assert isinstance(wire.backend.enqueued(wire.run(queue.enqueue, **queue_binds("x", dead, TINY))), Queued)
    assert isinstance(share_look(), Queued)
    wire.let_clock_pass(TINY)  # dead's wait is over
    assert wire.backend.ended(wire.run(wire.sql.release, name="x", owner=a, token=first.token), held=False).ended
    assert [r_[1] for r_ in wire.leases()["x"]] == [r]  # handed to the reader, who never hears of it
    wire.wait_expired("x")
    taken = wire.grant("x", a2, ttl=0.5)  # the name's next grant: exclusive, it sweeps no holder row
    assert isinstance(wire.backend.enqueued(wire.run(queue.enqueue, **queue_binds("x", b))), Queued)
    again = share_look()  # the reader waits again, behind b
    assert isinstance(again, Queued)
    wire.wait_expired("x")  # a2's lease runs out unreleased
    look = share_look(again.seq)
    assert isinstance(look, Queued), f"a look answered {look}: a reader granted beside the writer {b}"
    ((who, token),) = db.query(f"SELECT owner, token FROM {db.table} WHERE name = %s", ("x",))
    assert who == b and token > taken.token  # the walk the look made handed the name to b
