"""the driver's heartbeat on the job row (a RUNNING job whose driver stopped beating is dead),
and the last full refresh (checkpoints older than it are not restored)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ckpt_jobs", sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("ckpt_jobs", sa.Column("refresh_checkpoint_id", sa.BigInteger(), nullable=True))
    op.add_column("ckpt_jobs", sa.Column("refresh_token", sa.String(256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ckpt_jobs") as batch_op:
        batch_op.drop_column("refresh_token")
        batch_op.drop_column("refresh_checkpoint_id")
        batch_op.drop_column("heartbeat_at")
