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
        ("many_names.py", ["--names", "200", "--chunk", "50"]),
        ("many_lockers.py", ["--processes", "2", "--leases", "3", "--seconds", "1", "--ttl", "0.9"]),
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
