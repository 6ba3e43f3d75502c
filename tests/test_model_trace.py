"""Traces recorded from real runs, checked against the models' steps by Spin (model/trace.pml).

As etcd's raft validates traces of its real nodes against its TLA+ spec: a trigger records
every change of one lock name's row and of its holders, in commit order, with the database
clock, while real clients race for the name; ``tools/model_trace.py`` turns each
transaction into the steps of model/lease.pml and model/shared.pml, and model/trace.pml
replays them through Spin's verifier on that one path, asserting that each step is one the
models allow in the state the trace reached, and that the database wrote what the step
writes. The checker can fail: corrupted traces (a grant while a live lease is held, a token
going down, an extend by a client that does not hold the lease, ...) are refused, each by
the assertion of the step it breaks. (Checking real traces found two steps the code takes that
lease.pml and shared.pml had left out, a release clearing the expiry and a shared release
shortening or freeing the row; the models take them now.)
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import psycopg
import pytest

from dblock import Locker
from tools import model_trace as mt
from tools.model_trace import Call, Change, Conversion, Trace

from .conftest import Db, libpq_dsn
from .workers import run_together

ROOT = Path(__file__).resolve().parent.parent
NAME = "hot"
needs_spin = pytest.mark.skipif(mt.missing_tools() is not None, reason=mt.missing_tools() or "")

# The races: two processes of three clients each, for 3 s (longer, if a slow machine granted
# fewer than 20 leases to a process), with ttls of 20 and 80 ms, so that leases run out and are
# taken over between the releases, extends and hand-offs. One process waits in the fair queue
# (NOTIFY hand-offs), the other polls with the plain statements.
RACE = {"threads": 3, "duration": 3.0, "ttls": [0.02, 0.08], "timeout": 0.15, "hold": 0.01, "wait": 0.4,
        "at_least": 20}
SHARED_RACE = {**RACE, "writers": 0.3, "limits": [None, 1, 2]}


def record_race(db: Db, spec: dict[str, Any], tmp_path: Path) -> Trace:
    """Race two worker processes for NAME (``spec``: a ``model_trace.RaceSpec``), recording; the trace."""
    with psycopg.connect(libpq_dsn(db.url), autocommit=True) as conn:
        mt.install(conn, db.table)
    command = [sys.executable, "-m", "tools.model_trace", "race", db.url, db.table, NAME]
    specs = [spec, {**spec, "options": {"fair": False}}]
    outs = run_together([[*command, json.dumps(s)] for s in specs], cwd=ROOT, quiet=True)
    with psycopg.connect(libpq_dsn(db.url), autocommit=True) as conn:
        changes = mt.read(conn, db.table, NAME)
    trace = Trace(NAME, spec["ttls"], changes, [Call(**c) for out in outs for c in json.loads(out)])
    trace.dump(tmp_path / "trace.json")  # after a failure: python -m tools.model_trace check <it>
    return trace


def checked(trace: Trace, tmp_path: Path) -> tuple[Conversion, mt.Verdict]:
    conversion = mt.steps(trace.changes)
    assert mt.attribution(conversion.events, trace.calls) == []
    return conversion, mt.check(conversion, trace.ttls, workdir=tmp_path / "spin")


@needs_spin
def test_a_race_for_one_lock_takes_only_steps_the_model_allows(pg: Db, tmp_path: Path) -> None:
    trace = record_race(pg, RACE, tmp_path)
    conversion, verdict = checked(trace, tmp_path)
    assert verdict.ok, verdict.explain()
    seen = mt.summary(conversion.events)
    # The race did what it is for: leases taken over after they ran out, handed over by a
    # release to the fair queue, extended.
    assert seen["grant (expired)"] >= 3 and seen["grant (handed over by a release)"] >= 3, seen
    assert seen["grant by the fair queue"] >= 3 and seen["renew"] >= 10, seen
    assert len(trace.calls) >= 30 and len({c.owner for c in trace.calls}) == len(trace.calls), seen


@needs_spin
def test_a_race_of_readers_semaphores_and_writers_takes_only_steps_the_model_allows(pg: Db, tmp_path: Path) -> None:
    trace = record_race(pg, SHARED_RACE, tmp_path)
    conversion, verdict = checked(trace, tmp_path)
    assert verdict.ok, verdict.explain()
    seen = mt.summary(conversion.events)
    for step in ("shared grant (reader)", "shared grant (limit 1)", "shared grant (limit 2)", "share release",
                 "share renew", "forget", "renew"):
        assert seen[step] >= 3, (step, seen)
    # Writers after readers (handed the name by the last live holder's release, or after the
    # shared leases ran out), and readers after writers.
    assert seen["grant (after shared leases)"] + seen["grant (free)"] >= 3, seen
    assert seen["shared grant (handed over by a writer's release)"] + seen[
        "shared grant (after a writer's lease ran out)"
    ] >= 1, seen


# -- a small run, recorded once, and corrupted ------------------------------------------------


@dataclass
class Scenario:
    """A recorded run of known steps; ``leases``: each client's (owner, token), by its role."""

    trace: Trace
    leases: dict[str, tuple[str, int]]

    def tx(self, role: str, nth: int = 0) -> int:
        """The txid of the ``nth`` transaction that wrote ``role``'s lease (0: its grant)."""
        owner, _ = self.leases[role]
        txids = dict.fromkeys(c.txid for c in self.trace.changes if c.new is not None and c.new.owner == owner)
        return list(txids)[nth]

    def changes(self, txid: int) -> list[Change]:
        return [c for c in self.trace.changes if c.txid == txid]


@pytest.fixture(scope="module")
def scenario(pg_url: str) -> Iterator[Scenario]:
    """One client after another on NAME, on a table of its own, recorded:

    A takes the lock (ttl 0.5 s), extends it to 2 s and releases it; B takes it (0.5 s)
    and leaves it to run out; C takes it over, extends and releases it. Reader R1 (2 s)
    and a semaphore holder S (limit 2, 0.5 s) share it; S extends and leaves, then R1
    (the last live holder: the row is freed). Writer W takes and releases it. Reader R2
    (0.5 s) leaves its lease to run out; S2 (limit 1) sweeps it away and takes a slot.
    The ttls are long enough that no grant comes back with less than half of one left to
    trust, which its acquire would extend before returning (a step more in the trace).
    """
    db = Db("postgresql", pg_url, "t_" + secrets.token_hex(6))
    Locker(db.url, table=db.table).create_schema()
    leases: dict[str, tuple[str, int]] = {}
    calls: list[Call] = []
    try:
        with psycopg.connect(libpq_dsn(db.url), autocommit=True) as conn:
            mt.install(conn, db.table)
            locker = db.locker()
            readers, pair, single = locker.readers(NAME), locker.semaphore(NAME, 2), locker.semaphore(NAME, 1)

            def took(role: str, lease: Any, extend: float | None = None, release: bool = True) -> None:
                assert lease is not None, role
                if extend is not None:
                    lease.extend(extend)
                leases[role] = (lease.owner, lease.token)
                calls.append(Call(lease.owner, lease.token, lease.shared, int(extend is not None),
                                  release and lease.release()))

            took("A", locker.try_acquire(NAME, ttl=0.5), extend=2.0)
            took("B", locker.try_acquire(NAME, ttl=0.5), release=False)
            time.sleep(0.8)
            took("C", locker.try_acquire(NAME, ttl=0.5), extend=0.5)
            r1 = readers.try_acquire(ttl=2.0)
            took("S", pair.try_acquire(ttl=0.5), extend=0.5)
            took("R1", r1)
            took("W", locker.try_acquire(NAME, ttl=0.5))
            took("R2", readers.try_acquire(ttl=0.5), release=False)
            time.sleep(0.8)
            took("S2", single.try_acquire(ttl=0.5))
            changes = mt.read(conn, db.table, NAME)
        yield Scenario(Trace(NAME, [0.5, 2.0], changes, calls), leases)
    finally:
        db.drop()


def shift(changes: list[Change], txid: int, to: int) -> list[Change]:
    """The changes with transaction ``txid`` moved to run at ``to``: its times and the expiries it
    computed (clock + ttl) move with it, as if its statement had run then."""
    first = next(c for c in changes if c.txid == txid)
    delta = to - first.at

    def moved(c: Change) -> Change:
        new = c.new
        if new is not None and new.expires is not None and (c.old is None or c.old.expires != new.expires):
            new = dataclasses.replace(new, expires=new.expires + delta)
        return dataclasses.replace(c, at=c.at + delta, began=c.began + delta, new=new)

    return [moved(c) if c.txid == txid else c for c in changes]


def renewed(s: Scenario, role: str, change: Callable[[Change], Change]) -> list[Change]:
    """The changes with ``change`` applied to the row's change of ``role``'s extend."""
    txid = s.tx(role, 1)
    return [change(c) if c.txid == txid and c.table == "lock" else c for c in s.trace.changes]


def takeover_while_live(s: Scenario) -> Conversion:
    # C's takeover of B's lease, moved to 1 ms after B's grant: B's lease (0.5 s) is live.
    b_granted = s.changes(s.tx("B"))[0].at
    return mt.steps(shift(s.trace.changes, s.tx("C"), b_granted + 1000))


def token_goes_down(s: Scenario) -> Conversion:
    # C's grant writes A's token, drawn before B's.
    c_tx, a_token = s.tx("C"), s.leases["A"][1]
    return mt.steps([
        dataclasses.replace(c, new=dataclasses.replace(c.new, token=a_token)) if c.txid == c_tx and c.new else c
        for c in s.trace.changes
    ])


def extend_by_a_non_holder(s: Scenario) -> Conversion:
    # C's extend, made by B with its own token: B's lease was taken over by C, and B never
    # heard of it. (Recorded, that change would show the row as B's before it, which the
    # SYNC before the step refuses: the row was C's.)
    conversion = mt.steps(s.trace.changes)
    owner, token = s.leases["B"]
    events = [
        dataclasses.replace(e, owner=owner, token=token) if e.kind == "RENEW" and e.owner == s.leases["C"][0] else e
        for e in conversion.events
    ]
    return dataclasses.replace(conversion, events=events)


def extend_shortens(s: Scenario) -> Conversion:
    # C's extend moves its expiry 10 ms earlier.
    def shorter(c: Change) -> Change:
        assert c.old is not None and c.new is not None and c.old.expires is not None
        return dataclasses.replace(c, new=dataclasses.replace(c.new, expires=c.old.expires - 10_000))
    return mt.steps(renewed(s, "C", shorter))


def past_the_limit(s: Scenario) -> Conversion:
    # R1 is recorded as a semaphore holder with a limit of 1: S's grant beside it breaks it.
    owner = s.leases["R1"][0]
    return mt.steps([
        dataclasses.replace(c, new=dataclasses.replace(c.new, limit=1))
        if c.table == "holder" and c.op == "I" and c.new and c.new.owner == owner else c
        for c in s.trace.changes
    ])


def sweep_of_a_live_lease(s: Scenario) -> Conversion:
    # S2's grant, which deletes R2's lease that ran out, moved to 1 ms after R2's grant.
    r2_granted = s.changes(s.tx("R2"))[0].at
    return mt.steps(shift(s.trace.changes, s.tx("S2"), r2_granted + 1000))


def change_not_recorded(s: Scenario) -> Conversion:
    # C's extend missing from the recording: the row at C's release is not the model's.
    txid = s.tx("C", 1)
    return mt.steps([c for c in s.trace.changes if c.txid != txid])


# corruption: (the events, the step refused, the assertion that refuses it)
CORRUPTIONS: dict[str, tuple[Callable[[Scenario], Conversion], str, str]] = {
    "a grant while a live lease is held": (takeover_while_live, "GRANT", "expires<=clock"),
    "a token going down": (token_goes_down, "GRANT", "tok>seq"),
    "an extend by a client that does not hold the lease": (extend_by_a_non_holder, "RENEW", "owner==who"),
    "an extend that shortens the lease": (extend_shortens, "RENEW", "exp==expires"),
    "a shared lease past the smallest limit": (past_the_limit, "SHARE_GRANT", "count<least"),
    "a live shared lease swept away": (sweep_of_a_live_lease, "FORGET", "hexp[who]<=clock"),
    "a change the recording lost": (change_not_recorded, "SYNC", "expires==exp"),
}


@needs_spin
def test_the_recorded_scenario_takes_only_steps_the_model_allows(scenario: Scenario, tmp_path: Path) -> None:
    conversion = mt.steps(scenario.trace.changes)
    assert mt.attribution(conversion.events, scenario.trace.calls) == []
    kinds = [e.kind for e in conversion.events if e.kind not in ("SYNC", "HELLO")]
    assert kinds == [
        "GRANT", "RENEW", "RELEASE",  # A
        "GRANT",  # B
        "GRANT", "RENEW", "RELEASE",  # C takes B's lease over
        "SHARE_GRANT", "SHARE_GRANT", "SHARE_RENEW", "SHARE_RELEASE", "SHARE_RELEASE",  # R1 and S
        "GRANT", "RELEASE",  # W
        "SHARE_GRANT", "FORGET", "SHARE_GRANT", "SHARE_RELEASE",  # R2, swept by S2
    ], kinds
    verdict = mt.check(conversion, scenario.trace.ttls, workdir=tmp_path)
    assert verdict.ok, verdict.explain()


@needs_spin
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupted_trace_is_refused_at_the_step_it_breaks(
    scenario: Scenario, corruption: str, tmp_path: Path
) -> None:
    corrupt, kind, assertion = CORRUPTIONS[corruption]
    verdict = mt.check(corrupt(scenario), scenario.trace.ttls, workdir=tmp_path)
    assert not verdict.ok and verdict.event is not None, verdict.explain()
    assert verdict.event.kind == kind and assertion in (verdict.assertion or ""), verdict.explain()


def test_what_a_client_saw_must_be_its_own_steps(scenario: Scenario) -> None:
    events = mt.steps(scenario.trace.changes).events
    calls = scenario.trace.calls
    b, c = (next(call for call in calls if call.owner == scenario.leases[r][0]) for r in ("B", "C"))
    # B says it extended its lease after C took it over (an extend by a non-holder that the
    # database let through would show as C's extend): the trace has no extend of B's.
    assert mt.attribution(events, [*calls, dataclasses.replace(b, extends=1)])[-1:] == [
        f"the client of owner {b.owner} (token {b.token}) saw 1 extend(s) of its own; the trace has 0"
    ]
    # C never released its lease (a release by name from another client would look so): the trace has one.
    assert f"the client of owner {c.owner} (token {c.token}) saw 0 release(s) of its own; the trace has 1" in (
        mt.attribution(events, [dataclasses.replace(c, released=False)])
    )


def test_changes_of_two_transactions_at_once_break_the_commit_order(scenario: Scenario) -> None:
    # A's extend recorded between the two changes of R1's grant: seq would not be commit order.
    changes = scenario.trace.changes
    extend = next(c for c in changes if c.txid == scenario.tx("A", 1))
    r1 = scenario.changes(scenario.tx("R1"))
    mixed = [c for c in changes if c is not extend]
    mixed.insert(mixed.index(r1[0]) + 1, extend)
    with pytest.raises(mt.RecordingError, match="changed the name again"):
        list(mt.transactions(mixed))
