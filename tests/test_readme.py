"""The README: short, its commands and example run as written, its links work on a package index."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def sh_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README, re.S)


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def test_the_readme_fits_a_screen_or_two_and_leads_into_the_site() -> None:
    assert len(README.splitlines()) <= 120
    headings = re.findall(r"^## (.*)$", README, re.M)
    assert headings[0] == "Set-up in two commands" and headings[-1] == "Development"
    assert "<!-- test-command -->" in README.split("\n## Development\n", 1)[1]  # the contributor's command, last
    assert len(python_blocks()) == 1  # one example; the rest is on the site


def test_the_readme_example_runs_on_the_embedded_default(tmp_path: Path) -> None:
    (block,) = python_blocks()
    env = {"DBLOCK_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", block], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "holding nightly-report with fencing token 1\n"


def test_quickstart_runs_on_the_embedded_default(tmp_path: Path) -> None:
    env = {"DBLOCK_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "fencing token 1" in out.stdout and "leases held now: []" in out.stdout


def test_first_command_runs_under_a_lock_on_the_embedded_default(tmp_path: Path) -> None:
    """The README's first command, after its install step: the installed console script."""
    first = sh_blocks()[0].strip()
    assert first.startswith("python3 -m venv .venv && .venv/bin/pip install -q '.[binary]' && .venv/bin/dblock run ")
    command = first.split(" && ", 2)[2].replace(".venv/bin/", "", 1)
    bin_dir = Path(sys.executable).parent
    env = {"DBLOCK_HOME": str(tmp_path), "PATH": f"{bin_dir}:/usr/bin:/bin"}
    out = subprocess.run(command, shell=True, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "holding nightly, fencing token 1\n"


def test_the_package_links_work_on_an_index_and_the_sdist_carries_the_docs() -> None:
    """No relative link (a package index cannot follow one); project URLs into the site; the
    sdist carries the site's sources and every file its pages include."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not [link for link in re.findall(r"\]\(([^)\s]+)\)", README) if not link.startswith("https://")]
    urls = project["project"]["urls"]
    assert urls["Documentation"] == "https://dblock.readthedocs.io/en/latest/"
    assert urls["Changelog"].startswith(urls["Documentation"])
    include = project["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    included = set()
    for path in (ROOT / "docs").glob("*.md"):
        included |= set(re.findall(r'--8<-- "([^"]+)"', path.read_text()))
    assert {"CHANGELOG.md", "BENCHMARKS.md", "examples/fastapi_app.py"} <= included  # the rule reads what it should
    for link in sorted(included | {"LICENSE", "docs", "mkdocs.yml", ".readthedocs.yaml"}):
        assert (ROOT / link).exists(), link
        assert any(link == part or link.startswith(part + "/") for part in include), f"{link} is not in the sdist"
