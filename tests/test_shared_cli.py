"""`dblock run --shared NAME` and `dblock run --limit N NAME`, run as users run them, and `status` listing every holder."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from dblock.cli import EXIT_BUSY

from .conftest import Db, wait_for

DBLOCK = Path(sys.executable).parent / "dblock"
# Holds until DIR/stop exists; writes DIR/<its token> when it starts.
HOLD = (
    "import os, sys, time; d = sys.argv[1]; open(os.path.join(d, os.environ['DBLOCK_TOKEN']), 'w').close()\n"
    "while not os.path.exists(os.path.join(d, 'stop')): time.sleep(0.02)"
)


def start(db: Db, tmp: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(DBLOCK), "run", "job", "--url", db.url, "--table", db.table, "--ttl", "10", *flags, "--",
         sys.executable, "-c", HOLD, str(tmp)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def dblock(db: Db, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(DBLOCK), *args, "--url", db.url, "--table", db.table], capture_output=True, text=True, timeout=60
    )


def started(tmp: Path) -> int:
    return len([p for p in tmp.iterdir() if p.name.isdigit()])


def test_limit_runs_at_most_n_commands_and_status_shows_every_holder(db: Db, tmp_path: Path) -> None:
    first, second = start(db, tmp_path, "--limit", "2"), start(db, tmp_path, "--limit", "2")
    wait_for(lambda: started(tmp_path) == 2, what="two commands running")
    third = start(db, tmp_path, "--limit", "2")
    assert third.wait(30) == EXIT_BUSY, third.stderr.read() if third.stderr else ""
    exclusive = start(db, tmp_path)
    assert exclusive.wait(30) == EXIT_BUSY
    status = dblock(db, "status", "--json")
    assert status.returncode == 0, status.stderr
    rows = json.loads(status.stdout)
    assert [(r["name"], r["shared"], r["limit"]) for r in rows] == [("job", True, 2), ("job", True, 2)]
    assert "job" in dblock(db, "status").stdout
    (tmp_path / "stop").touch()
    assert first.wait(30) == 0 and second.wait(30) == 0
    assert dblock(db, "status", "job").returncode != 0  # nothing held any more


def test_shared_runs_together_and_keep_the_exclusive_run_out(db: Db, tmp_path: Path) -> None:
    readers = [start(db, tmp_path, "--shared") for _ in range(3)]
    wait_for(lambda: started(tmp_path) == 3, what="three readers running")
    assert start(db, tmp_path).wait(30) == EXIT_BUSY
    writer = start(db, tmp_path, "--wait", "20")
    time.sleep(0.5)
    assert writer.poll() is None  # waiting for the readers
    (tmp_path / "stop").touch()
    assert all(r.wait(30) == 0 for r in readers)
    assert writer.wait(30) == 0
    files = [p for p in tmp_path.iterdir() if p.name.isdigit()]
    assert len(files) == 4
    writers = max(files, key=lambda p: p.stat().st_mtime_ns)  # the last command to start
    assert int(writers.name) == max(int(p.name) for p in files)  # the writer's token is above every reader's


def test_bad_limits_and_both_flags_are_refused_before_anything_runs(db: Db, tmp_path: Path) -> None:
    for flags in (["--limit", "0"], ["--limit", "x"], ["--limit", "1.5"], ["--shared", "--limit", "2"]):
        p = start(db, tmp_path, *flags)
        assert p.wait(30) == 2, flags
    assert started(tmp_path) == 0
