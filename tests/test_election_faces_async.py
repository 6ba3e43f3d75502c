"""Leader election (``locker.election(name)``), written once for both faces: this asyncio module is
the source and ``tests/test_election_faces.py`` is generated from it (``python tools/async_to_sync.py``).
Every case runs on each backend (the ``db`` fixture). What needs processes (a SIGSTOPped leader,
the audited race) is in ``tests/test_election.py``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from dblock import FencedOut, Leader, LeaseLost, LockNotAcquired
from dblock._acompat import ajoin, asleep, aspawn, running

from .conftest import ALL_BACKENDS, Db
from .test_faces_async import make, until

BACKENDS = ALL_BACKENDS

if True:  # ASYNC
    pytestmark = pytest.mark.asyncio


async def test_a_candidate_leads_with_a_term_and_a_value_everyone_can_read(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        election, seen = locker.election("primary"), other.election("primary")
        assert await seen.leader() is None
        leadership = await election.campaign(value="node-a", ttl=30)
        now = await seen.leader()
        assert isinstance(now, Leader) and (now.value, now.term) == ("node-a", leadership.term)
        assert now.since == leadership.since and leadership.token == leadership.term
        with pytest.raises(LockNotAcquired):
            await seen.campaign(value="node-b", timeout=0)  # one leader at a time
        await leadership.proclaim("node-a, moved")
        again = await seen.leader()
        assert again is not None and (again.value, again.term) == ("node-a, moved", leadership.term)  # same term
        assert await leadership.resign() is True and await leadership.resign() is False
        assert await seen.leader() is None
        with pytest.raises(LeaseLost):
            await leadership.proclaim("too late")
        second = await seen.campaign(value="node-b", ttl=30)
        assert second.term > leadership.term  # terms only grow
        await second.resign()


async def test_resign_hands_over_at_once_not_at_the_end_of_the_ttl(db: Db) -> None:
    async with make(db) as first, make(db) as second:
        leader = await first.election("hand").campaign(value="a", ttl=60)
        out: dict[str, Any] = {}

        async def campaign() -> None:
            out["leadership"] = await second.election("hand").campaign(value="b", ttl=60, timeout=30)
            out["at"] = time.monotonic()

        worker = aspawn(campaign, name="candidate")
        await asleep(0.2)  # the candidate waits
        resigned = time.monotonic()
        assert await leader.resign() is True
        await ajoin(worker, 30)
        assert not running(worker)
        assert out["at"] - resigned < 10  # far sooner than the 60 s ttl
        assert out["leadership"].term > leader.term
        await out["leadership"].resign()


async def test_observe_sees_each_leader_in_order(db: Db) -> None:
    hold = 0.0 if db.backend == "postgresql" else 0.5  # PostgreSQL: heard by NOTIFY, however short
    async with make(db) as watcher, make(db) as a, make(db) as b, make(db) as c:
        seen: list[Leader | None] = []

        async def watch() -> None:
            async for leader in watcher.election("seq").observe(interval=0.1):
                seen.append(leader)
                if len([x for x in seen if x is not None]) == 3:
                    return

        worker = aspawn(watch, name="observer")
        await until(lambda: seen == [None], "the first look: nobody leads")
        terms = []
        for locker, value in ((a, "a"), (b, "b"), (c, "c")):
            leadership = await locker.election("seq").campaign(value=value, ttl=30)
            terms.append(leadership.term)
            await asleep(hold)
            await leadership.resign()
        await ajoin(worker, 30)
        assert not running(worker), seen
        leaders = [x for x in seen if x is not None]
        assert [(x.value, x.term) for x in leaders] == list(zip("abc", terms))  # every change, in order


async def test_a_deposed_leaders_fenced_write_is_refused(db: Db) -> None:
    """The leader's term is a fencing token: once a newer leader wrote, the old one's write fails."""
    from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, create_engine, update

    from dblock import fenced_update

    engine = create_engine(db.url)
    table = Table(f"{db.table}_config", MetaData(), Column("id", Integer, primary_key=True, autoincrement=False),
                  Column("leader", Integer), Column("fence_token", BigInteger, nullable=False, server_default="0"))
    table.create(engine)
    try:
        with engine.begin() as conn:
            conn.execute(table.insert().values(id=1, leader=0))
        async with make(db) as old_node, make(db) as new_node, make(db) as operator:
            old = await old_node.election("writer").campaign(value="old", ttl=30)
            (info,) = await operator.leases("writer")
            assert await operator.force_release(info) is True  # deposed (as a lapse during a pause would)
            new = await new_node.election("writer").campaign(value="new", ttl=30, timeout=5)
            with engine.begin() as conn:
                fenced_update(conn, update(table).where(table.c.id == 1).values(leader=2), new)
            with pytest.raises(FencedOut), engine.begin() as conn:
                fenced_update(conn, update(table).where(table.c.id == 1).values(leader=1), old)
            with engine.connect() as conn:
                assert conn.execute(table.select()).one()[1:] == (2, new.term)
            await new.resign()
    finally:
        table.drop(engine)
        engine.dispose()


async def test_bad_values_are_refused_before_any_statement(db: Db) -> None:
    async with make(db) as locker:
        election = locker.election("bad")
        for value, error in (("", ValueError), ("x" * 256, ValueError), (3, TypeError)):
            with pytest.raises(error, match="value"):
                await election.campaign(value=value)
        with pytest.raises(ValueError, match="interval"):
            async for _ in election.observe(interval=0):
                pass
        with pytest.raises(ValueError, match="lock name"):
            locker.election("")
        assert locker.open_connections() == 0
