"""the drivers' own PostgreSQL roles (``ckpt_driver_grants``: which job each per-attempt login
role may read and write, looked up by the row-level security policies of
:mod:`checkpointing.metastore.driver_roles`); on SQLite a plain, unused table

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

#: the tables ``ckpt db driver-scope enable`` puts under row-level security (those with a
#: ``job_id``), as of this revision
_SCOPED = (
    "ckpt_jobs",
    "ckpt_checkpoints",
    "ckpt_checkpoint_tasks",
    "ckpt_checkpoint_acks",
    "ckpt_shared_state",
    "ckpt_requests",
    "ckpt_restores",
)


def upgrade() -> None:
    op.create_table(
        "ckpt_driver_grants",
        sa.Column("role_name", sa.String(length=63), nullable=False),
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("attempt", sa.String(length=64), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("role_name"),
    )


def downgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        _disable_driver_scope()
    op.drop_table("ckpt_driver_grants")


def _disable_driver_scope() -> None:
    """Undo ``ckpt db driver-scope enable``, which depends on the table: without row security
    the drivers' group must lose its privileges too, or its roles would reach every job's rows.
    The roles themselves are cluster-wide and stay (``ckpt db driver-scope expire`` drops them
    before a downgrade); without privileges they reach nothing here."""
    bind = op.get_bind()
    group = bind.execute(
        sa.text(
            "SELECT roles[1] FROM pg_policies WHERE schemaname = current_schema() "
            "AND tablename = 'ckpt_jobs' AND policyname = 'ckpt_driver_own_job'"
        )
    ).scalar()
    quote = bind.dialect.identifier_preparer.quote
    schema = quote(bind.execute(sa.text("SELECT current_schema()")).scalar_one())
    if group is not None:
        op.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {quote(group)}")
        op.execute(f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {quote(group)}")
        op.execute(f"REVOKE ALL ON SCHEMA {schema} FROM {quote(group)}")
    for table in _SCOPED:
        op.execute(f"DROP POLICY IF EXISTS ckpt_driver_own_job ON {table}")
        op.execute(f"DROP POLICY IF EXISTS ckpt_all_rows ON {table}")
        op.execute(f"ALTER TABLE {table} DISABLE ROW LEVEL SECURITY")
    op.execute("DROP FUNCTION IF EXISTS ckpt_driver_job()")
