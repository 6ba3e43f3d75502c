"""The benchmarks still run (tiny sizes; speed itself is measured by running them, not here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize(
    "script, sizes",
    [
        ("uncontended.py", ["--rounds", "1", "--pairs", "3"]),
        ("fenced_write.py", ["--rounds", "1", "--writes", "3"]),
        ("contended.py", ["--processes", "2", "--threads", "2", "--attempts", "4", "--rounds", "1",
                          "--variants", "dblock;pg_advisory"]),
        ("waiters.py", ["--sizes", "2x2,3x2/2", "--settle", "0.2", "--seconds", "0.5", "--rounds", "1", "--breakdown", "4"]),
        ("many_names.py", ["--names", "200", "--chunk", "50"]),
        ("many_lockers.py", ["--processes", "2", "--leases", "3", "--seconds", "1", "--ttl", "0.9"]),
        ("queue_ops.py", ["--sizes", "3,30", "--rounds", "1", "--calls", "3", "--listeners", "2"]),
        ("floor.py", ["--handovers", "6", "--rounds", "1"]),
        ("aio.py", ["--rounds", "1", "--pairs", "3", "--tasks", "3", "--seconds", "0.3"]),
        ("shared.py", ["--processes", "2", "--threads", "2", "--seconds", "0.3", "--rounds", "1", "--sem-processes", "2",
                       "--sem-threads", "3", "--limit", "2", "--attempts", "3"]),
        ("coordination.py", ["--sizes", "2,3", "--pairs", "4", "--rounds", "1", "--handovers", "2", "--block", "1",
                             "--settle", "0.05", "--observations", "2", "--interval", "0.1"]),
    ],
)
def test_benchmark_runs(pg_url: str, script: str, sizes: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--url", pg_url, *sizes],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.splitlines()[-1]
    assert "x" in last or "%" in last  # the last row carries its ratio, or its regrant share


def test_waiters_benchmark_splits_the_hand_over(pg_url: str) -> None:
    """The waiters benchmark prints a row per size and variant, and the hand-over breakdown."""
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "waiters.py"), "--url", pg_url, "--sizes", "2x2", "--settle", "0.2",
         "--seconds", "0.5", "--rounds", "1", "--breakdown", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = {line.split()[4] for line in out.stdout.splitlines() if line.lstrip().startswith("4 ")}
    assert {"dblock", "pg_advisory_lock"} <= rows, out.stdout
    assert "where a hand-over goes, 4 waiters" in out.stdout, out.stdout
    assert "(b): release p50" in out.stdout, out.stdout
    assert "error x" not in out.stdout, out.stdout
