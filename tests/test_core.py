"""The pure core (dblock._core): plain values in, decisions out. No database needed here."""

from __future__ import annotations

import functools
import math
import random
from datetime import datetime, timedelta, timezone

import pytest

from dblock import _core as core
from dblock._core import Grant, Miss, Queued
from dblock.backends import Backend, PostgreSQL, SQLite

T0 = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)


# -- rows into outcomes (each backend decodes its own) ---------------------------------------------------------
def test_when_keeps_datetimes_and_reads_sqlite_seconds_as_utc() -> None:
    assert core.when(T0) is T0
    assert core.when(T0.timestamp()) == T0
    assert core.when(str(T0.timestamp())) == T0
    assert core.when(T0.timestamp()).tzinfo is not None


def test_postgresql_acquire_row_is_a_grant_or_a_miss_with_its_wait() -> None:
    assert PostgreSQL.acquired([(True, 7, T0, None)], []) == Grant(7, T0)
    assert PostgreSQL.acquired([(False, None, None, 2.5)], []) == Miss(2.5)
    assert PostgreSQL.acquired([(False, None, None, None)], []) == Miss(None)  # free again just now
    # Zero rows: a concurrent first acquire created the row; nothing known about when it ends.
    assert PostgreSQL.acquired([], []) == Miss(None)


def test_sqlite_acquire_row_is_a_grant_or_the_holders_wait() -> None:
    assert SQLite.acquired([(3, T0.timestamp())], []) == Grant(3, T0)
    assert SQLite.acquired([], [(1.25,)]) == Miss(1.25)
    assert SQLite.acquired([], [(None,)]) == Miss(None)
    assert SQLite.acquired([], []) == Miss(None)  # no row at all


def test_enqueue_row_is_a_grant_a_place_in_line_or_look_again() -> None:
    assert PostgreSQL.enqueued([(True, 9, T0, None, None, None, None)]) == Grant(9, T0)
    queued = PostgreSQL.enqueued([(False, None, None, 4.0, 12, 2, "1700000000.5")])
    assert queued == Queued(4.0, 12, 2, 1700000000.5)
    assert isinstance(queued, Queued) and isinstance(queued.at, float)
    assert PostgreSQL.enqueued([]) is None


def test_cancel_row_tells_a_lease_handed_first_from_a_plain_exit() -> None:
    assert PostgreSQL.cancelled([(True, 5, T0)]) == Grant(5, T0)
    assert PostgreSQL.cancelled([(False, None, None)]) is None
    assert PostgreSQL.cancelled([]) is None


def test_release_rows_say_ended_or_held_until_when() -> None:
    # The plain release: PostgreSQL's (token, handed), SQLite's (token,); zero rows: not ours.
    assert Backend.ended([(4, True)], held=False) == core.Ended(True, None)
    assert Backend.ended([(4,)], held=False) == core.Ended(True, None)
    assert Backend.ended([], held=False) == core.Ended(False, None)
    # release_held: (token, handed, held_until); NULL held_until: the hold had passed, it ended now.
    assert Backend.ended([(4, False, T0)], held=True) == core.Ended(True, T0)
    assert Backend.ended([(4, 0, T0.timestamp())], held=True) == core.Ended(True, T0)  # SQLite keeps seconds
    assert Backend.ended([(4, True, None)], held=True) == core.Ended(True, None)
    assert Backend.ended([], held=True) == core.Ended(False, None)


def test_only_a_positive_min_hold_takes_the_held_release() -> None:
    assert core.holds(0.001) and core.holds(3600.0)
    assert not core.holds(0.0)  # no hold: the plain release statement, as before holds existed


def test_extend_many_rows_match_leases_by_name_and_token_in_the_callers_order() -> None:
    later = T0 + timedelta(seconds=30)
    rows = [("b", 2, later), ("a", 1, T0.timestamp())]
    # "c" was taken over; "a" with an older token is not the lease extended.
    assert Backend.extended(rows, [("a", 1), ("c", 3), ("b", 2), ("a", 0)]) == [T0, None, later, None]
    assert Backend.extended([], [("a", 1)]) == [None]


# -- pauses ---------------------------------------------------------------------------
@pytest.mark.parametrize("draw", [0.0, 0.5, 0.999999])
def test_backoff_is_jittered_in_delay_to_twice_delay(draw: float) -> None:
    pause = core.backoff(0.1, None, draw)
    assert 0.1 <= pause < 0.2
    assert pause == pytest.approx(0.1 + draw * 0.1)


def test_backoff_never_sleeps_past_the_holders_known_expiry_nor_spins() -> None:
    assert core.backoff(0.4, 0.05, 0.5) == 0.05
    assert core.backoff(0.4, 10.0, 0.5) == pytest.approx(0.6)  # the expiry is further than the backoff
    assert core.backoff(0.4, 0.0, 0.5) == 0.001  # it just ended: look again almost at once, not in a hot loop
    assert core.backoff(0.4, -3.0, 0.5) == 0.001


def test_next_delay_doubles_up_to_poll_max() -> None:
    assert core.next_delay(0.01, 0.5) == 0.02
    assert core.next_delay(0.4, 0.5) == 0.5
    assert core.next_delay(0.5, 0.5) == 0.5


def test_outage_pause_doubles_to_its_cap_and_never_passes_the_deadline() -> None:
    pause, later = core.outage_pause(core.OUTAGE_RETRY_MIN, 10.0, 0.5)
    assert pause == pytest.approx(0.075) and later == 0.1
    assert core.outage_pause(0.8, 10.0, 0.0)[1] == core.OUTAGE_RETRY_MAX
    assert core.outage_pause(0.8, 0.3, 0.9) == (0.3, core.OUTAGE_RETRY_MAX)
    assert core.outage_pause(0.8, -1.0, 0.9)[0] == -1.0  # the caller does not sleep


def test_look_pause_grows_with_the_place_in_line_up_to_the_fallback_cap() -> None:
    assert core.look_pause(0.5, 0, None, 0.0) == 0.5
    assert core.look_pause(0.5, 3, None, 0.0) == 2.0
    assert core.look_pause(0.5, 3, None, 0.999) < 4.0
    assert core.look_pause(0.5, 100, None, 0.5) == core.FALLBACK_MAX


def test_only_the_first_few_in_line_look_at_the_known_expiry() -> None:
    for ahead in range(core.EXPIRY_LOOKERS):
        assert core.look_pause(0.5, ahead, 0.2, 0.5) == 0.2
        assert core.look_pause(0.5, ahead, -1.0, 0.5) == 0.001
    far_back = core.EXPIRY_LOOKERS
    assert core.look_pause(0.5, far_back, 0.2, 0.0) == 0.5 * (1 + far_back)


def test_a_polling_waiter_backs_off_with_its_place_in_line() -> None:
    assert core.poll_delay(0.01, 0.5, 0) == 0.01
    assert core.poll_delay(0.01, 0.5, None) == 0.01
    assert core.poll_delay(0.01, 0.5, 4) == pytest.approx(0.05)
    assert core.poll_delay(0.01, 0.5, 99) == 0.5


def test_lapse_is_four_missed_beats_and_a_second() -> None:
    assert core.lapse(0.5) == 3.0
    assert core.lapse(0.0) == 1.0


def test_wait_seconds_is_none_for_ever_and_never_negative() -> None:
    assert core.wait_seconds(math.inf) is None
    assert core.wait_seconds(1.5) == 1.5
    assert core.wait_seconds(-0.1) == 0.0


# -- deadlines ----------------------------------------------------------------------
def test_a_waits_statement_may_run_grace_past_its_deadline_on_postgresql() -> None:
    assert core.statement_deadline(100.0, 101.0, 5.0, sqlite=False) == 101.0 + core.GRACE
    assert core.statement_deadline(100.0, 200.0, 5.0, sqlite=False) == 105.0  # op_timeout bounds every statement
    assert core.statement_deadline(100.0, 99.0, 5.0, sqlite=False) == 99.0 + core.GRACE


def test_on_sqlite_the_waits_deadline_bounds_its_statement() -> None:
    assert core.statement_deadline(100.0, 101.0, 5.0, sqlite=True) == 101.0
    assert core.statement_deadline(100.0, 200.0, 5.0, sqlite=True) == 105.0
    # At or past it (a try, timeout=0): a moment to be sent and to wait for a writer, never negative.
    assert core.statement_deadline(100.0, 99.0, 5.0, sqlite=True) == 100.0 + core.LAST_LOOK
    assert core.statement_deadline(100.0, 100.0, 5.0, sqlite=True) == 100.0 + core.LAST_LOOK


def test_a_queue_entry_lives_as_long_as_its_wait_and_grace() -> None:
    assert core.entry_lifetime(math.inf) is None
    assert core.entry_lifetime(3.0) == 3.0 + core.GRACE
    assert core.entry_lifetime(-1.0) == core.GRACE


# -- trust (G5) ----------------------------------------------------------------------
NO_DRIFT = core.Drift(0.0, 0.0)  # clocks taken to run at one rate: the trust before the allowance


def test_a_grant_is_trusted_from_its_send_time_not_its_reply() -> None:
    assert core.trusted_until(sent_at=50.0, ttl=30.0, drift=NO_DRIFT) == 80.0


def test_trust_is_shortened_by_the_clock_allowance() -> None:
    # Redlock's allowance by default: 1% of the ttl plus 2 ms.
    assert core.DRIFT == (0.01, 0.002)
    assert core.allowance(30.0, core.DRIFT) == pytest.approx(0.302)
    assert core.trusted_until(sent_at=50.0, ttl=30.0, drift=core.DRIFT) == pytest.approx(80.0 - 0.302)
    assert core.trust_span(10.0, core.Drift(0.05, 0.5)) == pytest.approx(9.0)
    # The least ttl leaves no trust; anything longer leaves some.
    least = core.least_ttl(core.DRIFT)
    assert least == pytest.approx(0.002 / 0.99)
    assert core.trust_span(least, core.DRIFT) == pytest.approx(0.0, abs=1e-15)
    assert core.trust_span(least * 1.001, core.DRIFT) > 0


@pytest.mark.parametrize("seed", range(200))
def test_trust_ends_before_the_database_expiry_while_its_clock_runs_fast_within_the_allowance(seed: int) -> None:
    # The database's clock runs `rate` faster than ours, at most the allowance's: its expiry,
    # ttl of its seconds after it received the statement, comes ttl / rate of ours after that.
    rng = random.Random(seed)
    drift = core.Drift(rng.uniform(0, 0.5), rng.uniform(0, 1))
    ttl = rng.uniform(core.least_ttl(drift), 60)
    rate = 1 + rng.uniform(0, drift.rate)
    sent = rng.uniform(0, 1000)
    received = sent + rng.uniform(0, 5)
    assert core.trusted_until(sent, ttl, drift) <= received + ttl / rate


@pytest.mark.parametrize("seed", range(200))
def test_a_handed_lease_is_never_trusted_past_its_database_expiry_nor_past_now_plus_ttl(seed: int) -> None:
    # G5 for a hand-off: the waiter's last queueing attempt was sent at `sent` (client clock)
    # and ran at `at` (database clock), later by an unknown delay d >= 0. The database's
    # expiry E, mapped onto the client clock, is sent + d + (E - at) / rate, the database's
    # clock running `rate` faster than ours, within the allowance: trust must end by then,
    # whatever d is. And never past now + ttl less the allowance.
    rng = random.Random(seed)
    drift = core.Drift(0.0, 0.0) if seed % 4 == 0 else core.Drift(rng.uniform(0, 0.5), rng.uniform(0, 1))
    rate = 1 + rng.uniform(0, drift.rate)
    ttl = rng.uniform(max(0.1, 2 * core.least_ttl(drift)), 60)
    sent = rng.uniform(0, 1000)
    skew = rng.uniform(-1e6, 1e6)  # the database's clock reads anything: only differences count
    d = rng.uniform(0, 5)  # the attempt's delay to the database
    at = sent + skew + d
    handed_at = at + rng.uniform(0, 120)  # the hand-off (a release) came later, by the database clock
    expires = handed_at + ttl
    now = sent + d + (handed_at - at) / rate + rng.uniform(0, 5)  # we learn of it after it happened
    # The lease trusts sent_at + ttl less the ttl's allowance, as every grant (``LeaseState``).
    trusted = core.trusted_until(core.handed_trust(sent, at, expires, now, ttl, drift) - ttl, ttl, drift)
    assert trusted <= sent + d + (expires - at) / rate + 1e-9  # the database expiry on our clock
    assert trusted <= now + core.trust_span(ttl, drift) + 1e-9
    # ... and not needlessly short: the hand-off came after our attempt was sent.
    span = expires - at
    assert trusted >= min(sent + span * (1 - drift.rate) - drift.fixed, now + core.trust_span(ttl, drift)) - 1e-9
    assert trusted >= min(sent + ttl, now + ttl) - core.allowance(span, drift) - 1e-9


def test_handed_trust_edges() -> None:
    handed = functools.partial(core.handed_trust, drift=NO_DRIFT)
    # The hand-off happened at once: trust is the send time plus ttl.
    assert handed(sent=10.0, at=500.0, expires_at=530.0, now=10.0, ttl=30.0) == 40.0
    # Handed long after our attempt while we slept far back in the line: trust does not age.
    assert handed(sent=10.0, at=500.0, expires_at=590.0, now=65.0, ttl=30.0) == 95.0  # not sent + ttl (40)
    # An expiry far in the future (a clock jump on the server) never buys more than now + ttl.
    assert handed(sent=10.0, at=500.0, expires_at=10_000.0, now=11.0, ttl=30.0) == 41.0
    # Expired already by the mapping: trust is in the past (the lease gets refreshed or dropped).
    assert handed(sent=10.0, at=500.0, expires_at=505.0, now=20.0, ttl=30.0) == 15.0
    # With an allowance, the database's 90 s from our look take 1% off all 90 s, not only off the ttl's 30:
    # the lease (trusting this - ttl, less the ttl's allowance) ends 0.9 s + 2 ms before 100.
    drift = core.Drift(0.01, 0.002)
    trusted = core.handed_trust(sent=10.0, at=500.0, expires_at=590.0, now=75.0, ttl=30.0, drift=drift)
    assert core.trusted_until(trusted - 30.0, 30.0, drift) == pytest.approx(100.0 - 0.9 - 0.002)


def test_a_handed_lease_with_less_than_half_its_ttl_left_is_refreshed_first() -> None:
    assert core.needs_refresh(trusted=114.9, now=100.0, span=30.0)
    assert not core.needs_refresh(trusted=115.0, now=100.0, span=30.0)
    assert core.needs_refresh(trusted=90.0, now=100.0, span=30.0)  # already past its trust


# -- renewal ------------------------------------------------------------------------
def test_renewal_is_due_when_a_third_of_the_trust_is_used() -> None:
    assert core.until_due(30.0, 30.0, NO_DRIFT) == 10.0
    assert core.until_due(30.0, 25.0, NO_DRIFT) == pytest.approx(5.0)  # a slow reply: follow up sooner
    assert core.until_due(30.0, 0.0, NO_DRIFT) == 1.0  # out of trust: ttl/30, never a hot loop
    assert core.until_due(30.0, 100.0, NO_DRIFT) == 10.0  # never later than every ttl/3
    # With an allowance, a third of the trusted time (the ttl less the allowance: 20 s of 30).
    drift = core.Drift(0.3, 1.0)
    assert core.until_due(30.0, 20.0, drift) == pytest.approx(20.0 / 3)
    assert core.until_due(30.0, 15.0, drift) == pytest.approx(15.0 - 40.0 / 3)
    assert core.until_due(30.0, 0.0, drift) == pytest.approx(20.0 / 30)


def test_the_expiring_warning_comes_within_the_trusted_time() -> None:
    assert core.expiring_margin(None, 30.0, NO_DRIFT) == 10.0
    assert core.expiring_margin(None, 30.0, core.Drift(0.3, 1.0)) == pytest.approx(20.0 / 3)
    assert core.expiring_margin(2.0, 30.0, core.Drift(0.3, 1.0)) == 2.0
    # Never more than half the trusted time: renewal extends at two thirds of it left.
    assert core.expiring_margin(14.0, 30.0, NO_DRIFT) == 14.0
    assert core.expiring_margin(14.0, 30.0, core.Drift(0.3, 1.0)) == pytest.approx(10.0)


def test_a_failed_extend_is_retried_three_times_per_interval_while_trusted() -> None:
    assert core.retry_after(30.0, 20.0) == pytest.approx(30.0 / 9)
    assert core.retry_after(30.0, 1.0) == 1.0  # never past the trust


def test_a_lease_due_soon_joins_the_batch_going_out() -> None:
    assert core.renewal_due(100.0, 100.0, 30.0, early=False)
    assert not core.renewal_due(100.1, 100.0, 30.0, early=False)
    assert core.renewal_due(105.0, 100.0, 30.0, early=True)  # within ttl/6
    assert not core.renewal_due(105.1, 100.0, 30.0, early=True)


def test_a_renewal_batch_never_runs_past_its_least_trusted_lease() -> None:
    assert core.batch_deadline(100.0, 5.0, [120.0, 103.0, 200.0]) == 103.0
    assert core.batch_deadline(100.0, 5.0, [120.0]) == 105.0


def test_a_wait_that_cannot_leave_its_line_reports_why() -> None:
    from dblock._driver import OutOfTime
    from dblock.errors import DatabaseUnavailable

    no_time, outage, broken = OutOfTime("no time"), DatabaseUnavailable("down"), DatabaseUnavailable("reset")
    assert core.left_line_failed(broken, outage, answered=True) is broken  # the leaving itself failed
    assert core.left_line_failed(no_time, None, answered=True) is None  # queued, then out of time: held
    assert core.left_line_failed(no_time, outage, answered=True) is outage
    assert core.left_line_failed(no_time, None, answered=False) is no_time  # never answered: not a holder
    assert core.left_line_failed(no_time, outage, answered=False) is outage


def test_a_pool_keeps_a_connection_for_releases_and_opens_no_more_than_its_size() -> None:
    from dblock._core import IDLE, OPEN, WAIT, pool_turn

    # (waiting, fresh, waiting_out, idle, opened, size)
    assert pool_turn(False, False, 0, 1, 1, 4) == IDLE
    assert pool_turn(False, True, 0, 1, 1, 4) == OPEN  # a retry wants a new connection
    assert pool_turn(False, False, 0, 0, 4, 4) == WAIT  # all open and busy
    assert pool_turn(True, False, 3, 1, 4, 4) == WAIT  # waiters hold size - 1: the last one is kept
    assert pool_turn(False, False, 3, 1, 4, 4) == IDLE  # ...for a release
    assert pool_turn(True, False, 0, 0, 0, 1) == OPEN  # a pool of one still serves a waiter
