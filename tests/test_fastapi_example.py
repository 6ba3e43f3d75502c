"""examples/fastapi_app.py, driven through an ASGI client on PostgreSQL and SQLite."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import Db

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fastapi_app.py"


def load_app(url: str, table: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("DBLOCK_TABLE", table)
    spec = importlib.util.spec_from_file_location("fastapi_app_under_test", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.asyncio
async def test_one_report_per_customer_at_a_time(db: Db, monkeypatch: pytest.MonkeyPatch) -> None:
    url = db.url if db.backend == "postgresql" else db.url.replace("sqlite://", "sqlite+aiosqlite://")
    example = load_app(url, db.table, monkeypatch)
    app = example.app
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                same = await asyncio.gather(client.post("/reports/acme"), client.post("/reports/acme"))
                assert sorted(r.status_code for r in same) == [200, 409]
                (ok,) = [r for r in same if r.status_code == 200]
                other = await client.post("/reports/globex")
                assert other.status_code == 200
                again = await client.post("/reports/acme")  # the first one is done: free again
                assert again.status_code == 200 and again.json()["token"] > ok.json()["token"]
        rows = db.query("SELECT customer, body, fence_token FROM reports ORDER BY customer")
        assert rows == [
            ("acme", "report for acme", again.json()["token"]),
            ("globex", "report for globex", other.json()["token"]),
        ]
        assert db.query(f"SELECT count(*) FROM {db.table} WHERE owner IS NOT NULL") == [(0,)]
    finally:
        db.query("DROP TABLE IF EXISTS reports")


def test_the_fastapi_page_shows_this_example_whole() -> None:
    """docs/fastapi.md includes the file itself (a snippet), so the page shows the code this file runs."""
    from .docs import samples

    ((tested, block),) = samples("fastapi.md")
    assert tested == "tests/test_fastapi_example.py"
    assert block == '--8<-- "examples/fastapi_app.py"\n'
