"""Leader election: whoever holds an election's name leads, and its lease's token is its term.

Written once for both faces (``tools/async_to_sync.py`` writes ``_election.py``,
whose ``Election`` the sync face hands out, from this module's ``AsyncElection``).
``Locker.election(name)`` makes one.

An election is the exclusive lock of its name, and nothing else: campaigning is
a waiting ``acquire`` with renewal (first come, first served in PostgreSQL's
fair queue), leading is holding the lease, resigning is releasing it (which
hands it to the next candidate in the same statement, where there is a queue),
and the term is the lease's fencing token, so a deposed leader's late fenced
write is refused. The leader's value lives in the lease's label: a campaign
sets it with one more statement once it leads (``relabel``), and ``proclaim``
changes it without a new term. Where the database can notify (PostgreSQL),
that statement also notifies the election's channel in commit order, and
``observe`` hears every leader from those notifications; elsewhere it polls.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from . import _core as core
from ._lease_state import Leader
from ._validate import check_interval, check_text
from .errors import LeaseLost
from .schema import LABEL_LENGTH

if TYPE_CHECKING:
    from ._alease import AsyncLease, AsyncOnLost

log = logging.getLogger("dblock.election")

_UNSEEN = Leader("", -1, datetime.min)  # before the first look: any leader, or none, is news
_RACE = 0.05  # seconds to read notifications sent just before a look at the table


class AsyncLeadership:
    """This candidate's term as the leader of an election: what ``campaign`` returns.

    It works as a lease wherever one is taken (its ``token`` is the term, so
    ``fenced_update(conn, statement, leadership)`` fences the leader's writes),
    renews itself while held, and reports its loss as a lease does (``lost``,
    ``on_lost``). ``value`` is what this leader proclaims (``leader()`` shows
    it to everyone), ``since`` when its term began (database clock).
    """

    __slots__ = ("election", "lease", "value", "since")

    def __init__(self, election: AsyncElection, lease: AsyncLease, value: str, since: datetime) -> None:
        self.election = election
        self.lease = lease  # the lock's lease behind the term
        self.value = value
        self.since = since

    @property
    def term(self) -> int:
        """The term: the lease's fencing token, larger than every earlier leader's."""
        return self.lease.token

    @property
    def token(self) -> int:
        return self.lease.token

    @property
    def name(self) -> str:
        return self.lease.name

    @property
    def owner(self) -> str:
        return self.lease.owner

    @property
    def locker(self) -> Any:
        return self.lease.locker

    @property
    def lost(self) -> Any:
        """Set once this leader learns that its term is over without its resigning (an Event)."""
        return self.lease.lost

    def remaining(self) -> float:
        """Seconds this leader may still rely on leading (0 once resigned or lost)."""
        return self.lease.remaining()

    async def extend(self, ttl: float | None = None) -> None:
        """Extend the term's lease (renewal does it on its own; see ``Lease.extend``)."""
        await self.lease.extend(ttl)

    async def proclaim(self, value: str) -> None:
        """Change the value the leader shows (``leader()``, ``observe()``), in the same term.
        LeaseLost if the term is over."""
        value = check_text(value, "value", LABEL_LENGTH)
        since = await self.election.relabel(self.lease, value)
        if since is None:
            raise LeaseLost(f"the leadership of {self.name!r} (term {self.term}) is over; nothing proclaimed")
        self.value = value

    async def resign(self) -> bool:
        """Stop leading now: the next candidate in line leads at once (on PostgreSQL the release
        hands it the lease in the same statement), not at the end of the TTL. True if this call
        ended the term, False if it had ended already."""
        return await self.lease.release()

    async def release(self) -> bool:
        """``resign()``, by the name a lease's release has."""
        return await self.resign()

    async def __aenter__(self) -> AsyncLeadership:
        await self.lease.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Resign; raise LeaseLost if the term was lost before the block ended (as a lease's with-block does)."""
        try:
            await self.lease.__aexit__(exc_type, exc, tb)
        except LeaseLost as lost:  # told of the term's lease: tell it of the term
            said = str(lost).replace(
                f"lease on {self.name!r} (token {self.term})", f"the leadership of {self.name!r} (term {self.term})", 1
            )
            raise LeaseLost(said) from lost.__cause__

    def __repr__(self) -> str:
        state = "lost" if self.lost.is_set() else f"remaining={self.remaining():.3f}s"
        return f"<AsyncLeadership {self.name!r} term={self.term} value={self.value!r} {state}>"


class AsyncElection:
    """An election on one name: candidates ``campaign``, one leads at a time, everyone may ask
    who leads (``leader``) or follow each change (``observe``).

    Made by ``AsyncLocker.election(name)``; the Locker's options (fairness,
    polling, ``op_timeout``) apply.
    """

    __slots__ = ("locker", "name", "_acquire", "_relabel", "_label", "_watch", "_channel")

    def __init__(
        self,
        locker: Any,
        name: str,
        acquire: Callable[..., Any],
        relabel: Callable[..., Any],
        label: Callable[[], str],
        watch: Callable[..., Any] | None,
        channel: str,
    ) -> None:
        self.locker, self.name = locker, name
        # The Locker's own steps, handed over once, so that the election needs none of its private names.
        self._acquire = acquire  # a waiting acquire with renewal
        self._relabel = relabel  # set a lease's label, notifying the channel where the database can
        self._label = label  # the Locker's label: the default value
        self._watch = watch  # (channel, deadline) -> a connection listening on it; None: polling only
        self._channel = channel

    async def campaign(
        self,
        *,
        value: str | None = None,
        ttl: float | None = None,
        timeout: float | None = None,
        on_lost: AsyncOnLost | None = None,
        on_expiring: AsyncOnLost | None = None,
        expiring_margin: float | None = None,
    ) -> AsyncLeadership:
        """Wait up to ``timeout`` s (default: the Locker's, for ever) until this candidate leads;
        ``LockNotAcquired`` when the time runs out.

        Candidates wait as a waiting ``acquire`` does (in PostgreSQL's fair
        queue: first come, first served). The leadership renews itself every
        ttl/3 until it resigns or is lost (``on_lost``, ``on_expiring`` as for
        a renewing lease). ``value`` (default: the Locker's label) is what
        ``leader()`` shows, written with the grant; one more statement once
        this candidate leads tells watchers (``observe``) and reads when the
        term began.
        """
        value = self._label() if value is None else check_text(value, "value", LABEL_LENGTH)
        lease: AsyncLease = await self._acquire(
            self.name, value, ttl=ttl, timeout=timeout, on_lost=on_lost, on_expiring=on_expiring,
            expiring_margin=expiring_margin,
        )
        try:
            since = await self.relabel(lease, value)
        except BaseException:
            await _give_up(lease)
            raise
        if since is None:
            await _give_up(lease)
            raise LeaseLost(f"the leadership of {self.name!r} (term {lease.token}) was lost as it began")
        return AsyncLeadership(self, lease, value, since)

    async def relabel(self, lease: AsyncLease, value: str) -> datetime | None:
        """Set the leader's value (a term's lease label), notifying watchers where the database can."""
        since: datetime | None = await self._relabel(lease, value, self._channel)
        return since

    async def leader(self) -> Leader | None:
        """Who leads now (by the database clock): its value, term and since when; None if nobody does.
        One statement."""
        for info in await self.locker.leases(self.name):
            if not info.shared:
                return Leader(info.label or "", info.token, info.acquired_at)
        return None

    async def observe(self, *, interval: float | None = None) -> AsyncIterator[Leader | None]:
        """Yield who leads, first now, then at each change: a new term, a new value
        (``proclaim``), or nobody leading (None).

        On PostgreSQL a connection of its own LISTENs on the election's
        channel, so each leader is heard as its term begins, in order, none
        skipped; it also looks every ``interval`` seconds (default: the
        Locker's ``poll_max``), which is how a leader that ended without a
        successor (resigned, crashed) is seen. Elsewhere it looks every
        ``interval`` seconds, and a leader that came and went between two looks
        is not seen. Break out of the loop to stop; the connection closes then.
        """
        interval = self.locker.poll_max if interval is None else check_interval(interval, "interval")
        last: Leader | None = _UNSEEN
        conn = await self._listen()
        wait = 0.0  # the first look is at once
        try:
            while True:
                # Each leader notified (where the database can), in commit order.
                heard, conn = await self._hear(conn, wait)
                for leader in heard:
                    if _newer(leader, last):
                        last = leader
                        yield leader
                wait = interval
                now = await self.leader()
                if now is None:
                    if last is not None:
                        last = None
                        yield None  # nobody leads: resigned with nobody in line, or ended
                elif _newer(now, last):
                    # A leader not heard of yet: its notification may be on its way, with those of
                    # terms before it: read them first, so that none is skipped.
                    heard, conn = await self._hear(conn, _RACE)
                    for leader in [*heard, now]:
                        if _newer(leader, last):
                            last = leader
                            yield leader
        finally:
            if conn is not None:
                await _close(conn)

    async def _listen(self) -> Any:
        if self._watch is None:
            return None
        try:
            return await self._watch(self._channel, time.monotonic() + self.locker.op_timeout)
        except Exception as exc:  # noqa: BLE001 - no notifications: observe looks every interval
            log.warning("cannot LISTEN for the leaders of %r (%s); looking every interval instead", self.name, exc)
            return None

    async def _hear(self, conn: Any, wait: float) -> tuple[list[Leader], Any]:
        """The leaders notified by the time ``wait`` s have passed, or as soon as one is (without a
        connection: none, after sleeping ``wait`` s); and the connection, None once it broke."""
        if conn is None:
            await _sleep(wait)
            return [], None
        heard: list[str] = []
        try:
            async for note in conn.notifies(timeout=wait, stop_after=1):
                heard.append(note.payload)
            if heard:  # and those that came with it, already received: no more waiting
                async for note in conn.notifies(timeout=0.0):
                    heard.append(note.payload)
        except Exception as exc:  # noqa: BLE001 - the connection broke: look every interval from now on
            log.warning("lost the LISTEN connection for the leaders of %r (%s); looking every interval", self.name, exc)
            await _close(conn)
            conn = None
        return [leader for leader in map(_parse, heard) if leader is not None], conn

    def __repr__(self) -> str:
        return f"<AsyncElection {self.name!r}>"


def _newer(leader: Leader, last: Leader | None) -> bool:
    return last is None or leader.term > last.term or (leader.term == last.term and leader.value != last.value)


def _parse(payload: str) -> Leader | None:
    """A relabel's notification: "token acquired_at(epoch) label"."""
    token, _, rest = payload.partition(" ")
    since, _, value = rest.partition(" ")
    try:
        return Leader(value, int(token), core.when(float(since)))
    except ValueError:
        log.warning("ignored a malformed leader notification %r", payload)
        return None


async def _give_up(lease: AsyncLease) -> None:
    try:
        await lease.release()
    except Exception:  # noqa: BLE001 - the lease ends at its TTL anyway
        log.warning("could not give up the leadership of %r (token %s)", lease.name, lease.token, exc_info=True)


async def _close(conn: Any) -> None:
    try:
        await conn.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass


if True:  # ASYNC
    import asyncio

    async def _sleep(seconds: float) -> None:
        await asyncio.sleep(seconds)

else:

    def _sleep(seconds: float) -> None:
        time.sleep(seconds)


__all__ = ["AsyncElection", "AsyncLeadership", "Leader"]
