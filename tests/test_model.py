"""The model of dblock's lease (``model/lease.pml``), checked by Spin: every interleaving within
its bounds keeps its properties, each known bug class (a mutant) yields a counterexample, and
the model names every statement the backends have, or lists it as not modelled yet."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dblock.backends.base import QueueStatements, Statements

MODEL = Path(__file__).resolve().parent.parent / "model"
MUTANTS = {  # mutant: the assertion its counterexample breaks
    "MUTANT_TOKEN_BEFORE_LOCK": "token==seq",
    "MUTANT_EXTEND_SHORTENS": "clock<trust",
    "MUTANT_RELEASE_BY_NAME": "clock<trust",
    "MUTANT_TRUST_FROM_REPLY": "clock<trust",
    "MUTANT_NO_FENCE": "mine[me]>=wrote",
}


def _missing() -> str | None:
    for tool, package in (("spin", "spin"), ("gcc", "gcc")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package}; tests/install-spin.sh does it as root)"
    return None


needs_spin = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


def verify(tmp_path: Path, *defines: str) -> tuple[str, Path]:
    """Build and run the verifier of lease.pml (with ``defines``): its report, and its directory."""
    shutil.copy(MODEL / "lease.pml", tmp_path / "lease.pml")
    flags = [f"-D{d}" for d in defines]
    subprocess.run(["spin", "-a", *flags, "lease.pml"], cwd=tmp_path, check=True, capture_output=True, timeout=60)
    # SAFETY: assertions only; COLLAPSE: compressed states; MEMLIM: never more than 1 GB.
    subprocess.run(["gcc", "-O2", "-w", "-DSAFETY", "-DCOLLAPSE", "-DMEMLIM=1024", "-o", "pan", "pan.c"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=120)
    run = subprocess.run(["./pan", "-m1000000"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    return run.stdout + run.stderr, tmp_path


@needs_spin
def test_every_interleaving_within_the_bounds_keeps_the_properties(tmp_path: Path) -> None:
    report, _ = verify(tmp_path)
    assert "errors: 0" in report, report
    assert "reached -DMEMLIM bound" not in report, report  # exhaustive: the whole space was explored
    states = int(re.search(r"(\d+) states, stored", report).group(1))  # type: ignore[union-attr]
    assert states > 1_000_000, report  # the bounds were not shrunk to nothing


@needs_spin
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_known_bug_class_yields_a_counterexample(tmp_path: Path, mutant: str) -> None:
    report, where = verify(tmp_path, mutant)
    assert "errors: 1" in report and "assertion violated" in report, report
    assert MUTANTS[mutant] in report.replace(" ", ""), report
    trail = subprocess.run(["spin", "-t", "-p", f"-D{mutant}", "lease.pml"], cwd=where, capture_output=True,
                           text=True, timeout=60)
    assert "assertion violated" in trail.stdout, trail.stdout[-2000:]  # the steps that lead there, replayed


def test_the_model_names_every_statement_or_lists_it_as_not_modelled() -> None:
    readme = (MODEL / "README.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)` \|", readme, flags=re.M))
    statements = {f.name for cls in (Statements, QueueStatements) for f in dataclasses.fields(cls)}
    assert statements - listed == set(), "statements the model's table does not list"
    assert listed - statements - {m.removeprefix("MUTANT_") for m in MUTANTS} - set(MUTANTS) == set()
    model = (MODEL / "lease.pml").read_text()
    named = set(re.findall(r"\(models: ([^)]+)\)", model))
    steps = {name.strip() for text in named for name in text.replace(";", ",").split(",")}
    for step in steps:
        word = step.split()[0].rstrip(":")
        assert word in statements or word.startswith(("fencing.", "expiry", "retry")), step
    for statement in ("acquire", "release", "extend", "extend_many"):
        assert any(s.split()[0].rstrip(":") == statement for s in steps), f"no model step names {statement}"
