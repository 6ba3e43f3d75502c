"""Run dblock's Alembic migrations (the one source of its schema), or fit them into an app's.

Two ways to create dblock's tables (README, "Adding dblock to an existing app"):

- dblock's own history: ``Locker.create_schema()`` or ``dblock migrate``, recorded
  in dblock's own version table, never the app's ``alembic_version``;
- the app's history: the app lists ``dblock:_migrations/versions`` in its
  ``version_locations`` and runs ``alembic upgrade heads`` (branch ``dblock``).

Either way the app's autogenerate must not see dblock's tables: ``exclude_dblock``.
"""

from __future__ import annotations

import io
import zlib
from pathlib import Path
from typing import Any, Callable

from alembic import command
from alembic.config import Config
from sqlalchemy import text
from sqlalchemy.engine import Engine

from ._validate import check_identifier
from .schema import DEFAULT_TABLE, fences_table_name, version_table_name

IncludeObject = Callable[[Any, "str | None", str, bool, Any], bool]


def migrations_dir() -> Path:
    """The ``migrations`` folder: inside the installed wheel, or beside the package in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_migrations", here.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(f"dblock's migrations are missing (looked in {here / '_migrations'})")


def target() -> tuple[str, str | None]:
    """For dblock's migration scripts: the (table, schema) being migrated.

    dblock's own env.py puts them in ``config.attributes``. Run from an app's
    history instead, they come from the app's ``alembic.ini`` main section
    (``dblock_table``, ``dblock_schema``), else the default table ``locks``.
    """
    from alembic import context

    config = context.config
    attributes = config.attributes
    if "dblock_table" in attributes:
        return attributes["dblock_table"], attributes["dblock_schema"]
    table = check_identifier(config.get_main_option("dblock_table", DEFAULT_TABLE), "dblock_table")
    schema = config.get_main_option("dblock_schema")
    return table, None if not schema else check_identifier(schema, "dblock_schema")


def exclude_dblock(
    *tables: str, schema: str | None = None, include_object: IncludeObject | None = None
) -> IncludeObject:
    """An ``include_object`` hook for an app's env.py: autogenerate leaves dblock's tables alone.

    It hides the lock tables named in ``tables`` (default ``locks``) in
    ``schema``, their fences tables and dblock's version tables, so that
    ``alembic revision --autogenerate`` never proposes dropping them. Other
    objects go to the app's own ``include_object``, if given.
    """
    names = [check_identifier(t, "table") for t in tables or (DEFAULT_TABLE,)]
    schema = None if schema is None else check_identifier(schema, "schema")
    hidden = {n for t in names for n in (t, fences_table_name(t), version_table_name(t))}

    def include(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if type_ == "table" and name in hidden and obj.schema == schema:
            return False
        return include_object is None or include_object(obj, name, type_, reflected, compare_to)

    return include


def alembic_config(table: str, schema: str | None) -> Config:
    cfg = Config(stdout=io.StringIO())
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["dblock_table"] = table
    cfg.attributes["dblock_schema"] = schema
    return cfg


def upgrade(engine: Engine, table: str, schema: str | None, revision: str = "heads") -> None:
    """Bring dblock's tables to ``revision``, safely when several processes race to do it."""
    cfg = alembic_config(table, schema)
    if engine.dialect.name == "sqlite":
        # SQLite's DDL is transactional; BEGIN IMMEDIATE takes the write lock up
        # front so a racing create_schema waits and then finds the tables made.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
            except BaseException:
                conn.exec_driver_sql("ROLLBACK")
                raise
            conn.exec_driver_sql("COMMIT")
        return
    with engine.begin() as conn:
        # Serialise concurrent migrations of this table; released at commit.
        key = zlib.crc32(f"dblock:{schema}.{table}".encode())
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, table: str, schema: str | None, revision: str = "base") -> None:
    cfg = alembic_config(table, schema)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def sql(url: str, table: str, schema: str | None, revision: str = "heads") -> str:
    """The DDL that ``upgrade`` would run, as text (offline mode)."""
    out = io.StringIO()
    cfg = alembic_config(table, schema)
    cfg.stdout = out
    cfg.output_buffer = out
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # ini values interpolate %
    command.upgrade(cfg, revision, sql=True)
    return out.getvalue()
