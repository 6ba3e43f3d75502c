"""The models of dblock's protocol (``model/*.pml``), checked by Spin: every interleaving within
their bounds keeps their properties (and, for the fair queue, no waiter stays in line for ever
behind a free name), each known bug class (a mutant) yields a counterexample, and the models
name every statement the backends have, or list it as not modelled yet."""

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
    "upgrade.pml": {
        "MUTANT_UPGRADE_BESIDE_READERS": "(kind[1]==1))&&",  # the upgraded writer beside a reader
        "MUTANT_TWO_UPGRADEABLE": "&&up[1])&&",
        "MUTANT_WRITER_BESIDE_READERS": "(kind[3]==1))&&",
    },
    "queue.pml": {
        "MUTANT_WALK_IGNORES_LIMITS": "<2)||(want[",  # two holders of a limit of 1
        "MUTANT_WALK_PAST_WRITER": "ahead==0",
        "MUTANT_CANCEL_NO_WALK": "!(fits)",
    },
}
STATES = {  # at least: the bounds are not shrunk
    "lease.pml": 1_000_000, "shared.pml": 1_000_000, "once.pml": 1_000, "queue.pml": 1_000_000,
    "upgrade.pml": 1_000_000,
}
MUTANTS = {mutant: model for model, mutants in MODELS.items() for mutant in mutants}
# Models with a progress claim (an ltl formula compiled in with -DLIVENESS, checked for acceptance
# cycles under weak fairness), its least states, and the mutants that must break it.
LIVENESS = {"queue.pml": (1_000_000, ["MUTANT_EXPIRED_LEASE_HOLDS"])}
PROGRESS_MUTANTS = {mutant: model for model, (_, mutants) in LIVENESS.items() for mutant in mutants}
# A bug the model found in the code (model/README.md), fixed by migration 0010: the bounds that
# reach it, the mutant that puts the old text back, and the assertion its counterexample breaks.
FOUND_BUG = ("queue.pml", ("MAXCLOCK=4", "MAXJOIN=4", "MAXSTALE=0"), "MUTANT_STALE_HOLDER_GRANTED", "(trust[me]==0)||")
FUNCTIONS = MODEL.parent / "dblock" / "backends" / "postgresql.sql"  # the PL/pgSQL the fair queue runs


def _missing() -> str | None:
    for tool, package in (("spin", "spin"), ("gcc", "gcc")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package}; tests/install-spin.sh does it as root)"
    return None


needs_spin = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


def verify(tmp_path: Path, model: str, *defines: str, liveness: bool = False, quick: bool = False) -> tuple[str, Path]:
    """Build and run the verifier of ``model`` (with ``defines``): its report, and its directory.

    ``liveness``: the model's progress claim (``-DLIVENESS``), searched for acceptance cycles
    under weak fairness (``pan -a -f``) instead of assertions alone. ``quick``: a search that stops
    at its first counterexample (a mutant's), so the verifier is built unoptimised: gcc -O2 takes
    several seconds over a large model, longer than such a search runs."""
    shutil.copy(MODEL / model, tmp_path / model)
    flags = [f"-D{d}" for d in (*defines, *(["LIVENESS"] if liveness else []))]
    subprocess.run(["spin", "-a", *flags, model], cwd=tmp_path, check=True, capture_output=True, timeout=60)
    # SAFETY: assertions only; MEMLIM: never more than 2 GB. States are stored uncompressed: the
    # largest model takes about 1 GB so, and half the time it takes compressed (-DCOLLAPSE).
    safety = [] if liveness else ["-DSAFETY"]
    subprocess.run(["gcc", "-O0" if quick else "-O2", "-w", *safety, "-DMEMLIM=2048", "-o", "pan", "pan.c"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=120)
    search = ["-a", "-f"] if liveness else []
    run = subprocess.run(["./pan", *search, "-m1000000"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
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
@pytest.mark.slow  # 10-20 s: millions of states, each with its fairness copies
@pytest.mark.parametrize("model", sorted(LIVENESS))
def test_no_waiter_stays_in_line_for_ever_behind_a_free_name(tmp_path: Path, model: str) -> None:
    report, _ = verify(tmp_path, model, liveness=True)
    assert re.search(r"acceptance\s+cycles\s+\+ \(fairness enabled\)", report), report  # checked, fairly
    assert "errors: 0" in report, report
    assert "reached -DMEMLIM bound" not in report, report
    states = int(re.search(r"(\d+) states, stored", report).group(1))  # type: ignore[union-attr]
    assert states > LIVENESS[model][0], report


@needs_spin
@pytest.mark.parametrize("mutant", sorted(PROGRESS_MUTANTS))
def test_each_progress_bug_class_yields_a_waiter_stuck_for_ever(tmp_path: Path, mutant: str) -> None:
    model = PROGRESS_MUTANTS[mutant]
    report, where = verify(tmp_path, model, mutant, liveness=True, quick=True)
    assert "errors: 1" in report and "acceptance cycle" in report, report
    trail = subprocess.run(["spin", "-t", "-p", "-DLIVENESS", f"-D{mutant}", model], cwd=where, capture_output=True,
                           text=True, timeout=60)
    assert "START OF CYCLE" in trail.stdout, trail.stdout[-2000:]  # the steps, and the loop it is stuck in


@needs_spin
@pytest.mark.slow  # about 5 s
def test_the_fair_queue_keeps_its_properties_on_the_clock_that_reached_the_bug_it_found(tmp_path: Path) -> None:
    model, defines, _, _ = FOUND_BUG
    report, _ = verify(tmp_path, model, *defines)
    assert "errors: 0" in report, report
    assert "reached -DMEMLIM bound" not in report, report


@needs_spin
def test_the_bug_the_fair_queue_model_found_yields_its_counterexample(tmp_path: Path) -> None:
    """share_enqueue's look answering a holder row that ran out as a grant (0008's text)."""
    model, defines, mutant, assertion = FOUND_BUG
    report, _ = verify(tmp_path, model, *defines, mutant, quick=True)
    assert "errors: 1" in report and assertion in report.replace(" ", ""), report


@needs_spin
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_known_bug_class_yields_a_counterexample(tmp_path: Path, mutant: str) -> None:
    model = MUTANTS[mutant]
    report, where = verify(tmp_path, model, mutant, quick=True)
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
    mutants = {*MUTANTS, *PROGRESS_MUTANTS, FOUND_BUG[2]}
    assert listed - statements - {m.removeprefix("MUTANT_") for m in mutants} - mutants == set()
    functions = set(re.findall(r"^CREATE OR REPLACE FUNCTION public\.(\w+)\(", FUNCTIONS.read_text(), flags=re.M))
    assert "locks_admit" in functions, FUNCTIONS  # the fair queue's walk, as the database runs it
    text = "".join((MODEL / model).read_text() for model in MODELS)
    named = set(re.findall(r"\(models: ([^)]+)\)", text))
    steps = {name.strip() for text in named for name in text.replace(";", ",").split(",")}
    for step in steps:
        word = step.split()[0].rstrip(":")
        words = [w.rstrip(":") for w in step.split() if w.startswith("locks_")]  # PL/pgSQL functions it names
        assert word in statements or word in functions or word.startswith(("fencing.", "expiry", "retry")), step
        assert set(words) <= functions, step
    for statement in ("acquire", "release", "release_held", "extend", "extend_many", "share_acquire", "share_release",
                      "share_extend", "enqueue", "share_enqueue", "cancel", "beat", "upgrade", "downgrade"):
        assert any(s.split()[0].rstrip(":") == statement for s in steps), f"no model step names {statement}"
