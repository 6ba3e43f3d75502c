"""G4 on SQLAlchemy's asyncio extension: dblock.aio_fencing on real databases.

PostgreSQL through psycopg's async driver, SQLite files through aiosqlite.
Each async helper is checked on the key cases of its sync twin's tests
(tests/test_fencing.py, tests/test_orm.py): a stale token is refused and
writes nothing, the same lease writes again, strict mode, upserts, the
fences table, the lease check and the commit guard failing closed, and
fenced_session. Leases come from the sync Locker; a small object with a
lease's attributes stands in for any other lease (such as an AsyncLease).
"""

from __future__ import annotations

import re

import pickle
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import pytest

pytest.importorskip("pytest_asyncio")
pytest.importorskip("aiosqlite")

import pytest_asyncio  # noqa: E402
from sqlalchemy import event, insert, select, update  # noqa: E402
from sqlalchemy.engine import Result, make_url  # noqa: E402
from sqlalchemy.ext.asyncio import (  # noqa: E402
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session  # noqa: E402
from sqlalchemy.orm.exc import StaleDataError  # noqa: E402

import dblock  # noqa: E402
from dblock import FencedOut, LeaseLost, aio_fencing, fencing  # noqa: E402
from dblock.aio_fencing import (  # noqa: E402
    check_lease,
    commit_guard,
    fence,
    fenced_read,
    fenced_session,
    fenced_update,
    fenced_upsert,
)
from dblock.orm import fenced_session as sync_fenced_session  # noqa: E402
from dblock.schema import fences_table_name  # noqa: E402

from .conftest import ALL_BACKENDS, Db, wait_for  # noqa: E402

BACKENDS = ALL_BACKENDS
from .test_fencing import Counter, Takeover, lost_lease, takeover  # noqa: E402
from .test_orm import Models  # noqa: E402


def async_url(db: Db) -> str:
    driver = {"postgresql": "postgresql+psycopg", "sqlite": "sqlite+aiosqlite", "mariadb": "mariadb+aiomysql"}[db.backend]
    return make_url(db.url).set(drivername=driver).render_as_string(hide_password=False)


class Aio:
    """An async engine on the test's database that records every statement it sends."""

    def __init__(self, db: Db) -> None:
        self.engine = create_async_engine(async_url(db))
        self.statements: list[str] = []
        event.listen(self.engine.sync_engine, "before_cursor_execute", self._record)

    def _record(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.statements.append(statement)

    @asynccontextmanager
    async def open(self, via: str, engine: AsyncEngine | None = None) -> AsyncIterator[Any]:
        """An AsyncConnection or an AsyncSession on ``engine`` (default: this one's), no transaction begun."""
        engine = self.engine if engine is None else engine
        if via == "connection":
            async with engine.connect() as conn:
                yield conn
        else:
            async with AsyncSession(engine) as session:
                yield session

    @asynccontextmanager
    async def begin(self, via: str) -> AsyncIterator[Any]:
        """A transaction on an AsyncConnection, an AsyncSession or an async_scoped_session; committed at the end."""
        if via == "connection":
            async with self.engine.begin() as conn:
                yield conn
        elif via == "session":
            async with AsyncSession(self.engine) as session, session.begin():
                yield session
        else:
            scoped = async_scoped_session(async_sessionmaker(self.engine), scopefunc=lambda: "test")
            try:
                yield scoped
                await scoped.commit()
            finally:
                await scoped.remove()


@pytest.fixture
def counter(db: Db) -> Any:
    c = Counter(db)
    yield c
    c.drop()


@pytest_asyncio.fixture
async def aio(db: Db, counter: Counter) -> AsyncIterator[Aio]:
    a = Aio(db)
    yield a
    await a.engine.dispose()


@dataclass(frozen=True)
class Where:
    table: str
    schema: str | None = None


@dataclass(frozen=True)
class LeaseLike:
    """Not a dblock Lease: only a lease's attributes, as an AsyncLease has them."""

    name: str
    owner: Any
    token: Any
    locker: Where


def like(lease: dblock.Lease) -> LeaseLike:
    return LeaseLike(lease.name, lease.owner, lease.token, Where(lease.locker.table, lease.locker.schema))


async def set_owner(
    aio: Aio, counter: Counter, lease: Any, owner: int, *, strict: bool = False, via: str = "connection"
) -> Any:
    t = counter.table
    async with aio.begin(via) as conn:
        return await fenced_update(conn, update(t).where(t.c.id == 1).values(owner=owner), lease, strict=strict)


def stale_and_fresh(db: Db, name: str = "resource") -> tuple[dblock.Lease, dblock.Lease]:
    old = db.locker().acquire(name, ttl=0.05)
    new = takeover(db.locker(), name)  # granted once `old` expired
    assert new.token > old.token
    return old, new


def round_trip(exc: BaseException) -> Any:
    return pickle.loads(pickle.dumps(exc))


VIA = pytest.mark.parametrize("via", ["connection", "session", "scoped"])


# -- a token column on the guarded table ---------------------------------------------------
@VIA
@pytest.mark.asyncio
async def test_a_fresh_lease_writes_in_one_statement_and_writes_again(
    db: Db, counter: Counter, aio: Aio, via: str
) -> None:
    lease = db.locker().acquire("resource")
    aio.statements.clear()
    result = await set_owner(aio, counter, lease, 1, via=via)
    assert result.rowcount == 1
    assert len(aio.statements) == 1 and aio.statements[0].startswith("UPDATE")  # no extra SELECT
    assert counter.row() == (0, 1, lease.token)
    assert (await set_owner(aio, counter, lease, 2, via=via)).rowcount == 1  # the same lease again (default mode)
    assert counter.row() == (0, 2, lease.token)


@VIA
@pytest.mark.asyncio
async def test_a_stale_token_is_refused_and_writes_nothing(db: Db, counter: Counter, aio: Aio, via: str) -> None:
    old, new = stale_and_fresh(db)
    await set_owner(aio, counter, new, 2, via=via)
    aio.statements.clear()
    with pytest.raises(FencedOut) as caught:
        await set_owner(aio, counter, old, 1, via=via)
    assert (caught.value.token, caught.value.newer) == (old.token, new.token)
    assert caught.value.resource == f"table {counter.name!r}"
    assert [s.split()[0] for s in aio.statements if s.split()[0] in ("UPDATE", "SELECT")] == ["UPDATE", "SELECT"]
    assert counter.row() == (0, 2, new.token)  # the newer holder's value survives
    assert counter.accepted() == [new.token]
    copy = round_trip(caught.value)  # crosses process boundaries with its attributes
    assert (type(copy), str(copy), copy.token, copy.newer) == (FencedOut, str(caught.value), old.token, new.token)


@pytest.mark.asyncio
async def test_strict_mode_lets_each_grant_write_once(db: Db, counter: Counter, aio: Aio) -> None:
    lease = db.locker().acquire("resource")
    await set_owner(aio, counter, lease, 1, strict=True)
    with pytest.raises(FencedOut) as caught:
        await set_owner(aio, counter, lease, 2, strict=True)
    assert caught.value.newer == lease.token
    assert counter.row() == (0, 1, lease.token)


@pytest.mark.asyncio
async def test_a_missing_row_is_not_a_fence_failure(db: Db, counter: Counter, aio: Aio) -> None:
    old, new = stale_and_fresh(db)
    await set_owner(aio, counter, new, 2)  # another row carries a newer token than `old`
    t = counter.table
    async with aio.engine.begin() as conn:
        result = await fenced_update(conn, update(t).where(t.c.id == 42).values(owner=9), old)
    assert result.rowcount == 0


@pytest.mark.asyncio
async def test_fenced_update_with_returning(db: Db, counter: Counter, aio: Aio) -> None:
    if not aio.engine.dialect.update_returning:
        pytest.skip("MariaDB's UPDATE has no RETURNING")
    old, new = stale_and_fresh(db)
    t = counter.table
    write = update(t).where(t.c.id == 1).returning(t.c.owner)
    async with aio.engine.begin() as conn:
        assert (await fenced_update(conn, write.values(owner=2), new)).all() == [(2,)]
    with pytest.raises(FencedOut):
        async with aio.engine.begin() as conn:
            await fenced_update(conn, write.values(owner=1), old)
    assert counter.row() == (0, 2, new.token)


@pytest.mark.parametrize("via", ["connection", "session"])
@pytest.mark.asyncio
async def test_fenced_upsert_inserts_updates_and_refuses_stale(db: Db, counter: Counter, aio: Aio, via: str) -> None:
    old, new = stale_and_fresh(db)
    t = counter.table
    async with aio.begin(via) as conn:
        await fenced_upsert(conn, t, {"id": 2, "n": 1, "owner": 2}, new)  # insert
    assert counter.row(2) == (1, 2, new.token)
    async with aio.begin(via) as conn:
        await fenced_upsert(conn, t, {"id": 2, "n": 5, "owner": 2}, new)  # update by the same lease
    assert counter.row(2) == (5, 2, new.token)
    aio.statements.clear()
    with pytest.raises(FencedOut) as caught:
        async with aio.begin(via) as conn:
            await fenced_upsert(conn, t, {"id": 2, "n": 99, "owner": 1}, old)
    assert caught.value.newer == new.token
    assert len([s for s in aio.statements if s.startswith("INSERT")]) == 1
    assert counter.row(2) == (5, 2, new.token)
    with pytest.raises(FencedOut) as caught:
        async with aio.begin(via) as conn:
            await fenced_upsert(conn, t, {"id": 2, "n": 6, "owner": 2}, new, strict=True)  # strict: once per grant
    assert caught.value.newer == new.token
    assert counter.row(2) == (5, 2, new.token)


# -- read-modify-write: stamp first, then read ----------------------------------------------
async def stamp_and_read_n(conn: Any, counter: Counter, lease: Any) -> int:
    t = counter.table
    return int((await fenced_read(conn, select(t.c.n).where(t.c.id == 1), lease)).scalar_one())


@pytest.mark.asyncio
async def test_fenced_read_stamps_and_reads_in_one_statement(db: Db, counter: Counter, aio: Aio) -> None:
    lease = db.locker().acquire("resource")
    t = counter.table
    aio.statements.clear()
    async with aio.engine.begin() as conn:
        n = await stamp_and_read_n(conn, counter, lease)
        stamp = 1 if aio.engine.dialect.update_returning else 2  # MariaDB: the stamp, then a locking read
        assert len(aio.statements) == stamp and aio.statements[0].startswith("UPDATE")
        await fenced_update(conn, update(t).where(t.c.id == 1).values(n=n + 1), lease)
    assert counter.row() == (1, 0, lease.token)
    async with aio.engine.begin() as conn:  # reads like the select: the whole table, keys and all
        rows = (await fenced_read(conn, select(t).where(t.c.id == 1), lease)).mappings().all()
    assert rows == [{"id": 1, "n": 1, "owner": 0, "fence_token": lease.token}]


@pytest.mark.asyncio
async def test_stamp_first_refuses_the_late_write_of_an_older_holder(db: Db, counter: Counter, aio: Aio) -> None:
    a = db.locker().acquire("resource", ttl=0.05)
    async with aio.engine.begin() as conn:
        seen_by_a = await stamp_and_read_n(conn, counter, a)
    b = takeover(db.locker(), "resource")
    async with aio.engine.begin() as conn:
        seen_by_b = await stamp_and_read_n(conn, counter, b)
    t = counter.table
    with pytest.raises(FencedOut) as caught:
        async with aio.engine.begin() as conn:
            await fenced_update(conn, update(t).where(t.c.id == 1).values(n=seen_by_a + 1), a)
    assert caught.value.newer == b.token
    with pytest.raises(FencedOut) as caught:  # nor may A stamp again: all or nothing, then roll back
        async with aio.engine.begin() as conn:
            await stamp_and_read_n(conn, counter, a)
    assert "roll back" in str(caught.value)
    async with aio.engine.begin() as conn:
        await fenced_update(conn, update(t).where(t.c.id == 1).values(n=seen_by_b + 1), b)
    assert counter.row() == (1, 0, b.token)  # one accepted increment, one count


# -- the fences table -------------------------------------------------------------------------
@pytest.mark.parametrize("via", ["connection", "session"])
@pytest.mark.asyncio
async def test_fence_table_refuses_a_stale_token_and_rolls_back_the_callers_writes(
    db: Db, counter: Counter, aio: Aio, via: str
) -> None:
    old, new = stale_and_fresh(db, "report")
    t = counter.table
    async with aio.begin(via) as conn:
        await fence(conn, new)  # resource defaults to the lease's name, the table to its Locker's
        await conn.execute(update(t).where(t.c.id == 1).values(owner=2))
    fences = fences_table_name(db.table)
    assert db.query(f"SELECT resource, last_token FROM {fences}") == [("report", new.token)]
    with pytest.raises(FencedOut) as caught:
        async with aio.begin(via) as conn:
            await conn.execute(update(t).where(t.c.id == 1).values(owner=1))  # written first, same transaction
            await fence(conn, old)
    assert (caught.value.newer, caught.value.resource) == (new.token, "resource 'report'")
    assert counter.row() == (0, 2, 0)  # the stale holder's other write rolled back with the fence
    async with aio.begin(via) as conn:
        await fence(conn, new)  # the same lease passes again (default mode)
    with pytest.raises(FencedOut):
        async with aio.begin(via) as conn:
            await fence(conn, new, strict=True)
    async with aio.begin(via) as conn:
        await fence(conn, new.token, "other", table=db.table)  # a bare token (e.g. from $DBLOCK_TOKEN)
    async with aio.begin(via) as conn:
        await fence(conn, like(new), "third")  # a lease-like: its locker's table, not the default `locks`
    assert sorted(db.query(f"SELECT resource, last_token FROM {fences}")) == [
        ("other", new.token),
        ("report", new.token),
        ("third", new.token),
    ]


@pytest.mark.asyncio
async def test_fence_without_dblocks_tables_says_what_to_run(db: Db, counter: Counter, aio: Aio) -> None:
    lease = db.locker().acquire("resource")
    with pytest.raises(dblock.SchemaMissing, match="dblock migrate"):
        async with aio.engine.begin() as conn:
            await fence(conn, lease.token, "r", table="no_such_locks")
    duck = LeaseLike(lease.name, lease.owner, lease.token, Where("no_such_locks"))
    with pytest.raises(dblock.SchemaMissing, match="dblock migrate"):
        async with aio.engine.begin() as conn:
            await check_lease(conn, duck)


# -- commit-time lease check --------------------------------------------------------------------
@pytest.mark.parametrize("lease_kind", ["Lease", "lease-like"])
@pytest.mark.asyncio
async def test_check_lease_passes_while_live_and_refuses_a_taken_over_lease(
    db: Db, counter: Counter, aio: Aio, lease_kind: str
) -> None:
    old, new = stale_and_fresh(db)
    wrap = like if lease_kind == "lease-like" else (lambda lease: lease)
    async with aio.engine.connect() as conn:
        await check_lease(conn, wrap(new))
        await conn.rollback()
        with pytest.raises(LeaseLost) as caught:
            await check_lease(conn, wrap(old))
        await conn.rollback()
    assert f"token {old.token}" in str(caught.value)
    assert str(round_trip(caught.value)) == str(caught.value)
    async with AsyncSession(aio.engine) as session:
        await check_lease(session, wrap(new))
        await session.rollback()  # the check's row lock would hold up the release
        new.release()
        with pytest.raises(LeaseLost):
            await check_lease(session, wrap(new))


@pytest.mark.asyncio
async def test_a_checked_lease_cannot_be_taken_over_before_the_commit(db: Db, counter: Counter, aio: Aio) -> None:
    locker = db.locker()
    lease = locker.acquire("resource", ttl=0.3)
    t = counter.table
    async with aio.engine.connect() as conn:
        await check_lease(conn, lease)  # first in the transaction: what it locks must hold until commit
        wait_for(lambda: not locker.leases(), what="the lease to expire by database time")
        attempt = Takeover(db)
        await conn.execute(update(t).where(t.c.id == 1).values(owner=1))
        await conn.commit()
    assert (attempt.before, attempt.after_commit()) == (False, True)
    assert counter.row() == (0, 1, 0)


@pytest.mark.parametrize("via", ["connection", "session"])
@pytest.mark.asyncio
async def test_commit_guard_commits_while_the_lease_is_live(db: Db, counter: Counter, aio: Aio, via: str) -> None:
    lease = db.locker().acquire("resource")
    t = counter.table
    async with aio.open(via) as target, commit_guard(target, like(lease)) as guarded:
        assert guarded is target
        await guarded.execute(update(t).where(t.c.id == 1).values(owner=1))
    assert counter.row() == (0, 1, 0)


@pytest.mark.parametrize("via", ["connection", "session"])
@pytest.mark.asyncio
async def test_commit_guard_checks_a_commit_made_inside_the_block(db: Db, counter: Counter, aio: Aio, via: str) -> None:
    lease = db.locker().acquire("resource")
    t = counter.table
    async with aio.open(via) as target:
        with pytest.raises(LeaseLost):
            async with commit_guard(target, lease):
                await target.execute(update(t).where(t.c.id == 1).values(owner=1))
                await target.commit()  # checked: still live
                lease.release()
                await target.execute(update(t).where(t.c.id == 1).values(owner=2))
                await target.commit()  # checked: gone, so rolled back
        assert not target.in_transaction()
    assert counter.row() == (0, 1, 0)


@pytest.mark.parametrize("lost", ["expired", "taken over", "released"])
@pytest.mark.parametrize("via", ["connection", "session"])
@pytest.mark.asyncio
async def test_commit_guard_rolls_back_when_the_lease_is_gone(
    db: Db, counter: Counter, aio: Aio, via: str, lost: str
) -> None:
    lease = lost_lease(db, lost)
    t = counter.table
    async with aio.open(via) as target:
        with pytest.raises(LeaseLost):
            async with commit_guard(target, lease):
                await target.execute(update(t).where(t.c.id == 1).values(owner=1))
    assert counter.row() == (0, 0, 0)
    assert counter.accepted() == []


@pytest.mark.parametrize("via", ["connection", "session"])
@pytest.mark.asyncio
async def test_commit_guard_checks_at_commit_time_not_when_the_transaction_began(
    db: Db, counter: Counter, aio: Aio, via: str
) -> None:
    """The lease is live when the block writes and gone by the commit: the commit is refused."""
    locker = db.locker()
    lease = locker.acquire("resource", ttl=0.3)
    t = counter.table
    async with aio.open(via) as target:
        with pytest.raises(LeaseLost):
            async with commit_guard(target, lease):
                await target.execute(update(t).where(t.c.id == 1).values(owner=1))  # the transaction begins
                wait_for(lambda: not locker.leases(), what="the lease to expire by database time")
    assert counter.row() == (0, 0, 0)


@pytest.mark.asyncio
async def test_commit_guard_fails_closed_when_a_new_holder_took_over_mid_transaction(pg: Db) -> None:
    """PostgreSQL: the guarded transaction has written, then the lease expires and a new holder takes
    the lock while it is still open (no row lock stands in the way before the check). Its commit must
    be refused, and the new holder's fenced write is the one that lands."""
    counter = Counter(pg)
    aio = Aio(pg)
    try:
        locker = pg.locker()
        lease = locker.acquire("resource", ttl=0.3)
        t = counter.table
        with pytest.raises(LeaseLost):
            async with aio.engine.connect() as conn, commit_guard(conn, lease):
                await conn.execute(update(t).where(t.c.id == 1).values(n=99))
                new = takeover(pg.locker(), "resource")
                assert new.token > lease.token
        with counter.engine.begin() as sync_conn:
            dblock.fenced_update(sync_conn, update(t).where(t.c.id == 1).values(owner=2), new)
        assert counter.row() == (0, 2, new.token)
    finally:
        await aio.engine.dispose()
        counter.drop()


@pytest.mark.asyncio
async def test_check_lease_refuses_an_autocommit_connection(db: Db, counter: Counter, aio: Aio) -> None:
    lease = db.locker().acquire("resource")
    autocommit = aio.engine.execution_options(isolation_level="AUTOCOMMIT")
    async with autocommit.connect() as conn:
        with pytest.raises(ValueError, match="AUTOCOMMIT"):
            await check_lease(conn, lease)
    async with autocommit.connect() as conn:  # and the driver really is in autocommit, not merely said to be
        await conn.execute(update(counter.table).where(counter.table.c.id == 1).values(owner=5))
        assert counter.row() == (0, 5, 0)


@pytest.mark.parametrize("via", ["connection", "session"])
@pytest.mark.asyncio
async def test_commit_guard_refuses_an_autocommit_connection_before_the_block_runs(
    db: Db, counter: Counter, aio: Aio, via: str
) -> None:
    lease = db.locker().acquire("resource")
    t = counter.table
    autocommit = aio.engine.execution_options(isolation_level="AUTOCOMMIT")
    ran: list[bool] = []
    async with aio.open(via, autocommit) as target:
        aio.statements.clear()
        with pytest.raises(ValueError, match="AUTOCOMMIT"):
            async with commit_guard(target, lease):
                ran.append(True)
                await target.execute(update(t).where(t.c.id == 1).values(owner=1))
        assert not ran, "the block's body ran on an AUTOCOMMIT connection"
        assert aio.statements == []
        assert not target.in_transaction()  # the check left no transaction behind
    assert counter.row() == (0, 0, 0)


# -- the sync face takes lease-likes too ----------------------------------------------------
def test_the_sync_helpers_take_a_lease_like_object(db: Db, counter: Counter) -> None:
    old, new = stale_and_fresh(db)
    t = counter.table
    with counter.engine.begin() as conn:
        dblock.fenced_update(conn, update(t).where(t.c.id == 1).values(owner=2), like(new))
        dblock.fence(conn, like(new))
    with pytest.raises(FencedOut), counter.engine.begin() as conn:
        dblock.fenced_update(conn, update(t).where(t.c.id == 1).values(owner=1), like(old))
    with pytest.raises(FencedOut), counter.engine.begin() as conn:
        dblock.fence(conn, like(old))
    with counter.engine.connect() as conn, dblock.commit_guard(conn, like(new)):
        conn.execute(update(t).where(t.c.id == 1).values(n=1))
    with pytest.raises(LeaseLost), counter.engine.connect() as conn, dblock.commit_guard(conn, like(old)):
        conn.execute(update(t).where(t.c.id == 1).values(n=2))
    assert counter.row() == (1, 2, new.token)
    assert db.query(f"SELECT resource, last_token FROM {fences_table_name(db.table)}") == [("resource", new.token)]


# -- one source of truth: both faces send the same statements ---------------------------------------
SAME_SQL: dict[str, Callable[[Any, Any, Counter, dblock.Lease, dblock.Lease], Any]] = {
    "fenced_update": lambda f, c, k, old, new: f.fenced_update(c, update(k.table).values(owner=3), old),
    "fenced_update strict": lambda f, c, k, old, new: f.fenced_update(c, update(k.table).values(n=3), new, strict=True),
    "fenced_upsert": lambda f, c, k, old, new: f.fenced_upsert(c, k.table, {"id": 1, "n": 3, "owner": 3}, old),
    "fenced_read": lambda f, c, k, old, new: f.fenced_read(c, select(k.table.c.n), new),
    "fence": lambda f, c, k, old, new: f.fence(c, old),
    "check_lease": lambda f, c, k, old, new: f.check_lease(c, new),
    "check_lease lost": lambda f, c, k, old, new: f.check_lease(c, old),
}


@pytest.mark.parametrize("call", sorted(SAME_SQL))
@pytest.mark.asyncio
async def test_both_faces_send_the_same_statements_and_decide_the_same(
    db: Db, counter: Counter, aio: Aio, call: str
) -> None:
    old, new = stale_and_fresh(db)
    with counter.engine.begin() as conn:  # the newer lease has written the row and the fence
        dblock.fenced_update(conn, update(counter.table).values(owner=2), new)
        dblock.fence(conn, new)
    before = counter.row()

    def outcome(value: Any) -> Any:
        return ("returned", value.all() if isinstance(value, Result) else value)

    counter.statements.clear()
    with counter.engine.connect() as conn:  # rolled back at the end
        try:
            sync = outcome(SAME_SQL[call](fencing, conn, counter, old, new))
        except dblock.DBLockError as exc:
            sync = (type(exc).__name__, str(exc))
    aio.statements.clear()
    async with aio.engine.connect() as aconn:
        try:
            result = outcome(await SAME_SQL[call](aio_fencing, aconn, counter, old, new))
        except dblock.DBLockError as exc:
            result = (type(exc).__name__, str(exc))
    # The same SQL; the placeholders as each driver writes them (PyMySQL's %(name)s, aiomysql's %s).
    assert counter.statements and same_sql(aio.statements) == same_sql(counter.statements)
    assert result == sync
    assert counter.row() == before


def same_sql(statements: list[str]) -> list[str]:
    return [re.sub(r"%\(\w+\)s", "%s", s) for s in statements]


# -- bad input changes nothing ----------------------------------------------------------------
LISTED = dblock.LeaseInfo("r", "o", 5, None, None, 1.0)  # type: ignore[arg-type]  # a row of Locker.leases()
BAD: list[tuple[Callable[[Any, Any, Any], Awaitable[Any]], type]] = [
    (lambda c, t, l: fenced_update(c, update(t).values(n=1), True), TypeError),
    (lambda c, t, l: fenced_update(c, update(t).values(n=1), 0), ValueError),
    (lambda c, t, l: fenced_update(c, update(t).values(n=1), "5"), TypeError),
    (lambda c, t, l: fenced_update(c, update(t).values(n=1), LeaseLike("r", "o", "5", Where("locks"))), TypeError),
    (lambda c, t, l: fenced_update(c, update(t).values(n=1), LISTED), TypeError),  # a listing, no locker: not a lease
    (lambda c, t, l: fenced_update(c, update(t).values(fence_token=99), l), ValueError),
    (lambda c, t, l: fenced_update(c, update(t).values(n=1), l, column="nope"), ValueError),
    (lambda c, t, l: fenced_update(c, insert(t).values(n=1), l), TypeError),
    (lambda c, t, l: fenced_upsert(c, t, {}, l), ValueError),
    (lambda c, t, l: fenced_upsert(c, t, {"nope": 1}, l), ValueError),
    (lambda c, t, l: fenced_upsert(c, t, {"n": 1, "fence_token": 5}, l), ValueError),
    (lambda c, t, l: fence(c, l, ""), ValueError),
    (lambda c, t, l: fence(c, l.token), TypeError),
    (lambda c, t, l: fence(c, l, table="bad name"), ValueError),
    (lambda c, t, l: fenced_read(c, update(t).values(n=1), l), TypeError),
    (lambda c, t, l: fenced_read(c, select(t.c.n).order_by(t.c.n), l), ValueError),
    (lambda c, t, l: check_lease(c, l.token), TypeError),
    (lambda c, t, l: check_lease(c, LeaseLike(l.name, l.owner, l.token, Where("bad name"))), ValueError),
    (lambda c, t, l: check_lease(c, LeaseLike(l.name, None, l.token, Where(l.locker.table))), TypeError),
    (lambda c, t, l: check_lease(c, LeaseLike("", l.owner, l.token, Where(l.locker.table))), ValueError),
]


@pytest.mark.parametrize("case", range(len(BAD)))
@pytest.mark.asyncio
async def test_bad_input_is_refused_before_any_sql(db: Db, counter: Counter, aio: Aio, case: int) -> None:
    call, error = BAD[case]
    lease = db.locker().acquire("resource")
    before = counter.row()
    async with aio.engine.connect() as conn:
        aio.statements.clear()
        with pytest.raises(error):
            await call(conn, counter.table, lease)
        assert aio.statements == []
    assert counter.row() == before


@pytest.mark.asyncio
async def test_a_sync_connection_or_an_unstarted_one_is_refused_before_any_sql(
    db: Db, counter: Counter, aio: Aio
) -> None:
    lease = db.locker().acquire("resource")
    t = counter.table
    with counter.engine.connect() as conn, Session(counter.engine) as session:
        counter.statements.clear()
        for target in (conn, session, counter.engine):
            with pytest.raises(TypeError, match="AsyncConnection or AsyncSession"):
                await fenced_update(target, update(t).values(owner=1), lease)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="AsyncConnection or AsyncSession"):
                await check_lease(target, lease)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="AsyncConnection or AsyncSession"):
                async with commit_guard(target, lease):  # type: ignore[arg-type]
                    pass
        with pytest.raises(TypeError, match="AsyncSession"):
            async with fenced_session(session, lease):  # type: ignore[arg-type]
                pass
        assert counter.statements == []
    unstarted = aio.engine.connect()  # not awaited: no connection yet
    with pytest.raises(ValueError, match="not connected"):
        await fence(unstarted, lease)
    assert aio.statements == []
    assert counter.row() == (0, 0, 0)


# -- fenced_session on an AsyncSession ---------------------------------------------------------
class AioModels:
    def __init__(self, db: Db) -> None:
        self.m = Models(db)
        self.engine: AsyncEngine = create_async_engine(async_url(db))
        self.statements: list[str] = []
        event.listen(self.engine.sync_engine, "before_cursor_execute", lambda c, cur, s, *a: self.statements.append(s))

    def session(self) -> AsyncSession:
        return AsyncSession(self.engine)


@pytest_asyncio.fixture
async def models(db: Db) -> AsyncIterator[AioModels]:
    am = AioModels(db)
    yield am
    await am.engine.dispose()
    am.m.Base.metadata.drop_all(am.m.engine)
    am.m.engine.dispose()


@pytest.mark.asyncio
async def test_a_fresh_lease_flushes_and_stamps_its_token(models: AioModels) -> None:
    m = models.m
    _, new = m.stale_and_fresh()
    async with models.session() as s, fenced_session(s, new):
        (await s.get(m.Account, 1)).balance = 90  # type: ignore[union-attr]
        s.add(m.Entry(id=2, account_id=1))
        await s.commit()
    assert m.rows() == [(1, 90, new.token), (2, 0, 0), (1, 1, 0), (2, 1, new.token)]


@pytest.mark.asyncio
async def test_repeated_writes_by_one_lease_succeed_and_strict_mode_refuses_the_second(models: AioModels) -> None:
    m = models.m
    _, new = m.stale_and_fresh()
    async with models.session() as s, fenced_session(s, new):
        for balance in (90, 80, 70):
            (await s.get(m.Account, 1)).balance = balance  # type: ignore[union-attr]
            await s.commit()
    assert m.rows()[0] == (1, 70, new.token)
    async with models.session() as s:
        async with fenced_session(s, new, strict=True):
            (await s.get(m.Account, 2)).balance = 5  # type: ignore[union-attr]
            await s.commit()
        with pytest.raises(FencedOut):
            async with fenced_session(s, new, strict=True):
                (await s.get(m.Account, 2)).balance = 6  # type: ignore[union-attr]
                await s.commit()
    assert m.rows()[:2] == [(1, 70, new.token), (2, 5, new.token)]


@pytest.mark.asyncio
async def test_a_stale_flush_of_a_row_loaded_before_the_takeover_is_refused(models: AioModels) -> None:
    """The UPDATE finds the row changed (StaleDataError); the newer token on it makes that FencedOut."""
    m = models.m
    old = m.locker.acquire("accounts", ttl=0.05)
    async with models.session() as stale:
        account = await stale.get(m.Account, 1)  # loaded with fence_token 0 <= old.token
        new = m.locker.acquire("accounts", timeout=30)
        m.write(new, m.Account, 1, balance=50)
        before = m.rows()
        with pytest.raises(FencedOut) as caught:
            async with fenced_session(stale, old):
                account.balance = 0  # type: ignore[union-attr]
                (await stale.get(m.Account, 2)).balance = 100  # type: ignore[union-attr]
                await stale.commit()
        assert (caught.value.token, caught.value.newer) == (old.token, new.token)
        assert isinstance(caught.value.__cause__, StaleDataError)
        assert not stale.in_transaction()  # rolled back
    assert m.rows() == before == [(1, 50, new.token), (2, 0, 0), (1, 1, 0)]


@pytest.mark.asyncio
async def test_a_stale_flush_of_a_row_loaded_after_the_takeover_is_refused_before_any_update(
    models: AioModels,
) -> None:
    m = models.m
    old, new = m.stale_and_fresh()
    m.write(new, m.Account, 1, balance=50)
    models.statements.clear()
    async with models.session() as stale:
        with pytest.raises(FencedOut) as caught:
            async with fenced_session(stale, old):
                for account in await stale.scalars(select(m.Account)):
                    account.balance += 1
                await stale.commit()
        assert caught.value.newer == new.token
    assert not [s for s in models.statements if s.startswith("UPDATE")]
    assert m.rows() == [(1, 50, new.token), (2, 0, 0), (1, 1, 0)]


@pytest.mark.asyncio
async def test_an_older_leases_write_is_a_concurrent_change_not_a_fence_failure(models: AioModels) -> None:
    m = models.m
    old, new = m.stale_and_fresh()
    async with models.session() as fresh:
        account = await fresh.get(m.Account, 1)
        m.write(old, m.Account, 1, balance=7)
        with pytest.raises(StaleDataError):
            async with fenced_session(fresh, new):
                account.balance = 1  # type: ignore[union-attr]
                await fresh.commit()
    assert m.rows()[0] == (1, 7, old.token)


@pytest.mark.asyncio
async def test_an_error_inside_the_block_rolls_back_and_pending_changes_are_flushed_not_committed(
    models: AioModels,
) -> None:
    m = models.m
    old, new = m.stale_and_fresh()
    async with models.session() as s:
        with pytest.raises(RuntimeError):
            async with fenced_session(s, new):
                (await s.get(m.Account, 1)).balance = 0  # type: ignore[union-attr]
                raise RuntimeError("the caller's own error")
        await s.commit()  # outside the block: nothing pending may be written unfenced
    assert m.rows()[0] == (1, 100, 0)
    async with models.session() as s:
        async with fenced_session(s, new):
            (await s.get(m.Account, 1)).balance = 1  # type: ignore[union-attr]
            models.statements.clear()
        assert [q for q in models.statements if q.startswith("UPDATE")]  # flushed as the block ended
        assert s.in_transaction()
        await s.rollback()  # the caller decides: this discards the flushed change
    assert m.rows()[0] == (1, 100, 0)


@pytest.mark.asyncio
async def test_fenced_read_through_an_async_session_stamps_and_refreshes_the_objects(models: AioModels) -> None:
    m = models.m
    old, new = m.stale_and_fresh()
    Account = m.Account
    async with models.session() as s:
        account = await s.get(Account, 1)  # the new holder loaded the row earlier...
        m.write(old, Account, 1, balance=50)  # a late write by the old holder landed since
        models.statements.clear()
        (read,) = (await fenced_read(s, select(Account).where(Account.id == 1), new)).scalars().all()
        stamp = 1 if s.bind.dialect.update_returning else 2  # MariaDB: the stamp, then a locking read
        assert len(models.statements) == stamp and models.statements[0].startswith("UPDATE")
        assert read is account
        assert (account.balance, account.fence_token) == (50, new.token)  # type: ignore[union-attr]
        async with fenced_session(s, new):
            account.balance += 10  # type: ignore[union-attr]
            await s.commit()
        with pytest.raises(FencedOut) as caught:
            await fenced_read(s, select(Account.balance).where(Account.id == 1), old)
        assert caught.value.newer == new.token
        await s.rollback()
    assert m.rows()[0] == (1, 60, new.token)


@pytest.mark.asyncio
async def test_commit_guard_on_an_async_session_with_fenced_session(models: AioModels) -> None:
    m = models.m
    lease = m.locker.acquire("accounts", ttl=30)
    async with models.session() as s, commit_guard(s, lease), fenced_session(s, lease):
        (await s.get(m.Account, 1)).balance = 1  # type: ignore[union-attr]
        await s.commit()  # checked: the lease is live
        (await s.get(m.Account, 1)).balance = 2  # type: ignore[union-attr]
    assert m.rows()[0] == (1, 2, lease.token)  # the guard committed at the end of the block
    lease.release()
    with pytest.raises(LeaseLost):
        async with models.session() as s, commit_guard(s, lease):
            (await s.get(m.Account, 1)).balance = 3  # type: ignore[union-attr]
    assert m.rows()[0] == (1, 2, lease.token)


@pytest.mark.asyncio
async def test_fenced_session_checks_its_arguments(models: AioModels) -> None:
    lease = models.m.locker.acquire("accounts")
    async with models.session() as s:
        with pytest.raises(TypeError):
            async with fenced_session(s, "7"):  # type: ignore[arg-type]
                pass
        with pytest.raises(TypeError):
            async with fenced_session(s, lease, strict="yes"):  # type: ignore[arg-type]
                pass
        with pytest.raises(RuntimeError):
            async with fenced_session(s, lease), fenced_session(s, lease):
                pass
        with pytest.raises(RuntimeError):  # one fence per session, whichever face put it there
            async with fenced_session(s, lease):
                with sync_fenced_session(s.sync_session, lease):
                    pass
    assert "fenced_session" in aio_fencing.__all__

