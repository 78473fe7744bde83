"""The SQL metastore's tables (SQLAlchemy 2 typed models).

The table and column meanings are documented in ``docs/metastore.md``; ``sql/`` holds the
reference DDL and ``checkpointing/metastore/migrations`` the Alembic migrations. A test keeps
all three in step.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

ID = String(128)
PATH = String(2048)
JSONType = JSON().with_variant(JSONB(), "postgresql")


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend.

    PostgreSQL stores ``timestamptz``; SQLite has no time zones, so values are stored as naive
    UTC (which also keeps string comparison in SQL correct) and come back aware.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: metastore times must be timezone-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSONType}


class Job(Base):
    """A checkpointed job: its checkpoint configuration and the coordinator's durable state."""

    __tablename__ = "ckpt_jobs"

    job_id: Mapped[str] = mapped_column(ID, primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default="CREATED")
    storage_url: Mapped[str] = mapped_column(PATH)
    # CheckpointConfig
    interval_ms: Mapped[int | None] = mapped_column(BigInteger)
    timeout_ms: Mapped[int] = mapped_column(BigInteger)
    min_pause_ms: Mapped[int] = mapped_column(BigInteger, default=0)
    max_concurrent: Mapped[int] = mapped_column(Integer, default=1)
    tolerable_failures: Mapped[int] = mapped_column(Integer, default=0)
    retained: Mapped[int] = mapped_column(Integer, default=1)
    retention: Mapped[str] = mapped_column(String(32))
    prefer_checkpoint_for_recovery: Mapped[bool] = mapped_column(Boolean, default=False)
    #: SavepointRetention, applied by ``ckpt gc`` (NULL: no limit)
    savepoint_keep: Mapped[int | None] = mapped_column(Integer)
    savepoint_max_age_ms: Mapped[int | None] = mapped_column(BigInteger)
    # coordinator state
    next_checkpoint_id: Mapped[int] = mapped_column(BigInteger, default=1)
    periodic_scheduling: Mapped[bool] = mapped_column(Boolean, default=False)
    coordinator_id: Mapped[str | None] = mapped_column(String(64))
    consecutive_failures: Mapped[int] = mapped_column(Integer, default=0)
    last_completed_id: Mapped[int | None] = mapped_column(BigInteger)
    last_completion_at: Mapped[datetime | None]
    #: the running driver's last heartbeat (:mod:`checkpointing.coordination.heartbeat`)
    heartbeat_at: Mapped[datetime | None]
    #: the last full refresh (``--full-refresh``): its first checkpoint id (older checkpoints
    #: and savepoints are never restored by ``latest``) and the token of the run that began it
    refresh_checkpoint_id: Mapped[int | None] = mapped_column(BigInteger)
    refresh_token: Mapped[str | None] = mapped_column(String(256))
    #: a detached driver (the deferrable Airflow task's): the attempt that submitted it, where
    #: it runs (host, pid of spark-submit, log file), its parallelism and when; the job row's
    #: coordinator id says whether that attempt still leads, ``driver_watcher`` which attempt
    #: coordinates it now (a retry that re-attached) (:mod:`checkpointing.coordination.drivers`)
    driver_attempt: Mapped[str | None] = mapped_column(String(64))
    driver_host: Mapped[str | None] = mapped_column(String(255))
    driver_pid: Mapped[int | None] = mapped_column(Integer)
    driver_parallelism: Mapped[int | None] = mapped_column(Integer)
    driver_log: Mapped[str | None] = mapped_column(PATH)
    driver_submitted_at: Mapped[datetime | None]
    driver_watcher: Mapped[str | None] = mapped_column(String(64))
    failure_cause: Mapped[str | None] = mapped_column(Text)
    #: who wrote ``status``: ``<writer>:<coordinator id>``
    #: (:class:`~checkpointing.status.StatusWriter`)
    status_by: Mapped[str | None] = mapped_column(String(80))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class Checkpoint(Base):
    """A checkpoint or savepoint: the PendingCheckpoint row and its later states."""

    __tablename__ = "ckpt_checkpoints"
    __table_args__ = (Index("ix_ckpt_checkpoints_job_status", "job_id", "status"),)

    job_id: Mapped[str] = mapped_column(
        ForeignKey("ckpt_jobs.job_id", ondelete="CASCADE"), primary_key=True
    )
    checkpoint_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    checkpoint_type: Mapped[str] = mapped_column(String(24))
    status: Mapped[str] = mapped_column(String(16))
    periodic: Mapped[bool] = mapped_column(Boolean, default=False)
    # CheckpointProperties
    forced: Mapped[bool] = mapped_column(Boolean)
    discard_on_subsumed: Mapped[bool] = mapped_column(Boolean)
    discard_on_finished: Mapped[bool] = mapped_column(Boolean)
    discard_on_cancelled: Mapped[bool] = mapped_column(Boolean)
    discard_on_failed: Mapped[bool] = mapped_column(Boolean)
    discard_on_suspended: Mapped[bool] = mapped_column(Boolean)
    # lifecycle
    trigger_at: Mapped[datetime]
    deadline_at: Mapped[datetime]
    completed_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    num_tasks: Mapped[int] = mapped_column(Integer)
    storage_location: Mapped[str] = mapped_column(PATH)
    metadata_path: Mapped[str | None] = mapped_column(PATH)
    metadata_checksum: Mapped[str | None] = mapped_column(String(80))
    #: bytes of every file the state spans, shared files of earlier checkpoints included
    state_size: Mapped[int] = mapped_column(BigInteger, default=0)
    #: bytes this checkpoint wrote itself (Flink's checkpointed data size): ``state_size`` less
    #: the shared files it reuses; the two are equal for a full (non-incremental) checkpoint
    checkpointed_size: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    failure_reason: Mapped[str | None] = mapped_column(String(64))
    failure_message: Mapped[str | None] = mapped_column(Text)
    coordinator_id: Mapped[str | None] = mapped_column(String(64))
    #: completion claim: set by the one caller that completes the checkpoint
    completing_by: Mapped[str | None] = mapped_column(String(64))
    #: completion notifications (commit hooks) succeeded at this time; NULL = still to run
    notified_at: Mapped[datetime | None]
    notify_error: Mapped[str | None] = mapped_column(Text)
    request_id: Mapped[int | None] = mapped_column(
        ForeignKey("ckpt_requests.request_id", ondelete="SET NULL")
    )


class CheckpointTask(Base):
    """A task a pending checkpoint waits for (Flink's ``notYetAcknowledgedTasks`` plan)."""

    __tablename__ = "ckpt_checkpoint_tasks"
    __table_args__ = (
        ForeignKeyConstraint(
            ["job_id", "checkpoint_id"],
            ["ckpt_checkpoints.job_id", "ckpt_checkpoints.checkpoint_id"],
            ondelete="CASCADE",
        ),
        UniqueConstraint("job_id", "checkpoint_id", "operator_id", "subtask_index"),
    )

    job_id: Mapped[str] = mapped_column(ID, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    attempt_id: Mapped[str] = mapped_column(ID, primary_key=True)
    operator_id: Mapped[str] = mapped_column(ID)
    subtask_index: Mapped[int] = mapped_column(Integer)
    parallelism: Mapped[int] = mapped_column(Integer)
    max_parallelism: Mapped[int] = mapped_column(Integer)


class CheckpointAck(Base):
    """A task's acknowledgement: where its snapshot is and what it measured."""

    __tablename__ = "ckpt_checkpoint_acks"
    __table_args__ = (
        ForeignKeyConstraint(
            ["job_id", "checkpoint_id", "attempt_id"],
            [
                "ckpt_checkpoint_tasks.job_id",
                "ckpt_checkpoint_tasks.checkpoint_id",
                "ckpt_checkpoint_tasks.attempt_id",
            ],
            ondelete="CASCADE",
        ),
    )

    job_id: Mapped[str] = mapped_column(ID, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    attempt_id: Mapped[str] = mapped_column(ID, primary_key=True)
    state_handle: Mapped[str | None] = mapped_column(PATH)
    state_size: Mapped[int] = mapped_column(BigInteger, default=0)
    checksum: Mapped[str | None] = mapped_column(String(80))
    sync_ms: Mapped[int] = mapped_column(Integer, default=0)
    async_ms: Mapped[int] = mapped_column(Integer, default=0)
    acked_at: Mapped[datetime]
    #: what the state file holds, for restore without reading it: keyed state's key-group range
    #: and bytes per group, or operator list state's items (see ``metadata.SubtaskStateHandle``)
    state_meta: Mapped[dict[str, Any] | None]


class SharedStateRef(Base):
    """One completed checkpoint's use of one file under the job's ``shared/`` directory (an
    entry of Flink's ``SharedStateRegistry``): a file's reference count is its number of rows,
    and the file is deleted when the last retained checkpoint using it is released."""

    __tablename__ = "ckpt_shared_state"
    __table_args__ = (Index("ix_ckpt_shared_state_job_handle", "job_id", "handle"),)

    job_id: Mapped[str] = mapped_column(
        ForeignKey("ckpt_jobs.job_id", ondelete="CASCADE"), primary_key=True
    )
    checkpoint_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    handle: Mapped[str] = mapped_column(PATH, primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)


class CheckpointRequest(Base):
    """A queued checkpoint or savepoint request (from the UI, a DAG, the CLI or the timer)."""

    __tablename__ = "ckpt_requests"
    __table_args__ = (Index("ix_ckpt_requests_job_status", "job_id", "status"),)

    request_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("ckpt_jobs.job_id", ondelete="CASCADE"))
    checkpoint_type: Mapped[str] = mapped_column(String(24))
    forced: Mapped[bool] = mapped_column(Boolean, default=False)
    periodic: Mapped[bool] = mapped_column(Boolean, default=False)
    priority: Mapped[int] = mapped_column(Integer)
    requested_by: Mapped[str] = mapped_column(String(256))
    requested_at: Mapped[datetime]
    target_location: Mapped[str | None] = mapped_column(PATH)
    status: Mapped[str] = mapped_column(String(16))
    checkpoint_id: Mapped[int | None] = mapped_column(BigInteger)
    message: Mapped[str | None] = mapped_column(Text)
    finished_at: Mapped[datetime | None]


class RestoreEvent(Base):
    """A restore decision: which checkpoint, for which attempt, the state assignment, fallbacks."""

    __tablename__ = "ckpt_restores"
    __table_args__ = (Index("ix_ckpt_restores_job", "job_id", "restore_id"),)

    restore_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("ckpt_jobs.job_id", ondelete="CASCADE"))
    attempt: Mapped[str] = mapped_column(String(256))
    checkpoint_id: Mapped[int | None] = mapped_column(BigInteger)
    checkpoint_type: Mapped[str | None] = mapped_column(String(24))
    external_path: Mapped[str | None] = mapped_column(PATH)
    parallelism: Mapped[int | None] = mapped_column(Integer)
    assignment: Mapped[dict[str, Any] | None]
    fallbacks: Mapped[dict[str, Any] | None]
    status: Mapped[str] = mapped_column(String(16))
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]


class DriverGrant(Base):
    """A Spark driver's own PostgreSQL login role and the one job it may read and write
    (:mod:`checkpointing.metastore.driver_roles`): the row-level security policies look the
    connected role up here, so a driver can touch no other job's rows."""

    __tablename__ = "ckpt_driver_grants"

    role_name: Mapped[str] = mapped_column(String(63), primary_key=True)
    job_id: Mapped[str] = mapped_column(ID)
    attempt: Mapped[str] = mapped_column(String(64))
    #: the role's ``VALID UNTIL``; past it the role sees no row and ``expire_driver_roles``
    #: drops it
    expires_at: Mapped[datetime]
