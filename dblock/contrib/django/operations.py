"""The migration operation that makes dblock's tables: dblock's own Alembic migrations, run by Django's.

dblock's schema has one source, its Alembic migrations (``migrations/``). This
operation runs them, the same code as ``dblock migrate``, so the tables a
Django project gets cannot drift from anyone else's (tests/test_django_schema.py
compares the two anyway). They run on connections dblock opens from the
database's settings, not in Django's transaction: the migration is not
atomic. They record their revision in dblock's own version table,
``alembic_version_dblock``, so ``dblock migrate`` and ``Locker.create_schema()``
find the tables current, and the other way round.

Each Django migration of this app pins one Alembic revision of dblock's: when
dblock adds a revision, this app adds a migration that upgrades to it (and
downgrades to the one before). A drift test fails until it does.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from django.db import router
from django.db.migrations.operations.base import Operation

from dblock.schema import DEFAULT_TABLE, version_table_name

from .database import database_url, vendor


class MigrateDBLock(Operation):
    """Bring dblock's tables (lock table ``locks``) to Alembic ``revision``; backwards, to ``previous``
    (None: remove them, and dblock's version table)."""

    reduces_to_sql = True  # `manage.py sqlmigrate dblock 0001` prints the DDL
    reversible = True
    atomic = False

    def __init__(self, revision: str, previous: str | None = None) -> None:
        self.revision = revision
        self.previous = previous

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass  # no models: Django's state knows nothing of dblock's tables

    def describe(self) -> str:
        return f"Bring dblock's tables to its Alembic revision {self.revision}"

    @property
    def migration_name_fragment(self) -> str:
        return self.revision

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        alias = schema_editor.connection.alias
        if not router.allow_migrate(alias, app_label):
            return
        from dblock import migrate  # Alembic: loaded when a migration runs, not whenever Django lists them

        if schema_editor.collect_sql:
            dialect = "postgresql+psycopg://" if vendor(alias) == "postgresql" else "sqlite://"
            steps = self.revision if self.previous is None else f"{self.previous}:{self.revision}"
            schema_editor.collected_sql.append(migrate.sql(dialect, DEFAULT_TABLE, None, steps).rstrip())
            return
        with _engine(alias) as engine, migrate.database_errors(engine, DEFAULT_TABLE):
            from dblock import backends

            backends.of(engine).prepare_database(engine)  # SQLite: WAL
            # To the head, upgrade looks first: tables already current (made by
            # `dblock migrate`, or the app's own Alembic history) stay as they are.
            target = "heads" if self.revision in _heads() else self.revision
            migrate.upgrade(engine, DEFAULT_TABLE, None, target)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        alias = schema_editor.connection.alias
        if not router.allow_migrate(alias, app_label):
            return
        if schema_editor.collect_sql:
            schema_editor.collected_sql.append(
                f"-- dblock's Alembic downgrade to {self.previous or 'base'} (run by `manage.py migrate`)"
            )
            return
        from sqlalchemy import MetaData, Table, func, inspect, select

        from dblock import migrate

        with _engine(alias) as engine, migrate.database_errors(engine, DEFAULT_TABLE):
            migrate.downgrade(engine, DEFAULT_TABLE, None, self.previous or "base")
            if self.previous is None:
                # Alembic keeps its version table, empty: the last trace of dblock here.
                with engine.begin() as conn:
                    if inspect(conn).has_table(version_table_name(DEFAULT_TABLE)):
                        versions = Table(version_table_name(DEFAULT_TABLE), MetaData(), autoload_with=conn)
                        if conn.scalar(select(func.count()).select_from(versions)) == 0:
                            versions.drop(conn)


def _heads() -> set[str]:
    from alembic.script import ScriptDirectory

    from dblock import migrate

    return set(ScriptDirectory.from_config(migrate.alembic_config(DEFAULT_TABLE, None)).get_heads())


@contextmanager
def _engine(alias: str) -> Iterator[Any]:
    """An engine dblock makes for the alias (as a Locker's), disposed of after."""
    from dblock._engine import engine_for

    engine, _, _ = engine_for(database_url(alias))
    try:
        yield engine
    finally:
        engine.dispose()
