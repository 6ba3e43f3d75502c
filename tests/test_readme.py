"""The README's examples run as written (with the test database swapped in)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import types
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from .conftest import Db, libpq_dsn

ROOT = Path(__file__).resolve().parent.parent


def sh_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_api_example_runs(pg: Db) -> None:
    url = 'Locker("postgresql+psycopg://app@db/app")'
    (block,) = [b for b in python_blocks() if url in b]
    code = block.replace(url, f"Locker({pg.url!r}, table={pg.table!r})")
    exec(compile(code, "README.md", "exec"), {})
    assert pg.query(f"SELECT count(*) FROM {pg.table} WHERE owner IS NOT NULL") == [(0,)]


def test_readme_decorator_example_runs(pg: Db, capsys: pytest.CaptureFixture[str]) -> None:
    url = 'Locker("postgresql://app@db/app")'
    (block,) = [b for b in python_blocks() if url in b]
    namespace: dict[str, object] = {}
    exec(compile(block.replace(url, f"Locker({pg.url!r}, table={pg.table!r})"), "README.md", "exec"), namespace)
    namespace["locker"].close()  # type: ignore[attr-defined]
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"daily report for 42, token \d+", lines[0]), lines
    assert lines[1:] == ["sync-acme", "busy: report-42"]
    assert pg.query(f"SELECT count(*) FROM {pg.table} WHERE owner IS NOT NULL") == [(0,)]


def test_readme_metrics_example_runs(pg: Db) -> None:
    """In a process of its own: OpenTelemetry's console exporter writes to the real stdout."""
    url = 'Locker("postgresql+psycopg://app@db/app", ttl=30)'
    (block,) = [b for b in python_blocks() if "dblock.metrics.enable(" in b]
    assert url in block
    code = block.replace(url, f"Locker({pg.url!r}, table={pg.table!r}, ttl=30)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("dblock.lock.wait.duration", "dblock.lock.hold.duration", "dblock.lock.grants"):
        assert f'"name": "{name}"' in out.stdout, out.stdout
    assert pg.query(f"SELECT count(*) FROM {pg.table} WHERE owner IS NOT NULL") == [(0,)]


def section(title: str) -> str:
    """The README's text under a heading (``### Celery``), up to the next heading of level 2 or 3."""
    return re.split(r"\n#{2,3} ", (ROOT / "README.md").read_text().split(f"\n{title}\n", 1)[1], 1)[0]


def test_readme_min_hold_example_runs(pg: Db, capsys: pytest.CaptureFixture[str]) -> None:
    url = 'Locker("postgresql://app@db/app", table="periodic")'
    (block,) = re.findall(r"```python\n(.*?)```", section("### Once per period (min_hold)"), re.S)
    assert url in block
    namespace: dict[str, object] = {}
    exec(compile(block.replace(url, f"Locker({pg.url!r}, table={pg.table!r})"), "README.md", "exec"), namespace)
    namespace["locker"].close()  # type: ignore[attr-defined]
    assert capsys.readouterr().out.splitlines() == ["report sent", "already done", "True", "True", "None"]
    # Both leases are kept: the report's for an hour after its grant, the clean-up's for a week.
    kept = pg.query(
        f"SELECT name, EXTRACT(EPOCH FROM expires_at - acquired_at)::int FROM {pg.table} "
        "WHERE owner IS NOT NULL AND expires_at > now() ORDER BY name"
    )
    assert kept == [("nightly-report", 3600), ("weekly-cleanup", 7 * 86400)]


def test_readme_fencing_examples_run(pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every python block of "Fencing your writes", in order, on a scratch database: each as pasted
    on its own (a fresh namespace), sharing only the database."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Fencing your writes", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 4
    url = 'create_engine("postgresql+psycopg://app@db/app")'
    assert all(url in block for block in blocks)
    scratch = "readme_" + secrets.token_hex(4)
    admin = psycopg.connect(libpq_dsn(pg_url), autocommit=True)
    admin.execute(f"CREATE DATABASE {scratch}")
    scratch_url = make_url(pg_url).set(database=scratch).render_as_string(hide_password=False)
    try:
        for i, block in enumerate(blocks):
            module = types.ModuleType(f"readme_fencing_{i}")  # the ORM resolves annotations through sys.modules
            sys.modules[module.__name__] = module
            namespace = module.__dict__
            try:
                exec(compile(block.replace(url, f"create_engine({scratch_url!r})"), "README.md", "exec"), namespace)
            finally:
                namespace["locker"].close()
                namespace["engine"].dispose()
                del sys.modules[module.__name__]
        assert "fenced out: table 'accounts' already accepted newer token" in capsys.readouterr().out
        with psycopg.connect(libpq_dsn(scratch_url)) as conn:
            balances = conn.execute("SELECT id, balance FROM accounts").fetchall()
            wallets = conn.execute("SELECT id, balance, fence_token > 0 FROM wallets").fetchall()
        assert balances == [(1, 50)]  # 100 - 30; 50 from the fresh holder (not 0); +1 fenced; -1 guarded
        assert wallets == [(1, 70, True)]
    finally:
        admin.execute(f"DROP DATABASE {scratch} WITH (FORCE)")
        admin.close()


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


def test_readme_django_example_runs(pg_url: str, tmp_path: Path) -> None:
    """The python blocks of "Django" as a project's files: makemigrations, migrate, then debit()."""
    pytest.importorskip("django")
    from .django_support import drop_database, scratch_database

    section = (ROOT / "README.md").read_text().split("\n## Django\n", 1)[1].split("\n## ", 1)[0]
    files = {block.split("\n", 1)[0].removeprefix("# "): block for block in re.findall(r"```python\n(.*?)```", section, re.S)}
    assert set(files) == {"settings.py", "shop/models.py", "shop/jobs.py"}
    url = make_url(scratch_database(pg_url))
    (tmp_path / "shop").mkdir()
    (tmp_path / "shop" / "__init__.py").write_text("")
    for path, text in files.items():
        (tmp_path / path).write_text(text)
    with (tmp_path / "settings.py").open("a") as settings:
        database = {"ENGINE": "django.db.backends.postgresql", "NAME": url.database, "USER": url.username or "",
                    "PASSWORD": url.password or "", "HOST": url.query.get("host") or url.host or "",  # a socket dir: in the query
                    "PORT": str(url.port or url.query.get("port") or "")}
        settings.write(f"DATABASES = {{'default': {database!r}}}\nSECRET_KEY = 'readme'\nUSE_TZ = True\n"
                       "DEFAULT_AUTO_FIELD = 'django.db.models.BigAutoField'\n")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DJANGO_SETTINGS_MODULE": "settings", "PYTHONPATH": str(tmp_path)}

    def manage(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "django", *args], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    try:
        manage("makemigrations", "shop", "-v", "0")
        manage("migrate", "-v", "0")
        script = (
            "from shop.jobs import debit\nfrom shop.models import Account\n"
            "Account.objects.create(pk=1, balance=100)\nprint(debit(1, 30))\n"
            "print(*Account.objects.values_list('balance', 'fence_token').get(pk=1))"
        )
        result, row = manage("shell", "-v", "0", "-c", script).splitlines()
        assert result == "debited"
        balance, token = map(int, row.split())
        assert balance == 70 and token >= 1
        assert manage("dblock", "status") == "no leases held\n"
    finally:
        drop_database(pg_url, url.render_as_string(hide_password=False))


def test_the_sdist_carries_what_the_readme_links_to() -> None:
    """Every relative link of the README names a file that exists and that the sdist includes."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = project["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    links = {link for link in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())}
    assert "examples/fastapi_app.py" in links and "BENCHMARKS.md" in links  # the rule reads what it should
    for link in sorted(links):
        assert (ROOT / link).exists(), link
        assert any(link == part or link.startswith(part + "/") for part in include), f"{link} is not in the sdist"
    assert {"LICENSE", "CHANGELOG.md"} <= set(include)
