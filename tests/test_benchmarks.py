"""The benchmarks still run (tiny sizes; speed itself is measured by running them, not here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize(
    "script, sizes",
    [("uncontended.py", ["--pairs", "3"]), ("fenced_write.py", ["--writes", "3"])],
)
def test_benchmark_runs(pg_url: str, script: str, sizes: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--url", pg_url, "--rounds", "1", *sizes],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "x" in out.stdout.splitlines()[-1]  # the last row carries its ratio
