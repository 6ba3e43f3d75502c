"""The documentation's pages, as the tests that run their samples read them.

A python block preceded by ``<!-- tested: tests/test_x.py -->`` is run by that file (it needs
a worker, a project or a cluster of its own); tests/test_docs.py runs every other one.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from .conftest import libpq_dsn

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SAMPLE = re.compile(r"(?:<!-- tested: (\S+) -->\n)?```(\w+)\n(.*?)```", re.S)
# The database the samples name; the tests put a scratch database of theirs in its place.
SAMPLE_URL = re.compile(r"postgresql(?:\+psycopg)?://app@db/\w+")


# The same for MariaDB's samples.
MARIADB_SAMPLE_URL = re.compile(r"(?:mariadb|mysql)(?:\+pymysql)?://app@db/\w+")


def create_mariadb_database(url: str) -> str:
    """A new, empty database on the MariaDB server of ``url``: its URL (drop it with drop_mariadb_database)."""
    from .conftest import mariadb_connect

    name = "docs_" + secrets.token_hex(5)
    conn = mariadb_connect(url)
    try:
        conn.cursor().execute(f"CREATE DATABASE {name}")
    finally:
        conn.close()
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def drop_mariadb_database(url: str) -> None:
    from .conftest import mariadb_connect

    conn = mariadb_connect(url)
    try:
        conn.cursor().execute(f"DROP DATABASE IF EXISTS {make_url(url).database}")
    finally:
        conn.close()


def page(name: str) -> str:
    return (DOCS / name).read_text()


def section(name: str, heading: str) -> str:
    """A page's text under ``## heading``, up to the next heading of level 2 (or the end)."""
    return re.split(r"\n## ", page(name).split(f"\n## {heading}\n", 1)[1], 1)[0]


def blocks(text: str, lang: str = "python") -> list[str]:
    return [code for _, kind, code in SAMPLE.findall(text) if kind == lang]


def samples(name: str, lang: str = "python") -> list[tuple[str | None, str]]:
    """(the file that runs it, or None: tests/test_docs.py does; the code) for each block of a page."""
    return [(tested or None, code) for tested, kind, code in SAMPLE.findall(page(name)) if kind == lang]


def create_database(pg_url: str, prefix: str = "docs_") -> str:
    """A new, empty database on the test server: its URL (drop it with drop_database)."""
    name = prefix + secrets.token_hex(5)
    with psycopg.connect(libpq_dsn(pg_url), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    return make_url(pg_url).set(database=name).render_as_string(hide_password=False)


def drop_database(pg_url: str, url: str) -> None:
    with psycopg.connect(libpq_dsn(pg_url), autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {make_url(url).database} WITH (FORCE)")
