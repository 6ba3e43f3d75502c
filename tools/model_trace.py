"""Check traces recorded from real runs of dblock against the models' steps (model/trace.pml).

As etcd's raft checks traces of its real nodes against its TLA+ spec, this records what
PostgreSQL did to one lock name during a real run and asks Spin whether each recorded step
is one the models (model/lease.pml, model/shared.pml) allow, in the state the trace has
reached. Four parts:

- **The recorder** (``install``, ``read``): a trigger on the lock table and on its holders
  table writes every change of a row, old and new values, to ``<table>_audit``, with the
  database clock (``clock_timestamp()``), the transaction's start (``now()``), its txid and
  the dblock functions that made the change (read from ``PG_CONTEXT``).
- **The converter** (``steps``): each transaction's changes become the models' steps: a
  grant, an extend, a release, a shared grant, extend or release, the sweep of a shared lease
  that ran out; a transaction's start and end are checked against the row as recorded
  (nothing changed it unrecorded, and the steps wrote what the database did).
- **The check** (``check``): the steps, as a C array, and model/trace.pml, which replays them
  on one path through Spin's verifier (``pan``), asserting each step's guard and effect.
- **The attribution** (``attribution``): what each client saw (the grants, extends and
  releases its calls reported) against the steps the trace gives its owner id.

**Commit order.** Every statement of dblock that writes a name's lock row or its holders
holds the name's row lock from its first write to its commit: the lock row's writers take it
with their UPDATE, the PL/pgSQL functions with SELECT ... FOR UPDATE before they touch the
holders (or the row), and a name's first INSERT is waited for by any other writer through
the unique key; dblock runs each statement in a transaction of its own, and a row lock is
held until the transaction ends. So the transactions that write a name do so one after
another, each after the one before committed. The audit's ``seq`` is a bigserial, drawn in
the trigger, that is, while the row lock is held; a sequence (with the default cache of 1)
hands out increasing numbers across sessions in real time. So every number a transaction
draws is larger than every number drawn by the transactions that committed before it:
``ORDER BY seq`` is commit order, and within a transaction the order of its changes. (A
rolled-back transaction's audit rows roll back with it: the trace holds committed changes
only.) ``read`` checks what it can of this: each transaction's changes are consecutive; and
trace.pml checks that the database clock never runs back from one change to the next, as
it cannot if each transaction wrote after the one before committed. The one writer that
takes no row lock, ``share_prune``, deletes holders that ran out long before; a race does
not run it (were it recorded, its change would be refused, as the model has no such step).

Run a race's worker (tests/test_model_trace.py starts them), or check a saved trace::

    python -m tools.model_trace race URL TABLE NAME SPEC     # one process of a race
    python -m tools.model_trace check TRACE.json [-DSOME_DEFINE ...]
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "model" / "trace.pml"
SHARED_OWNER = "*shared"  # the owner the lock row shows while shared leases hold the name
US = 1_000_000  # the trace counts time in microseconds, as PostgreSQL's timestamps do


# -- the recorder ---------------------------------------------------------------------------


def audit_table(table: str) -> str:
    """The audit's table: ``<table>_audit``, which the suite's clean-up drops with the lock table."""
    return f"{table}_audit"


def install_sql(table: str) -> list[str]:
    """The statements that start recording every change of ``table``'s rows and its holders'.

    ``table`` is a plain, unquoted name in the search path (the suite's tables are). The
    audit's ``seq`` is a bigserial: its ``nextval`` runs in the trigger, under the row lock.
    ``via`` lists the dblock functions the change ran in, innermost first (from the call
    stack PostgreSQL reports in PG_CONTEXT; the first entry is this trigger itself, dropped),
    empty for a statement's own SQL (acquire, release, extend).
    """
    audit, fn = audit_table(table), f"{table}_audit_fn"
    columns = "owner, token, expires, lim, waiting"
    old = ", ".join(f"old_{c}" for c in columns.split(", "))
    new = ", ".join(f"new_{c}" for c in columns.split(", "))
    image = (
        "{0}->>'owner', ({0}->>'token')::bigint, ({0}->>'expires_at')::timestamptz,"
        " ({0}->>'lim')::int, ({0}->>'waiting')::int"
    )
    return [
        f"""CREATE TABLE {audit} (
    seq bigserial PRIMARY KEY, txid bigint NOT NULL, at timestamptz NOT NULL, began timestamptz NOT NULL,
    tab text NOT NULL, op text NOT NULL, name text NOT NULL, via text NOT NULL,
    old_owner text, old_token bigint, old_expires timestamptz, old_lim int, old_waiting int,
    new_owner text, new_token bigint, new_expires timestamptz, new_lim int, new_waiting int)""",
        # The rows as JSON: one function serves both tables (a holder has lim, the lock row waiting).
        f"""CREATE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    o jsonb := CASE WHEN TG_OP <> 'INSERT' THEN to_jsonb(OLD) END;
    n jsonb := CASE WHEN TG_OP <> 'DELETE' THEN to_jsonb(NEW) END;
    stack text;
    via text;
BEGIN
    GET DIAGNOSTICS stack = PG_CONTEXT;
    SELECT coalesce(string_agg(f.m[1], ',' ORDER BY f.k), '') INTO via
    FROM regexp_matches(stack, 'PL/pgSQL function ([^(\\s]+)\\(', 'g') WITH ORDINALITY AS f(m, k) WHERE f.k > 1;
    INSERT INTO {audit} (txid, at, began, tab, op, name, via, {old}, {new})
    VALUES (txid_current(), clock_timestamp(), now(), TG_ARGV[0], left(TG_OP, 1), coalesce(n, o)->>'name', via,
        {image.format('o')}, {image.format('n')});
    RETURN NULL;
END $$""",
        f"CREATE TRIGGER {table}_audit_tr AFTER INSERT OR UPDATE OR DELETE ON {table}"
        f" FOR EACH ROW EXECUTE FUNCTION {fn}('lock')",
        f"CREATE TRIGGER {table}_holders_audit_tr AFTER INSERT OR UPDATE OR DELETE ON {table}_holders"
        f" FOR EACH ROW EXECUTE FUNCTION {fn}('holder')",
    ]


def install(conn: Any, table: str) -> None:
    """Start recording (``conn``: a psycopg connection in autocommit mode)."""
    for sql in install_sql(table):
        conn.execute(sql)


def uninstall(conn: Any, table: str) -> None:
    """Stop recording and drop the audit."""
    conn.execute(f"DROP TABLE IF EXISTS {audit_table(table)}")
    conn.execute(f"DROP FUNCTION IF EXISTS {table}_audit_fn() CASCADE")


@dataclass(frozen=True)
class Image:
    """A row as the trigger saw it, before or after a change (times: microseconds since the epoch)."""

    owner: str | None
    token: int
    expires: int | None
    limit: int | None = None  # a holder's limit (None: a reader)
    waiting: int | None = None  # the lock row's count of live waiters


@dataclass(frozen=True)
class Change:
    """One change of a row, as recorded."""

    seq: int
    txid: int
    at: int  # clock_timestamp() after the change (µs since the epoch)
    began: int  # now(): the transaction's start
    table: str  # "lock" or "holder"
    op: str  # "I", "U" or "D"
    via: tuple[str, ...]  # dblock's functions it ran in, innermost first
    old: Image | None
    new: Image | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Change:
        image = {k: None if data[k] is None else Image(**data[k]) for k in ("old", "new")}
        return cls(**{**data, **image, "via": tuple(data["via"])})


class RecordingError(Exception):
    """The recording breaks a premise of the check (the commit order), or is malformed."""


def read(conn: Any, table: str, name: str) -> list[Change]:
    """The changes of ``name`` (its lock row and its holders) in commit order."""
    def us(column: str) -> str:
        return f"(extract(epoch FROM {column}) * {US})::bigint"

    columns = ["seq", "txid", us("at"), us("began"), "tab", "op", "via"]
    for side in ("old", "new"):
        columns += [f"{side}_owner", f"{side}_token", us(f"{side}_expires"), f"{side}_lim", f"{side}_waiting"]
    rows = conn.execute(
        f"SELECT {', '.join(columns)} FROM {audit_table(table)} WHERE name = %s ORDER BY seq", (name,)
    ).fetchall()
    changes = []
    for seq, txid, at, began, tab, op, via, *images in rows:
        names = tuple(f.split(".")[-1].strip('"').removeprefix(table + "_") for f in via.split(",") if f)
        old, new = (None if images[k + 1] is None else Image(*images[k:k + 5]) for k in (0, 5))
        changes.append(Change(seq, txid, at, began, tab, op, names, old, new))
    # The commit-order premise: each transaction's changes are consecutive. Then each, in the
    # order it made its changes.
    return [change for tx in transactions(changes) for change in written_order(tx)]


def written_order(tx: list[Change]) -> list[Change]:
    """A transaction's changes in the order it made them.

    The recorder is an AFTER trigger, which PostgreSQL fires when the statement that made
    the change ends, or, for a change a function made, when that function's statement
    ends. A release (0012) clears the lease with its own UPDATE, then its RETURNING calls
    hand_on, whose changes are recorded first: the statement's own changes (empty ``via``)
    come first, at the transaction's first recorded moment (the clock was read later).
    Every other dblock statement makes changes of one kind only, and keeps its order.
    """
    own = [c for c in tx if not c.via]
    if not own or len(own) == len(tx) or tx[0] in own:
        return tx
    first = min(c.at for c in tx)
    return [dataclasses.replace(c, at=first) for c in own] + [c for c in tx if c.via]


def transactions(changes: Sequence[Change]) -> Iterator[list[Change]]:
    """The changes grouped by transaction, in commit order.

    Raises RecordingError when a transaction's changes are not consecutive: two
    transactions then changed the name at once, and ``seq`` would not be commit order.
    """
    done: set[int] = set()
    group: list[Change] = []
    for change in changes:
        if group and change.txid != group[0].txid:
            done.add(group[0].txid)
            yield group
            group = []
        if change.txid in done:
            raise RecordingError(
                f"transaction {change.txid} changed the name again after another did (seq {change.seq})"
            )
        group.append(change)
    if group:
        yield group


# -- the converter: changes into the models' steps -------------------------------------------


@dataclass(frozen=True)
class Event:
    """One step of the models (model/trace.pml's K_ codes), as the trace shows it.

    ``owner`` is the client that takes the step (dblock draws an owner id per attempt); for
    SYNC, the row's owner (None: free, or ``SHARED_OWNER``). Times in µs since the epoch.
    """

    kind: str
    owner: str | None
    token: int = 0
    expires: int | None = None
    at: int = 0
    began: int = 0
    limit: int | None = None  # SHARE_GRANT: the caller's limit (None: a reader)
    row_owner: str | None = None  # SHARE_RELEASE: the row's owner after it
    row_expires: int | None = None  # SHARE_GRANT, _RENEW and _RELEASE: the row's expiry after it
    seq: int = 0  # the recorded change it comes from
    txid: int = 0  # and its transaction
    via: str = ""  # the dblock functions of that change, innermost first
    why: str = ""  # UNKNOWN: what the change did

    def describe(self) -> str:
        who = "-" if self.owner is None else self.owner
        expires = "" if self.expires is None else f", expiring at {self.expires} µs"
        via = f", in {self.via}" if self.via else ""
        why = f": {self.why}" if self.why else ""
        return f"{self.kind} by {who}, token {self.token}{expires} (change {self.seq}{via}){why}"


@dataclass
class Conversion:
    """The steps of a trace, and who holds what when it ends (a slot stays taken until then)."""

    events: list[Event]
    row_owner: str | None
    holders: set[str]


class _Steps:
    """Turns transactions into steps, keeping the row and the holders as the steps leave them.

    It only tells which step a change is: whether the step is allowed is trace.pml's to say.
    """

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.owner: str | None = None  # the name has no row yet: as free, token 0
        self.token = 0
        self.expires: int | None = None
        self.holders: dict[str, int] = {}

    def emit(self, event: Event) -> None:
        self.events.append(event)
        kind = event.kind
        if kind == "GRANT":
            self.owner, self.token, self.expires = event.owner, event.token, event.expires
        elif kind == "RENEW":
            self.expires = event.expires
        elif kind == "RELEASE":
            self.owner, self.expires = None, None
        elif kind == "SHARE_GRANT":
            self.owner, self.token, self.expires = SHARED_OWNER, event.token, event.row_expires
            self.holders[event.owner or ""] = event.token
        elif kind == "SHARE_RENEW":
            self.expires = event.row_expires
        elif kind == "SHARE_RELEASE":
            self.holders.pop(event.owner or "", None)
            self.owner, self.expires = event.row_owner, event.row_expires
        elif kind == "FORGET":
            self.holders.pop(event.owner or "", None)

    def transaction(self, tx: list[Change]) -> None:
        rows = [c for c in tx if c.table == "lock"]
        first = tx[0]
        if rows and rows[0].old is not None:
            self.sync(rows[0].old, first)
        before = len(self.events)
        if any("handoff" in c.via for c in tx) and self.owner not in (None, SHARED_OWNER):
            # The release statement's hand-off (migration 0005): it checked the releaser's owner
            # and token under the row lock, then grants the line's head, or frees the name. The
            # release is the step the models know; the grant that follows is another.
            self.step("RELEASE", first, owner=self.owner, token=self.token)
        used: set[int] = set()
        for k, change in enumerate(tx):
            if k not in used:
                (self.holder if change.table == "holder" else self.row)(tx, k, used)
        if rows and rows[-1].new is not None:
            end = rows[-1].new
            if len(self.events) > before or rows[0].old is None or (end.owner, end.token, end.expires) != (
                rows[0].old.owner, rows[0].old.token, rows[0].old.expires
            ):
                self.sync(end, tx[-1])  # else the fair queue's bookkeeping: the row as it began, checked

    def sync(self, image: Image, change: Change) -> None:
        self.events.append(Event("SYNC", image.owner, image.token, image.expires, change.at, change.began,
                                 seq=change.seq, txid=change.txid, via=",".join(change.via)))

    def step(self, kind: str, change: Change, **values: Any) -> None:
        self.emit(Event(kind, at=change.at, began=change.began, seq=change.seq, txid=change.txid,
                        via=",".join(change.via), **values))

    def unknown(self, change: Change, why: str) -> None:
        self.step("UNKNOWN", change, owner=None, why=why)

    def grant_pair(self, tx: list[Change], k: int, used: set[int]) -> int | None:
        """The change that pairs with ``tx[k]`` in a shared grant: the holder's INSERT and the row's
        UPDATE to its token (share_acquire writes the holder first, admit the row first)."""
        change = tx[k]
        token = change.new.token if change.new else None
        want = "holder" if change.table == "lock" else "lock"
        for j, other in enumerate(tx):
            if j in used or j == k or other.table != want or other.new is None or other.new.token != token:
                continue
            if want == "lock" and other.new.owner == SHARED_OWNER:
                return j
            if want == "holder" and (other.op == "I" or (other.old is not None and other.old.token != token)):
                return j
        return None

    def share_grant(self, tx: list[Change], k: int, used: set[int]) -> None:
        j = self.grant_pair(tx, k, used)
        if j is None:
            return self.unknown(tx[k], "a shared grant on one of the row and the holders, not both")
        used.add(j)
        holder, row = (tx[k], tx[j]) if tx[k].table == "holder" else (tx[j], tx[k])
        assert holder.new is not None and row.new is not None
        if holder.op == "U" and holder.old is not None:  # admit's ON CONFLICT: a holder row replaced
            self.step("FORGET", tx[k], owner=holder.old.owner, token=holder.old.token)
        # At the first of the two changes: the expiry was computed before either was written.
        self.step("SHARE_GRANT", tx[min(j, k)], owner=holder.new.owner, token=holder.new.token,
                  expires=holder.new.expires, limit=holder.new.limit, row_expires=row.new.expires)

    def row_after(self, tx: list[Change], k: int, used: set[int], freed: bool = False) -> Change | None:
        """The lock row's change that the same function makes next after holder change ``tx[k]``
        (share_extend's and share_release's update of the row), if any; with ``freed``, also
        the fair queue's freeing of the row when the release left nobody live and it granted
        nobody (admit, called by the release)."""
        for j in range(k + 1, len(tx)):
            change = tx[j]
            if j in used or change.table != "lock":
                continue
            if change.via[:1] == tx[k].via[:1] or (
                freed and change.via[1:2] == tx[k].via[:1] and change.new is not None and change.new.owner is None
            ):
                used.add(j)
                return change
            if freed:
                return None  # the fair queue granted first: the release left the row as it was
        return None

    def holder(self, tx: list[Change], k: int, used: set[int]) -> None:
        change = tx[k]
        old, new = change.old, change.new
        if new is not None and (old is None or old.token != new.token):
            return self.share_grant(tx, k, used)
        if new is not None and old is not None:  # the same lease: share_extend, or a retry of share_acquire
            row = self.row_after(tx, k, used)
            row_expires = self.expires if row is None or row.new is None else row.new.expires
            return self.step("SHARE_RENEW", change, owner=new.owner, token=new.token, expires=new.expires,
                             row_expires=row_expires)
        assert old is not None
        if change.via[:1] == ("share_release",):
            row = self.row_after(tx, k, used, freed=True)
            if row is None or row.new is None:
                # None live is left and someone waits: the row stays as it was, and the line's
                # head takes the name (admit).
                row_owner, row_expires = self.owner, self.expires
            else:
                row_owner, row_expires = row.new.owner, row.new.expires
            return self.step("SHARE_RELEASE", change, owner=old.owner, token=old.token,
                             row_owner=row_owner, row_expires=row_expires)
        self.step("FORGET", change, owner=old.owner, token=old.token)

    def row(self, tx: list[Change], k: int, used: set[int]) -> None:
        change = tx[k]
        new = change.new
        if new is None:
            return self.unknown(change, "the name's row was deleted (prune is not modelled)")
        if new.owner == SHARED_OWNER:
            if self.owner != SHARED_OWNER or new.token != self.token:
                return self.share_grant(tx, k, used)
            if new.expires != self.expires:
                self.unknown(change, "the shared row's expiry changed with no holder's step")
            return  # bookkeeping of the fair queue (waiting)
        if new.owner is None:
            if self.owner is None:
                return  # bookkeeping, or a free row made (token 0) for a shared grant to take
            if self.owner == SHARED_OWNER:
                return self.unknown(change, "the row shared leases held was freed with no holder's release")
            return self.step("RELEASE", change, owner=self.owner, token=self.token)
        if new.owner == self.owner and new.token == self.token:
            if new.expires != self.expires or not change.via:
                # extend (a statement of its own: its unchanged expiry is a step too), a retry by
                # the owner, or enqueue's renewal of a lease a release handed the caller.
                self.step("RENEW", change, owner=new.owner, token=new.token, expires=new.expires)
            return  # else bookkeeping of the fair queue
        self.step("GRANT", change, owner=new.owner, token=new.token, expires=new.expires)


def _handed_on(via: str) -> bool:
    """Whether a change ran in a writer's release's hand-off: the hand-off function a release
    called before 0012 (handoff), or the one its RETURNING calls since (hand_on)."""
    return any(f in ("handoff", "hand_on") for f in via.split(","))


def summary(events: Sequence[Event]) -> Counter[str]:
    """How many steps of each sort a trace has: grants split by what they took (a free row, a
    writer's lease that ran out, the name after shared leases, a lease its release handed
    over), extends, releases, shared steps."""
    # Transactions that handed the name on in hand_on: a release's own UPDATE (0012) is one of theirs.
    handed_on = {e.txid for e in events if "hand_on" in e.via.split(",")}
    seen: Counter[str] = Counter()
    owner: str | None = None
    for e in events:
        if e.kind == "SYNC":
            owner = e.owner
            continue
        if e.kind == "GRANT":
            if _handed_on(e.via):
                taken = "handed over by a release"
            else:
                taken = "free" if owner is None else "after shared leases" if owner == SHARED_OWNER else "expired"
            seen[f"grant ({taken})"] += 1
            if "admit" in e.via or _handed_on(e.via):  # the walk, or a release's quick hand-off (0011, 0012)
                seen["grant by the fair queue"] += 1
        elif e.kind == "SHARE_GRANT":
            seen[f"shared grant (limit {e.limit})" if e.limit is not None else "shared grant (reader)"] += 1
            if _handed_on(e.via):
                seen["shared grant (handed over by a writer's release)"] += 1
            elif owner not in (None, SHARED_OWNER):
                seen["shared grant (after a writer's lease ran out)"] += 1
        elif e.kind == "RELEASE" and (_handed_on(e.via) or e.txid in handed_on):
            seen["release handing over"] += 1
        else:
            seen[e.kind.lower().replace("_", " ")] += 1
        owner = {"GRANT": e.owner, "SHARE_GRANT": SHARED_OWNER, "RELEASE": None}.get(e.kind, owner)
        if e.kind == "SHARE_RELEASE":
            owner = e.row_owner
    return seen


def steps(changes: Sequence[Change]) -> Conversion:
    """The models' steps that ``changes`` (one name's, in commit order) take."""
    out = _Steps()
    for tx in transactions(changes):
        out.transaction(tx)
    return Conversion(out.events, out.owner, set(out.holders))


# -- the check: trace.pml, run by Spin ---------------------------------------------------------


def kind_codes() -> dict[str, int]:
    """trace.pml's event codes (``#define K_GRANT 3``): the model is their one source."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^#define K_(\w+) (\d+)", MODEL.read_text(), flags=re.M)}


FREE, SHARED, FIRST, NOLIMIT = 0, 1, 2, 255  # trace.pml's owner codes and a reader's limit


def slotted(conversion: Conversion) -> tuple[list[Event], dict[int, int]]:
    """The events with a HELLO before each client's first, and the slot of each event's client.

    A client's slot is given again after the transaction that names it last: by then the
    row has passed to another (the step that takes it from a client names the client, in
    the SYNC that starts its transaction) and its holder's row is gone. HELLO lets
    trace.pml check that the slot was left clean. Clients that still hold the row or a
    holder's row when the trace ends keep theirs. Returns the events and, by index in
    them, the slot of each one's owner.
    """
    events = conversion.events
    last: dict[str, int] = {}
    for k, event in enumerate(events):
        if event.owner not in (None, SHARED_OWNER):
            last[event.owner] = k
    for owner in {conversion.row_owner, *conversion.holders} - {None, SHARED_OWNER}:
        last[owner or ""] = len(events)
    slots: dict[str, int] = {}
    free: list[int] = []
    top = FIRST
    out: list[Event] = []
    where: dict[int, int] = {}
    done: list[str] = []  # clients named last in the current transaction
    for k, event in enumerate(events):
        if k and event.txid != events[k - 1].txid:
            free.extend(slots.pop(owner) for owner in done)
            done = []
        owner = event.owner
        if owner not in (None, SHARED_OWNER) and owner not in slots:
            if free:
                slot = free.pop()
            else:
                slot, top = top, top + 1
            slots[owner] = slot
            where[len(out)] = slot
            out.append(Event("HELLO", owner, at=event.at, began=event.at, seq=event.seq, txid=event.txid))
        if owner in slots:
            where[len(out)] = slots[owner]
        out.append(event)
        if owner in slots and last[owner] == k:
            done.append(owner)
    if top > NOLIMIT:
        raise RecordingError(f"{top - FIRST} clients at once: more than trace.pml's byte slots hold")
    return out, where


def _code(owner: str | None, slot: int | None) -> int:
    """trace.pml's code for an owner: FREE, SHARED, a client's slot, or NOLIMIT for none of these
    (a client where only FREE or SHARED may be: the model refuses it)."""
    if owner is None:
        return FREE
    if owner == SHARED_OWNER:
        return SHARED
    return NOLIMIT if slot is None else slot


def promela(conversion: Conversion, ttls: Sequence[float]) -> tuple[str, str, list[Event]]:
    """The run file (it includes trace.pml), the C header of its TRACE, and the events as numbered there."""
    events, slot = slotted(conversion)
    if not events:
        raise RecordingError("an empty trace")
    codes = kind_codes()
    base = min(e.began for e in events) - US  # every time > 0: 0 stands for NULL
    span = max(max(e.at, e.expires or 0, e.row_expires or 0) for e in events) - base

    def t(value: int | None) -> int:
        return 0 if value is None else value - base

    if span >= 2**31:
        raise RecordingError(f"a trace of {span / US:.0f} s: longer than trace.pml's 32-bit clock counts")
    rows = []
    for k, e in enumerate(events):
        who = _code(e.owner, slot.get(k))
        a = b = 0
        if e.kind == "SHARE_GRANT":
            a, b = NOLIMIT if e.limit is None else e.limit, t(e.row_expires)
            if not 0 < a <= NOLIMIT:
                raise RecordingError(f"a limit of {e.limit}: trace.pml's limits are bytes")
        elif e.kind == "SHARE_RENEW":
            b = t(e.row_expires)
        elif e.kind == "SHARE_RELEASE":
            a, b = _code(e.row_owner, None), t(e.row_expires)
        if e.token >= 2**31:
            raise RecordingError(f"token {e.token}: larger than trace.pml's 32-bit ints")
        rows.append(f"{{{codes[e.kind]},{who},{e.token},{t(e.expires)},{t(e.at)},{t(e.began)},{a},{b},{e.seq}}}")
    # A ttl of T seconds, in µs, within a microsecond: PostgreSQL rounds T * interval '1 second'.
    fits = " || ".join(f"((lo) <= {round(ttl * US) + 1} && {round(ttl * US) - 1} <= (hi))" for ttl in ttls)
    run = (
        f"/* Generated by tools/model_trace.py: {len(events)} steps recorded from dblock, checked by trace.pml. */\n"
        f"#define LEN {len(events)}\n"
        f"#define SLOTS {max(slot.values(), default=FIRST) + 1}\n"
        f"#define TTL_FITS(lo, hi) ({fits or '0'})\n"
        'c_decl { \\#include "trace_events.h" }\n'
        '#include "trace.pml"\n'
    )
    header = (
        "/* Generated by tools/model_trace.py: kind, who, tok, exp, at, began, a, b, change (see trace.pml). */\n"
        f"static const int TRACE[{len(events)}][9] = {{\n" + ",\n".join(rows) + "\n};\n"
    )
    return run, header, events


@dataclass
class Verdict:
    """What Spin said of a trace: ``ok``, or the first step the model refused and the assertion."""

    ok: bool
    steps: int
    assertion: str | None = None
    index: int | None = None
    event: Event | None = None
    report: str = ""
    seconds: float = 0.0

    def explain(self) -> str:
        if self.ok:
            return f"the model allows each of the {self.steps} recorded steps"
        if self.assertion is None:
            return f"Spin did not check the trace to its end:\n{self.report}"
        where = "?" if self.event is None else self.event.describe()
        return f"step {self.index} of {self.steps}, {where}: assertion violated ({self.assertion})"


def missing_tools() -> str | None:
    """Why the check cannot run here, or None."""
    for tool in ("spin", "gcc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {tool}; tests/install-spin.sh does it as root)"
    return None


def check(conversion: Conversion, ttls: Sequence[float], *, defines: Sequence[str] = (),
          workdir: Path | None = None) -> Verdict:
    """Run trace.pml on the trace's steps with Spin's verifier: a single path, the recorded one."""
    started = time.monotonic()
    run, header, events = promela(conversion, ttls)
    with tempfile.TemporaryDirectory(prefix="dblock-trace-") as scratch:
        where = Path(scratch) if workdir is None else workdir
        where.mkdir(parents=True, exist_ok=True)
        shutil.copy(MODEL, where / "trace.pml")
        (where / "trace_run.pml").write_text(run)
        (where / "trace_events.h").write_text(header)

        def call(*argv: str, timeout: float = 300) -> str:
            done = subprocess.run(argv, cwd=where, capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0 and argv[0] != "./pan":
                raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout}{done.stderr}")
            return done.stdout + done.stderr

        call("spin", "-a", *(f"-D{d}" for d in defines), "trace_run.pml")
        # SAFETY: assertions only; COLLAPSE: compressed states; MEMLIM: never more than 1 GB.
        # -O0: one path runs in milliseconds; compiling with more would take longer than that.
        call("gcc", "-O0", "-w", "-DSAFETY", "-DCOLLAPSE", "-DMEMLIM=1024", "-o", "pan", "pan.c")
        # Two transitions a step (the loop's guard, the step); -m: deep enough for all of them.
        report = call("./pan", f"-m{2 * len(events) + 100}")
        seconds = time.monotonic() - started
        depth = re.search(r"depth reached (\d+), errors: 0", report)
        if depth is not None and int(depth[1]) >= 2 * len(events):  # no error, and every step was taken
            return Verdict(True, len(events), report=report, seconds=seconds)
        failed = re.search(r"assertion violated \((.*)\) \(at depth", report)
        trail = call("./pan", "-r") if (where / "trace_run.pml.trail").exists() else ""
        index = re.search(r"\bnev:\s*(\d+)", trail)
        k = None if index is None else int(index[1])
        event = events[k] if k is not None and k < len(events) else None
        return Verdict(False, len(events), None if failed is None else failed[1], k, event, report, seconds)


# -- the attribution: what the clients saw against the steps their owner ids take ------------


@dataclass
class Call:
    """What one client saw of one lease it was granted: its owner id, token, and its calls' outcomes."""

    owner: str
    token: int
    shared: bool
    extends: int = 0  # extends that returned (a LeaseLost is not counted)
    released: bool = False  # its release returned True


def attribution(events: Sequence[Event], calls: Sequence[Call]) -> list[str]:
    """Where the steps the trace gives a client's owner id disagree with what that client saw.

    Each grant a client received is a grant in the trace; a lease its client saw granted is
    released in the trace exactly when its release returned True, and extended by a statement
    of its own (extend, share_extend) as often as its extends returned, and once more at most:
    an acquire whose grant came back with little of its ttl left to trust (a slow reply, or a
    lease the fair queue handed over a while ago) extends it before it returns. So every
    release and extend of such a lease is one its own client made: the row's owner, whom the
    checker names, is the caller. (Grants nobody received are dblock's own: a hand-off to a
    waiter that gave up, or a grant whose extend came back too late to trust, which dblock
    ends; their steps are the model's all the same.)
    """
    grants = {(e.owner, e.token): e.via for e in events if e.kind in ("GRANT", "SHARE_GRANT")}
    releases = Counter((e.owner, e.token) for e in events if e.kind in ("RELEASE", "SHARE_RELEASE"))
    extends = Counter(
        (e.owner, e.token) for e in events if e.kind in ("RENEW", "SHARE_RENEW") and e.via in ("", "share_extend")
    )
    problems = []
    for call in calls:
        key, who = (call.owner, call.token), f"the client of owner {call.owner} (token {call.token})"
        if key not in grants:
            problems.append(f"{who} was granted its lease: the trace has no such grant")
        if releases[key] != int(call.released):
            problems.append(f"{who} saw {int(call.released)} release(s) of its own; the trace has {releases[key]}")
        if not call.extends <= extends[key] <= call.extends + 1:  # + 1: the acquire's own, if its grant came late
            problems.append(f"{who} saw {call.extends} extend(s) of its own; the trace has {extends[key]}")
    return problems


# -- a trace on disk ---------------------------------------------------------------------------


@dataclass
class Trace:
    """A recorded run: the name's changes, what the clients saw, and the ttls they asked for."""

    name: str
    ttls: list[float]
    changes: list[Change]
    calls: list[Call] = field(default_factory=list)

    def dump(self, path: Path) -> None:
        data = {"name": self.name, "ttls": self.ttls, "changes": [c.to_json() for c in self.changes],
                "calls": [dataclasses.asdict(c) for c in self.calls]}
        path.write_text(json.dumps(data))

    @classmethod
    def load(cls, path: Path) -> Trace:
        data = json.loads(path.read_text())
        return cls(data["name"], data["ttls"], [Change.from_json(c) for c in data["changes"]],
                   [Call(**c) for c in data["calls"]])


# -- a race's worker ---------------------------------------------------------------------------


@dataclass
class RaceSpec:
    """One process of a race: ``threads`` clients take the name for ``duration`` seconds.

    Each take is the exclusive lock with probability ``writers``, else a reader's lease or a
    semaphore slot (``limits``: each take picks one; None is a reader); blocking (the fair
    queue, with ``timeout``) with probability ``wait``, else one try. Each lease is asked
    for with a ttl from ``ttls``, held up to ``hold`` seconds between calls, extended 0 to 2
    times with a ttl from ``ttls``, and released, or left to run out (``abandon``) so that
    another client takes it over. ``options``: the Locker's keyword options (``{"fair": false}``:
    blocking acquires poll with the plain statements instead of queueing). A process races on
    past ``duration`` (up to ten times it) until its clients were granted ``at_least`` leases:
    a stalled machine must not make the race no race.
    """

    threads: int = 3
    duration: float = 2.0
    ttls: list[float] = field(default_factory=lambda: [0.05, 0.2])
    writers: float = 1.0
    limits: list[int | None] = field(default_factory=lambda: [None])
    wait: float = 0.5
    timeout: float = 0.25
    hold: float = 0.02
    abandon: float = 0.3
    options: dict[str, Any] = field(default_factory=dict)
    at_least: int = 0


def race(url: str, table: str, name: str, spec: RaceSpec) -> None:
    """A race's worker: prints "ready" once connected, reads the start time (time.monotonic())
    from stdin, races, and prints the leases its clients saw, as JSON (a list of ``Call``)."""
    from dblock import Lease, LeaseLost, Locker, LockNotAcquired  # here: checking a trace needs no dblock

    # Abandoned leases are the point: dblock's warning about a wait for a lease the thread
    # still holds would only fill stderr, which the suite reads for a thread's death.
    logging.getLogger("dblock").setLevel(logging.ERROR)
    locker = Locker(url, table=table, poll_min=0.001, poll_max=0.01, **spec.options)
    locker.leases()  # connected before the start
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    calls: list[Call] = []
    failures: list[BaseException] = []
    guard = threading.Lock()

    def take(rng: random.Random) -> Lease | None:
        ttl = rng.choice(spec.ttls)
        wait = rng.random() < spec.wait
        side = None
        if rng.random() >= spec.writers:
            limit = rng.choice(spec.limits)
            side = locker.readers(name) if limit is None else locker.semaphore(name, limit)
        try:
            if side is None and wait:
                return locker.acquire(name, ttl=ttl, timeout=spec.timeout)
            if side is None:
                return locker.try_acquire(name, ttl=ttl)
            return side.acquire(ttl=ttl, timeout=spec.timeout) if wait else side.try_acquire(ttl=ttl)
        except LockNotAcquired:
            return None

    def client() -> None:
        rng = random.Random()
        time.sleep(max(0.0, start_at - time.monotonic()))
        while time.monotonic() < start_at + spec.duration or (
            len(calls) < spec.at_least and time.monotonic() < start_at + 10 * spec.duration
        ):
            lease = take(rng)
            if lease is None:
                time.sleep(rng.random() * 0.002)
                continue
            seen = Call(lease.owner, lease.token, lease.shared)
            for _ in range(rng.randrange(3)):
                time.sleep(rng.random() * spec.hold)
                try:
                    lease.extend(rng.choice(spec.ttls))
                except LeaseLost:
                    break
                seen.extends += 1
            time.sleep(rng.random() * spec.hold)
            if rng.random() >= spec.abandon:
                seen.released = lease.release()
            with guard:
                calls.append(seen)

    def run() -> None:
        try:
            client()
        except BaseException as exc:  # a client that dies must fail the race, not shrink it
            failures.append(exc)
            raise

    threads = [threading.Thread(target=run) for _ in range(spec.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    locker.close()
    if failures:
        sys.exit(f"{len(failures)} client(s) failed: {failures[0]!r}")
    json.dump([dataclasses.asdict(c) for c in calls], sys.stdout)


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["race"] and len(argv) == 5:
        race(argv[1], argv[2], argv[3], RaceSpec(**json.loads(argv[4])))
        return 0
    if argv[:1] == ["check"] and len(argv) >= 2:
        trace = Trace.load(Path(argv[1]))
        conversion = steps(trace.changes)
        problems = attribution(conversion.events, trace.calls)
        verdict = check(conversion, trace.ttls, defines=[a.removeprefix("-D") for a in argv[2:]])
        print("\n".join(problems + [verdict.explain()]))
        return 0 if verdict.ok and not problems else 1
    print(__doc__.split("\n\n")[-1] if __doc__ else "", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
