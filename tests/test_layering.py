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


def _defines(tree: ast.Module) -> set[str]:
    """The private names a module defines: its own to use on any receiver."""
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
        p.relative_to(PACKAGE).with_suffix("").as_posix(): ast.parse(p.read_text(), str(p))
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
    owner = ast.parse(
        "class Lease:\n"
        "    __slots__ = ('_slot',)\n"
        "    def __init__(self):\n"
        "        self._released = False\n"
        "    def _lose(self):\n"
        "        self._released = True\n"
        "def _helper(): pass\n"
    )
    poker = ast.parse(
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
