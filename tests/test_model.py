"""The models of dblock's protocol (``model/*.pml``), checked by Spin: every interleaving within
their bounds keeps their properties, each known bug class (a mutant) yields a counterexample,
and the models name every statement the backends have, or list it as not modelled yet."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dblock.backends.base import QueueStatements, Statements

MODEL = Path(__file__).resolve().parent.parent / "model"
MODELS = {  # model: {mutant: the assertion its counterexample breaks}
    "lease.pml": {
        "MUTANT_TOKEN_BEFORE_LOCK": "token==seq",
        "MUTANT_EXTEND_SHORTENS": "clock<trust",
        "MUTANT_RELEASE_BY_NAME": "clock<trust",
        "MUTANT_TRUST_FROM_REPLY": "clock<trust",
        "MUTANT_NO_FENCE": "mine[me]>=wrote",
    },
    "shared.pml": {
        "MUTANT_WRITER_BESIDE_READERS": "kind[2]==1",
        "MUTANT_IGNORE_LIMIT": "lim[1]<2",
        "MUTANT_OWN_LIMIT": "lim[1]<2",
    },
    "once.pml": {
        "MUTANT_HOLD_FROM_RELEASE": "clock>=(last+3)",
    },
}
STATES = {"lease.pml": 1_000_000, "shared.pml": 1_000_000, "once.pml": 1_000}  # at least: the bounds are not shrunk
MUTANTS = {mutant: model for model, mutants in MODELS.items() for mutant in mutants}


def _missing() -> str | None:
    for tool, package in (("spin", "spin"), ("gcc", "gcc")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package}; tests/install-spin.sh does it as root)"
    return None


needs_spin = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


def verify(tmp_path: Path, model: str, *defines: str) -> tuple[str, Path]:
    """Build and run the verifier of ``model`` (with ``defines``): its report, and its directory."""
    shutil.copy(MODEL / model, tmp_path / model)
    flags = [f"-D{d}" for d in defines]
    subprocess.run(["spin", "-a", *flags, model], cwd=tmp_path, check=True, capture_output=True, timeout=60)
    # SAFETY: assertions only; COLLAPSE: compressed states; MEMLIM: never more than 1 GB.
    subprocess.run(["gcc", "-O2", "-w", "-DSAFETY", "-DCOLLAPSE", "-DMEMLIM=1024", "-o", "pan", "pan.c"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=120)
    run = subprocess.run(["./pan", "-m1000000"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    return run.stdout + run.stderr, tmp_path


@needs_spin
@pytest.mark.slow  # 5-20 s each: millions of states
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_interleaving_within_the_bounds_keeps_the_properties(tmp_path: Path, model: str) -> None:
    report, _ = verify(tmp_path, model)
    assert "errors: 0" in report, report
    assert "reached -DMEMLIM bound" not in report, report  # exhaustive: the whole space was explored
    states = int(re.search(r"(\d+) states, stored", report).group(1))  # type: ignore[union-attr]
    assert states > STATES[model], report  # the bounds were not shrunk to nothing


@needs_spin
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_known_bug_class_yields_a_counterexample(tmp_path: Path, mutant: str) -> None:
    model = MUTANTS[mutant]
    report, where = verify(tmp_path, model, mutant)
    assert "errors: 1" in report and "assertion violated" in report, report
    assert MODELS[model][mutant] in report.replace(" ", ""), report
    trail = subprocess.run(["spin", "-t", "-p", f"-D{mutant}", model], cwd=where, capture_output=True,
                           text=True, timeout=60)
    assert "assertion violated" in trail.stdout, trail.stdout[-2000:]  # the steps that lead there, replayed


def test_the_model_names_every_statement_or_lists_it_as_not_modelled() -> None:
    readme = (MODEL / "README.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)` \|", readme, flags=re.M))
    statements = {f.name for cls in (Statements, QueueStatements) for f in dataclasses.fields(cls)}
    assert statements - listed == set(), "statements the model's table does not list"
    assert listed - statements - {m.removeprefix("MUTANT_") for m in MUTANTS} - set(MUTANTS) == set()
    text = "".join((MODEL / model).read_text() for model in MODELS)
    named = set(re.findall(r"\(models: ([^)]+)\)", text))
    steps = {name.strip() for text in named for name in text.replace(";", ",").split(",")}
    for step in steps:
        word = step.split()[0].rstrip(":")
        assert word in statements or word.startswith(("fencing.", "expiry", "retry")), step
    for statement in ("acquire", "release", "release_held", "extend", "extend_many", "share_acquire", "share_release"):
        assert any(s.split()[0].rstrip(":") == statement for s in steps), f"no model step names {statement}"
