"""The documentation site: it builds in strict mode, and every code sample on its pages runs.

Each page's python samples run in order, each as pasted on its own (a fresh namespace), on a
scratch PostgreSQL database of their own in place of ``postgresql://app@db/app`` (and on a
SQLite file of their own for ``Locker()``). A sample marked ``<!-- tested: tests/x.py -->``
needs more than that (a Celery worker, a Django project, a Patroni cluster, a process of
its own): that file runs it, and the tests below check that it reads the page. The samples
whose output the page shows are checked here against it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import Engine, make_url

from dblock import Locker

from .conftest import Db, libpq_dsn
from .docs import (
    DOCS,
    MARIADB_SAMPLE_URL,
    ROOT,
    SAMPLE_URL,
    blocks,
    create_database,
    create_mariadb_database,
    drop_database,
    drop_mariadb_database,
    page,
    samples,
    section,
)

PAGES = sorted(path.name for path in DOCS.glob("*.md"))
SITE_URL = "https://dblock.readthedocs.io/en/latest/"


# -- the site ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mkdocs build --strict``: a broken link or anchor, a page left out of the nav, an API
    reference that names nothing, or a docstring griffe cannot read fails the build."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    assert "WARNING" not in build.stderr, build.stderr
    return out


def test_the_site_builds_in_strict_mode_with_every_page(site: Path) -> None:
    for name in PAGES:
        built = site / ("index.html" if name == "index.md" else f"{name.removesuffix('.md')}/index.html")
        assert built.exists(), name
    api = (site / "api" / "index.html").read_text()
    for name in ("Locker", "try_acquire", "AsyncLocker", "fenced_update", "LockNotAcquired", "run_with", "FenceTokenField"):
        assert f'id="{name}"' in api or f"{name}</code>" in api or f">{name}<" in api, name
    assert "(G" not in api and "DESIGN.md" not in api  # the docstrings speak to users


def test_the_config_names_the_site_the_readme_links_to() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    assert f"site_url: {SITE_URL}\n" in config
    rtd = (ROOT / ".readthedocs.yaml").read_text()
    assert "configuration: mkdocs.yml" in rtd and "- docs" in rtd  # the host installs .[docs] and builds this config


def assert_in_site(site: Path, link: str) -> None:
    path, _, anchor = link.removeprefix(SITE_URL).partition("#")
    built = site / path / "index.html"
    assert built.exists(), link
    if anchor:
        assert f'id="{anchor}"' in built.read_text(), link


def test_readme_links_reach_pages_and_anchors_of_the_site(site: Path) -> None:
    """The README's links are absolute (they work on a package index too); those into the
    site name a page and anchor that the build made."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links and all(link.startswith("https://") for link in links), links
    into_site = [link for link in links if link.startswith(SITE_URL)]
    assert len(into_site) >= 5
    for link in into_site:
        assert_in_site(site, link)


def test_the_pages_messages_point_at_exist(site: Path) -> None:
    """Error messages and warnings that send the user to a page of the site name one that exists."""
    sources = [*(ROOT / "dblock").rglob("*.py"), *(ROOT / "migrations").rglob("*.py"), ROOT / "pyproject.toml"]
    links = {link for path in sources for link in re.findall(re.escape(SITE_URL) + r"[\w/#-]*", path.read_text())}
    assert len(links) >= 4  # the rule reads what it should: least-privilege, high-availability, alembic, ...
    for link in sorted(links):
        assert_in_site(site, link.rstrip("."))


# -- the samples -------------------------------------------------------------------------------
def close_what_it_opened(namespace: dict[str, Any]) -> None:
    for value in list(namespace.values()):
        if isinstance(value, Locker):
            value.close()
        elif isinstance(value, Engine):
            value.dispose()


def mariadb_scratch(name: str, request: pytest.FixtureRequest) -> str | None:
    """A scratch MariaDB database for a page whose samples name one (skipped where MariaDB cannot be had)."""
    if not MARIADB_SAMPLE_URL.search(page(name)):
        return None
    return create_mariadb_database(request.getfixturevalue("mariadb_url"))


@pytest.mark.parametrize("name", [name for name in PAGES if any(t is None for t, _ in samples(name))])
def test_the_samples_of_a_page_run(
    name: str, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    monkeypatch.setenv("DBLOCK_HOME", str(tmp_path))  # Locker(): a SQLite file of this test's
    monkeypatch.delenv("DBLOCK_URL", raising=False)
    maria = mariadb_scratch(name, request)
    url = create_database(pg_url)
    try:
        for i, (tested, code) in enumerate(samples(name)):
            if tested is not None:
                continue
            code = SAMPLE_URL.sub(lambda m: url if "+" in m.group(0) else url.replace("+psycopg", ""), code)
            if maria is not None:
                code = MARIADB_SAMPLE_URL.sub(maria, code)
            module = types.ModuleType(f"docs_{name.removesuffix('.md').replace('-', '_')}_{i}")
            sys.modules[module.__name__] = module  # the ORM resolves annotations through sys.modules
            try:
                exec(compile(code, f"docs/{name}", "exec"), module.__dict__)
            finally:
                close_what_it_opened(module.__dict__)
                del sys.modules[module.__name__]
    finally:
        drop_database(pg_url, url)
        if maria is not None:
            drop_mariadb_database(maria)


# Shell lines the samples test leaves alone: installs, servers and the contributor's test command
# (this suite is that command), and Django's manage.py (tests/test_django.py runs `manage.py dblock`).
NOT_RUN = ("pip install ", "sh tests/install-", "python manage.py dblock ", "DATABASE_URL=")


@pytest.mark.parametrize("name", [name for name in PAGES if blocks(page(name), "sh")])
def test_the_shell_samples_of_a_page_run(name: str, pg_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Each `dblock ...` line, in order, with the installed command, on the page's own scratch
    database (for a --url) and SQLite file (for the embedded default)."""
    maria = mariadb_scratch(name, request)
    url = create_database(pg_url)
    env = {"DBLOCK_HOME": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    try:
        for line in [line for block in blocks(page(name), "sh") for line in block.splitlines()]:
            if line.startswith(NOT_RUN):
                continue
            assert line.startswith("dblock "), f"docs/{name}: a shell line no test runs: {line}"
            command = SAMPLE_URL.sub(url.replace("+psycopg", ""), line)
            if maria is not None:
                command = MARIADB_SAMPLE_URL.sub(maria, command)
            out = subprocess.run(command, shell=True, env=env, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, (line, out.stdout + out.stderr)
    finally:
        drop_database(pg_url, url)
        if maria is not None:
            drop_mariadb_database(maria)


@pytest.mark.parametrize("name", PAGES)
def test_a_sample_left_to_another_test_is_run_by_it(name: str) -> None:
    for tested, _ in samples(name):
        if tested is not None:
            assert (ROOT / tested).is_file(), tested
            assert f'"{name}"' in (ROOT / tested).read_text(), f"{tested} does not read docs/{name}"


def test_every_page_has_its_samples_in_a_language_the_tests_know() -> None:
    for name in PAGES:
        for lang in re.findall(r"^```(\S*)$", page(name), re.M)[::2]:
            assert lang in {"python", "sh", "sql", "text", "ini", "yaml"}, (name, lang)


# -- samples whose output the page shows --------------------------------------------------------
def test_the_decorator_sample_prints_what_it_says(pg: Db, capsys: pytest.CaptureFixture[str]) -> None:
    url = 'Locker("postgresql://app@db/app")'
    (block,) = [b for b in blocks(section("locks.md", "Decorator")) if url in b]
    namespace: dict[str, object] = {}
    exec(compile(block.replace(url, f"Locker({pg.url!r}, table={pg.table!r})"), "docs/locks.md", "exec"), namespace)
    namespace["locker"].close()  # type: ignore[attr-defined]
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"daily report for 42, token \d+", lines[0]), lines
    assert lines[1:] == ["sync-acme", "busy: report-42"]
    assert pg.query(f"SELECT count(*) FROM {pg.table} WHERE owner IS NOT NULL") == [(0,)]


def test_the_metrics_sample_exports_each_instrument(pg: Db) -> None:
    """In a process of its own: OpenTelemetry's console exporter writes to the real stdout,
    and metrics once enabled stay on in the process."""
    url = 'Locker("postgresql+psycopg://app@db/app", ttl=30)'
    ((tested, block),) = samples("metrics.md")
    assert tested == "tests/test_docs.py" and url in block
    code = block.replace(url, f"Locker({pg.url!r}, table={pg.table!r}, ttl=30)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("dblock.lock.wait.duration", "dblock.lock.hold.duration", "dblock.lock.grants"):
        assert f'"name": "{name}"' in out.stdout, out.stdout
    assert pg.query(f"SELECT count(*) FROM {pg.table} WHERE owner IS NOT NULL") == [(0,)]


def test_the_min_hold_sample_keeps_its_leases(pg: Db, capsys: pytest.CaptureFixture[str]) -> None:
    url = 'Locker("postgresql://app@db/app", table="periodic")'
    ((tested, block),) = samples("once-per-period.md")
    assert tested == "tests/test_docs.py" and url in block
    namespace: dict[str, object] = {}
    exec(compile(block.replace(url, f"Locker({pg.url!r}, table={pg.table!r})"), "docs/once-per-period.md", "exec"), namespace)
    namespace["locker"].close()  # type: ignore[attr-defined]
    assert capsys.readouterr().out.splitlines() == ["report sent", "already done", "True", "True", "None"]
    # Both leases are kept: the report's for an hour after its grant, the clean-up's for a week.
    kept = pg.query(
        f"SELECT name, EXTRACT(EPOCH FROM expires_at - acquired_at)::int FROM {pg.table} "
        "WHERE owner IS NOT NULL AND expires_at > now() ORDER BY name"
    )
    assert kept == [("nightly-report", 3600), ("weekly-cleanup", 7 * 86400)]


def test_the_fencing_samples_write_what_they_say(pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every sample of "Fencing your writes", in order, on a scratch database: each as pasted
    on its own (a fresh namespace), sharing only the database."""
    found = samples("fencing.md")
    assert len(found) >= 5 and all(tested == "tests/test_docs.py" for tested, _ in found)
    url = 'create_engine("postgresql+psycopg://app@db/app")'
    assert all(url in block for _, block in found)
    scratch_url = create_database(pg_url)
    try:
        for i, (_, block) in enumerate(found):
            module = types.ModuleType(f"docs_fencing_{i}")  # the ORM resolves annotations through sys.modules
            sys.modules[module.__name__] = module
            try:
                exec(compile(block.replace(url, f"create_engine({scratch_url!r})"), "docs/fencing.md", "exec"), module.__dict__)
            finally:
                close_what_it_opened(module.__dict__)
                del sys.modules[module.__name__]
        assert "fenced out: table 'accounts' already accepted newer token" in capsys.readouterr().out
        with psycopg.connect(libpq_dsn(scratch_url)) as conn:
            balances = conn.execute("SELECT id, balance FROM accounts").fetchall()
            wallets = conn.execute("SELECT id, balance, fence_token > 0 FROM wallets").fetchall()
        assert balances == [(1, 50)]  # 100 - 30; 50 from the fresh holder (not 0); +1 fenced; -1 guarded
        assert wallets == [(1, 70, True)]
    finally:
        drop_database(pg_url, scratch_url)


def test_the_django_samples_make_a_project_that_runs(pg_url: str, tmp_path: Path) -> None:
    """The python blocks of "Django" as a project's files: makemigrations, migrate, then debit()."""
    pytest.importorskip("django")
    url = make_url(create_database(pg_url))
    database = {"ENGINE": "django.db.backends.postgresql", "NAME": url.database, "USER": url.username or "",
                "PASSWORD": url.password or "", "HOST": url.query.get("host") or url.host or "",  # a socket dir: in the query
                "PORT": str(url.port or url.query.get("port") or "")}
    try:
        run_the_django_samples(tmp_path, database)
    finally:
        drop_database(pg_url, url.render_as_string(hide_password=False))


def run_the_django_samples(tmp_path: Path, database: dict[str, str], prelude: str = "") -> None:
    """docs/django.md's files as a project on ``database`` (settings' DATABASES["default"], after
    ``prelude``): makemigrations, migrate, a fenced debit, and `manage.py dblock status`."""
    found = samples("django.md")
    assert all(tested == "tests/test_docs.py" for tested, _ in found)
    files = {block.split("\n", 1)[0].removeprefix("# "): block for _, block in found}
    assert set(files) == {"settings.py", "shop/models.py", "shop/jobs.py"}
    (tmp_path / "shop").mkdir()
    (tmp_path / "shop" / "__init__.py").write_text("")
    for path, text in files.items():
        (tmp_path / path).write_text(text)
    with (tmp_path / "settings.py").open("a") as settings:
        settings.write(f"{prelude}DATABASES = {{'default': {database!r}}}\nSECRET_KEY = 'readme'\nUSE_TZ = True\n"
                       "DEFAULT_AUTO_FIELD = 'django.db.models.BigAutoField'\n")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DJANGO_SETTINGS_MODULE": "settings", "PYTHONPATH": str(tmp_path)}

    def manage(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "django", *args], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

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
