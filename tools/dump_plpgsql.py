"""Write dblock/backends/postgresql.sql: the PL/pgSQL dblock's migrations leave on PostgreSQL, whole.

The migrations hold their functions as Python strings, and later ones edit an
earlier one's text, so the functions the database runs are written out whole
nowhere but in a migrated database. This script migrates one and reads them
back from it: in a throwaway schema of the server given, it creates the lock
table ``locks`` as ``Locker(url).create_schema()`` does (no ``schema=``, so the
bodies name the tables unqualified, as an app with the defaults has them),
reads every function and trigger there with ``pg_get_functiondef`` and
``pg_get_triggerdef``, drops the schema, and writes the text, names qualified
with ``public`` rather than the throwaway schema.

    python tools/dump_plpgsql.py [URL]            # write the file
    python tools/dump_plpgsql.py --check [URL]    # exit 1, showing a diff, when the file is stale

URL is a PostgreSQL server where the role may create a schema; without it,
$DBLOCK_TEST_URL. tests/test_plpgsql_file.py runs ``generate`` and fails while
the file is stale.

The text is the server's deparsing of the catalog, so it could differ between
PostgreSQL versions; 15 (15.20) and 16 (pgserver's 16.2) print these functions
identically, so nothing is normalised but the schema's name. Should a version
print them differently, normalise that in ``_render``, so the check holds on all.
"""

from __future__ import annotations

import argparse
import difflib
import os
import secrets
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":
    # Run as a script, Python puts tools/ first on the path, not the checkout: this checkout's
    # dblock and migrations are the ones to dump, whichever dblock is installed.
    sys.path.insert(0, str(ROOT))

from sqlalchemy import create_engine, event, text  # noqa: E402
from sqlalchemy.engine import Engine, make_url  # noqa: E402
from sqlalchemy.pool import NullPool  # noqa: E402

from dblock import Locker, migrate  # noqa: E402
from dblock.schema import DEFAULT_TABLE  # noqa: E402

SQL_FILE = ROOT / "dblock" / "backends" / "postgresql.sql"
REGENERATE = "python tools/dump_plpgsql.py postgresql://USER@HOST/DB  (or with DBLOCK_TEST_URL set)"
ENV_URL = "DBLOCK_TEST_URL"
# The schema the text is written for: where an app's default search_path puts dblock's tables.
SCHEMA = "public"

# Both queries order by byte (COLLATE "C"), whatever the database's collation, so the file is the same everywhere.
_FUNCTIONS = """
SELECT pg_get_functiondef(p.oid)
FROM pg_proc AS p
WHERE p.pronamespace = CAST(:schema AS regnamespace)
ORDER BY p.proname COLLATE "C", pg_get_function_identity_arguments(p.oid) COLLATE "C"
"""

# Not the internal triggers PostgreSQL makes for constraints (foreign keys): dblock writes none of those.
_TRIGGERS = """
SELECT pg_get_triggerdef(t.oid)
FROM pg_trigger AS t JOIN pg_class AS c ON c.oid = t.tgrelid
WHERE c.relnamespace = CAST(:schema AS regnamespace) AND NOT t.tgisinternal
ORDER BY t.tgname COLLATE "C", c.relname COLLATE "C"
"""


def generate(url: str) -> str:
    """The file's text, from a freshly migrated throwaway schema on the PostgreSQL server at ``url``."""
    migrations = migrate.migrations_dir().resolve()
    if migrations != ROOT / "migrations":
        # Another checkout's (or an installed wheel's) migrations would be compared with this checkout's file.
        raise RuntimeError(
            f"dblock is imported from {migrations.parent}, not this checkout ({ROOT}): "
            f"run with PYTHONPATH={ROOT}"
        )
    scratch = f"dblock_plpgsql_{secrets.token_hex(6)}"  # lower case: quote_ident leaves it bare
    engine = _engine(url, scratch)
    try:
        with engine.connect() as conn:
            conn.execute(text(f"CREATE SCHEMA {scratch}"))
            conn.commit()
        locker = Locker(engine, table=DEFAULT_TABLE)
        try:
            locker.create_schema()
        finally:
            locker.close()
        with engine.connect() as conn:
            if conn.execute(text("SELECT to_regclass(:t)"), {"t": f"{scratch}.{DEFAULT_TABLE}"}).scalar() is None:
                raise RuntimeError(f"the migrations did not make {DEFAULT_TABLE} in the throwaway schema {scratch}")
            functions = [row[0] for row in conn.execute(text(_FUNCTIONS), {"schema": scratch})]
            triggers = [row[0] for row in conn.execute(text(_TRIGGERS), {"schema": scratch})]
    finally:
        with engine.connect() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {scratch} CASCADE"))
            conn.commit()
        engine.dispose()
    return _render(migrate.revisions()[-1], functions, triggers, scratch)


def _engine(url: str, scratch: str) -> Engine:
    """An engine on ``url`` (as psycopg 3, dblock's driver) whose sessions see only the schema ``scratch``.

    Unqualified names then mean ``scratch``: the migrations' (run without a
    schema) as much as the catalog's deparsing, as ``public`` means them for an
    app with the defaults. psycopg 3 also keeps dblock from swapping in an
    engine of its own (it does for psycopg2 and asyncpg), which would not set the path.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        raise ValueError(f"a PostgreSQL URL is needed (postgresql://user@host/db), not {parsed.drivername}://")
    engine = create_engine(parsed.set(drivername="postgresql+psycopg"), poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _search_path(dbapi_connection: Any, _record: Any) -> None:
        # Outside a transaction: a SET inside one would be undone by its rollback.
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        dbapi_connection.execute(f"SET search_path TO {scratch}")
        dbapi_connection.autocommit = autocommit

    return engine


def _render(head: str, functions: list[str], triggers: list[str], scratch: str) -> str:
    """The file: a header, then each definition as a statement, with the throwaway schema's name made ``public``."""
    counts = f"{_count(len(functions), 'function')}, {_count(len(triggers), 'trigger')}"
    header = f"""\
-- GENERATED by tools/dump_plpgsql.py from a freshly migrated database: do not edit by hand. Regenerate:
--     {REGENERATE}
-- tests/test_plpgsql_file.py fails while this file is stale.
-- What PostgreSQL runs after dblock's migrations (to {head}) for the table `{DEFAULT_TABLE}` in schema `{SCHEMA}`
-- (the defaults): {counts}, by name. Another table name replaces `{DEFAULT_TABLE}` in each name; with
-- schema=S the bodies qualify the names with S.
"""
    body = "".join(f"\n{d.rstrip()};\n" for d in (*functions, *triggers))
    # The catalog qualifies a function's own name (always) and a trigger's table with the schema.
    made = (header + body).replace(f"{scratch}.", f"{SCHEMA}.")
    if scratch in made:
        raise RuntimeError(f"the throwaway schema's name {scratch} is left in the text where it is not a qualifier")
    return made


def _count(n: int, noun: str) -> str:
    return f"{n or 'no'} {noun}{'' if n == 1 else 's'}"


def stale_diff(made: str, path: Path = SQL_FILE) -> str | None:
    """A unified diff from the file at ``path`` to ``made``; None when they are the same."""
    current = path.read_text(encoding="utf-8") if path.exists() else ""
    if current == made:
        return None
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return "".join(
        difflib.unified_diff(
            current.splitlines(keepends=True),
            made.splitlines(keepends=True),
            fromfile=f"{where} (in the checkout)",
            tofile=f"{where} (from a migrated database)",
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Write the file, or with ``--check`` report whether it is current: 0 current, 1 stale, 2 no URL."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("url", nargs="?", help=f"a PostgreSQL URL (default ${ENV_URL})")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff if the file is stale")
    args = parser.parse_args(argv)
    url = args.url or os.environ.get(ENV_URL)
    if not url:
        parser.error(f"give a PostgreSQL URL, or set ${ENV_URL}")
    made = generate(url)
    diff = stale_diff(made)
    if args.check:
        if diff is None:
            print(f"{SQL_FILE.relative_to(ROOT)} is current")
            return 0
        sys.stdout.write(diff)
        print(f"\n{SQL_FILE.relative_to(ROOT)} is stale. Regenerate with: {REGENERATE}")
        return 1
    SQL_FILE.parent.mkdir(parents=True, exist_ok=True)
    SQL_FILE.write_text(made, encoding="utf-8")
    print(f"wrote {SQL_FILE.relative_to(ROOT)}" + (" (unchanged)" if diff is None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
