"""a job's savepoint retention (a count and/or an age, applied by ``ckpt gc``)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ckpt_jobs", sa.Column("savepoint_keep", sa.Integer(), nullable=True))
    op.add_column("ckpt_jobs", sa.Column("savepoint_max_age_ms", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ckpt_jobs") as batch_op:
        batch_op.drop_column("savepoint_max_age_ms")
        batch_op.drop_column("savepoint_keep")
