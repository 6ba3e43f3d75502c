"""The database server's clock, run fast and stepped: what a lease promises then, and what it cannot.

A client trusts a lease for its ttl less the clock allowance, counted on its own
monotonic clock from the send; the server ends it by its own wall clock. Each
test runs a PostgreSQL of its own under libfaketime (``tests/fakeclock.py``):

- a server clock running faster than the client's, by less than the allowance:
  the holder's trust still ends before anyone else is granted the name;
- a server clock stepped forward (what NTP does when it steps, and what the
  documentation requires it not to): the lease ends early on the server, and two
  holders trust the name at once; tokens still grow and the stale holder's
  fenced write is refused after the new holder's;
- a server clock stepped backward: the lease lasts longer on the server, which
  is safe, only slower.
"""

from __future__ import annotations

import time
from typing import Iterator

import pytest
from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, create_engine, select, update

from dblock import FencedOut, LeaseLost, Locker, fenced_update, fenced_upsert

from . import fakeclock
from .conftest import wait_for

pytestmark = pytest.mark.skipif(fakeclock.missing() is not None, reason=str(fakeclock.missing()))


@pytest.fixture(scope="module")
def stepped() -> Iterator[fakeclock.SteppedServer]:
    """One server for the module's step tests; each test steps its clock from where it needs it."""
    yield from fakeclock.running()


def test_a_server_clock_running_fast_within_the_allowance_still_ends_trust_before_the_next_grant() -> None:
    """The server's clock runs 25% fast: its 4 s of ttl pass in 3.2 s of ours. With an allowance of
    35% of the ttl the holder trusts its lease for 2.6 s from the send, so it has stopped trusting
    it before the request that is granted the name next is even sent (unless that one request
    took more than 0.6 s). Without the allowance it would trust it for 0.8 s after that grant."""
    for server in fakeclock.running("+0 x1.25"):
        with Locker(server.url, drift=0.35) as holder, Locker(server.url) as other:
            holder.create_schema()
            lease = holder.try_acquire("fast", ttl=4)
            assert lease is not None and lease.remaining() <= 4 * 0.65
            deadline = time.monotonic() + 30
            while True:  # ask as soon as the server lets the name go
                trusted_then = lease.remaining()
                taken = other.try_acquire("fast", ttl=4)
                if taken is not None:
                    break
                assert time.monotonic() < deadline, "the server never expired the lease"
            assert trusted_then == 0, "the server granted the name while its holder still trusted it"
            assert taken.token > lease.token


def test_a_server_clock_stepped_forward_lets_two_holders_trust_at_once_but_fencing_keeps_writes_in_order(
    stepped: fakeclock.SteppedServer,
) -> None:
    stepped.step("+0", 0)
    engine = create_engine(stepped.url)
    metadata = MetaData()
    accounts = Table(
        "accounts_forward", metadata,
        Column("id", Integer, primary_key=True),
        Column("balance", Integer, nullable=False),
        Column("fence_token", BigInteger, nullable=False, server_default="0"),
    )
    metadata.create_all(engine)
    try:
        with Locker(stepped.url, table="locks_forward") as first_locker, \
                Locker(stepped.url, table="locks_forward") as second_locker:
            first_locker.create_schema()
            first = first_locker.try_acquire("accounts", ttl=60)
            assert first is not None
            with engine.begin() as conn:
                fenced_upsert(conn, accounts, {"id": 1, "balance": 100}, first)
            assert second_locker.try_acquire("accounts", ttl=60) is None  # held, as it should be

            stepped.step("+1h", 3600)  # the server's clock jumps an hour ahead: its 60 s ran out long ago

            # What a lease cannot promise then: the server grants the name to another while the
            # first holder, whose clock did not jump, still trusts its lease for most of a minute.
            second = second_locker.try_acquire("accounts", ttl=60)
            assert second is not None
            assert first.remaining() > 50 and second.remaining() > 50
            assert not first.lost.is_set()

            # What still holds: the new grant's token is larger, and a fenced write with the old
            # token after the new holder's write is refused, changing nothing.
            assert second.token > first.token
            with engine.begin() as conn:
                fenced_update(conn, update(accounts).where(accounts.c.id == 1).values(balance=50), second)
            with pytest.raises(FencedOut) as refused, engine.begin() as conn:
                fenced_update(conn, update(accounts).where(accounts.c.id == 1).values(balance=0), first)
            assert refused.value.token == first.token and refused.value.newer == second.token
            with engine.connect() as conn:
                assert conn.execute(select(accounts.c.balance, accounts.c.fence_token)).all() == [(50, second.token)]
            # And the first holder learns of the loss at its next extend (renewal would tell it so).
            with pytest.raises(LeaseLost):
                first.extend()
            assert second.release() is True
    finally:
        metadata.drop_all(engine)
        engine.dispose()


def test_a_server_clock_stepped_backward_keeps_a_lease_longer_which_is_safe_only_slower(
    stepped: fakeclock.SteppedServer,
) -> None:
    stepped.step("+0", 0)
    with Locker(stepped.url, table="locks_backward") as holder, Locker(stepped.url, table="locks_backward") as other:
        holder.create_schema()
        lease = holder.try_acquire("job", ttl=1)
        assert lease is not None

        stepped.step("-1h", -3600)  # the server's clock falls an hour behind: its lease ends an hour later

        wait_for(lambda: lease.remaining() == 0, timeout=30, what="the holder's trust to run out (1 s)")
        # Nobody else is granted it while the server still counts the lease's second: no overlap.
        assert other.try_acquire("job", ttl=30) is None
        [info] = other.leases()
        assert info.token == lease.token and info.remaining > 3000  # by the server's clock, an hour to go
        # The holder (or an operator: dblock release --force) ends it; then the name is free again.
        assert lease.release() is True
        taken = other.try_acquire("job", ttl=30)
        assert taken is not None and taken.token > lease.token
        assert taken.release() is True
