"""Completed checkpoints in the metastore (Flink's ``CompletedCheckpointStore``).

The store holds COMPLETED checkpoints; it keeps the newest ``retained`` of them and subsumes the
rest. Savepoints are completed too but never enter the retained count and are never subsumed or
deleted by the system. File deletion always happens *after* the metastore transaction commits, so
a failed commit never leaves the metastore pointing at deleted files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from checkpointing.models import Checkpoint
from checkpointing.properties import CheckpointStatus, CheckpointType, JobStatus


@dataclass(frozen=True)
class Disposal:
    """Files to delete once the transaction that released them has committed."""

    checkpoint_id: int
    storage_location: str


def completed(session: Session, job_id: str, *, savepoints: bool = True) -> Sequence[Checkpoint]:
    """COMPLETED checkpoints (and savepoints), newest first."""
    query = select(Checkpoint).where(
        Checkpoint.job_id == job_id, Checkpoint.status == CheckpointStatus.COMPLETED
    )
    if not savepoints:
        query = query.where(Checkpoint.checkpoint_type == CheckpointType.CHECKPOINT)
    return session.scalars(query.order_by(Checkpoint.checkpoint_id.desc())).all()


def restore_candidates(session: Session, job_id: str, prefer_checkpoint: bool) -> list[Checkpoint]:
    """Newest first; with ``prefer_checkpoint`` checkpoints come before newer savepoints (Flink's
    ``getLatestCheckpoint(preferCheckpointForRecovery)``)."""
    rows = list(completed(session, job_id))
    if prefer_checkpoint:
        rows.sort(key=lambda c: (c.checkpoint_type != CheckpointType.CHECKPOINT, -c.checkpoint_id))
    return rows


def subsume(session: Session, job_id: str, retained: int, now: datetime) -> list[Disposal]:
    """Keep the newest ``retained`` completed checkpoints; subsume older ones."""
    old = session.scalars(
        select(Checkpoint)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.status == CheckpointStatus.COMPLETED,
            Checkpoint.checkpoint_type == CheckpointType.CHECKPOINT,
        )
        .order_by(Checkpoint.checkpoint_id.desc())
        .offset(retained)
    ).all()
    disposals = []
    for c in old:
        c.status = CheckpointStatus.SUBSUMED
        c.ended_at = now
        if c.discard_on_subsumed:
            disposals.append(Disposal(c.checkpoint_id, c.storage_location))
    return disposals


def shutdown(session: Session, job_id: str, job_status: JobStatus, now: datetime) -> list[Disposal]:
    """On a globally terminal job status, discard the checkpoints whose properties say so (the
    retention policy); a suspended job keeps everything, as Flink's store does."""
    if not job_status.is_globally_terminal:
        return []
    disposals = []
    for c in completed(session, job_id, savepoints=False):
        discard = {
            JobStatus.FINISHED: c.discard_on_finished,
            JobStatus.CANCELED: c.discard_on_cancelled,
            JobStatus.FAILED: c.discard_on_failed,
        }[job_status]
        if discard:
            c.status = CheckpointStatus.DISCARDED
            c.ended_at = now
            c.failure_message = f"discarded on job {job_status.value.lower()} (retention policy)"
            disposals.append(Disposal(c.checkpoint_id, c.storage_location))
    return disposals


def discard_savepoint(
    session: Session, job_id: str, checkpoint_id: int, now: datetime
) -> Disposal | None:
    """A user discards a completed savepoint; returns its files to delete, or None if it is not a
    completed savepoint."""
    result = session.execute(
        update(Checkpoint)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.checkpoint_id == checkpoint_id,
            Checkpoint.status == CheckpointStatus.COMPLETED,
            Checkpoint.checkpoint_type != CheckpointType.CHECKPOINT,
        )
        .values(
            status=CheckpointStatus.DISCARDED, ended_at=now, failure_message="discarded by user"
        )
        .returning(Checkpoint.storage_location)
    ).scalar_one_or_none()
    return None if result is None else Disposal(checkpoint_id, result)
