"""The decisions of acquiring, waiting and renewing, as pure functions.

No clock, no thread, no driver, no I/O and no randomness in here: the caller
passes in every time (``time.monotonic()`` seconds unless said otherwise) and
any random draw (``random.random()``, in [0, 1)). Both faces (``Locker``,
``AsyncLocker``) call these, so they cannot drift on how long to sleep, when
to look, how long a lease may be trusted or when a renewal is due.

What a statement's rows mean is not decided here: each database's backend
(``dblock.backends``) decodes its own rows into the outcomes below (``Grant``,
``Miss``, ``Queued``, ``Ended``), so this module knows no backend's row shapes.
"""

from __future__ import annotations

import hashlib
import math
from datetime import datetime, timezone
from typing import Any, NamedTuple, Sequence, TypeVar, Union

# A waiting acquire's last statements (the attempt in flight at its deadline,
# leaving the queue) may run this much past it before they are cut off.
GRACE = 1.0
# SQLite: the least time a statement of a wait gets, even at or past the wait's deadline (a try).
LAST_LOOK = 0.05
# While the database is unreachable, a wait retries after this pause, doubling.
OUTAGE_RETRY_MIN, OUTAGE_RETRY_MAX = 0.05, 1.0
# A fair waiter behind others looks (in case a notification was lost) at most this rarely.
FALLBACK_MAX = 30.0
# When the current lease is known to end, the first few in line look: a lease that ran
# out unreleased is handed to the first live waiter by whoever looks (or leaves) first.
EXPIRY_LOOKERS = 3
# Renewal: after a failed extend, retry this many times per renewal interval.
RETRIES_PER_INTERVAL = 3
# Renewal: a lease due within this share of its ttl joins the batch going out now.
EARLY = 1 / 6

Rows = Sequence[Sequence[Any]]
E = TypeVar("E", bound=BaseException)


# A database expiry: a timezone-aware datetime, or Unix seconds where that is what came (a
# hand-off's notification), made a datetime only if someone reads it (``when``): a waiter's
# hand-over does not pay for a datetime nobody may ask for.
Expiry = Union[datetime, float]


# -- rows into outcomes ---------------------------------------------------------
class Grant(NamedTuple):
    """The database granted (or handed) the lease: its token and database expiry."""

    token: int
    expires_at: Expiry


class Miss(NamedTuple):
    """Another owner holds the lock; ``wait``: seconds until its lease ends by the
    database clock (<= 0 or None: it just ended, or is not known)."""

    wait: float | None


class Queued(NamedTuple):
    """A fair waiter is in line (``seq``) behind ``ahead`` others; ``wait`` as in Miss;
    ``at``: the database's time (epoch seconds) when the attempt ran."""

    wait: float | None
    seq: int
    ahead: int
    at: float


def when(value: Any) -> datetime:
    """A database time as a timezone-aware datetime (SQLite keeps Unix seconds)."""
    if isinstance(value, datetime):
        return value
    return datetime.fromtimestamp(float(value), timezone.utc)


# What a wait asks for (its ``limit``): False the exclusive lock, None a reader's lease, an
# int a semaphore slot under that limit, and UPGRADEABLE the upgradeable reader's lease (a
# reader's, of which one lives at a time, that may become the write lease).
UPGRADEABLE = True


def shared_kind(limit: int | None | bool) -> bool:
    """Whether a wait's ``limit`` asks for a shared lease: False is the exclusive lock's,
    None a reader's, an int a semaphore's, UPGRADEABLE the upgradeable reader's (the
    ``limit`` of both faces' waiting loops)."""
    return limit is not False


def limit_bind(limit: int | None | bool) -> int | None:
    """The ``limit`` bind of ``queue.share_enqueue`` / ``sql.share_acquire`` (``dblock.backends``)
    for a wait's ``limit``."""
    return None if isinstance(limit, bool) else limit


def upgradeable_bind(limit: int | None | bool) -> bool:
    """The ``upgradeable`` bind of ``queue.share_enqueue`` / ``sql.share_acquire`` for a wait's ``limit``."""
    return limit is UPGRADEABLE


class Ended(NamedTuple):
    """A release's outcome. ``ended``: this call ended the lease or, for a lease with a
    minimum hold, kept it until ``held_until`` (database time; None: it ended now).
    False: it was already released, or taken over."""

    ended: bool
    held_until: datetime | None = None


def holds(min_hold: float) -> bool:
    """Whether a lease's release goes through ``sql.release_held`` (``dblock.backends``): it has a
    minimum hold. Without one (0), release sends the plain ``sql.release``, as before holds existed."""
    return min_hold > 0


def backoff(delay: float, wait: float | None, draw: float) -> float:
    """A jittered pause in [delay, 2 delay), cut short at the holder's known expiry.

    The holder's lease ends in ``wait`` s (database clock): no point polling
    before then, nor sleeping past it.
    """
    pause = delay + draw * delay
    if wait is not None:
        pause = min(pause, max(wait, 0.001))
    return pause


def next_delay(delay: float, poll_max: float) -> float:
    """The backoff's next base: doubling, up to ``poll_max``."""
    return min(delay * 2, poll_max)


def outage_pause(delay: float, left: float, draw: float) -> tuple[float, float]:
    """While the database is away: (this pause, never past the wait's ``left`` s; the next delay)."""
    return min(delay * (1 + draw), left), min(delay * 2, OUTAGE_RETRY_MAX)


def look_pause(poll_max: float, ahead: int, wait: float | None, draw: float) -> float:
    """How long a fair waiter with a listener sleeps before it looks again.

    A release hands over and notifies; looking is a fallback in case a
    notification was lost, rarer the further back in line. The first few in
    line also look when the current lease ends (a holder that died): that
    look hands the lease to the first live waiter.
    """
    pause = min((poll_max + draw * poll_max) * (1 + ahead), FALLBACK_MAX)
    if wait is not None and ahead < EXPIRY_LOOKERS:
        pause = min(pause, max(wait, 0.001))
    return pause


def poll_delay(poll_min: float, poll_max: float, ahead: int | None) -> float:
    """A polling fair waiter's backoff base: the first in line looks every ``poll_min``,
    the others back off with their place in the queue."""
    return min(poll_min * (1 + (ahead or 0)), poll_max)


def lapse(poll_max: float) -> float:
    """How long a process's heartbeat row keeps its waiters in line: 4 beats missed, and a second."""
    return 4 * poll_max + 1.0


def wait_seconds(left: float) -> float | None:
    """A timeout for ``Event.wait``: None for ever, never negative."""
    return None if left == math.inf else max(left, 0.0)


def left_line_failed(failure: E, outage: E | None, answered: bool) -> E | None:
    """Why a fair wait failed when even leaving the line (its last statement) failed with ``failure``.

    That statement found no time to be sent (``failure`` is an ``OutOfTime``,
    whose ``timed_out`` is True): the wait's own outage, if it had one; if no
    attempt was ever answered, the database (or a busy pool) was the trouble,
    not a holder, so the failure itself. None: just out of time, the lock held.
    Any other failure is the reason.
    """
    if not getattr(failure, "timed_out", False):
        return failure
    return outage if answered else outage or failure


# -- deadlines ----------------------------------------------------------------------
def statement_deadline(now: float, deadline: float, op_timeout: float, sqlite: bool) -> float:
    """The deadline of one statement, sent at ``now``, of a wait that ends at ``deadline``.

    SQLite's only wait is for another writer, which the wait's own deadline
    bounds, though never to less than ``LAST_LOOK`` from now: a try at or past
    the deadline (``timeout=0``) is still sent (1 ms was less than a busy event
    loop took to reach the send, which then raised OutOfTime for a mere try).
    Elsewhere a statement may run ``GRACE`` past it, so the attempt in flight at
    the deadline is not cut off when the server is merely slow.
    """
    if sqlite:
        return min(now + op_timeout, max(deadline, now + LAST_LOOK))
    return min(now + op_timeout, deadline + GRACE)


def entry_lifetime(left: float) -> float | None:
    """How long a fair waiter's queue entry lives (None: for ever) when its wait has
    ``left`` s: it dies with the wait, so it is skipped if this process cannot leave the line."""
    return None if left == math.inf else max(left, 0.0) + GRACE


# -- trust (G5) -----------------------------------------------------------------------
class Drift(NamedTuple):
    """The clock allowance taken off every lease's trust: ``rate`` of its ttl (how much faster the
    database server's clock may run than the client's) plus ``fixed`` seconds (for what is no
    rate: clock ticks, the rounding of the expiry)."""

    rate: float
    fixed: float


# The default allowance: Redlock's (1% of the ttl plus 2 ms).
DRIFT = Drift(0.01, 0.002)


def allowance(ttl: float, drift: Drift) -> float:
    """Seconds of a ``ttl`` the client does not rely on, for the clocks (``drift``)."""
    return ttl * drift.rate + drift.fixed


def trust_span(ttl: float, drift: Drift) -> float:
    """Seconds a lease of ``ttl`` is trusted, counted from the send of the statement that granted
    or extended it: the ttl less the clock allowance (``drift``)."""
    return ttl - ttl * drift.rate - drift.fixed


def least_ttl(drift: Drift) -> float:
    """The ttl below which the clock allowance ``drift`` leaves no trust at all."""
    return drift.fixed / (1 - drift.rate)


def trusted_until(sent_at: float, ttl: float, drift: Drift) -> float:
    """Until when a client trusts a lease granted (or extended) by a statement it sent at
    ``sent_at``: ``sent_at + ttl`` less the clock allowance ``drift``. The database computed the
    expiry, now + ttl by its clock, after it received the statement, so no earlier than
    ``sent_at + ttl`` while its clock runs at most ``drift.rate`` faster than ours and is never
    stepped forward (G5)."""
    return sent_at + trust_span(ttl, drift)


def handed_trust(sent: float, at: float, expires_at: float, now: float, ttl: float, drift: Drift) -> float:
    """Until when a lease handed to a fair waiter is trusted, on the waiter's clock, before the
    ttl's clock allowance: ``trusted_until(this - ttl, ttl, drift)`` is its trust.

    The waiter's last queueing attempt was sent at ``sent`` and ran at database
    time ``at`` (epoch seconds), a moment no earlier, so the lease's database
    expiry ``expires_at`` (epoch seconds) comes no earlier than
    ``sent + (expires_at - at)`` on the waiter's clock, less the clock
    allowance ``drift`` for that span (it may be longer than the ttl), which is
    what this leaves to take off beyond the ttl's own. The hand-off came after
    that attempt, so the span is at least the ttl; the trust does not age while
    the waiter sleeps far back in the line. Never more than ``now + ttl``: the
    hand-off happened before the waiter heard of it.
    """
    span = expires_at - at
    return min(sent + span - drift.rate * (span - ttl), now + ttl)


def needs_refresh(trusted: float, now: float, span: float) -> bool:
    """A lease granted or handed with less than half of ``span`` (its ttl, or its trusted time)
    of trust left is extended once before use."""
    return trusted - now < span / 2


def until_due(ttl: float, remaining: float, drift: Drift) -> float:
    """Seconds until a third of a lease's trusted time (its ttl less the clock allowance ``drift``)
    is used up: then renewal extends it.

    Counted from the trust left (``remaining``), not from now, so a grant or an
    extend whose reply was slow is followed up sooner.
    """
    span = trust_span(ttl, drift)
    return min(span / 3, max(span / 30, remaining - 2 * span / 3))


def expiring_margin(margin: float | None, ttl: float, drift: Drift) -> float:
    """Seconds of trust left at which renewal warns (``on_expiring``) that it has not extended a
    lease yet: ``margin`` (None: a third of the trusted time, the ttl less the clock allowance
    ``drift``), never more than half the trusted time, so a lease renewal extends on time is
    never warned about."""
    span = trust_span(ttl, drift)
    return min(span / 3 if margin is None else margin, span / 2)


def retry_after(ttl: float, left: float) -> float:
    """After a failed extend: seconds until the next try, while ``left`` s of trust remain."""
    return min(ttl / 3 / RETRIES_PER_INTERVAL, left)


def renewal_due(wake: float, now: float, ttl: float, *, early: bool) -> bool:
    """Whether a lease whose turn is at ``wake`` goes out now; ``early``: a batch is
    going out anyway, and a lease due within ``EARLY`` of its ttl joins it."""
    return wake <= now or (early and wake <= now + ttl * EARLY)


def batch_deadline(now: float, op_timeout: float, trusts: Sequence[float]) -> float:
    """A renewal batch's deadline: ``op_timeout``, never past its least trusted lease's trust."""
    return min(now + op_timeout, min(trusts))


# -- the connection pool (both drivers) ------------------------------------------------
IDLE, OPEN, WAIT = "idle", "open", "wait"


def pool_turn(waiting: bool, fresh: bool, waiting_out: int, idle: int, opened: int, size: int) -> str:
    """What a checkout does now (both drivers' pools): take an ``IDLE`` connection, ``OPEN``
    a new one, or ``WAIT`` for one to come back.

    Statements of waiting acquires may hold at most ``size - 1`` connections
    at once (one is kept for releases and the rest); ``fresh``: not an idle
    one (a retry after a broken connection).
    """
    if waiting and waiting_out >= max(1, size - 1):
        return WAIT  # wait for another waiter's statement to finish
    if idle and not fresh:
        return IDLE
    return OPEN if opened < size else WAIT


class Result(NamedTuple):
    """What ``Driver.run`` got back."""

    rows: list[Sequence[Any]]  # the statement's rows
    extra: list[Sequence[Any]]  # the follow-up statement's rows (``then``), when the first returned none
    retried: bool  # the statement was sent a second time because the first connection broke
    sent_at: float  # time.monotonic() as the statement that answered went out, on an open connection


# -- what the verbs return (both faces) ------------------------------------------------
class Extended(NamedTuple):
    """An extend that took: the lease's new database expiry, and when the statement was sent."""

    expires_at: datetime
    sent_at: float


class Granted(NamedTuple):
    """An acquire that got its lease: the token, the database expiry, and the moment (``time.monotonic()``)
    from which the client trusts it for its ttl (G5)."""

    token: int
    expires_at: Expiry
    sent_at: float


def keyed_owner(key: str) -> str:
    """The owner id of a lease acquired with ``owner=key``: the same in every process and on every
    machine (32 hex digits, as any owner id), so a holder that asks again with its key is
    recognised by the database's own owner check."""
    return hashlib.sha256(b"dblock owner key\x00" + key.encode("utf-8")).hexdigest()[:32]


def election_channel(table: str, schema: str | None, name: str) -> str:
    """The NOTIFY channel of an election (where the database can notify): one per table and name,
    a plain identifier whatever the name holds."""
    key = f"{schema or ''}.{table}\x00{name}".encode("utf-8")
    return "dblock_e_" + hashlib.sha256(key).hexdigest()[:32]
