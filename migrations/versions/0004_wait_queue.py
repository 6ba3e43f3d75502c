"""Add the wait queue: the waiters of a held lock, in arrival order (fair mode).

Revision ID: dblock_0004
Revises: dblock_0003
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from dblock.migrate import target

revision = "dblock_0004"
down_revision = "dblock_0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table, schema = target()
    # Nullable, no default: a catalog-only change on PostgreSQL. NULL means
    # nobody waits; release hands the lease to the first live entry.
    op.add_column(table, sa.Column("queue", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True), schema=schema)


def downgrade() -> None:
    table, schema = target()
    op.drop_column(table, "queue", schema=schema)
