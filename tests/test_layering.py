"""No module of dblock reaches into another's private names (DESIGN.md §10).

The rule, checked on the source with ``ast``: in a module of ``dblock/``,
``x._name`` where ``x`` is not ``self`` or ``cls`` (and ``_name`` is not a
dunder) must name something that module defines itself: an attribute it
assigns on ``self``/``cls``, a name in one of its class bodies or
``__slots__``, or a module-level name of its own. A private name another
dblock module defines, reached from here, is a layering break: give the owner
a small documented method, or hand over what is needed once (see
``Lease``/``Keeper``/``LeaseState``). Importing another module's private name
(``from .x import _y``) breaks the rule the same way.

A name defined both here and in another module (``_lock``, ``_reset``) passes:
without types the receiver cannot be told apart, so such names are best kept
to each class's own ``self``.

Modules with a leading underscore (``_core``, ``_driver``) are the package's
internals: importing them is fine, and so are their public names. Private
names of third-party libraries are not dblock's layering; the few dblock uses
are listed below, so that a new one is a decision rather than an accident.
Tests may poke privates; this checks only ``dblock/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import parse_python

PACKAGE = Path(__file__).resolve().parent.parent / "dblock"

# SQLAlchemy offers no public accessor for these (fencing.py inspects a statement before it runs).
# Django's model API is _meta and _base_manager (documented); a queryset's database is _db or,
# unset, the router's choice given its _hints, as QuerySet.update() decides.
THIRD_PARTY = {
    ("fencing", "_returning"),
    ("fencing", "_traverse_internals"),
    ("fencing", "_values"),
    ("contrib/django/fencing", "_meta"),
    ("contrib/django/fencing", "_base_manager"),
    ("contrib/django/fencing", "_db"),
    ("contrib/django/fencing", "_hints"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defines(tree: ast.AST) -> set[str]:
    """The private names a module (or a class) defines: its own to use on any receiver."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    for node in ast.walk(tree):  # __slots__ = ("_a", "_b")
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            names.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {n for n in names if _private(n)}


def _modules() -> dict[str, ast.Module]:
    """Every module of the package, subpackages (``contrib/django/fencing``) included."""
    return {
        p.relative_to(PACKAGE).with_suffix("").as_posix(): parse_python(p.read_text(), str(p))
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def _dblock_module(node: ast.ImportFrom) -> bool:
    return node.level > 0 or (node.module or "").split(".")[0] == "dblock"


def violations(modules: dict[str, ast.Module]) -> list[str]:
    defined = {name: _defines(tree) for name, tree in modules.items()}
    everywhere = set().union(*defined.values())
    found = []
    for module, tree in modules.items():
        own = defined[module]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if node.attr in own or (node.attr not in everywhere and (module, node.attr) in THIRD_PARTY):
                    continue
                whose = sorted(m for m, names in defined.items() if node.attr in names) or ["a third-party library"]
                found.append(f"dblock/{module}.py:{node.lineno}: .{node.attr} (defined in {', '.join(whose)})")
            elif isinstance(node, ast.ImportFrom) and _dblock_module(node):
                for alias in node.names:
                    if _private(alias.name) and alias.name not in modules:  # a private module is fine (_core)
                        found.append(f"dblock/{module}.py:{node.lineno}: imports {alias.name} from {node.module}")
    return found


def test_no_module_reaches_into_another_modules_private_names() -> None:
    assert violations(_modules()) == []


def test_third_party_privates_listed_are_still_used() -> None:
    # Keep the list honest: an entry that no longer matches anything goes.
    modules = _modules()
    used = {
        (module, node.attr)
        for module, tree in modules.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and _private(node.attr)
    }
    assert THIRD_PARTY <= used


def test_the_rule_catches_what_it_is_for() -> None:
    # A module that pokes another's private attribute, calls its private method,
    # or imports its private name is caught; self/cls and its own names are not.
    owner = parse_python(
        "class Lease:\n"
        "    __slots__ = ('_slot',)\n"
        "    def __init__(self):\n"
        "        self._released = False\n"
        "    def _lose(self):\n"
        "        self._released = True\n"
        "def _helper(): pass\n"
    )
    poker = parse_python(
        "from .lease import _helper\n"
        "class Renewer:\n"
        "    def __init__(self):\n"
        "        self._own = 1\n"
        "    def go(self, lease, other):\n"
        "        lease._released = True\n"
        "        lease._lose()\n"
        "        lease._slot\n"
        "        other._own\n"
        "        self._own\n"
        "        lease.__class__\n"
    )
    found = violations({"lease": owner, "renew": poker})
    assert sorted(f.split(": ", 1)[1] for f in found) == [
        "._lose (defined in lease)",
        "._released (defined in lease)",
        "._slot (defined in lease)",
        "imports _helper from lease",
    ]


# -- classes ------------------------------------------------------------------------------
# Within one module, too, no class reaches into another class's private names: ``x._name``
# in a class body, where ``x`` is not ``self`` or ``cls``, must name something that class
# defines itself (an attribute it assigns on self/cls, a method, a name in its body). A
# class that needs another's step is handed it (a bound method, or a small public method).
def class_violations(modules: dict[str, ast.Module]) -> list[str]:
    found = []
    for module, tree in modules.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            own = _defines(cls)  # what the class itself defines
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                    if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                        found.append(f"dblock/{module}.py:{node.lineno}: {cls.name} reaches .{node.attr}")
    return found


def test_no_class_reaches_into_another_classs_private_names() -> None:
    modules = _modules()
    allowed = {m for m in modules if m.startswith("contrib/django")}  # Django's documented _meta and friends
    assert [v for v in class_violations(modules) if v.split(".py:")[0][len("dblock/"):] not in allowed] == []


def test_the_class_rule_catches_what_it_is_for() -> None:
    tree = parse_python(
        "class Locker:\n"
        "    def __init__(self):\n"
        "        self._driver = 1\n"
        "    def _measured(self): pass\n"
        "class Shared:\n"
        "    def __init__(self, locker):\n"
        "        self.locker = locker\n"
        "        self._own = locker.open\n"
        "    def go(self):\n"
        "        self.locker._measured()\n"
        "        self.locker._driver\n"
        "        self._own\n"
    )
    assert sorted(v.split(": ", 1)[1] for v in class_violations({"locker": tree})) == [
        "Shared reaches ._driver",
        "Shared reaches ._measured",
    ]


# -- import circles -------------------------------------------------------------------------
def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Which of the package's modules each imports when it is loaded (module level, ``if``
    blocks included; imports for type checking only, or inside a function, are not loaded)."""
    graph: dict[str, set[str]] = {}
    for module, tree in modules.items():
        package = module.split("/")[:-1]
        deps: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for stmt in node.body if isinstance(node, ast.If) else [node]:
                if not isinstance(stmt, ast.ImportFrom) or not _dblock_module(stmt):
                    continue
                if stmt.level:  # from .x import y, from .. import z
                    parts = package[: len(package) - stmt.level + 1] + (stmt.module or "").split(".")
                else:  # from dblock.x import y
                    parts = (stmt.module or "").split(".")[1:]
                target = "/".join(p for p in parts if p)
                for alias in stmt.names:
                    module_of = f"{target}/{alias.name}".lstrip("/")  # the name is a module, or a package
                    for candidate in (module_of, f"{module_of}/__init__", target, f"{target}/__init__".lstrip("/")):
                        if candidate in modules:
                            deps.add(candidate)
                            break
        graph[module] = deps - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_no_module_imports_in_a_circle() -> None:
    assert circles(import_graph(_modules())) == []


def test_the_circle_rule_catches_what_it_is_for() -> None:
    modules = {
        "a": parse_python("from .b import x\n"),
        "b": parse_python("from . import c\n"),
        "c": parse_python("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\nfrom .a import z\n"),
        "d": parse_python("def f():\n    from .a import x\n"),
    }
    assert circles(import_graph(modules)) == [["a", "b", "c", "a"]]


# -- migrations ------------------------------------------------------------------------------
MIGRATIONS = PACKAGE.parent / "migrations"
# Frozen history: 0006, 0008 and 0009 read an earlier migration's function text (and 0008
# 0006's edits of it) through its module; tests/test_plpgsql_file.py stops any later
# migration from doing so.
FROZEN = {
    ("versions/0006_enqueue_fixes", "_functions"),
    ("versions/0008_shared_queue", "_enqueue"),
    ("versions/0008_shared_queue", "_EDITS"),
    ("versions/0009_walk_by_index", "_functions"),
}


def migration_violations() -> tuple[list[str], set[tuple[str, str]]]:
    """Private names a migration reaches in another module, or imports from dblock; and which
    FROZEN entries were met."""
    found, met = [], set()
    for path in sorted(MIGRATIONS.rglob("*.py")):
        name = path.relative_to(MIGRATIONS).with_suffix("").as_posix()
        tree = parse_python(path.read_text(), str(path))
        own = _defines(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                if (name, node.attr) in FROZEN:
                    met.add((name, node.attr))
                else:
                    found.append(f"migrations/{name}.py:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and _dblock_module(node):
                private_module = any(_private(part) for part in (node.module or "").split("."))
                for alias in node.names:
                    if private_module or _private(alias.name):
                        found.append(f"migrations/{name}.py:{node.lineno}: imports {alias.name} from {node.module}")
    return found, met


def test_migrations_use_only_dblocks_public_names() -> None:
    found, met = migration_violations()
    assert found == []
    assert met == FROZEN  # an entry no longer needed goes


# -- which database it is ----------------------------------------------------------------------
# A module asks its backend what the database can do (``backend.caps``), never which one it is;
# the backends themselves, and the Django adapter (which names Django's vendors), may.
DATABASE_NAMES = {"postgresql", "postgres", "sqlite", "mysql", "mariadb"}
MAY_NAME_DATABASES = ("backends/", "contrib/django/")


def dialect_comparisons(tree: ast.AST) -> list[int]:
    """The lines where a comparison names a database (``x == "postgresql"``, ``in ("sqlite", ...)``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                if any(isinstance(v, ast.Constant) and v.value in DATABASE_NAMES for v in values):
                    lines.append(node.lineno)
                    break
    return lines


def test_only_the_backends_compare_database_names() -> None:
    found = []
    for root, prefix in ((PACKAGE, "dblock"), (MIGRATIONS, "migrations")):
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if root is PACKAGE and relative.startswith(MAY_NAME_DATABASES):
                continue
            found += [f"{prefix}/{relative}:{line}" for line in dialect_comparisons(parse_python(path.read_text()))]
    assert found == []


def test_the_database_name_rule_catches_what_it_is_for() -> None:
    caught = parse_python(
        'a = dialect.name == "postgresql"\n'
        'b = "sqlite" != url.get_backend_name()\n'
        'c = kind in ("mysql", "mariadb")\n'
        'd = backend.caps.fair_queue\n'
        'e = sa.Float().with_variant(sa.Float(), "sqlite")\n'
    )
    assert dialect_comparisons(caught) == [1, 2, 3]
