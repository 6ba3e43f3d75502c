"""Real Django for dblock's tests: settings from tests/django_settings.py, on scratch databases.

``django_env`` (session) makes a scratch PostgreSQL database and a SQLite file,
sets Django up in this process on them and runs ``migrate`` on both.
``manage(env, *args)`` runs ``python -m django ...`` (what manage.py runs) in a
subprocess with the same settings, for commands as users run them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from .docs import create_database, drop_database

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = "tests.django_settings"


@dataclass
class DjangoEnv:
    pg_url: str  # the "default" database
    sqlite: Path  # the "sqlite" database

    def environ(self, **more: str) -> dict[str, str]:
        """The environment of a `python -m django` subprocess on these databases."""
        return {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": SETTINGS,
            "DBLOCK_DJANGO_PG": self.pg_url,
            "DBLOCK_DJANGO_SQLITE": str(self.sqlite),
            "PYTHONPATH": str(ROOT),
            **more,
        }


def scratch_database(pg_url: str) -> str:
    """A new, empty PostgreSQL database on the test server: its URL (drop it with drop_database)."""
    return create_database(pg_url, "dj_")


def manage(env: DjangoEnv, *args: str, timeout: float = 120, **environ: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "django", *args], cwd=ROOT, env=env.environ(**environ),
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="session")
def django_env(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DjangoEnv]:
    import django
    from django.core.management import call_command
    from django.db import connections

    env = DjangoEnv(scratch_database(pg_url), tmp_path_factory.mktemp("django") / "app.sqlite3")
    with pytest.MonkeyPatch.context() as patch:  # read once, by django.setup()
        for key, value in env.environ().items():
            if key.startswith(("DJANGO_", "DBLOCK_DJANGO_")):
                patch.setenv(key, value)
        django.setup()
    # A connection Django opened for an earlier test file of this process may be dead by now
    # (a test restarted the throwaway server since): start from fresh ones.
    connections.close_all()
    try:
        for alias in ("default", "sqlite"):
            call_command("migrate", database=alias, verbosity=0)
        yield env
    finally:
        from dblock.contrib.django import close_lockers

        close_lockers()
        connections.close_all()
        drop_database(pg_url, env.pg_url)
