"""acks record what their state file holds (key-group range and sizes, or list-state items)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

#: JSONB on PostgreSQL, JSON text elsewhere (as in checkpointing.metastore.models)
JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ckpt_checkpoint_acks", sa.Column("state_meta", JSON_TYPE, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ckpt_checkpoint_acks") as batch_op:
        batch_op.drop_column("state_meta")
