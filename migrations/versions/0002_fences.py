"""Create the fences table: the newest token each fenced resource accepted.

Revision ID: dblock_0002
Revises: dblock_0001
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from dblock.migrate import backend, target
from dblock.schema import fences_table_name

revision = "dblock_0002"
down_revision = "dblock_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table, schema = target()
    table = fences_table_name(table)
    op.create_table(
        table,
        sa.Column("resource", sa.String(255), primary_key=True),
        sa.Column("last_token", sa.BigInteger, nullable=False),
        schema=schema,
        **backend().table_options,
    )


def downgrade() -> None:
    table, schema = target()
    table = fences_table_name(table)
    op.drop_table(table, schema=schema)
