"""Create the locks table and its token sequence.

Revision ID: dblock_0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from dblock.migrate import backend, target

revision = "dblock_0001"
down_revision = None
branch_labels = ("dblock",)
depends_on = None


def upgrade() -> None:
    table, schema = target()
    sequence = backend().caps.token_sequence
    # Times: timestamptz on PostgreSQL; Unix seconds on SQLite, which has no time type.
    timestamp = sa.DateTime(timezone=True).with_variant(sa.Float(), "sqlite").with_variant(sa.Double(), "mariadb", "mysql")
    if sequence:
        # One sequence issues every token: CACHE 1 so tokens follow grant order
        # across connections, NO CYCLE so they never wrap.
        op.execute(
            sa.schema.CreateSequence(
                sa.Sequence(f"{table}_token_seq", schema=schema, start=1, cache=1, cycle=False)
            )
        )
    op.create_table(
        table,
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("owner", sa.String(32), nullable=True),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("acquired_at", timestamp, nullable=False),
        sa.Column("expires_at", timestamp, nullable=True),
        schema=schema,
        **backend().table_options,
    )
    if sequence:
        qualified = f'"{schema}"."{table}"' if schema else f'"{table}"'
        sequence = f'"{schema}"."{table}_token_seq"' if schema else f'"{table}_token_seq"'
        op.execute(f"ALTER SEQUENCE {sequence} OWNED BY {qualified}.token")
    else:
        # Without a sequence (SQLite) the next token is max(token) + 1: keep that a lookup.
        op.create_index(f"ix_{table}_token", table, ["token"], schema=schema)


def downgrade() -> None:
    table, schema = target()
    op.drop_table(table, schema=schema)
    if backend().caps.token_sequence:
        op.execute(sa.schema.DropSequence(sa.Sequence(f"{table}_token_seq", schema=schema), if_exists=True))
