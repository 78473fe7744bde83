"""the identity of a detached Spark driver (the deferrable Airflow task's): the attempt that
submitted it, its host, pid, parallelism, log file and when it was submitted, and the attempt
that watches it now (a retry that re-attached to it)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ckpt_jobs", sa.Column("driver_attempt", sa.String(64), nullable=True))
    op.add_column("ckpt_jobs", sa.Column("driver_host", sa.String(255), nullable=True))
    op.add_column("ckpt_jobs", sa.Column("driver_pid", sa.Integer(), nullable=True))
    op.add_column("ckpt_jobs", sa.Column("driver_parallelism", sa.Integer(), nullable=True))
    op.add_column("ckpt_jobs", sa.Column("driver_log", sa.String(2048), nullable=True))
    op.add_column(
        "ckpt_jobs", sa.Column("driver_submitted_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("ckpt_jobs", sa.Column("driver_watcher", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ckpt_jobs") as batch_op:
        batch_op.drop_column("driver_watcher")
        batch_op.drop_column("driver_submitted_at")
        batch_op.drop_column("driver_log")
        batch_op.drop_column("driver_parallelism")
        batch_op.drop_column("driver_pid")
        batch_op.drop_column("driver_host")
        batch_op.drop_column("driver_attempt")
