"""The README's examples run as written (with the test database swapped in)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from .conftest import Db

ROOT = Path(__file__).resolve().parent.parent


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_api_example_runs(pg: Db) -> None:
    (block,) = [b for b in python_blocks() if "Locker(" in b]
    url = 'Locker("postgresql+psycopg://app@db/app")'
    assert url in block
    code = block.replace(url, f"Locker({pg.url!r}, table={pg.table!r})")
    exec(compile(code, "README.md", "exec"), {})
    assert pg.query(f"SELECT count(*) FROM {pg.table} WHERE owner IS NOT NULL") == [(0,)]


def test_quickstart_runs_on_the_embedded_default(tmp_path: Path) -> None:
    env = {"DBLOCK_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "fencing token 1" in out.stdout and "leases held now: []" in out.stdout
