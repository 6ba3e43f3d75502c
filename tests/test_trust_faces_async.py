"""A lease is trusted from the send of the statement that granted it, on an open connection, and
never comes back with less trust than it can be used for: written once for both faces (this
asyncio module is the source; ``tests/test_trust_faces.py`` is generated from it by
``python tools/async_to_sync.py``).

The network is slowed for real, by a proxy in front of PostgreSQL (``tests/pgproxy.py``): it
holds the first bytes of every new connection longer than the ttl (a handshake retransmitted
across a partition that healed), or holds the reply to a statement about one name (its answer
comes late, after the statement ran). Every way to acquire is tried: one attempt, a wait in the
local line and in the fair queue, readers, semaphores, the upgradeable reader, groups and an
election.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from dblock import AsyncLocker

from .conftest import Db
from .pgproxy import PgProxy
from .test_faces_async import make, until
from .test_waiting_faces_async import background, joined, queue

if True:  # ASYNC
    pytestmark = pytest.mark.asyncio

TTL = 1.5
DELAY = 2.0  # longer than the ttl: counted from before the connect, nothing would be left
KINDS = ["exclusive", "reader", "semaphore", "upgradeable", "group", "election"]
MODES = ["try", "line", "fair"]  # one attempt; a wait in the local line; a wait in the fair queue


def statements(locker: AsyncLocker) -> list[str]:
    """The statements ``locker`` sends from now on (its own driver's, wrapped: nothing is faked)."""
    sent: list[str] = []
    execute = locker._driver._execute

    async def recorded(conn: Any, sql: str, params: dict[str, Any]) -> Any:
        sent.append(sql)
        return await execute(conn, sql, params)

    locker._driver._execute = recorded  # type: ignore[method-assign]
    return sent


def extends(locker: AsyncLocker, sent: list[str]) -> int:
    """How many single-lease extends are among ``sent`` (renewal's batches are not counted)."""
    sql = locker.backend.sql
    return sum(statement in (sql.extend, sql.share_extend) for statement in sent)


async def take(locker: AsyncLocker, kind: str, mode: str, name: str = "job", timeout: float = 30) -> Any:
    """A lease of ``kind`` on ``name`` (a group: on two names, ``name`` and another), by ``mode``."""
    if kind == "election":
        return await locker.election(name).campaign(ttl=TTL, timeout=timeout)
    if kind == "group":
        names = [name, name + "-2"]
        if mode == "try":
            return await locker.try_acquire_all(names, ttl=TTL)
        return await locker.acquire_all(names, ttl=TTL, timeout=timeout)
    if kind == "exclusive":
        if mode == "try":
            return await locker.try_acquire(name, ttl=TTL)
        return await locker.acquire(name, ttl=TTL, timeout=timeout)
    shared: Any = {
        "reader": lambda: locker.readers(name),
        "semaphore": lambda: locker.semaphore(name, 2),
        "upgradeable": lambda: locker.upgradeable(name),
    }[kind]()
    if mode == "try":
        return await shared.try_acquire(ttl=TTL)
    return await shared.acquire(ttl=TTL, timeout=timeout)


def held(pg: Db, name: str = "job") -> bool:
    """Whether the database holds ``name`` for someone now (exclusively or shared)."""
    return pg.query(f"SELECT count(*) FROM {pg.table} WHERE name = %s AND owner IS NOT NULL AND expires_at > now()",
                    (name,)) == [(1,)]


def cases() -> list[Any]:
    return [pytest.param(kind, mode, id=f"{kind}-{mode}") for kind in KINDS for mode in MODES
            if not (kind == "election" and mode == "try")]  # a candidate always waits


@pytest.fixture
def slow(pg: Db) -> Any:
    proxy = PgProxy(pg.url)
    yield proxy
    proxy.close()


# -- a slow connect ------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "mode"), cases())
async def test_a_slow_connect_does_not_eat_the_lease(pg: Db, slow: PgProxy, kind: str, mode: str) -> None:
    """Every new connection takes longer than the ttl to open (the acquire's own included): the
    lease still comes back trusted for nearly its whole ttl, with no extend needed, because trust
    counts from the statement's send on the open connection, not from before the connect."""
    slow.connect_delay = DELAY
    async with AsyncLocker(slow.url, table=pg.table, fair=mode == "fair", op_timeout=3 * DELAY) as locker:
        sent = statements(locker)
        lease = await take(locker, kind, mode)
        assert lease is not None
        assert not lease.lost if kind == "group" else not lease.lost.is_set()
        assert lease.remaining() >= TTL / 2, f"{lease.remaining():.3f} s of {TTL} trusted after a slow connect"
        assert extends(locker, sent) == 0, "the grant needed an extend: its trust counted the connect"
        assert held(pg)
        await lease.release()


@pytest.mark.parametrize("mode", ["line", "fair"])
async def test_a_waiter_whose_connect_was_slow_is_trusted_from_its_look(pg: Db, slow: PgProxy, mode: str) -> None:
    """A waiter's connections open slowly, then it waits behind a holder: the lease a release
    hands it (the fair queue) or its next look takes (the local line) is trusted for nearly its
    ttl, with no extend: the look that queued it counts from its send, not from the connect."""
    slow.connect_delay = DELAY
    async with make(pg) as holder, AsyncLocker(
        slow.url, table=pg.table, fair=mode == "fair", op_timeout=3 * DELAY, poll_min=0.05, poll_max=0.2
    ) as waiter:
        first = await holder.try_acquire("job", ttl=60)
        assert first is not None
        sent = statements(waiter)
        worker, out = background(lambda: waiter.acquire("job", ttl=TTL, timeout=30))
        if mode == "fair":
            await until(lambda: len(queue(pg, "job")) == 1, "the waiter to queue")
        else:
            await until(lambda: len(sent) >= 1, "the waiter's first look")
        assert await first.release() is True
        lease = await joined(worker, out)
        assert not lease.lost.is_set()
        assert lease.remaining() >= TTL / 2, f"{lease.remaining():.3f} s of {TTL} trusted"
        assert extends(waiter, sent) == 0, "the lease needed an extend: its trust counted the connect"
        await lease.release()


async def test_a_retry_on_a_new_connection_is_trusted_from_its_own_send(pg: Db, slow: PgProxy) -> None:
    """The grant's reply is lost with its connection (the statement ran), and the new connection
    the retry needs opens slowly: the lease (the same one, G6) is trusted from the retry's send."""
    async with AsyncLocker(slow.url, table=pg.table, op_timeout=3 * DELAY) as locker:
        await (await locker.try_acquire("warm", ttl=TTL)).release()  # type: ignore[union-attr]
        sent = statements(locker)
        slow.connect_delay = DELAY
        slow.drop_next_reply()
        lease = await locker.try_acquire("job", ttl=TTL)
        assert slow.dropped.is_set() and slow.connections == 2  # the reply was lost; a new connection
        assert lease is not None and not lease.lost.is_set()
        assert lease.remaining() >= TTL / 2, f"{lease.remaining():.3f} s of {TTL} trusted after the retry"
        assert extends(locker, sent) == 0, "the retry's grant needed an extend: its trust counted the connect"
        assert held(pg)
        await lease.release()


# -- a slow reply --------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "mode"), cases())
async def test_a_grant_whose_reply_came_late_is_extended_before_it_is_handed_over(
    pg: Db, slow: PgProxy, kind: str, mode: str
) -> None:
    """The grant's reply is held longer than the ttl (the statement ran; its answer came late):
    counted from the send, no trust is left, while the database holds the name for nearly a ttl
    more. One extend, on the open connection, makes the lease trusted again before the caller
    gets it: never a held, unlost lease with no trust."""
    async with AsyncLocker(slow.url, table=pg.table, fair=mode == "fair", poll_min=0.05, poll_max=0.2) as locker:
        await (await take(locker, kind, mode, name="warm")).release()  # connections (and listener) open
        sent = statements(locker)
        slow.delay_replies(1.2 * TTL, about=b"job")
        lease = await take(locker, kind, mode)
        assert lease is not None
        assert not lease.lost if kind == "group" else not lease.lost.is_set()
        assert lease.remaining() >= TTL / 2, f"handed over with {lease.remaining():.3f} s of {TTL} trusted"
        assert extends(locker, sent) == 1
        assert held(pg)
        await lease.release()


@pytest.mark.parametrize("mode", ["line", "fair"])
async def test_a_wait_whose_grant_and_extend_both_came_late_tries_again(pg: Db, slow: PgProxy, mode: str) -> None:
    """Both the grant's reply and its extend's come later than the ttl: the lease is ended unused,
    and the wait tries again within its timeout, coming back with a lease it can trust."""
    async with AsyncLocker(slow.url, table=pg.table, fair=mode == "fair", poll_min=0.05, poll_max=0.2) as locker:
        await (await locker.acquire("warm", ttl=TTL, timeout=30)).release()
        sent = statements(locker)
        slow.delay_replies(1.2 * TTL, about=b"job", times=2)
        lease = await locker.acquire("job", ttl=TTL, timeout=30)
        assert not lease.lost.is_set()
        assert lease.remaining() >= TTL / 2, f"handed over with {lease.remaining():.3f} s of {TTL} trusted"
        assert extends(locker, sent) == 1
        assert held(pg)
        await lease.release()


async def test_a_try_whose_grant_and_extend_both_came_late_ends_the_lease(
    pg: Db, slow: PgProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """One attempt whose grant and extend both answered later than the ttl: no lease to rely on,
    so none is handed over, and the name is not left held for a ttl by a lease nobody uses."""
    async with AsyncLocker(slow.url, table=pg.table) as locker:
        await (await locker.try_acquire("warm", ttl=TTL)).release()  # type: ignore[union-attr]
        slow.delay_replies(1.2 * TTL, about=b"job", times=2)
        with caplog.at_level(logging.WARNING, logger="dblock.acquire"):
            assert await locker.try_acquire("job", ttl=TTL) is None
        assert not held(pg), "the lease nobody can trust was left held"
        assert "too slowly" in caplog.text
        again = await locker.try_acquire("job", ttl=TTL)  # the network is quick again
        assert again is not None and again.remaining() >= TTL / 2
        await again.release()
