"""The network cut for real: a client in a network namespace of its own, its veth link set down.

A cut link drops packets without a word (no RST, no ICMP): the client's kernel retransmits
and its connects hang, as across a real partition. The server runs in a namespace of its
own (tests/netns.py); the cut-off client runs as a process in the client namespace
(tests/partition_worker.py), and the test process itself reaches the server through its
Unix socket, which no cut touches. Both processes run on one machine, so their
``time.monotonic()`` is one clock: the worker reports where its lease's trust ended, the
test compares it with the next grant, made by the server at ``acquired_at`` on its clock
(the machine's wall clock, read here against the monotonic one).

Needs root (network namespaces); skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, create_engine, insert, select, text, update

import dblock
from dblock import Locker

from . import netns

HERE = Path(__file__).parent
SLACK = 1.5  # a loaded 2-core machine's scheduling, on top of a documented bound
OP_TIMEOUT = 1.0  # the cut-off client's Locker
POLL_MAX = 0.2  # the fair waiter's: its heartbeat every 0.2 s, skipped once 4 * 0.2 + 1 s old
FIGURES: list[str] = []  # measured figures, printed at the end of the test run (conftest)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def network() -> Iterator[tuple[netns.Pair, netns.Server]]:
    """A server namespace running a throwaway PostgreSQL, and a client namespace, joined by a veth pair."""
    reason = netns.missing()
    if reason is not None:
        pytest.skip(reason)
    try:
        import pgserver  # noqa: F401 - its PostgreSQL binaries
    except ImportError:
        pytest.skip("the partition tests run pgserver's PostgreSQL: pip install 'dblock[testing]'")
    netns.sweep()  # what a run killed before its clean-up left behind
    with netns.pair() as pair, netns.postgresql(pair) as server:
        yield pair, server


class Worker:
    """tests/partition_worker.py in the client namespace: JSON commands in, JSON events out."""

    def __init__(self, pair: netns.Pair, server: netns.Server, table: str, counter: str, options: dict[str, Any], log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
        argv = [sys.executable, str(HERE / "partition_worker.py"), server.tcp_url, table, counter, json.dumps(options)]
        self.log = log
        self._stderr = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            pair.argv(pair.client, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env, text=True,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []  # every event read from the worker
        self.unread: list[dict[str, Any]] = []  # read by named(), not yet by expect()
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("ready", timeout=60)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put({"event": "exited"})

    def send(self, do: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"do": do, **args}) + "\n")
        self.proc.stdin.flush()

    def expect(self, *events: str, timeout: float) -> dict[str, Any]:
        """The next event named one of ``events`` (others are kept in ``seen``), within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            if self.unread:
                event = self.unread.pop(0)
            else:
                try:
                    event = self.events.get(timeout=max(deadline - time.monotonic(), 0))
                except queue.Empty:
                    raise AssertionError(f"no {events} within {timeout} s; seen {self.seen}; log: {self._tail()}") from None
                self.seen.append(event)
            if event["event"] in events:
                return event
            if event["event"] == "exited" or (event["event"] == "failed" and "failed" not in events):
                raise AssertionError(f"the worker reported {event} while {events} was expected; log: {self._tail()}")

    def named(self, event: str) -> list[dict[str, Any]]:
        """The events named ``event`` reported so far, read by ``expect`` or not."""
        while True:
            try:
                arrived = self.events.get_nowait()
            except queue.Empty:
                break
            self.seen.append(arrived)
            self.unread.append(arrived)
        return [e for e in self.seen if e["event"] == event]

    def _tail(self) -> str:
        self._stderr.flush()
        return self.log.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._stderr.close()


class Partition:
    """One test's view: its own tables on the namespaced server, workers, and the link."""

    def __init__(self, pair: netns.Pair, server: netns.Server, tmp_path: Path) -> None:
        self.pair = pair
        self.server = server
        self.tmp_path = tmp_path
        self.table = f"part_{secrets.token_hex(4)}"
        self.counter = Table(
            f"{self.table}_counter", MetaData(),
            Column("id", Integer, primary_key=True),
            Column("n", Integer, nullable=False),
            Column("fence_token", BigInteger, nullable=False, server_default="0"),
        )
        self.engine = create_engine(server.unix_url)
        self.counter.create(self.engine)
        with self.engine.begin() as conn:
            conn.execute(insert(self.counter).values(id=1, n=0))
        self.lockers: list[Locker] = []
        self.workers: list[Worker] = []
        self.locker().create_schema()
        self.cut_at: float | None = None

    def locker(self, **options: Any) -> Locker:
        """A Locker of the test process, through the server's Unix socket (no cut reaches it)."""
        made = Locker(self.server.unix_url, table=self.table, **options)
        self.lockers.append(made)
        return made

    def worker(self, **options: Any) -> Worker:
        """A client process in the client namespace, over the veth pair."""
        made = Worker(self.pair, self.server, self.table, self.counter.name, options, self.tmp_path / f"worker{len(self.workers)}.log")
        self.workers.append(made)
        return made

    def cut(self) -> float:
        self.pair.cut()
        self.cut_at = time.monotonic()
        return self.cut_at

    def heal(self) -> float:
        self.pair.heal()
        return time.monotonic()

    def counted(self) -> tuple[int, int]:
        with self.engine.connect() as conn:
            row = conn.execute(select(self.counter.c.n, self.counter.c.fence_token)).one()
        return row.n, row.fence_token

    def close(self) -> None:
        self.pair.heal()  # the next test starts with the link up, whatever happened here
        for worker in self.workers:
            worker.stop()
        for locker in self.lockers:
            locker.close()
        self.engine.dispose()


@pytest.fixture
def part(network: tuple[netns.Pair, netns.Server], tmp_path: Path) -> Iterator[Partition]:
    pair, server = network
    made = Partition(pair, server, tmp_path)
    try:
        yield made
    finally:
        made.close()


def on_this_clock(server_time: Any) -> float:
    """A server timestamp (the machine's wall clock) as a ``time.monotonic()`` reading."""
    return server_time.timestamp() - (time.time() - time.monotonic())


def poll_grant(part: Partition, locker: Locker, name: str, ttl: float, deadline: float) -> tuple[Any, float, float, Any]:
    """try_acquire ``name`` as fast as the server answers until granted: the lease, when the
    successful try was sent and when it returned, and the database expiry of the lease it
    took over (read before each try: the last read is the old lease's final expiry)."""
    while True:
        with part.engine.connect() as conn:
            expiry = conn.execute(text(f"SELECT expires_at FROM {part.table} WHERE name = :n"), {"n": name}).scalar()
        sent = time.monotonic()
        lease = locker.try_acquire(name, ttl=ttl)
        if lease is not None:
            return lease, sent, time.monotonic(), expiry
        assert sent < deadline, f"{name!r} was not granted by the deadline"
        time.sleep(0.001)


# -- a holder cut off while renewing --------------------------------------------------------


def test_a_holder_cut_off_while_renewing_stops_trusting_before_the_next_grant_and_is_fenced_out(part: Partition) -> None:
    ttl = 2.0
    holder = part.worker(op_timeout=OP_TIMEOUT)
    holder.send("hold", name="job", ttl=ttl)
    held = holder.expect("held", timeout=30)
    holder.send("write", name="job")
    assert holder.expect("wrote", "fenced", "failed", timeout=30)["event"] == "wrote"
    holder.expect("renewed", timeout=30)  # renewal is at work (it extends every ttl/3)
    assert holder.named("expiring") == [] and holder.named("lost") == []

    other = part.locker()
    cut = part.cut()
    lease, sent, returned, expiry = poll_grant(part, other, "job", ttl=30, deadline=cut + ttl + 30)
    expired = on_this_clock(expiry)  # the database expiry of the holder's last extend
    (info,) = [i for i in other.leases("job") if i.owner == lease.owner]
    granted = on_this_clock(info.acquired_at)  # the server's now() of the granting statement

    expiring = holder.expect("expiring", timeout=30)
    lost = holder.expect("lost", timeout=30)
    untrusted = holder.named("untrusted") or [holder.expect("untrusted", timeout=30)]
    trust_end = untrusted[0]["trust_end"]
    # The holder's trust ended before anybody else was granted, by the server's clock and by the
    # moment the grant came back; it was warned first, then told, with remaining() 0 and lost set.
    assert lease.token > held["token"]
    assert trust_end <= expired <= granted <= returned, (trust_end, expired, granted, returned)
    assert expiring["at"] < lost["at"], (expiring, lost)
    assert expiring["remaining"] > 0
    assert lost["remaining"] == 0 and lost["lost"] is True
    assert untrusted[0]["seen"] >= trust_end
    FIGURES.append(
        f"holder cut off while renewing (ttl {ttl:g} s): its trust ended {(expired - trust_end) * 1000:.2f} ms "
        f"before its database expiry and {(granted - trust_end) * 1000:.1f} ms before the next grant by the "
        f"server's clock ({(returned - trust_end) * 1000:.1f} ms before that grant came back); on_expiring "
        f"{expiring['at'] - cut:.2f} s and on_lost {lost['at'] - cut:.2f} s after the cut"
    )

    # The new holder writes; after the heal, the old one's fenced write is refused.
    with part.engine.begin() as conn:
        dblock.fenced_update(conn, update(part.counter).where(part.counter.c.id == 1).values(n=part.counter.c.n + 1), lease)
    part.heal()
    holder.send("write", name="job")
    refused = holder.expect("wrote", "fenced", "failed", timeout=30)
    assert refused["event"] == "fenced", refused
    assert refused["newer"] == lease.token
    holder.send("status", name="job")
    status = holder.expect("status", timeout=30)
    assert status["lost"] is True and status["remaining"] == 0
    assert part.counted() == (2, lease.token)  # the old holder's write before the cut, the new one's
    lease.release()


# -- every call bounded under a blackhole, and recovery after the heal ------------------------


# What docs/failures.md promises, with op_timeout = 1: a statement op_timeout + 0.25 s, at least
# 2 s where a connection must be opened; a waiting acquire its timeout + 2.5 s. The first call
# runs on the connection opened before the cut; the watchdog cuts it, so the others must connect.
BOUNDS = {
    "try_acquire": OP_TIMEOUT + 0.25,
    "acquire(timeout=1)": 1 + 2.5,
    "extend": max(OP_TIMEOUT, 2) + 0.25,
    "release": max(OP_TIMEOUT, 2) + 0.25,
    "leases": max(OP_TIMEOUT, 2) + 0.25,
    "try_acquire on a new Locker": max(OP_TIMEOUT, 2) + 0.25,
}


def test_every_call_is_bounded_under_a_blackhole_and_the_same_locker_recovers_after_the_heal(part: Partition) -> None:
    client = part.worker(op_timeout=OP_TIMEOUT)
    client.send("take", name="a", ttl=30)
    client.expect("taken", timeout=30)
    client.send("take", name="b", ttl=30)
    b = client.expect("taken", timeout=30)
    other = part.locker()
    busy = other.try_acquire("busy", ttl=60)
    assert busy is not None

    part.cut()
    client.send("calls", busy="busy")
    called = [client.expect("called", timeout=60) for _ in BOUNDS]
    for call in called:
        assert call.get("dblock_error") is True, call  # raised, and a DBLockError subclass
        assert call["took"] <= BOUNDS[call["call"]] + SLACK, call
    FIGURES.append(
        "under a blackhole (op_timeout 1 s): "
        + ", ".join(f"{c['call']} {c['took']:.2f} s ({c['error']})" for c in called)
    )

    # The same Locker, in the same process, waits through the rest of the outage and gets the
    # lease soon after the heal: its waiting acquire retries (backoff up to 1 s; a connect
    # begun during the cut completes when the kernel next retransmits its SYN).
    client.send("again", name="after", timeout=60)
    client.expect("trying", timeout=30)  # the acquire is under way in the blackhole
    healed = part.heal()
    again = client.expect("granted", "failed", timeout=90)
    assert again["event"] == "granted", again
    assert again["at"] > healed
    assert again["remaining"] > 30 / 2, again  # a fresh lease, trusted for most of its ttl
    FIGURES.append(f"after the heal, the same Locker's waiting acquire got the lease {again['at'] - healed:.2f} s later")
    # The release cut off above could not be confirmed: it is finished in the background, so
    # the lease does not outlive the partition until its ttl.
    deadline = time.monotonic() + 30
    while other.is_held("b"):
        assert time.monotonic() < deadline, "the unconfirmed release of 'b' was not finished after the heal"
        time.sleep(0.05)
    taken = other.try_acquire("b")
    assert taken is not None and taken.token > b["token"]
    busy.release()
    taken.release()


def test_a_lease_granted_over_a_connect_that_spans_the_heal_is_trusted_for_most_of_its_ttl(part: Partition) -> None:
    """A try_acquire that must open its connection, begun in the blackhole: the kernel
    retransmits the connect's SYN, the link heals, the connect completes a retransmission
    later (about 2 s after the call began) and the lease is granted. The lease comes back
    with trust to use (at least half its ttl), never held in the database and trusted for
    nothing."""
    ttl = 2.0
    client = part.worker(op_timeout=5)
    part.cut()
    client.send("fresh", name="slow", ttl=ttl)
    client.expect("trying", timeout=30)
    time.sleep(ttl * 0.75)  # the scenario: the heal comes after the connect's first SYN was dropped
    part.heal()
    granted = client.expect("granted", "missed", "failed", timeout=60)
    assert granted["event"] == "granted", granted
    (info,) = part.locker().leases("slow")
    FIGURES.append(
        f"try_acquire(ttl={ttl:g}) over a connect that spanned the heal: returned after {granted['took']:.2f} s "
        f"with {granted['remaining']:.2f} s trusted, while the server held it {info.remaining:.2f} s more"
    )
    assert granted["remaining"] >= ttl / 2, granted


# -- a fair waiter cut off -----------------------------------------------------------------


def queued_behind_a_holder(part: Partition, ttl: float) -> tuple[Locker, Any, Any, float]:
    """A Locker holding "fair" for 60 s, and the cut-off side's worker in its fair queue for a
    lease of ``ttl`` (returned once the database counts it in line), and the 30 s deadline the
    test's own waits keep to, counted from before the worker queued."""
    holder_locker = part.locker()
    holder = holder_locker.try_acquire("fair", ttl=60)
    assert holder is not None
    waiter = part.worker(op_timeout=OP_TIMEOUT, poll_max=POLL_MAX)
    waiter.send("wait", name="fair", ttl=ttl, timeout=120)
    deadline = time.monotonic() + 30
    while holder_locker.waiters().get("fair", 0) < 1:
        assert time.monotonic() < deadline, "the worker did not queue"
        time.sleep(0.02)
    return holder_locker, holder, waiter, deadline


def test_a_fair_waiter_cut_off_is_passed_over_and_does_not_come_back_with_a_lease_it_cannot_trust(part: Partition) -> None:
    ttl = 3.0
    holder_locker, holder, waiter, deadline = queued_behind_a_holder(part, ttl)
    # The next waiter, in the test process (its heartbeats go through the Unix socket).
    second = part.locker(poll_max=POLL_MAX)
    granted: list[tuple[Any, float]] = []  # the lease, and when the acquire returned
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            got = second.acquire("fair", ttl=30, timeout=60)
            granted.append((got, time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - checked below
            failed.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    while holder_locker.waiters().get("fair", 0) < 2:
        assert time.monotonic() < deadline, "the second waiter did not queue"
        time.sleep(0.02)

    cut = part.cut()
    # The second waiter's own heartbeat row stays fresh; the cut-off process's lapses.
    procs = f"{part.table}_procs"
    lapse = 4 * POLL_MAX + 1
    while True:
        with part.engine.connect() as conn:
            fresh = conn.execute(text(f"SELECT count(*) FROM {procs} WHERE until > now()")).scalar_one()
        if fresh <= 1:
            break
        assert time.monotonic() < cut + lapse + SLACK, "the cut-off waiter's heartbeat did not lapse"
        time.sleep(0.02)
    released = lapsed = time.monotonic()
    assert holder.release() is True
    thread.join(30)
    assert not thread.is_alive() and not failed, failed
    ((lease, handed),) = granted
    assert lease.token > holder.token
    assert lease.remaining() > 0
    FIGURES.append(
        f"fair waiter cut off: passed over {lapsed - cut:.2f} s after the cut (heartbeat lapse {lapse:g} s); "
        f"the release reached the next waiter in {(handed - released) * 1000:.0f} ms"
    )
    # The cut-off waiter got nothing meanwhile.
    assert waiter.named("granted") == []

    # Healed, the waiter queues again behind the new holder and gets the lease when it is released,
    # with trust to use, never a lease it cannot trust.
    part.heal()
    deadline = time.monotonic() + 30
    while holder_locker.waiters().get("fair", 0) < 1:
        assert time.monotonic() < deadline, "the healed waiter did not queue again"
        time.sleep(0.02)
    assert lease.release() is True
    back = waiter.expect("granted", "failed", timeout=60)
    assert back["event"] == "granted", back
    assert back["token"] > lease.token
    assert back["remaining"] >= ttl / 2, back  # trusted for most of its ttl, as a fresh grant
    waiter.send("status", name="fair")
    status = waiter.expect("status", timeout=30)
    assert status["held"] and not status["lost"]
    (info,) = holder_locker.leases("fair")
    assert info.token == back["token"]


@pytest.mark.parametrize("heal", ["while-handed", "after-the-next-grant"])
def test_a_fair_waiter_handed_the_lease_while_cut_off_comes_back_with_trust_or_without_it(part: Partition, heal: str) -> None:
    """The release comes right after the cut, while the cut-off waiter still counts as alive:
    the lease is handed to it, and it cannot hear so. Healed while that lease lasts, the
    waiter may come back with it (trusted, and its trust ends before the next waiter's grant);
    healed after the lease ran out and went to the next waiter, it must not come back with
    it: it waits on and gets a lease of its own, trusted for most of its ttl."""
    ttl = 3.0
    holder_locker, holder, waiter, deadline = queued_behind_a_holder(part, ttl)
    second = part.locker(poll_max=POLL_MAX)
    granted: queue.Queue[Any] = queue.Queue()

    def wait() -> None:
        try:
            granted.put(second.acquire("fair", ttl=30, timeout=60))
        except BaseException as exc:  # noqa: BLE001 - checked below
            granted.put(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    while holder_locker.waiters().get("fair", 0) < 2:
        assert time.monotonic() < deadline, "the second waiter did not queue"
        time.sleep(0.02)

    part.cut()
    assert holder.release() is True  # handed to the cut-off waiter: its heartbeat is still fresh
    with part.engine.connect() as conn:
        handed = conn.execute(text(f"SELECT token FROM {part.table} WHERE name = 'fair'")).scalar_one()
    assert handed > holder.token
    if heal == "while-handed":
        time.sleep(ttl / 3)  # the scenario: a third of the handed lease gone, then the heal
        part.heal()
        next_lease = granted.get(timeout=60)  # once the handed lease ended, by the server's clock
        assert not isinstance(next_lease, BaseException), next_lease
        assert next_lease.token > handed
        (info,) = holder_locker.leases("fair")
        assert info.token == next_lease.token
        assert next_lease.release() is True
        back = waiter.expect("granted", "failed", timeout=60)
        assert back["event"] == "granted", back
        if back["token"] == handed:
            # It came back with the lease handed to it; its trust ended before the next grant.
            trust_end = back["at"] + back["remaining"]
            assert trust_end < on_this_clock(info.acquired_at), (back, info)
            FIGURES.append(
                f"fair waiter handed the lease while cut off, healed {ttl / 3:g} s later: it came back with "
                f"{back['remaining']:.2f} s of {ttl:g} s trusted; its trust ended "
                f"{(on_this_clock(info.acquired_at) - trust_end) * 1000:.1f} ms before the next grant"
            )
        else:  # the handed lease ran out before it could confirm it: it waited on, and got the next
            assert back["token"] > next_lease.token
    else:
        next_lease = granted.get(timeout=60)  # once the handed lease ran out, by the server's clock
        assert not isinstance(next_lease, BaseException), next_lease
        assert next_lease.token > handed
        part.heal()
        while holder_locker.waiters().get("fair", 0) < 1:
            assert time.monotonic() < deadline + 60, "the healed waiter did not queue again"
            time.sleep(0.02)
        assert waiter.named("granted") == []
        assert next_lease.release() is True
        back = waiter.expect("granted", "failed", timeout=60)
        assert back["event"] == "granted", back
        assert back["token"] > next_lease.token
    assert back["remaining"] >= ttl / 2, back  # a lease to use, never one it cannot trust
    thread.join(30)
