"""Shared leases (issue 16): read/write locks and counting semaphores, on every backend.

The audited race of readers, semaphore holders, upgradeable readers and writers is in
tests/test_shared_races.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dblock import LeaseLost, Locker, LockNotAcquired

from dblock.pytest_plugin import expire_now

from .conftest import ALL_BACKENDS, Db, wait_for

BACKENDS = ALL_BACKENDS
from .test_shared_races import break_admit
from .test_waiting import count_statements, in_thread, joined, release_before_0012

HERE = Path(__file__).resolve().parent
SHARED = "'*shared'"


def test_an_expired_writer_is_taken_over_by_readers_and_its_verbs_fail(locker: Locker) -> None:
    w = locker.try_acquire("exp", ttl=0.05)
    assert w is not None
    time.sleep(0.1)
    r = locker.readers("exp").try_acquire(ttl=30)
    assert r is not None and r.token > w.token
    with pytest.raises(LeaseLost):
        w.extend(30)
    assert not w.release()
    assert locker.try_acquire("exp", ttl=30) is None  # the reader still holds


def test_a_stale_holder_changes_nothing(db: Db, locker: Locker) -> None:
    """G3: a semaphore holder that ran out is forgotten by the next grant: its extend and release change nothing."""
    sem = locker.semaphore("st", 1)
    stale = sem.try_acquire(ttl=0.05)
    assert stale is not None
    time.sleep(0.1)
    fresh = sem.try_acquire(ttl=30)
    assert fresh is not None and fresh.token > stale.token
    before = db.query(f"SELECT name, owner, token, expires_at FROM {db.table}_holders ORDER BY owner")
    with pytest.raises(LeaseLost):
        stale.extend(30)
    assert stale.release() is False
    assert db.query(f"SELECT name, owner, token, expires_at FROM {db.table}_holders ORDER BY owner") == before
    assert sem.try_acquire(ttl=30) is None  # the stale one did not come back


def test_a_stale_reader_after_a_writer_changes_nothing(locker: Locker) -> None:
    r = locker.readers("sw").try_acquire(ttl=0.05)
    assert r is not None
    time.sleep(0.1)
    w = locker.try_acquire("sw", ttl=30)
    assert w is not None and w.token > r.token
    with pytest.raises(LeaseLost):
        r.extend(30)
    assert r.release() is False
    assert w.extend(30) is None  # the writer is untouched


def test_extend_after_expiry_works_if_nobody_was_granted_since(locker: Locker) -> None:
    lease = locker.semaphore("ext", 2).try_acquire(ttl=0.05)
    assert lease is not None
    time.sleep(0.1)
    lease.extend(30)
    assert lease.remaining() > 20
    assert locker.try_acquire("ext", ttl=30) is None


def test_writer_tokens_exceed_every_earlier_grant(locker: Locker) -> None:
    tokens = []
    for _ in range(3):
        readers = [locker.readers("tok").try_acquire(ttl=30) for _ in range(3)]
        tokens += [r.token for r in readers if r]
        for r in readers:
            assert r is not None and r.release()
        w = locker.try_acquire("tok", ttl=30)
        assert w is not None and w.token > max(tokens)
        tokens.append(w.token)
        w.release()
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_leases_lists_every_holder(locker: Locker) -> None:
    a = locker.semaphore("ls", 2).try_acquire(ttl=30)
    b = locker.semaphore("ls", 2).try_acquire(ttl=30)
    w = locker.try_acquire("other", ttl=30)
    assert a and b and w
    infos = locker.leases()
    assert [(i.name, i.token, i.shared, i.limit) for i in infos] == [
        ("ls", a.token, True, 2), ("ls", b.token, True, 2), ("other", w.token, False, None)
    ]
    assert locker.force_release(infos[0])
    assert [i.token for i in locker.leases()] == [b.token, w.token]
    with pytest.raises(LeaseLost):
        a.extend()


def test_prune_keeps_names_with_live_holders(db: Db, locker: Locker) -> None:
    lease = locker.readers("keep").try_acquire(ttl=30)
    assert lease is not None
    time.sleep(0.05)
    locker.prune(0.01)
    assert locker.try_acquire("keep", ttl=30) is None
    assert lease.release()


def test_lock_context_and_waiting(locker: Locker) -> None:
    sem = locker.semaphore("ctx", 1)
    with sem.lock(ttl=30) as held:
        assert held.shared
        started = time.monotonic()
        with pytest.raises(LockNotAcquired):
            sem.acquire(ttl=30, timeout=0.2)
        assert time.monotonic() - started >= 0.19
    with locker.read_lock("ctx", ttl=30) as r:
        assert r.shared
    with locker.write_lock("ctx", ttl=30) as w:
        assert not w.shared


def test_waiting_semaphore_threads_all_get_through(locker: Locker) -> None:
    """16 threads, a semaphore of 4, each holding 20 ms: none times out, never more than 4 at once."""
    sem = locker.semaphore("many", 4)
    now_holding, most, errors = [0], [0], []
    guard = threading.Lock()

    def work() -> None:
        try:
            for _ in range(3):
                with sem.lock(ttl=10, timeout=20):
                    with guard:
                        now_holding[0] += 1
                        most[0] = max(most[0], now_holding[0])
                    time.sleep(0.02)
                    with guard:
                        now_holding[0] -= 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and most[0] == 4


# -- waiting writers are not starved ------------------------------------------------------
def test_a_waiting_writer_holds_off_new_readers_and_gets_the_lock(pg: Db) -> None:
    """PostgreSQL's fair queue: a writer in line stops new readers; the last reader out hands it the lock.

    poll_max=5: the writer's fallback looks are seconds apart, so getting the lock within
    half a second of the release means the release handed it over (and notified)."""
    locker = pg.locker(poll_max=5.0)
    first = locker.readers("q").try_acquire(ttl=30)
    assert first is not None
    got: list = []
    writer = threading.Thread(target=lambda: got.append(locker.acquire("q", ttl=30, timeout=10)))
    writer.start()
    deadline = time.monotonic() + 5
    while locker.waiters().get("q") != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert locker.waiters().get("q") == 1
    assert locker.readers("q").try_acquire(ttl=30) is None  # held off: the writer is waiting
    started = time.monotonic()
    assert first.release()
    writer.join(5)
    assert got and got[0].token > first.token
    assert time.monotonic() - started < 0.5  # handed over by the release, not found by polling later
    assert locker.readers("q").try_acquire(ttl=30) is None
    got[0].release()
    assert locker.readers("q").try_acquire(ttl=30) is not None


def test_a_queued_writer_is_not_granted_while_a_reader_holds(pg: Db) -> None:
    """The fair queue's functions (enqueue, its looks) see a name held by readers as held."""
    locker = pg.locker()
    reader = locker.readers("nq").try_acquire(ttl=1.0)
    assert reader is not None
    with pytest.raises(LockNotAcquired):
        locker.acquire("nq", ttl=30, timeout=0.3)  # enqueue sees the name held by the reader
    assert reader.release()


# -- one fair line for readers, semaphore waiters and writers (PostgreSQL, migration 0008) ---
# What each release hands over is read from the database right after it returns: the
# release's own statement admits (there is no moment between for a waiter's look). That
# the admitted waiters are woken by the release's NOTIFY is shown by statement counts:
# waiters that look only once a minute send their one enqueue and nothing after.
def in_line(db: Db, name: str) -> int:
    return db.query(f"SELECT count(*) FROM {db.table}_waiters WHERE name = %s", (name,))[0][0]


def holding(db: Db, name: str) -> int:
    return db.query(f"SELECT count(*) FROM {db.table}_holders WHERE name = %s AND expires_at > now()", (name,))[0][0]


def waiter(db: Db, name: str, kind: str, timeout: float = 60, mode: str = "fair", *flags: str) -> subprocess.Popen[str]:
    """A waiter in its own process (tests/wait_worker.py) that holds what it gets until told;
    with flag "go" it joins the line only when told (``go``)."""
    return subprocess.Popen(
        [sys.executable, str(HERE / "wait_worker.py"), db.url, db.table, name, str(timeout), mode, kind, "hold", *flags],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )


def ready(p: subprocess.Popen[str]) -> subprocess.Popen[str]:
    """Wait until a waiter started with flag "go" is up and connected."""
    line = p.stdout.readline() if p.stdout else ""
    assert line.strip() == "ready", line
    return p


def go(p: subprocess.Popen[str]) -> None:
    """Tell a ready waiter to join the line."""
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.flush()


def granted(p: subprocess.Popen[str]) -> int:
    line = p.stdout.readline() if p.stdout else ""
    assert line.startswith("granted"), line
    return int(line.split()[1])


def done(p: subprocess.Popen[str]) -> None:
    """Tell a holding waiter to release, and wait for its release to be done."""
    out, _ = p.communicate("\n", timeout=30)
    assert out.strip() == "released True", out


def queue_up(db: Db, name: str, kinds: list[str], mode: str = "fair") -> list[subprocess.Popen[str]]:
    """One waiter process per kind, each in line before the next starts: their arrival order.
    Waiters already in line count as ahead of them (and must stay in line meanwhile)."""
    ahead = in_line(db, name)
    procs = []
    for kind in kinds:
        procs.append(waiter(db, name, kind, mode=mode))
        wait_for(lambda: in_line(db, name) == ahead + len(procs), timeout=30, what=f"waiter {len(procs)} ({kind}) to queue")
    return procs


def test_readers_and_writers_are_served_in_arrival_order_across_processes(pg: Db) -> None:
    """Five processes queue behind a writer: reader, writer, reader, reader, writer. A reader
    behind a waiting writer waits for it, even while another reader holds; a writer's release
    admits every reader queued behind it, up to the next writer, in its one statement."""
    w0 = pg.locker().acquire("f", ttl=60)
    r1, w2, r3, r4, w5 = queue_up(pg, "f", ["read", "write", "read", "read", "write"])
    assert w0.release()
    assert (holding(pg, "f"), in_line(pg, "f")) == (1, 4)  # R1 only: R3 and R4 are behind W2
    t1 = granted(r1)
    done(r1)  # the last reader out hands the name to W2
    ((owner, t2),) = pg.query(f"SELECT owner, token FROM {pg.table} WHERE name = 'f'")
    assert owner != SHARED[1:-1] and (holding(pg, "f"), in_line(pg, "f")) == (0, 3)
    assert granted(w2) == t2
    done(w2)  # a writer's release admits R3 and R4 together
    assert (holding(pg, "f"), in_line(pg, "f")) == (2, 1)
    t3, t4 = granted(r3), granted(r4)
    done(r3)
    assert (holding(pg, "f"), in_line(pg, "f")) == (1, 1)  # W5 waits for R4 too
    done(r4)
    t5 = granted(w5)
    assert (holding(pg, "f"), in_line(pg, "f")) == (0, 0)
    done(w5)
    assert w0.token < t1 < t2 < min(t3, t4) <= max(t3, t4) < t5, "grants did not follow the line"


def test_semaphore_slots_go_to_waiters_in_arrival_order_across_processes(pg: Db) -> None:
    """A semaphore of 2, both slots held; three processes queue. Each release hands its slot
    to the first in line; a newcomer's try_acquire does not jump the line."""
    sem = pg.locker().semaphore("s", 2)
    a, b = sem.try_acquire(ttl=60), sem.try_acquire(ttl=60)
    assert a is not None and b is not None
    s1, s2, s3 = queue_up(pg, "s", ["sem:2", "sem:2", "sem:2"])
    assert a.release()
    assert (holding(pg, "s"), in_line(pg, "s")) == (2, 2)
    t1 = granted(s1)
    assert b.release()
    t2 = granted(s2)
    assert (holding(pg, "s"), in_line(pg, "s")) == (2, 1)
    done(s1)
    t3 = granted(s3)
    assert (holding(pg, "s"), in_line(pg, "s")) == (2, 0)
    assert sem.try_acquire(ttl=60) is None  # full
    done(s2)
    done(s3)
    assert b.token < t1 < t2 < t3


def test_a_newcomer_first_admits_the_line_when_holders_ran_out(pg: Db) -> None:
    """Holders that die unreleased leave waiters in line; the next call on the name (here a
    newcomer's try_acquire) hands their slots to the line first, and waits behind what is left."""
    locker = pg.locker()
    sem = locker.semaphore("x", 2)
    gone = [sem.try_acquire(ttl=60), sem.try_acquire(ttl=60)]
    # Waiters that never look by themselves: only the newcomer's call may admit them (a look of
    # their own after the expiry would admit them first, as a busy machine showed).
    s1, s2, s3 = queue_up(pg, "x", ["sem:2", "sem:2", "sem:2"], mode="still")
    for lease in gone:
        assert lease is not None
        expire_now(lease)  # as if its holder had died
    assert (holding(pg, "x"), in_line(pg, "x")) == (0, 3)
    assert sem.try_acquire(ttl=60) is None  # S1 and S2 were admitted first; S3 is still ahead of us
    assert (holding(pg, "x"), in_line(pg, "x")) == (2, 1)
    assert granted(s1) > max(g.token for g in gone if g) and granted(s2)
    for p in (s1, s2):
        done(p)
    granted(s3)
    done(s3)


def test_a_writer_that_gives_up_lets_the_readers_behind_it_in(pg: Db) -> None:
    """A reader holds; a writer waits; a reader queues behind it (first come, first served). The
    writer's wait runs out: its leaving admits the reader at once, beside the one holding."""
    locker = pg.locker()
    first = locker.readers("g").try_acquire(ttl=60)
    assert first is not None
    # The reader's process is up before the writer's 3 s start: only its joining is in them
    # (on a busy machine its start-up alone took longer, and it joined after the writer left).
    r2 = ready(waiter(pg, "g", "read", 60, "fair", "go"))
    out: dict = {}
    writer = threading.Thread(target=lambda: out.setdefault("w", _raises(lambda: locker.acquire("g", timeout=3))))
    writer.start()
    wait_for(lambda: in_line(pg, "g") == 1, what="the writer to queue")
    go(r2)
    wait_for(lambda: in_line(pg, "g") == 2, what="the reader to queue behind the writer")
    assert holding(pg, "g") == 1  # held off by the writer in line
    assert writer.is_alive(), "the writer gave up before the reader joined: nothing was tested"
    writer.join(30)
    assert isinstance(out["w"], LockNotAcquired)
    assert (holding(pg, "g"), in_line(pg, "g")) == (2, 0)  # the writer's cancel admitted R2
    assert granted(r2) > first.token
    done(r2)
    assert first.release()


def test_a_dead_writer_in_line_does_not_hold_up_the_readers_behind_it(pg: Db) -> None:
    """The writer ahead of a reader is SIGKILLed while it waits: the next release skips it (its
    listener session is gone) and admits the reader."""
    w0 = pg.locker().acquire("d", ttl=60)
    w1, r2 = queue_up(pg, "d", ["write", "read"])
    w1.kill()
    w1.wait(30)
    ((pid,),) = pg.query(f"SELECT pid FROM {pg.table}_waiters WHERE name = 'd' ORDER BY seq LIMIT 1")
    wait_for(lambda: not pg.query("SELECT FROM pg_stat_activity WHERE pid = %s", (pid,)),
             what="the dead writer's listener session to end")
    assert w0.release()
    assert (holding(pg, "d"), in_line(pg, "d")) == (1, 0)
    assert granted(r2) > w0.token
    done(r2)


@pytest.mark.parametrize("variant", ["dblock", "broken: the walk admits a writer beside readers"])
def test_a_queued_writer_waits_for_every_reader(pg: Db, variant: str) -> None:
    """Two readers hold, a writer waits: the first reader's release leaves the writer in line
    (its walk stops at a writer while anyone holds); the last reader's hands it the name. The
    broken walk is caught by the same checks."""
    if variant != "dblock":
        break_admit(pg, "writer")
    locker = pg.locker()
    r1, r2 = locker.readers("w").try_acquire(ttl=60), locker.readers("w").try_acquire(ttl=60)
    assert r1 is not None and r2 is not None
    writer = in_thread(lambda: _raises(lambda: locker.acquire("w", ttl=60, timeout=30)) or "granted")
    wait_for(lambda: in_line(pg, "w") == 1, what="the writer to queue")
    assert r1.release()
    owner = pg.query(f"SELECT owner FROM {pg.table} WHERE name = 'w'")[0][0]
    if variant != "dblock":
        assert owner != SHARED[1:-1], "the broken walk should have admitted the writer beside R2"
        assert r2.release() is False  # the writer took the name over
        joined(*writer)
        return
    assert (owner, holding(pg, "w"), in_line(pg, "w")) == (SHARED[1:-1], 1, 1)
    assert r2.release()
    assert joined(*writer) == "granted"
    assert pg.query(f"SELECT owner <> {SHARED}, waiting FROM {pg.table} WHERE name = 'w'") == [(True, 0)]


def test_a_polling_reader_finds_the_lease_a_release_handed_it(pg: Db) -> None:
    """Without NOTIFY (notify=False) nobody wakes a queued reader: the release hands it the
    lease all the same, and the reader's next look takes it up, token kept (as after a lost
    notification or a lost reply, G6)."""
    held = pg.locker().acquire("p", ttl=60)
    reader = pg.locker(notify=False, poll_min=0.05, poll_max=0.2)
    waiting = in_thread(lambda: reader.readers("p").acquire(timeout=30))
    wait_for(lambda: in_line(pg, "p") == 1, what="the reader to queue")
    assert held.release()
    ((token,),) = pg.query(f"SELECT token FROM {pg.table}_holders WHERE name = 'p'")
    lease = joined(*waiting)
    assert lease.token == token > held.token and lease.shared
    assert lease.release() and holding(pg, "p") == 0


def test_downgrading_0008_keeps_the_writers_in_line(pg: Db) -> None:
    """Down to 0007: shared waiters leave the line (they poll again), writers keep their places
    and the name's waiting count follows; 0007's functions are back. Up again: as before."""
    from dblock import migrate

    locker = pg.locker()
    held = locker.acquire("m", ttl=60)
    t = pg.table
    pg.query(f"INSERT INTO {t}_procs (id, until) VALUES ('p', now() + interval '1 hour')")
    for owner, shared in (("a" * 32, True), ("b" * 32, False), ("c" * 32, True)):
        pg.query(f"INSERT INTO {t}_waiters (name, owner, ttl, proc, shared) VALUES ('m', %s, 60, 'p', %s)", (owner, shared))
    pg.query(f"UPDATE {t} SET waiting = 3 WHERE name = 'm'")
    migrate.downgrade(locker.engine, t, None, "dblock_0007")
    assert pg.query(f"SELECT owner FROM {t}_waiters") == [("b" * 32,)]
    assert pg.query(f"SELECT waiting FROM {t} WHERE name = 'm'") == [(1,)]
    functions = {r[0] for r in pg.query("SELECT proname FROM pg_proc WHERE proname LIKE %s", (t + "_%",))}
    assert f"{t}_admit" not in functions and f"{t}_share_enqueue" not in functions
    # 0007's hand-off, to the writer left in line, by the release of a dblock from before 0012
    # (this dblock's release calls 0012's function).
    key = {"name": "m", "owner": held.owner, "token": held.token}
    assert [handed for _, handed in pg.query(release_before_0012(t), key)] == [True]
    assert pg.query(f"SELECT owner, waiting FROM {t} WHERE name = 'm'") == [("b" * 32, 0)]
    locker.create_schema()
    assert pg.query(f"SELECT count(*) FROM {t}_waiters") == [(0,)]
    reader = locker.readers("m")
    pg.query(f"UPDATE {t} SET expires_at = now() - interval '1 second' WHERE name = 'm'")
    lease = reader.acquire(timeout=5)
    assert lease.shared and lease.release()


def _raises(fn: Any) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        return exc
    return None


def warm_shared(db: Db, locker: Locker) -> None:
    """warm_waiting for a reader: the listener, the pooled connection and the shared statements."""
    other = db.locker()
    other.try_acquire("warm-s", ttl=0.05)
    locker.readers("warm-s").acquire(timeout=30).release()
    other.try_acquire("warm-s", ttl=60)
    with pytest.raises(LockNotAcquired):
        locker.readers("warm-s").acquire(timeout=0.01)


def test_a_writers_release_wakes_the_readers_it_admits(pg: Db) -> None:
    """Four readers in one process wait behind a writer, looking once a minute at most; a
    writer waits behind them. The release admits the four (not the writer) and its NOTIFYs
    wake them: each sent its one enqueue, and nothing after. The last reader out hands the
    name to the writer."""
    slow = {"poll_min": 60.0, "poll_max": 60.0}
    readers = pg.locker(**slow)
    warm_shared(pg, readers)
    held = pg.locker().acquire("n", ttl=60)
    sent = count_statements(readers)
    waits = [in_thread(lambda: readers.readers("n").acquire(timeout=120)) for _ in range(4)]
    wait_for(lambda: in_line(pg, "n") == 4, what="the readers to queue")
    late = pg.locker(**slow)
    writer = in_thread(lambda: late.acquire("n", timeout=120))
    wait_for(lambda: in_line(pg, "n") == 5, what="the writer to queue")
    assert held.release()
    assert (holding(pg, "n"), in_line(pg, "n")) == (4, 1)
    leases = [joined(*w) for w in waits]
    assert sent == [readers.backend.queue.share_enqueue] * 4  # one enqueue each: woken, never looking again
    assert min(lease.token for lease in leases) > held.token
    for lease in leases:
        assert lease.release()
    assert joined(*writer).token > max(lease.token for lease in leases)


# -- what a shared lease's token fences (docs/shared.md) ---------------
def test_a_readers_token_keeps_a_stale_writer_out(db: Db) -> None:
    """A reader stamps the resource first: a writer whose lease ran out before the reader was granted can no longer write."""
    import dblock
    from dblock import FencedOut

    locker = db.locker()
    writer = locker.try_acquire("res", ttl=0.05)
    assert writer is not None
    time.sleep(0.1)
    reader = locker.readers("res").try_acquire(ttl=30)
    assert reader is not None and reader.token > writer.token
    with locker.engine.begin() as conn:
        dblock.fence(conn, reader)  # stamp first, then read
    with pytest.raises(FencedOut), locker.engine.begin() as conn:
        dblock.fence(conn, writer)  # the stale writer's late write
    reader.release()
    fresh = locker.try_acquire("res", ttl=30)
    assert fresh is not None
    with locker.engine.begin() as conn:
        dblock.fence(conn, fresh)  # a writer granted after the readers passes


def test_readers_tokens_do_not_order_readers_among_themselves(db: Db) -> None:
    """Two readers hold at once: once the later one stamps, the earlier one's fenced write is refused."""
    import dblock
    from dblock import FencedOut

    locker = db.locker()
    first, second = locker.readers("res2").try_acquire(ttl=30), locker.readers("res2").try_acquire(ttl=30)
    assert first is not None and second is not None and first.token < second.token
    with locker.engine.begin() as conn:
        dblock.fence(conn, second)
    with pytest.raises(FencedOut), locker.engine.begin() as conn:
        dblock.fence(conn, first)  # still a live reader, but its token is older


def test_the_docs_shared_sample_runs(db: Db) -> None:
    from .docs import samples

    url = 'Locker("postgresql+psycopg://app@db/reports")'
    (block,) = [block for _, block in samples("shared.md") if "semaphore(" in block]
    assert url in block
    exec(compile(block.replace(url, f"Locker({db.url!r}, table={db.table!r})"), "docs/shared.md", "exec"), {})
    assert Locker(db.url, table=db.table).leases() == []


def test_docs_upgradeable_example_runs(db: Db, capsys: pytest.CaptureFixture[str]) -> None:
    from .docs import samples

    url = 'Locker("postgresql+psycopg://app@db/reports")'
    (block,) = [block for _, block in samples("shared.md") if "upgradeable_lock(" in block]
    assert url in block
    exec(compile(block.replace(url, f"Locker({db.url!r}, table={db.table!r})"), "docs/shared.md", "exec"), {})
    writing, reading = capsys.readouterr().out.splitlines()
    assert writing.startswith("writing, token") and reading.startswith("reading, token")
    assert int(reading.split()[-1]) > int(writing.split()[-1])  # the downgrade's new token
    assert Locker(db.url, table=db.table).leases() == []


def test_g6_a_retried_shared_acquire_returns_the_granted_lease(pg: Db) -> None:
    """PostgreSQL: the same owner asking again (a lost reply) gets its own lease back, token kept, not a second slot."""
    locker = pg.locker()
    first = locker._attempt("g6", "a" * 32, 30.0, limit=1).lease
    again = locker._attempt("g6", "a" * 32, 30.0, limit=1).lease
    assert first is not None and again is not None and again.token == first.token
    assert [i.owner for i in locker.leases()] == ["a" * 32]
    assert locker.semaphore("g6", 1).try_acquire(ttl=30) is None


def test_check_lease_and_commit_guard_take_shared_leases(db: Db) -> None:
    """A live shared lease passes the commit-time check; one that ran out and was taken over by a writer fails it."""
    from sqlalchemy import text

    import dblock

    locker = db.locker()
    live = locker.semaphore("chk", 2).try_acquire(ttl=30)
    stale = locker.readers("chk2").try_acquire(ttl=0.05)
    assert live is not None and stale is not None
    with locker.engine.connect() as conn:
        with dblock.commit_guard(conn, live):
            conn.execute(text("SELECT 1"))
    time.sleep(0.1)
    writer = locker.try_acquire("chk2", ttl=30)
    assert writer is not None
    with pytest.raises(LeaseLost), locker.engine.connect() as conn:
        with dblock.commit_guard(conn, stale):
            conn.execute(text("SELECT 1"))
    with locker.engine.begin() as conn:
        dblock.check_lease(conn, writer)  # the writer's own check is unchanged
        dblock.check_lease(conn, live)


def test_prune_forgets_shared_leases_that_ended_long_ago(db: Db, locker: Locker) -> None:
    old = locker.readers("gone").try_acquire(ttl=0.05)
    live = locker.readers("kept").try_acquire(ttl=30)
    assert old is not None and live is not None
    time.sleep(0.2)
    locker.prune(0.1)
    assert db.query(f"SELECT name FROM {db.table}_holders") == [("kept",)]
    with pytest.raises(LeaseLost):
        old.extend(30)
    assert live.release()


@pytest.mark.parametrize("variant", ["dblock", "broken: token drawn before the row lock"])
def test_g2_a_shared_grant_draws_its_token_after_the_row_lock(pg: Db, variant: str) -> None:
    """A deterministic replay of DESIGN.md §3's race for a shared grant: reader A blocks on the
    name's row lock; meanwhile grant B draws a token and commits. A's token must be above B's.
    The broken variant (the same function with nextval() moved before the row lock) is caught."""
    import dataclasses

    import psycopg

    from .conftest import libpq_dsn
    from .conftest import wait_for as wait

    locker = pg.locker()
    locker.try_acquire("x").release()
    t, seq = pg.table, f"{pg.table}_token_seq"
    if variant != "dblock":
        signature = f"{t}_share_acquire(text, text, float8, text, int, boolean)"  # 0010's (the earlier one calls it)
        ((definition,),) = pg.query(f"SELECT pg_get_functiondef('{signature}'::regprocedure)")
        draw = f"    tok := nextval('{seq}');\n"
        assert draw in definition
        broken = definition.replace(draw, "").replace(f"{t}_share_acquire", f"{t}_share_broken")
        broken = broken.replace("    -- Under the row's lock", draw + "    -- Under the row's lock")
        pg.query(broken)
        sql = locker.backend.sql.share_acquire.replace(f"{t}_share_acquire", f"{t}_share_broken")
        locker.backend.sql = dataclasses.replace(locker.backend.sql, share_acquire=sql)

    blocker = psycopg.connect(libpq_dsn(pg.url))
    blocker.execute(f"SELECT 1 FROM {t} WHERE name = 'x' FOR UPDATE")
    result: list = []
    thread = threading.Thread(target=lambda: result.append(locker.readers("x").try_acquire(ttl=30)))
    thread.start()
    watcher = psycopg.connect(libpq_dsn(pg.url), autocommit=True)

    def a_is_waiting() -> bool:
        return bool(watcher.execute(
            "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s", (f"%{t}_share%",)
        ).fetchall())

    wait(a_is_waiting, what="reader A to block on the row lock")
    (b_token,) = blocker.execute(
        f"UPDATE {t} SET owner = 'B', token = nextval('{seq}'), acquired_at = now(),"
        " expires_at = now() - interval '1 second' WHERE name = 'x' RETURNING token"
    ).fetchone()
    blocker.commit()
    thread.join(30)
    blocker.close()
    watcher.close()
    assert result and result[0] is not None
    if variant == "dblock":
        assert result[0].token > b_token
    else:
        assert result[0].token < b_token, "the check above would not have caught the broken function"
