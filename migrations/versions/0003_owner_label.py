"""Add the owner label: who holds a lease ("host:pid command"), for operators.

Revision ID: dblock_0003
Revises: dblock_0002
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from dblock.migrate import target

revision = "dblock_0003"
down_revision = "dblock_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table, schema = target()
    # Nullable with no default: on PostgreSQL a catalog-only change (no table
    # rewrite, no long lock); rows granted before it read NULL until re-granted.
    op.add_column(table, sa.Column("label", sa.String(255), nullable=True), schema=schema)


def downgrade() -> None:
    table, schema = target()
    op.drop_column(table, "label", schema=schema)
