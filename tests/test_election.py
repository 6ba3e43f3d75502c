"""Leader election across processes: one leader at a time in a race of processes and threads, a
SIGSTOPped leader deposed and its late fenced write refused, and ``dblock elect``. What both faces
promise in one process is in ``tests/test_election_faces_async.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, create_engine, update

from dblock import Locker, fenced_update

from .conftest import ALL_BACKENDS, Db

BACKENDS = ALL_BACKENDS
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

RACER = """
import json, sys, threading, time
from dblock import Locker
url, table, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
locker = Locker(url, table=table)
terms, lock = [], threading.Lock()
def run(i):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        leadership = locker.election("race").campaign(value=f"{i}", ttl=2, timeout=30)
        got = time.monotonic()
        time.sleep(0.002)
        left = time.monotonic()
        assert leadership.resign() is True
        with lock:
            terms.append((leadership.term, got, left))
threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
for t in threads: t.start()
for t in threads: t.join()
locker.close()
print(json.dumps(terms))
"""


def test_one_leader_at_a_time_and_terms_grow_in_a_race_of_processes(db: Db) -> None:
    db.locker().create_schema()
    procs = [
        subprocess.Popen([sys.executable, "-c", RACER, db.url, db.table, "3"], stdout=subprocess.PIPE, text=True, env=ENV)
        for _ in range(3)
    ]
    terms = sorted(t for p in procs for t in json.loads(p.communicate(timeout=120)[0]))
    assert all(p.returncode == 0 for p in procs)
    assert len(terms) >= 20, f"only {len(terms)} terms in 3 s"
    assert len({t for t, _, _ in terms}) == len(terms)  # no term twice
    for (_, _, left), (term, got, _) in zip(terms, terms[1:]):
        # CLOCK_MONOTONIC is the machine's: the next term began after the last one was left.
        assert got > left, f"term {term} began before the term before it ended"


LEADER = """
import sys, time
from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, create_engine, update
from dblock import FencedOut, Locker, fenced_update
url, table = sys.argv[1], sys.argv[2]
engine = create_engine(url)
t = Table(table + "_counter", MetaData(), Column("id", Integer, primary_key=True, autoincrement=False),
          Column("n", Integer), Column("fence_token", BigInteger, nullable=False, server_default="0"))
leadership = Locker(url, table=table).election("writer").campaign(value="stopped", ttl=1)
print("term", leadership.term, flush=True)
while True:
    try:
        with engine.begin() as conn:
            fenced_update(conn, update(t).where(t.c.id == 1).values(n=t.c.n + 1), leadership)
    except FencedOut as exc:
        print("fenced-out", exc.newer, flush=True)
        break
    print("wrote", flush=True)
    time.sleep(0.05)
"""


def test_a_sigstopped_leader_is_deposed_and_its_late_fenced_write_refused(db: Db) -> None:
    engine = create_engine(db.url)
    counter = Table(f"{db.table}_counter", MetaData(), Column("id", Integer, primary_key=True, autoincrement=False),
                    Column("n", Integer), Column("fence_token", BigInteger, nullable=False, server_default="0"))
    counter.create(engine)
    locker = db.locker()
    locker.create_schema()
    with engine.begin() as conn:
        conn.execute(counter.insert().values(id=1, n=0))
    worker = subprocess.Popen([sys.executable, "-c", LEADER, db.url, db.table], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert worker.stdout is not None
        old_term = int(worker.stdout.readline().split()[1])
        assert worker.stdout.readline() == "wrote\n"
        worker.send_signal(signal.SIGSTOP)  # paused mid-term: it cannot renew
        started = time.monotonic()
        new = locker.election("writer").campaign(value="new", ttl=30, timeout=30)
        assert new.term > old_term and time.monotonic() - started < 15  # deposed at its 1 s ttl
        with engine.begin() as conn:
            fenced_update(conn, update(counter).where(counter.c.id == 1).values(n=counter.c.n + 100), new)
        worker.send_signal(signal.SIGCONT)  # it wakes believing it leads, and writes
        out, _ = worker.communicate(timeout=30)
        assert out.split("\n")[-2] == f"fenced-out {new.term}", out
        with engine.connect() as conn:
            n, token = conn.execute(counter.select()).one()[1:]
        assert token == new.term and n >= 101  # the late write did not land
        assert new.resign() is True
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGCONT)
            worker.kill()
            worker.wait()
        counter.drop(engine)
        engine.dispose()


def test_dblock_elect_runs_the_command_while_leading(db: Db, tmp_path: Path) -> None:
    dblock = Path(sys.executable).with_name("dblock")
    base = [str(dblock), "--url", db.url, "--table", db.table]
    Locker(db.url, table=db.table).create_schema()
    flag = tmp_path / "running"
    leader = subprocess.Popen(
        [*base, "elect", "primary", "--value", "node-1", "--", sys.executable, "-c",
         f"import os, pathlib, time; p = pathlib.Path({str(flag)!r}); p.write_text(os.environ['DBLOCK_TOKEN'])\n"
         f"while p.exists(): time.sleep(0.02)"],
        env=ENV, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (flag.exists() and flag.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        term = int(flag.read_text())
        leader_now = Locker(db.url, table=db.table).election("primary").leader()
        assert leader_now is not None and (leader_now.value, leader_now.term) == ("node-1", term)
        busy = subprocess.run([*base, "elect", "primary", "--wait", "0", "--", "true"], env=ENV,
                              capture_output=True, text=True, timeout=60)
        assert busy.returncode == 75, busy  # another leads: exit at once with --wait 0
        status = subprocess.run([*base, "status"], env=ENV, capture_output=True, text=True, timeout=60)
        assert "node-1" in status.stdout, status
        flag.unlink()  # the command ends: the leader resigns
        assert leader.wait(30) == 0, leader.stderr
        assert Locker(db.url, table=db.table).election("primary").leader() is None
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()
