"""The sync modules written from their asyncio source are current (tools/async_to_sync.py).

One face is written by hand (asyncio); the other is generated from it, so a
change to acquiring, waiting, renewing or releasing is made once. A generated
module that differs from what the script writes now means someone edited it
by hand, or changed the source without running the script.
"""

from __future__ import annotations

import ast

from tools import async_to_sync

from .conftest import parse_python


def test_every_generated_module_is_current() -> None:
    stale = async_to_sync.stale()
    assert not stale, "".join(diff for _, diff in stale) + "\nstale: run python tools/async_to_sync.py"


def test_generated_modules_say_so_and_hold_no_asyncio() -> None:
    for source, target in async_to_sync.SOURCES:
        text = (async_to_sync.ROOT / target).read_text()
        assert text.startswith(async_to_sync.header(source))
        tree = parse_python(text)
        for node in ast.walk(tree):
            assert not isinstance(node, (ast.AsyncFunctionDef, ast.Await, ast.AsyncWith, ast.AsyncFor)), (target, node)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert "asyncio" not in names, f"{target} imports asyncio"


def test_the_rules_drop_async_blocks_and_keep_the_sync_branch() -> None:
    source = (
        "async def f(cond):\n"
        "    if True:  # ASYNC\n"
        "        await acond_wait(cond, 1)\n"
        "\n"
        "        x = 1\n"
        "    else:\n"
        "        cond.wait(2)\n"
        "    async with cond:\n"
        "        return await AsyncDriver().aconnect(0)\n"
    )
    assert async_to_sync.convert(source, "s.py") == async_to_sync.header("s.py") + (
        "def f(cond):\n"
        "    cond.wait(2)\n"
        "    with cond:\n"
        "        return Driver().connect(0)\n"
    )


def shadowed(tree: ast.Module) -> list[str]:
    """Module-level functions defined twice: the first never runs (a test that cannot fail)."""
    seen: set[str] = set()
    twice = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in seen:
                twice.append(f"{node.name} (line {node.lineno})")
            seen.add(node.name)
    return twice


def test_no_test_is_shadowed_by_a_second_of_its_name() -> None:
    """Folding twins into one written-once module once left two tests of one name, the first unrun."""
    found = {
        path.name: twice
        for path in sorted((async_to_sync.ROOT / "tests").glob("*.py"))
        if (twice := shadowed(parse_python(path.read_text())))
    }
    assert found == {}
    assert shadowed(parse_python("def test_a(): pass\nasync def test_a(): pass\ndef test_b(): pass\n")) == ["test_a (line 2)"]
