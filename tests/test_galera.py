"""dblock on a 3-node MariaDB Galera cluster (tests/galera.py), at the server's default settings.

Every node takes writes: clients connected to different nodes race for one
name, and Galera certifies each commit against the others' (a losing commit
fails with error 1213, which dblock reads as "not granted" and sends again).
Everything is judged from what the cluster committed, read back from one
node, and from the clients' own clocks (one machine: one monotonic clock).

- An audited race, one process on each node, tiny TTLs: every grant's token
  is its name's counter plus one, no token twice, every token a client got
  was committed, and no two clients trusted a lease at the same moment.
- The same race while one node is SIGKILLed: the survivors stall until it is
  evicted, then go on; the checks are the same, and no call outlives its
  documented bound.
- Fenced read-modify-write increments from every node: the counter ends equal
  to the number of writes that committed.
"""

from __future__ import annotations

import json
import math
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

import dblock

from . import galera, ha
from .workers import run_together

pytestmark = [pytest.mark.ha, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
RACE_WORKER = str(HERE / "race_worker.py")
GALERA_WORKER = str(HERE / "galera_worker.py")
READER = 0  # the node the audit is read from (never the one killed)
VICTIM = 2
TTL = "0.01"  # the races' leases
COUNTER_TTL = "0.005"  # the increments' leases: often taken over between the read and the write
FIGURES = ha.FIGURES  # shown at the end of the run (conftest's terminal summary)


@pytest.fixture(scope="module")
def cluster() -> Iterator[galera.Cluster]:
    """Three Galera nodes for the module; skipped, saying what to install, where parts are missing."""
    reason = galera.missing()
    if reason is not None:
        pytest.skip(reason)
    with galera.Cluster() as started:
        started.start(timeout=120)
        FIGURES.append(f"galera: 3 nodes (bootstrap, 2 joined by rsync SST) up in {started.start_seconds:.1f} s")
        yield started


@pytest.fixture
def whole(cluster: galera.Cluster) -> galera.Cluster:
    """The cluster with all three nodes up (a test that killed one may have left it down)."""
    for i in range(galera.NODES):
        if not cluster.nodes[i].running():
            cluster.restart(i)
    cluster.wait_size(galera.NODES, 60)
    return cluster


# -- helpers ---------------------------------------------------------------------------------
def new_table(c: galera.Cluster) -> str:
    """A fresh dblock table, made through node 0 (its DDL replicates to the others)."""
    table = "gal_" + secrets.token_hex(4)
    dblock.Locker(c.urls[0], table=table).create_schema()
    return table


def install_audit(c: galera.Cluster, t: str) -> None:
    """AFTER triggers log every change of the lock table's rows, with the node that made it.

    Replicated rows are applied without firing triggers (row-based replication): each change is
    logged once, by the node whose client made it. ``seq`` is no order: AUTO_INCREMENT values are
    interleaved per node on Galera. Nor is it unique across nodes: when a node leaves, the others
    are given a new increment and offset (wsrep_auto_increment_control), and a value one node
    draws then may be one another node drew just before (a duplicate key that failed a worker's
    grant in CI). The key is (node, seq): a node's own counter never goes back.

    In one CI run, MariaDB 10.11 failed every statement of one node's workers during the kill
    test with "Unknown trigger has an error in its body" (a syntax error at this trigger's name,
    which parses everywhere else). A statement whose AFTER trigger fails is rolled back whole,
    the row change with it, so the audit stays complete: the race's workers count such a call
    ("audit trigger") and go on, as after DatabaseUnavailable.
    """
    c.query(
        READER,
        f"CREATE TABLE {t}_audit (seq BIGINT AUTO_INCREMENT, node VARCHAR(64), op CHAR(1),"
        " name VARCHAR(255), old_owner VARCHAR(32), new_owner VARCHAR(32), old_token BIGINT, new_token BIGINT,"
        " PRIMARY KEY (node, seq), KEY (seq))",
    )
    c.query(
        READER,
        f"CREATE TRIGGER {t}_ai AFTER INSERT ON {t} FOR EACH ROW INSERT INTO {t}_audit"
        " (node, op, name, new_owner, new_token) VALUES (@@wsrep_node_name, 'I', NEW.name, NEW.owner, NEW.token)",
    )
    c.query(
        READER,
        f"CREATE TRIGGER {t}_au AFTER UPDATE ON {t} FOR EACH ROW INSERT INTO {t}_audit"
        " (node, op, name, old_owner, new_owner, old_token, new_token)"
        " VALUES (@@wsrep_node_name, 'U', NEW.name, OLD.owner, NEW.owner, OLD.token, NEW.token)",
    )
    c.query(
        READER,
        f"CREATE TRIGGER {t}_ad AFTER DELETE ON {t} FOR EACH ROW INSERT INTO {t}_audit"
        " (node, op, name, old_owner, old_token) VALUES (@@wsrep_node_name, 'D', OLD.name, OLD.owner, OLD.token)",
    )
    for i in c.live():  # DDL runs on every node in the same total order: there already
        assert len(c.query(i, "SHOW TRIGGERS LIKE %s", (t,))) == 3


def synced_query(c: galera.Cluster, i: int, sql: str) -> list[tuple[Any, ...]]:
    """A read on node i that first waits until the node has applied everything committed
    anywhere (this session's wsrep_sync_wait; the servers keep their default)."""
    conn = c.connect(i)
    try:
        with conn.cursor() as cur:
            cur.execute("SET SESSION wsrep_sync_wait = 1")
            cur.execute(sql)
            return [tuple(r) for r in cur.fetchall()]
    finally:
        conn.close()


def conflicts(c: galera.Cluster) -> dict[int, tuple[int, int]]:
    """Per live node: (commits that failed certification, local transactions a replicated write aborted)."""
    out = {}
    for i in c.live():
        s = c.status(i, "wsrep_local_cert_failures", "wsrep_local_bf_aborts")
        out[i] = (int(s["wsrep_local_cert_failures"]), int(s["wsrep_local_bf_aborts"]))
    return out


def lost(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> str:
    """The conflicts between two readings, over the nodes read both times, in words."""
    cert = sum(after[i][0] - before[i][0] for i in after if i in before)
    bf = sum(after[i][1] - before[i][1] for i in after if i in before)
    return f"{cert} certification failures and {bf} brute-force aborts"


def check_race(c: galera.Cluster, t: str, name: str, grants: list[list[float]]) -> dict[str, Any]:
    """The race's checks, on what the cluster committed (read through READER) and the clients' windows.

    Grants: [token, received_at, trusted_until] per lease a client was given.
    """
    rows = synced_query(c, READER, f"SELECT seq, node, op, old_owner, new_owner, old_token, new_token FROM {t}_audit"
                        f" WHERE name = '{name}'")
    granted = [r for r in rows if r[2] == "I" or (r[2] == "U" and r[6] != r[5])]
    audited = [int(r[6]) for r in granted]
    # A grant writes its name's counter plus one (a first grant, an INSERT, the table's largest plus one).
    jumps = [r for r in granted if r[2] == "U" and r[6] != r[5] + 1]
    assert jumps == [], f"{len(jumps)} grants whose token is not the row's token + 1, e.g. {jumps[:5]}"
    twice = sorted(k for k, n in Counter(audited).items() if n > 1)
    sample = [r for r in granted if r[6] in twice[:3]]
    assert twice == [], f"{len(twice)} tokens committed by two grants, e.g. {sample}"
    assert sorted(audited) == list(range(min(audited), max(audited) + 1)), "a gap in the name's tokens"
    final = synced_query(c, READER, f"SELECT token FROM {t} WHERE name = '{name}'")
    assert final == [(max(audited),)], f"the row holds {final}, the audit's largest grant is {max(audited)}"

    tokens = [int(g[0]) for g in grants]
    assert len(tokens) >= 100, f"only {len(tokens)} grants: the race did not race"
    dupes = sorted(k for k, n in Counter(tokens).items() if n > 1)
    assert dupes == [], f"tokens handed to two clients: {dupes[:10]}"
    phantoms = sorted(set(tokens) - set(audited))
    assert phantoms == [], f"tokens clients got that no committed grant wrote: {phantoms[:10]}"

    # Trusted windows [received, trusted_until] never overlap (1e-4 s: the clocks' rate difference).
    windows = sorted((r, u, tok) for tok, r, u in grants if u > r)
    latest_end, latest_token = -math.inf, None
    overlaps = []
    for received, until, token in windows:
        if received < latest_end - 1e-4:
            overlaps.append((token, latest_token, round(latest_end - received, 4)))
        if until > latest_end:
            latest_end, latest_token = until, token
    assert overlaps == [], f"{len(overlaps)} leases trusted while another still was, e.g. {overlaps[:5]}"
    return {"grants": len(tokens), "committed": len(audited), "by_node": dict(Counter(r[1] for r in granted))}


def start_together(commands: list[list[str]]) -> tuple[list[subprocess.Popen[str]], float]:
    """Workers (tests/workers.py's protocol) started together; their processes and the start time.

    Their stderr goes to a file each (read by ``finish``): a pipe nobody reads during the race
    could fill up and stall a worker.
    """
    procs = []
    try:
        for command in commands:
            err = tempfile.TemporaryFile("w+")
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
            proc.err = err  # type: ignore[attr-defined]
            procs.append(proc)
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line == "ready\n", f"a worker did not start: {line!r} {stderr(p)}"
        start_at = time.monotonic() + 0.05
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(repr(start_at) + "\n")
            p.stdin.flush()
    except BaseException:
        end(procs)
        raise
    return procs, start_at


def stderr(p: subprocess.Popen[str]) -> str:
    err = p.err  # type: ignore[attr-defined]
    err.seek(0)
    return str(err.read())


def end(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        p.kill()
        p.wait()
        p.err.close()  # type: ignore[attr-defined]


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[dict[str, Any]]:
    """Each worker's JSON report; each must exit 0."""
    reports = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, stderr(p)
            reports.append(json.loads(out))
    finally:
        end(procs)
    return reports


# -- the tests -------------------------------------------------------------------------------
def test_audited_race_across_three_nodes(whole: galera.Cluster) -> None:
    """3 processes x 4 threads, each process on its own node, one name, 10 ms TTLs, 4 s."""
    c = whole
    t = new_table(c)
    install_audit(c, t)
    before = conflicts(c)
    commands = [[sys.executable, RACE_WORKER, url, t, "hot", TTL, "4", "4", "try"] for url in c.urls]
    outs = run_together(commands, timeout=120)
    after = conflicts(c)
    per_node = [len(json.loads(out)) for out in outs]
    grants = [g for out in outs for g in json.loads(out)]
    summary = check_race(c, t, "hot", grants)
    FIGURES.append(
        f"galera race, a process on each node: {summary['grants']} grants to clients (per node {per_node}),"
        f" {summary['committed']} committed; {lost(before, after)}"
    )


def test_race_while_a_node_is_killed(whole: galera.Cluster) -> None:
    """The race for 14 s with node 2 SIGKILLed at about 4 s: the workers on nodes 0 and 1 stall until
    it is evicted and go on; node 2's worker keeps what it got before and fails fast after.

    The survivors' workers are told when the eviction was seen and race on past the 14 s (up to
    30 s more) until each has a grant after it: the stall lasts 5-7 s, and a thread whose call was
    cut off at op_timeout just before the eviction can reach the end with no time left to race
    (it did in one run of six, with a fixed end)."""
    c = whole
    t = new_table(c)
    install_audit(c, t)
    duration = 14.0
    before = conflicts(c)
    commands = [
        [sys.executable, GALERA_WORKER, "race", url, t, "hot", TTL, "4", str(duration), "30"] for url in c.urls
    ]
    procs, start_at = start_together(commands)
    try:
        time.sleep(max(0.0, start_at + 0.3 * duration - time.monotonic()))
        killed_at = time.monotonic()
        c.kill(VICTIM)
        c.wait_size(galera.NODES - 1, 30)
        evicted = time.monotonic() - killed_at  # until the survivors see a cluster of two
        for i, p in enumerate(procs):
            assert p.stdin is not None
            p.stdin.write(("-inf" if i == VICTIM else repr(killed_at + evicted)) + "\n")
            p.stdin.flush()
    except BaseException:
        end(procs)
        raise
    reports = finish(procs, timeout=150)
    after = conflicts(c)
    survivors = [i for i in range(galera.NODES) if i != VICTIM]

    for i, report in enumerate(reports):
        assert report["over_bound"] == [], f"node {i}'s worker: calls past their bound: {report['over_bound'][:5]}"
    for i in survivors:
        # Statements cut off at op_timeout during the stall are allowed; afterwards the survivors work.
        late = [g for g in reports[i]["grants"] if g[1] > killed_at + evicted]
        assert late, f"node {i}'s worker got no grant after node {VICTIM} was evicted: {reports[i]['errors']}"
    assert reports[VICTIM]["errors"], "the killed node's worker saw no error"

    grants = [g for report in reports for g in report["grants"]]
    summary = check_race(c, t, "hot", grants)
    after_kill = sorted(g[1] for i in survivors for g in reports[i]["grants"] if g[1] > killed_at)
    stall = after_kill[0] - killed_at if after_kill else math.inf
    rejoin = c.restart(VICTIM)
    c.wait_size(galera.NODES, 60)
    slowest = max(max(r["slowest"].values()) for r in reports)
    errors = {i: r["errors"] for i, r in enumerate(reports) if r["errors"]}
    FIGURES.append(
        f"galera race with node {VICTIM} SIGKILLed at +{killed_at - start_at:.1f} s: {summary['grants']} grants"
        f" ({summary['committed']} committed); first grant on a survivor {stall:.2f} s after the kill, eviction"
        f" seen {evicted:.2f} s after it; slowest call {slowest:.2f} s; calls failed per worker {errors};"
        f" on the survivors {lost(before, after)}; node {VICTIM} rejoined in {rejoin:.1f} s"
    )


def test_fenced_increments_across_nodes(whole: galera.Cluster) -> None:
    """3 processes x 3 threads, one on each node: acquire (5 ms TTL), stamp and read the counter
    (fenced_read), pause 0-3 ms, write read + 1 (fenced_update), commit. The counter must equal
    the number of writes that committed: none lost, none doubled."""
    c = whole
    t = new_table(c)
    counter = f"{t}_counter"
    c.query(READER, f"CREATE TABLE {counter} (id INT PRIMARY KEY, n INT NOT NULL, fence_token BIGINT NOT NULL DEFAULT 0)")
    c.query(READER, f"INSERT INTO {counter} (id, n) VALUES (1, 0)")
    before = conflicts(c)
    commands = [[sys.executable, GALERA_WORKER, "counter", url, t, counter, COUNTER_TTL, "3", "4"] for url in c.urls]
    procs, _ = start_together(commands)
    reports = finish(procs, timeout=150)
    after = conflicts(c)
    totals = {k: sum(r[k] for r in reports) for k in ("accepted", "refused", "conflicts", "takeovers")}
    tokens = [tok for r in reports for tok in r["tokens"]]
    for i, report in enumerate(reports):
        assert report["over_bound"] == [], f"node {i}'s worker: calls past their bound: {report['over_bound'][:5]}"
    assert totals["accepted"] + totals["refused"] + totals["conflicts"] >= 45, f"the loop did not race: {totals}"
    assert totals["refused"] + totals["conflicts"] + totals["takeovers"] > 0, f"nothing ever contended: {totals}"
    assert len(set(tokens)) == len(tokens), "two accepted writes under one lease"
    n, fence = synced_query(c, READER, f"SELECT n, fence_token FROM {counter} WHERE id = 1")[0]
    assert n == totals["accepted"], f"{totals['accepted'] - n} increments lost (counter {n}, totals {totals})"
    assert fence == max(tokens), f"the stored fence {fence} is not the largest accepted token {max(tokens)}"
    FIGURES.append(f"galera fenced increments from 3 nodes: {totals} (counter {n}); {lost(before, after)}")
