"""Run dblock's Alembic migrations (the one source of its schema)."""

from __future__ import annotations

import io
import zlib
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import text
from sqlalchemy.engine import Engine


def migrations_dir() -> Path:
    """The ``migrations`` folder: inside the installed wheel, or beside the package in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_migrations", here.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(f"dblock's migrations are missing (looked in {here / '_migrations'})")


def target() -> tuple[str, str | None]:
    """For dblock's migration scripts: the (table, schema) being migrated."""
    from alembic import context

    attributes = context.config.attributes
    return attributes["dblock_table"], attributes["dblock_schema"]


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
    cfg.set_main_option("sqlalchemy.url", url)
    command.upgrade(cfg, revision, sql=True)
    return out.getvalue()
