"""The PL/pgSQL the database runs, whole in one file, and migrations that carry whole text (DESIGN.md §10).

dblock/backends/postgresql.sql is generated from a migrated database by
tools/dump_plpgsql.py; the first test regenerates it and fails, with the diff
and the command, while the committed file is stale. The others keep new
migrations from editing an earlier migration's text, as 0006, 0008 and 0009
did: whole text per migration is what lets a reader find a function's source.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dblock.schema import (
    DEFAULT_TABLE,
    lean_function_names,
    queue_function_names,
    shared_function_names,
    shared_queue_function_names,
    upgrade_function_names,
)
from tools import dump_plpgsql

from .conftest import parse_python

VERSIONS = dump_plpgsql.ROOT / "migrations" / "versions"
# Migrations before this one predate the rule (0006, 0008 and 0009 edit earlier text); they stay as they are.
FIRST_GUARDED = 10


def test_plpgsql_file_is_what_a_migrated_database_runs(pg_url: str) -> None:
    made = dump_plpgsql.generate(pg_url)
    diff = dump_plpgsql.stale_diff(made)
    if diff is not None:
        where = dump_plpgsql.SQL_FILE.relative_to(dump_plpgsql.ROOT)
        pytest.fail(
            f"{where} is stale: a freshly migrated database runs other text than it shows.\n\n{diff}\n"
            f"Regenerate it (and commit it with the migration):\n    {dump_plpgsql.REGENERATE}",
            pytrace=False,
        )
    # The file holds the functions dblock's code calls, by the names dblock.schema gives them.
    dumped = re.findall(r"^CREATE OR REPLACE FUNCTION public\.(\w+)\(", made, re.MULTILINE)
    assert dumped == sorted(dumped)
    t = DEFAULT_TABLE
    assert set(dumped) == {
        *queue_function_names(t), *shared_function_names(t), *shared_queue_function_names(t), *upgrade_function_names(t),
        *lean_function_names(t),
    }


def test_no_migration_after_0009_edits_an_earlier_migrations_text() -> None:
    guarded = [p for p in sorted(VERSIONS.glob("*.py")) if _number(p) >= FIRST_GUARDED]
    findings = [finding for path in guarded for finding in edits_of_other_migrations(path)]
    assert not findings, (
        "a migration edits text it takes from another migration; give it the whole text of what it creates "
        "(DESIGN.md §10):\n" + "\n".join(findings)
    )


def test_the_guard_sees_the_edits_0006_0008_and_0009_make() -> None:
    """The guard against the migrations that do edit earlier text (and those that do not), and a whole-text restore."""
    flagged = {_number(p) for p in VERSIONS.glob("*.py") if _number(p) < FIRST_GUARDED and edits_of_other_migrations(p)}
    assert flagged == {6, 8, 9}
    restore = (
        "def downgrade():\n"
        "    sql = context.script.get_revision('dblock_0009').module._functions('locks', None)[0]\n"
        "    op.execute(sql)\n"
        "    op.execute(_own().replace('a', 'b'))\n"
    )
    assert _findings(parse_python(restore), "restore.py") == []


def _number(path: Path) -> int:
    """A migration's number from its file name (``0009_walk_by_index.py``: 9); -1 for other files."""
    match = re.match(r"(\d+)_", path.name)
    return int(match.group(1)) if match else -1


# -- the guard -----------------------------------------------------------------------------------
# What fetches another migration's code or text: Alembic's revision lookup (script.get_revision(...).module),
# importing it by path or name, or reading its source.
_FETCHES = {"get_revision", "import_module", "__import__", "run_path", "spec_from_file_location", "SourceFileLoader",
            "getsource", "read_text", "read_bytes"}
# String methods that make new text from old; and re.sub / re.subn, which take the old text as an argument.
_EDIT_METHODS = {"replace", "format", "format_map", "translate"}
_EDIT_FUNCTIONS = {"sub", "subn"}


def edits_of_other_migrations(path: Path) -> list[str]:
    """Where the migration at ``path`` edits text taken from another migration: one line per place.

    A tripwire, not a proof: it follows the text through names, tuple unpacking,
    loops and the module's own functions' return values, and sees the edits
    0006, 0008 and 0009 make (str.replace, format, re.sub); slicing or
    concatenation of the text would pass it.
    """
    return _findings(parse_python(path.read_text(encoding="utf-8")), path.name)


def _findings(tree: ast.Module, where: str) -> list[str]:
    defs = (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    scopes: list[ast.AST] = [tree, *defs]
    module_names: set[str] = set()
    local: dict[int, set[str]] = {id(s): set() for s in scopes}
    functions: set[str] = set()  # the module's functions that return another migration's text

    def tainted(expr: ast.AST | None, names: set[str]) -> bool:
        return expr is not None and any(_fetches(n) or _uses(n, names, functions) for n in ast.walk(expr))

    # Taint spreads through assignments and return values until nothing more changes.
    changed = True
    while changed:
        changed = False
        for scope in scopes:
            names = module_names if scope is tree else local[id(scope)]
            visible = module_names | names
            for node in _own_nodes(scope):
                bound: set[str] = set()
                if isinstance(node, (ast.Import, ast.ImportFrom)) and _imports_a_migration(node):
                    bound = {(a.asname or a.name).split(".")[0] for a in node.names}
                elif isinstance(node, ast.Assign) and tainted(node.value, visible):
                    bound = {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and tainted(node.value, visible):
                    bound = {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
                elif isinstance(node, (ast.For, ast.comprehension)) and tainted(node.iter, visible):
                    bound = {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
                elif isinstance(node, ast.withitem) and node.optional_vars and tainted(node.context_expr, visible):
                    bound = {n.id for n in ast.walk(node.optional_vars) if isinstance(n, ast.Name)}
                elif isinstance(node, ast.Return) and isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if scope.name not in functions and tainted(node.value, visible):
                        functions.add(scope.name)
                        changed = True
                if bound - names:
                    names |= bound
                    changed = True

    found: list[tuple[int, str]] = []
    for scope in scopes:
        visible = module_names | (set() if scope is tree else local[id(scope)])
        for node in _own_nodes(scope):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            edited = isinstance(func, ast.Attribute) and func.attr in _EDIT_METHODS and tainted(func.value, visible)
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if edited or (name in _EDIT_FUNCTIONS and any(tainted(a, visible) for a in node.args)):
                found.append((node.lineno, f"{where} line {node.lineno}: {ast.unparse(node)[:100]}"))
    return [text for _, text in sorted(found)]


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of a module or function, not those of the functions defined in it (scopes of their own)."""
    nodes: list[ast.AST] = []
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        nodes.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend(ast.iter_child_nodes(node))
    return nodes


def _fetches(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "module":  # a Script's module: get_revision(...).module
        return True
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        return name in _FETCHES
    return False


def _uses(node: ast.AST, names: set[str], functions: set[str]) -> bool:
    """A tainted name, or a call of one of the module's functions that return another migration's text."""
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions


def _imports_a_migration(node: ast.Import | ast.ImportFrom) -> bool:
    modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    return any(re.search(r"(^|\.)(versions|_alembic|migrations)(\.|$)|(^|\.)\d+_", m) for m in modules)
