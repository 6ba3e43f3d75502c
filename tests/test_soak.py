"""A minute of the soak (benchmarks/soak.py): every lock kind in many processes under a schedule of
faults, with a clean audit; and the audit itself catches what it is there to catch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import netns
from tests import pgbouncer as bouncer

ROOT = Path(__file__).resolve().parent.parent
SOAK = ROOT / "benchmarks" / "soak.py"
FAULTS = ["pg-restart-fast", "pg-restart-immediate", "holder-sigkill", "holder-sigstop", "pgbouncer-restart"]
GRANTS = [
    "exclusive", "reader", "semaphore", "upgradeable", "upgraded to writer", "writer (read/write)",
    "group (per name)", "election term",
]

pytestmark = [pytest.mark.slow, pytest.mark.pgbouncer]


def soak(tmp_path: Path, *args: str) -> tuple[int, str, dict[str, int]]:
    """Run the soak; its exit status, output, and report table (row: number)."""
    pytest.importorskip("pgserver", reason="the soak starts its own PostgreSQL: pip install 'dblock[testing]'")
    if bouncer.binary() is None:
        pytest.skip(bouncer.MISSING)
    done = subprocess.run(
        [sys.executable, str(SOAK), "--seed", "41", "--keep", str(tmp_path / "logs"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        # Its own bound: the run, the workers' start on a busy machine, the end of their last holds.
        timeout=900,
    )
    out = done.stdout + done.stderr
    table = {m[1].strip(): int(m[2]) for m in re.finditer(r"^\| (.+?) +\| +(\d+) \|$", out, re.M)}
    return done.returncode, out, table


def test_a_minute_of_faults_leaves_every_guarantee_whole(tmp_path: Path) -> None:
    """One minute, a fault every 5 s (each kind at least once): no overlap, no token out of order, every
    write told committed recorded once, every call within its bound; the exit status says so."""
    code, out, table = soak(tmp_path, "--minutes", "1", "--fault-every", "5")
    assert code == 0 and "clean: no violation" in out, out
    kinds = FAULTS + (["partition"] if netns.missing() is None else [])
    assert all(table[f"fault: {kind}"] >= 1 for kind in kinds), out
    # Every kind of lock was granted, and worked: writes told committed are all in the database.
    assert all(table[f"grants: {kind}"] >= 1 for kind in GRANTS), out
    assert table["writes told committed"] >= 1 and table["writes lost"] == 0, out
    for row in ["calls over their bound (paused processes aside)", "overlaps", "token order breaks",
                "writes recorded twice", "violations"]:
        assert table[row] == 0, out


def test_the_audit_reports_what_it_audits(tmp_path: Path) -> None:
    """Workers broken on purpose, their writers pausing past the ttl before some writes: writes
    that skip the fence, trust that outlives the lease, writes reported but rolled back. The audit
    names each kind of violation, and the exit status is 1."""
    code, out, table = soak(tmp_path, "--minutes", "0.5", "--mutant", "unfenced,overtrust,lost", "--no-partitions")
    assert code == 1, out
    for row, message in [
        ("token order breaks", "token order on"),  # a stale write that skipped the fence
        ("overlaps", "overlap on"),  # a holder trusting its lease past its end
        ("writes lost", "is not in the database"),  # a write reported but rolled back
    ]:
        assert table[row] >= 1 and message in out, out
