"""who wrote a job's status (``status_by``: ``run:<attempt>`` for the job's own run, i.e. its
driver, ``failover:<attempt>`` for a failed try's failover): a detached driver's watcher ends
only on the driver's own terminal status, never on a late failure callback's

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ckpt_jobs", sa.Column("status_by", sa.String(80), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ckpt_jobs") as batch_op:
        batch_op.drop_column("status_by")
