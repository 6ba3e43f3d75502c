"""No internal labels in what a user reads: the guarantees' short names, design-note sections and
issue numbers stay in the project's own notes, out of docstrings of public names, the README, the documentation's
pages and what the migrations print."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .conftest import parse_python

ROOT = Path(__file__).resolve().parent.parent
INTERNAL = re.compile(r"\bG[1-7]\b|DESIGN\.md|§|\bissue \d+")


def public_docstrings(tree: ast.Module, public_module: bool, exported: set[str] = frozenset()) -> list[tuple[str, str]]:
    """(where, text) of the module's docstring (a public module's) and of its public classes,
    functions and methods; in a private module (``public_module`` False), of those it defines
    that dblock exports (``exported``: ``Locker`` lives in ``_locker``), and their methods."""
    found = []
    if public_module and ast.get_docstring(tree):
        found.append(("module", ast.get_docstring(tree) or ""))

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef, ast.If)):
                continue
            if not public_module and not prefix and not isinstance(node, ast.If) and node.name not in exported:
                continue
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                if ast.get_docstring(node):
                    found.append((prefix + node.name, ast.get_docstring(node) or ""))
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.If):  # the faces' `if True:  # ASYNC` blocks
                visit(node.body + node.orelse, prefix)

    visit(tree.body, "")
    return found


def labels_in(text: str) -> list[str]:
    return INTERNAL.findall(text)


def test_public_docstrings_docs_and_migration_messages_hold_no_internal_labels() -> None:
    import dblock

    exported = set(dblock.__all__)
    found = []
    for path in sorted((ROOT / "dblock").rglob("*.py")):
        public_module = not any(part.startswith("_") for part in path.relative_to(ROOT).with_suffix("").parts[1:])
        for where, text in public_docstrings(parse_python(path.read_text()), public_module, exported):
            found += [f"{path.relative_to(ROOT)} {where}: {label}" for label in labels_in(text)]
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 20  # the documentation site's pages too
    for path in pages:
        found += [f"{path.relative_to(ROOT)}: {label}" for label in labels_in(path.read_text())]
    for path in sorted((ROOT / "migrations" / "versions").glob("*.py")):  # alembic prints the first line
        first = (ast.get_docstring(parse_python(path.read_text())) or "").splitlines()[0]
        found += [f"{path.name}: {label}" for label in labels_in(first)]
    assert found == []


def test_the_rule_catches_what_it_is_for() -> None:
    tree = parse_python(
        '"""Fenced writes (G4)."""\n'
        "class Locker:\n"
        '    def prune(self):\n        """Tokens keep growing (G2)."""\n'
        '    def _private(self):\n        """Internal (G5) is fine."""\n'
        "if True:  # ASYNC\n"
        '    def locked(self):\n        """See DESIGN.md §3 and issue 16."""\n'
    )
    labels = [(where, labels_in(text)) for where, text in public_docstrings(tree, public_module=True)]
    assert labels == [("module", ["G4"]), ("Locker.prune", ["G2"]), ("locked", ["DESIGN.md", "§", "issue 16"])]
