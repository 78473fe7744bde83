"""the shared state registry (incremental checkpoints) and each checkpoint's checkpointed size

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ckpt_shared_state",
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("handle", sa.String(length=2048), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["ckpt_jobs.job_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "checkpoint_id", "handle"),
    )
    op.create_index(
        "ix_ckpt_shared_state_job_handle", "ckpt_shared_state", ["job_id", "handle"], unique=False
    )
    op.add_column(
        "ckpt_checkpoints",
        sa.Column("checkpointed_size", sa.BigInteger(), server_default="0", nullable=False),
    )
    # every checkpoint before incremental ones wrote all its state itself
    op.execute("UPDATE ckpt_checkpoints SET checkpointed_size = state_size")


def downgrade() -> None:
    with op.batch_alter_table("ckpt_checkpoints") as batch_op:
        batch_op.drop_column("checkpointed_size")
    op.drop_index("ix_ckpt_shared_state_job_handle", table_name="ckpt_shared_state")
    op.drop_table("ckpt_shared_state")
