"""The benchmarks still run (tiny sizes; speed itself is measured by running them, not here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
# The benchmarks that draw a figure with --plot PATH.png (benchmarks/_plot.py, dblock[plots]):
# their run below draws it too.
PLOTTED = {"waiters.py", "many_names.py", "idle_listeners.py", "uncontended.py", "floor.py"}
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "script, sizes",
    [
        ("uncontended.py", ["--rounds", "1", "--pairs", "3", "--profile", "--layers"]),
        ("fenced_write.py", ["--rounds", "1", "--writes", "3"]),
        ("contended.py", ["--processes", "2", "--threads", "2", "--attempts", "4", "--rounds", "1",
                          "--variants", "dblock;pg_advisory"]),
        ("waiters.py", ["--sizes", "2x2,3x2/2", "--settle", "0.2", "--seconds", "0.5", "--rounds", "1", "--breakdown", "4"]),
        ("many_names.py", ["--names", "200", "--chunk", "50"]),
        ("many_lockers.py", ["--processes", "2", "--leases", "3", "--seconds", "1", "--ttl", "0.9"]),
        ("queue_ops.py", ["--sizes", "3,30", "--rounds", "1", "--calls", "3", "--listeners", "2"]),
        ("floor.py", ["--handovers", "6", "--rounds", "1"]),
        ("floor.py", ["--handovers", "6", "--rounds", "1", "--processes", "--parts"]),
        ("aio.py", ["--rounds", "1", "--pairs", "3", "--tasks", "3", "--seconds", "0.3"]),
        ("shared.py", ["--processes", "2", "--threads", "2", "--seconds", "0.3", "--rounds", "1", "--sem-processes", "2",
                       "--sem-threads", "3", "--limit", "2", "--attempts", "3"]),
        ("idle_listeners.py", ["--processes", "2", "--handoffs", "3", "--rounds", "1", "--settle", "0"]),
        ("coordination.py", ["--sizes", "2,3", "--pairs", "4", "--rounds", "1", "--handovers", "2", "--block", "1",
                             "--settle", "0.05", "--observations", "2", "--interval", "0.1"]),
    ],
)
def test_benchmark_runs(pg_url: str, tmp_path: Path, script: str, sizes: list[str]) -> None:
    """The benchmark runs on a server that stays, prints its ratios, draws its figure, and leaves
    none of its tables, sequences or functions behind."""
    before = _benchmark_objects(pg_url)
    figure = tmp_path / "figures" / "x.png"  # a folder that does not exist yet: the plot makes it
    plot = ["--plot", str(figure)] if script in PLOTTED else []
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--url", pg_url, *sizes, *plot],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.splitlines()[-1]
    assert "x" in last or "%" in last  # the last row carries its ratio, or its regrant share
    if plot:
        assert figure.read_bytes().startswith(PNG), out.stderr
    assert _benchmark_objects(pg_url) - before == set()


def _benchmark_objects(url: str) -> set[str]:
    """The relations and functions named as the benchmarks name theirs (bench_..., floor_...)."""
    import psycopg
    from sqlalchemy.engine import make_url

    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname FROM pg_class WHERE relname ~ '^(alembic_version_dblock_)?(bench|floor)_' UNION ALL "
            "SELECT proname FROM pg_proc WHERE proname ~ '^(bench|floor)_'"
        ).fetchall()
    return {name for (name,) in rows}


def test_plot_without_matplotlib_names_the_extra_before_the_run(tmp_path: Path) -> None:
    """--plot where matplotlib cannot be imported stops at once, naming dblock[plots]."""
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('not installed')\n")
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "many_names.py"), "--url", "postgresql://nobody@127.0.0.1:1/none",
         "--plot", str(tmp_path / "x.png")],
        capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pip install 'dblock[plots]'" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "x.png").exists()


def test_the_figures_of_benchmarks_md_exist_from_the_root_and_from_docs() -> None:
    """BENCHMARKS.md names its figures from the repository's root, as GitHub shows it;
    docs/benchmarks.md, which includes it, names the same files again from docs/."""
    text, page = (ROOT / "BENCHMARKS.md").read_text(), (ROOT / "docs" / "benchmarks.md").read_text()
    definitions = re.compile(r"^\[([\w-]+)\]: (\S+)$", re.M)
    here, there = dict(definitions.findall(text)), dict(definitions.findall(page))
    figures = re.findall(r"!\[[^\]]*\]\[([\w-]+)\]", text)
    assert len(figures) >= 3 and not re.search(r"!\[[^\]]*\]\(", text)  # by reference, not inline
    for ref in figures:
        assert (ROOT / here[ref]).resolve() == (ROOT / "docs" / there[ref]).resolve(), ref
        assert (ROOT / here[ref]).read_bytes().startswith(PNG), ref


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
