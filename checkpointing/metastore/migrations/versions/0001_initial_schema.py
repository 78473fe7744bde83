"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

#: JSONB on PostgreSQL, JSON text elsewhere (as in checkpointing.metastore.models)
JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ckpt_jobs",
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("storage_url", sa.String(length=2048), nullable=False),
        sa.Column("interval_ms", sa.BigInteger(), nullable=True),
        sa.Column("timeout_ms", sa.BigInteger(), nullable=False),
        sa.Column("min_pause_ms", sa.BigInteger(), nullable=False),
        sa.Column("max_concurrent", sa.Integer(), nullable=False),
        sa.Column("tolerable_failures", sa.Integer(), nullable=False),
        sa.Column("retained", sa.Integer(), nullable=False),
        sa.Column("retention", sa.String(length=32), nullable=False),
        sa.Column("prefer_checkpoint_for_recovery", sa.Boolean(), nullable=False),
        sa.Column("next_checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("periodic_scheduling", sa.Boolean(), nullable=False),
        sa.Column("coordinator_id", sa.String(length=64), nullable=True),
        sa.Column("consecutive_failures", sa.Integer(), nullable=False),
        sa.Column("last_completed_id", sa.BigInteger(), nullable=True),
        sa.Column("last_completion_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("failure_cause", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("job_id"),
    )
    op.create_table(
        "ckpt_requests",
        sa.Column("request_id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("checkpoint_type", sa.String(length=24), nullable=False),
        sa.Column("forced", sa.Boolean(), nullable=False),
        sa.Column("periodic", sa.Boolean(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("requested_by", sa.String(length=256), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("target_location", sa.String(length=2048), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["ckpt_jobs.job_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("request_id"),
    )
    op.create_index(
        "ix_ckpt_requests_job_status", "ckpt_requests", ["job_id", "status"], unique=False
    )

    op.create_table(
        "ckpt_restores",
        sa.Column("restore_id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("attempt", sa.String(length=256), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=True),
        sa.Column("checkpoint_type", sa.String(length=24), nullable=True),
        sa.Column("external_path", sa.String(length=2048), nullable=True),
        sa.Column("parallelism", sa.Integer(), nullable=True),
        sa.Column("assignment", JSON_TYPE, nullable=True),
        sa.Column("fallbacks", JSON_TYPE, nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["ckpt_jobs.job_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("restore_id"),
    )
    op.create_index("ix_ckpt_restores_job", "ckpt_restores", ["job_id", "restore_id"], unique=False)

    op.create_table(
        "ckpt_checkpoints",
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("checkpoint_type", sa.String(length=24), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("periodic", sa.Boolean(), nullable=False),
        sa.Column("forced", sa.Boolean(), nullable=False),
        sa.Column("discard_on_subsumed", sa.Boolean(), nullable=False),
        sa.Column("discard_on_finished", sa.Boolean(), nullable=False),
        sa.Column("discard_on_cancelled", sa.Boolean(), nullable=False),
        sa.Column("discard_on_failed", sa.Boolean(), nullable=False),
        sa.Column("discard_on_suspended", sa.Boolean(), nullable=False),
        sa.Column("trigger_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("num_tasks", sa.Integer(), nullable=False),
        sa.Column("storage_location", sa.String(length=2048), nullable=False),
        sa.Column("metadata_path", sa.String(length=2048), nullable=True),
        sa.Column("metadata_checksum", sa.String(length=80), nullable=True),
        sa.Column("state_size", sa.BigInteger(), nullable=False),
        sa.Column("failure_reason", sa.String(length=64), nullable=True),
        sa.Column("failure_message", sa.Text(), nullable=True),
        sa.Column("coordinator_id", sa.String(length=64), nullable=True),
        sa.Column("completing_by", sa.String(length=64), nullable=True),
        sa.Column("notified_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("notify_error", sa.Text(), nullable=True),
        sa.Column("request_id", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["ckpt_jobs.job_id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["request_id"], ["ckpt_requests.request_id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("job_id", "checkpoint_id"),
    )
    op.create_index(
        "ix_ckpt_checkpoints_job_status", "ckpt_checkpoints", ["job_id", "status"], unique=False
    )

    op.create_table(
        "ckpt_checkpoint_tasks",
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt_id", sa.String(length=128), nullable=False),
        sa.Column("operator_id", sa.String(length=128), nullable=False),
        sa.Column("subtask_index", sa.Integer(), nullable=False),
        sa.Column("parallelism", sa.Integer(), nullable=False),
        sa.Column("max_parallelism", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id", "checkpoint_id"],
            ["ckpt_checkpoints.job_id", "ckpt_checkpoints.checkpoint_id"],
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "checkpoint_id", "attempt_id"),
        sa.UniqueConstraint("job_id", "checkpoint_id", "operator_id", "subtask_index"),
    )
    op.create_table(
        "ckpt_checkpoint_acks",
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt_id", sa.String(length=128), nullable=False),
        sa.Column("state_handle", sa.String(length=2048), nullable=True),
        sa.Column("state_size", sa.BigInteger(), nullable=False),
        sa.Column("checksum", sa.String(length=80), nullable=True),
        sa.Column("sync_ms", sa.Integer(), nullable=False),
        sa.Column("async_ms", sa.Integer(), nullable=False),
        sa.Column("acked_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id", "checkpoint_id", "attempt_id"],
            [
                "ckpt_checkpoint_tasks.job_id",
                "ckpt_checkpoint_tasks.checkpoint_id",
                "ckpt_checkpoint_tasks.attempt_id",
            ],
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "checkpoint_id", "attempt_id"),
    )


def downgrade() -> None:
    op.drop_table("ckpt_checkpoint_acks")
    op.drop_table("ckpt_checkpoint_tasks")
    op.drop_index("ix_ckpt_checkpoints_job_status", table_name="ckpt_checkpoints")

    op.drop_table("ckpt_checkpoints")
    op.drop_index("ix_ckpt_restores_job", table_name="ckpt_restores")

    op.drop_table("ckpt_restores")
    op.drop_index("ix_ckpt_requests_job_status", table_name="ckpt_requests")

    op.drop_table("ckpt_requests")
    op.drop_table("ckpt_jobs")
