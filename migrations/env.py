"""Alembic environment for dblock's own tables.

dblock keeps its own version table (``alembic_version_dblock``), so running
these migrations never touches a host application's ``alembic_version``.

Run by ``Locker.create_schema()`` and ``dblock.migrate.run_with()`` (in an app's
own env.py) with a connection and the table options in ``config.attributes``, or
by the ``alembic`` command with ``sqlalchemy.url`` in the ini file and
``-x table=... -x schema=...``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, inspect
from sqlalchemy.schema import CreateSchema

from dblock.backends import of
from dblock.schema import DEFAULT_TABLE, version_table_name

config = context.config
x = context.get_x_argument(as_dictionary=True)
table = config.attributes.setdefault("dblock_table", x.get("table", DEFAULT_TABLE))
schema = config.attributes.setdefault("dblock_schema", x.get("schema"))


def run(connection) -> None:
    if schema and of(connection).caps.schemas and not inspect(connection).has_schema(schema):
        # The version table lives in the schema too, so make it before Alembic looks.
        # Only when missing: even IF NOT EXISTS needs CREATE on the database,
        # which the role that owns the schema (README, "Least privilege") may lack.
        connection.execute(CreateSchema(schema, if_not_exists=True))
    context.configure(
        connection=connection,
        version_table=version_table_name(table),
        version_table_schema=schema,
        target_metadata=None,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    # From dblock.migrate.run_with, inside an app's offline run: the app's dialect, and no
    # BEGIN/COMMIT of dblock's own, so that its statements join the app's transaction block.
    dialect_name = config.attributes.get("dialect_name")
    context.configure(
        url=None if dialect_name else config.get_main_option("sqlalchemy.url"),
        dialect_name=dialect_name,
        transactional_ddl=False if dialect_name else None,
        literal_binds=True,
        version_table=version_table_name(table),
        version_table_schema=schema,
    )
    with context.begin_transaction():
        if schema and of(context.get_context().dialect).caps.schemas:
            context.execute(CreateSchema(schema, if_not_exists=True))  # as online, before the version table
        context.run_migrations()
elif config.attributes.get("connection") is not None:
    run(config.attributes["connection"])
else:
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as conn:
        run(conn)
        conn.commit()
    engine.dispose()
