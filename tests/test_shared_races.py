"""The audited race of shared leases (issue 16), in a file of its own so that it runs beside the
rest of the shared leases' tests: 3 processes x 4 threads take one name as readers, semaphore
holders, upgradeable readers and writers, with tiny TTLs, on every backend.

The race is audited by the database itself (triggers on the lock and holders tables record
every grant, extend and release with the database's clock): never a writer together with any
other holder, never more holders than any live holder's limit, every grant's token above every
earlier grant's. Mutants that ignore the limit, let a writer in beside readers, or upgrade
beside readers are shown to fail the same checks.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

from .conftest import ALL_BACKENDS, Db
from .workers import run_together

BACKENDS = ALL_BACKENDS
HERE = Path(__file__).resolve().parent
SHARED = "'*shared'"


# -- the audit: every lease's life by the database's clock --------------------------
def install_audit(db: Db) -> None:
    t, h = db.table, f"{db.table}_holders"
    if db.backend == "postgresql":
        db.query(
            f"CREATE TABLE {t}_audit (seq bigserial PRIMARY KEY, kind text, token bigint, at float8, expires float8,"
            " lim int, tx bigint DEFAULT txid_current())"
        )
        ep = "extract(epoch FROM {})::float8"
        now = ep.format("clock_timestamp()")
        db.query(
            f"""CREATE FUNCTION {t}_audit_h() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF TG_OP = 'INSERT' THEN
                INSERT INTO {t}_audit (kind, token, at, expires, lim)
                VALUES ('gs', NEW.token, {now}, {ep.format("NEW.expires_at")}, NEW.lim);
              ELSIF TG_OP = 'UPDATE' THEN
                INSERT INTO {t}_audit (kind, token, at, expires) VALUES ('xs', NEW.token, {now}, {ep.format("NEW.expires_at")});
              ELSE
                INSERT INTO {t}_audit (kind, token, at) VALUES ('ds', OLD.token, {now});
              END IF;
              RETURN NULL;
            END $$"""
        )
        db.query(f"CREATE TRIGGER {t}_audit_h AFTER INSERT OR UPDATE OR DELETE ON {h} FOR EACH ROW EXECUTE FUNCTION {t}_audit_h()")
        db.query(
            f"""CREATE FUNCTION {t}_audit_l() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              -- A writer's lease ends when the row changes hands (released, handed over, taken over).
              IF TG_OP = 'UPDATE' AND OLD.owner IS NOT NULL AND OLD.owner <> {SHARED}
                 AND (OLD.token <> NEW.token OR NEW.owner IS DISTINCT FROM OLD.owner) THEN
                INSERT INTO {t}_audit (kind, token, at) VALUES ('dw', OLD.token, {now});
              END IF;
              IF NEW.owner IS NOT NULL AND NEW.owner <> {SHARED} THEN
                IF TG_OP = 'INSERT' OR OLD.token <> NEW.token THEN
                  INSERT INTO {t}_audit (kind, token, at, expires) VALUES ('gw', NEW.token, {now}, {ep.format("NEW.expires_at")});
                ELSIF NEW.expires_at IS DISTINCT FROM OLD.expires_at THEN
                  INSERT INTO {t}_audit (kind, token, at, expires) VALUES ('xw', NEW.token, {now}, {ep.format("NEW.expires_at")});
                END IF;
              END IF;
              RETURN NULL;
            END $$"""
        )
        db.query(f"CREATE TRIGGER {t}_audit_l AFTER INSERT OR UPDATE ON {t} FOR EACH ROW EXECUTE FUNCTION {t}_audit_l()")
        return
    if db.backend == "mariadb":  # the SQLite triggers below, in MariaDB's words
        now = "UNIX_TIMESTAMP(SYSDATE(6))"
        db.query(
            f"CREATE TABLE {t}_audit (seq BIGINT AUTO_INCREMENT PRIMARY KEY, kind CHAR(2), token BIGINT, at DOUBLE,"
            " expires DOUBLE, lim INT)"
        )
        w = f"NEW.owner IS NOT NULL AND NEW.owner <> {SHARED}"
        for sql in (
            f"CREATE TRIGGER {t}_a1 AFTER INSERT ON {h} FOR EACH ROW INSERT INTO {t}_audit (kind, token, at, expires, lim)"
            f" VALUES ('gs', NEW.token, {now}, NEW.expires_at, NEW.lim)",
            f"CREATE TRIGGER {t}_a2 AFTER UPDATE ON {h} FOR EACH ROW INSERT INTO {t}_audit (kind, token, at, expires)"
            f" VALUES ('xs', NEW.token, {now}, NEW.expires_at)",
            f"CREATE TRIGGER {t}_a3 AFTER DELETE ON {h} FOR EACH ROW INSERT INTO {t}_audit (kind, token, at)"
            f" VALUES ('ds', OLD.token, {now})",
            f"CREATE TRIGGER {t}_a4 AFTER INSERT ON {t} FOR EACH ROW BEGIN IF {w} THEN"
            f" INSERT INTO {t}_audit (kind, token, at, expires) VALUES ('gw', NEW.token, {now}, NEW.expires_at); END IF; END",
            f"CREATE TRIGGER {t}_a5 AFTER UPDATE ON {t} FOR EACH ROW BEGIN"
            f" IF OLD.owner IS NOT NULL AND OLD.owner <> {SHARED} AND (NEW.token <> OLD.token OR NOT NEW.owner <=> OLD.owner)"
            f" THEN INSERT INTO {t}_audit (kind, token, at) VALUES ('dw', OLD.token, {now}); END IF;"
            f" IF {w} AND NEW.token <> OLD.token THEN"
            f" INSERT INTO {t}_audit (kind, token, at, expires) VALUES ('gw', NEW.token, {now}, NEW.expires_at);"
            f" ELSEIF {w} AND NOT NEW.expires_at <=> OLD.expires_at THEN"
            f" INSERT INTO {t}_audit (kind, token, at, expires) VALUES ('xw', NEW.token, {now}, NEW.expires_at); END IF; END",
        ):
            db.query(sql)
        return
    now = "((julianday('now') - 2440587.5) * 86400.0)"
    db.query(
        f"CREATE TABLE {t}_audit (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT, token INTEGER, at REAL,"
        " expires REAL, lim INTEGER)"
    )
    for sql in (
        f"CREATE TRIGGER {t}_a1 AFTER INSERT ON {h} BEGIN INSERT INTO {t}_audit (kind, token, at, expires, lim)"
        f" VALUES ('gs', NEW.token, {now}, NEW.expires_at, NEW.lim); END",
        f"CREATE TRIGGER {t}_a2 AFTER UPDATE ON {h} BEGIN INSERT INTO {t}_audit (kind, token, at, expires)"
        f" VALUES ('xs', NEW.token, {now}, NEW.expires_at); END",
        f"CREATE TRIGGER {t}_a3 AFTER DELETE ON {h} BEGIN INSERT INTO {t}_audit (kind, token, at)"
        f" VALUES ('ds', OLD.token, {now}); END",
        f"CREATE TRIGGER {t}_a4 AFTER INSERT ON {t} WHEN NEW.owner IS NOT NULL AND NEW.owner <> {SHARED}"
        f" BEGIN INSERT INTO {t}_audit (kind, token, at, expires) VALUES ('gw', NEW.token, {now}, NEW.expires_at); END",
        f"CREATE TRIGGER {t}_a5 AFTER UPDATE ON {t} WHEN NEW.owner IS NOT NULL AND NEW.owner <> {SHARED}"
        f" AND NEW.token <> OLD.token"
        f" BEGIN INSERT INTO {t}_audit (kind, token, at, expires) VALUES ('gw', NEW.token, {now}, NEW.expires_at); END",
        f"CREATE TRIGGER {t}_a6 AFTER UPDATE ON {t} WHEN NEW.owner IS NOT NULL AND NEW.owner <> {SHARED}"
        f" AND NEW.token = OLD.token AND NEW.expires_at IS NOT OLD.expires_at"
        f" BEGIN INSERT INTO {t}_audit (kind, token, at, expires) VALUES ('xw', NEW.token, {now}, NEW.expires_at); END",
        f"CREATE TRIGGER {t}_a7 AFTER UPDATE ON {t} WHEN OLD.owner IS NOT NULL AND OLD.owner <> {SHARED}"
        f" AND (NEW.token <> OLD.token OR NEW.owner IS NOT OLD.owner)"
        f" BEGIN INSERT INTO {t}_audit (kind, token, at) VALUES ('dw', OLD.token, {now}); END",
    ):
        db.query(sql)


Life = tuple[float, float, str, "int | None", int]  # start, end, kind ("w" or "s"), limit, token


def audited(db: Db) -> tuple[list[Life], list[int]]:
    """Every lease's [grant, end) by the database's clock, and the grants' tokens in grant order.

    On PostgreSQL an end is placed at its transaction's first recorded moment: an AFTER
    trigger fires when its statement ends, and a release (0012) clears the lease with its
    own UPDATE before its RETURNING hands the name on, whose changes are recorded first.
    (The UPDATE ended the lease before that moment, so the end placed there is no earlier
    than the real one: no overlap is hidden. A transaction changes the name under its row
    lock, so no other transaction's change falls between.)"""
    tx = ", tx" if db.backend == "postgresql" else ", NULL"
    rows = db.query(f"SELECT kind, token, at, expires, lim{tx} FROM {db.table}_audit ORDER BY seq")
    first: dict[int, float] = {}
    for _, _, at, _, _, txid in rows:
        if txid is not None:
            first[txid] = min(first.get(txid, at), at)
    lives: dict[int, list] = {}
    order: list[int] = []
    for kind, token, at, expires, lim, txid in rows:
        if kind in ("gw", "gs"):
            assert token not in lives, f"token {token} granted twice"
            lives[token] = [at, expires, math.inf, kind[1], lim]
            order.append(token)
        elif kind in ("xw", "xs"):
            lives[token][1] = max(lives[token][1], expires)
        else:  # a release (or, for a holder, forgetting it after it ran out)
            lives[token][2] = min(lives[token][2], first.get(txid, at))
    return [(s, min(e, d), k, lim, tok) for tok, (s, e, d, k, lim) in lives.items()], order


def violations(lives: list[Life]) -> list[str]:
    """Moments where a writer held with anyone else, or more shared leases held than a holder's limit."""
    events = sorted(
        [(e, 0, i) for i, (s, e, *_) in enumerate(lives) if e > s] + [(s, 1, i) for i, (s, e, *_) in enumerate(lives) if e > s]
    )  # at one instant, ends before starts: [start, end) intervals
    active: set[int] = set()
    found: list[str] = []
    for _, starts, i in events:
        if not starts:
            active.discard(i)
            continue
        new = lives[i]
        if active and (new[2] == "w" or any(lives[j][2] == "w" for j in active)):
            found.append(f"token {new[4]} ({new[2]}) held together with {sorted(lives[j][4] for j in active)}")
        else:
            limits = [lives[j][3] for j in (*active, i) if lives[j][3] is not None]
            if limits and len(active) + 1 > min(limits):
                found.append(f"token {new[4]}: {len(active) + 1} shared leases held at once, a limit is {min(limits)}")
        active.add(i)
    return found


def race(db: Db, spec: dict, ttl: float = 0.005, duration: str = "2", processes: int = 3) -> list[list]:
    command = [
        sys.executable, str(HERE / "shared_race_worker.py"), db.url, db.table, "hot", repr(ttl), "4", duration,
        json.dumps(spec),
    ]
    return [g for out in run_together([command] * processes) for g in json.loads(out)]


def check_race(db: Db, grants: list[list]) -> None:
    lives, order = audited(db)
    assert len(grants) >= 100, f"only {len(grants)} grants: the race did not race"
    assert {g[1] for g in grants} <= set(order), "a client got a token the database never granted"
    assert len({g[1] for g in grants}) == len(grants), "a token was handed out twice"
    # G2: every grant's token is above every earlier grant's (readers' and writers' alike).
    assert [(a, b) for a, b in zip(order, order[1:]) if b <= a] == [], "a grant's token was below an earlier grant's"
    # G1 for shared leases, by the database's clock.
    assert violations(lives) == []
    # ...and as the clients trusted their leases (G5): [received, trusted_until).
    trusted = [(r, u, kind, limit, token) for kind, token, r, u, limit in grants]
    assert violations(trusted) == []


def warm_ttl(db: Db) -> float:
    """A waiting grant takes a few commits: scale the TTL to this machine's commit time."""
    probe = db.locker()
    started = time.monotonic()
    for _ in range(5):
        probe.try_acquire("warm").release()
    return min(0.5, max(0.01, 10 * (time.monotonic() - started) / 5))


SCENARIOS = {
    "readers and writers": {"limits": [None], "writers": 0.2},
    "semaphore of 2": {"limits": [2]},
    "limits 2 and 3, readers, writers": {"limits": [2, 3, None], "writers": 0.1},
    # Every write an upgrade's, so the race shows upgrades happen; writers beside upgrades race in
    # tests/test_upgradeable_faces*.py.
    "upgradeable readers and readers": {"limits": [None], "upgraders": 0.5},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("wait", [False, True], ids=["try", "wait"])
def test_race_of_readers_writers_and_semaphore_holders(db: Db, scenario: str, wait: bool) -> None:
    """3 processes x 4 threads take one name with tiny TTLs (try: 5 ms, or a few round trips on a
    slow machine; wait: blocking acquires,
    writers in PostgreSQL's fair queue), holding past the TTL half the time."""
    install_audit(db)
    # A try's ttl is a few round trips, so that holders outlive it; no fixed clock allowance (one
    # machine, one clock), which on a ttl this short would leave a grant too little trust to use.
    ttl = warm_ttl(db) if wait else max(0.005, warm_ttl(db) / 4)
    spec = SCENARIOS[scenario]
    grants = race(db, {**spec, "wait": wait, "options": {"drift_fixed": 0}}, ttl=ttl)
    check_race(db, grants)
    if spec.get("upgraders") and not spec.get("writers"):
        assert sum(g[0] == "w" for g in grants) >= 5, "the upgradeable readers hardly ever upgraded: no race"


@pytest.mark.parametrize(
    "broken, spec, error",
    [
        ("limit", {"limits": [2]}, "shared leases held at once"),
        ("writer", {"limits": [None], "writers": 0.3}, "held together with"),
        ("upgrade", {"limits": [None], "upgraders": 0.5}, "held together with"),
    ],
)
def test_race_catches_a_mutant(db: Db, broken: str, spec: dict, error: str) -> None:
    """The same race and checks against a mutant: a shared acquire sent without the caller's
    limit, a write acquire that ignores shared holders, or an upgrade that does not wait for the
    other readers. The checks must fail."""
    install_audit(db)
    if broken == "upgrade" and db.backend == "postgresql":  # the workers call this copy instead
        signature = f"{db.table}_upgrade(text, text, bigint, float8)"
        ((definition,),) = db.query(f"SELECT pg_get_functiondef('{signature}'::regprocedure)")
        assert definition.count("IF n > 0 THEN") == 1
        broken_copy = definition.replace("IF n > 0 THEN", "IF false THEN")
        db.query(broken_copy.replace(f"{db.table}_upgrade(", f"{db.table}_upgrade_broken(", 1))
    grants = race(db, {**spec, "broken": broken}, ttl=0.02)
    with pytest.raises(AssertionError, match=error):
        check_race(db, grants)


# Mutants of the fair queue's walk (migration 0008's admit), made in the database itself.
_ADMIT_MUTANTS = {
    # the walk grants readers and semaphore waiters past every limit
    "limit": ("IF n >= coalesce(v.lim, n + 1) OR n >= coalesce(m, n + 1) THEN", "IF false THEN"),
    # the walk grants a writer at the head while shared leases are held
    "writer": ("IF n = 0 THEN", "IF true THEN"),
}


def break_admit(pg: Db, broken: str) -> None:
    ((definition,),) = pg.query(f"SELECT pg_get_functiondef('{pg.table}_admit'::regproc)")
    old, new = _ADMIT_MUTANTS[broken]
    assert definition.count(old) == 1
    pg.query(definition.replace(old, new))


def test_race_catches_a_mutant_of_the_queue(pg: Db) -> None:
    """The waiting race of a semaphore of 2 against a queue walk that ignores limits: the checks must fail."""
    install_audit(pg)
    break_admit(pg, "limit")
    grants = race(pg, {"limits": [2], "wait": True}, ttl=warm_ttl(pg))
    with pytest.raises(AssertionError, match="shared leases held at once"):
        check_race(pg, grants)


def test_violations_sees_a_writer_with_a_reader() -> None:
    """The checker itself: a writer overlapping a reader, and a third holder of a limit of 2."""
    assert violations([(0.0, 2.0, "s", None, 1), (1.0, 3.0, "w", None, 2)])
    assert violations([(0.0, 2.0, "w", None, 1), (1.0, 3.0, "s", None, 2)])
    assert violations([(0, 5, "s", 2, 1), (1, 5, "s", 2, 2), (2, 5, "s", None, 3)])
    assert not violations([(0, 1, "w", None, 1), (1, 2, "s", 2, 2), (1, 2, "s", 2, 3), (2, 3, "w", None, 4)])
