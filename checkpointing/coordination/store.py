"""Completed checkpoints in the metastore (Flink's ``CompletedCheckpoint`` and
``CompletedCheckpointStore``).

The store holds COMPLETED checkpoints; it keeps the newest ``retained`` of them and subsumes the
rest. Savepoints are completed too but never enter the retained count and are never subsumed or
deleted by the system. Nothing here deletes a file: the store returns what to delete (a
:class:`Disposal`), which the :class:`~checkpointing.coordination.cleaner.CheckpointsCleaner`
deletes *after* the metastore transaction commits, so a failed commit never leaves the metastore
pointing at deleted files.

Incremental checkpoints share files under the job's ``shared/`` directory: a completion registers
the ones it uses (:mod:`checkpointing.coordination.shared_state`) before it subsumes anything, and
a checkpoint leaving the retained set releases its references; the shared files left
unreferenced are in its :class:`Disposal`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from checkpointing.coordination import shared_state
from checkpointing.metastore.models import Checkpoint, Job
from checkpointing.state.metadata import CheckpointMetadata
from checkpointing.state.storage import FileInfo
from checkpointing.status import CheckpointStatus, CheckpointType, JobStatus


@dataclass(frozen=True)
class CompletedCheckpoint:
    """A checkpoint whose ``_metadata`` is written and whose row is COMPLETED (Flink's
    ``CompletedCheckpoint``): what completion listeners and restores receive."""

    job_id: str
    checkpoint_id: int
    checkpoint_type: CheckpointType
    metadata_path: str
    location: str
    state_size: int
    metadata: CheckpointMetadata
    #: bytes the checkpoint wrote itself (``state_size`` less the shared files it reuses)
    checkpointed_size: int = 0

    @classmethod
    def of(cls, row: Checkpoint, metadata: CheckpointMetadata) -> CompletedCheckpoint:
        """The completed checkpoint of a COMPLETED row and its ``_metadata``."""
        assert row.metadata_path is not None
        return cls(
            row.job_id,
            row.checkpoint_id,
            CheckpointType(row.checkpoint_type),
            row.metadata_path,
            row.storage_location,
            row.state_size,
            metadata,
            row.checkpointed_size,
        )


@dataclass(frozen=True)
class Disposal:
    """Files to delete once the transaction that released them has committed."""

    checkpoint_id: int
    #: the checkpoint's directory, deleted whole
    storage_location: str
    #: shared state files (under the job's ``shared/``) that no retained checkpoint refers to
    #: any more since this one was released
    shared: tuple[str, ...] = ()
    #: what it is: the cleaner derives the directory it deletes from the ids and this type,
    #: and compares ``storage_location`` (read from the row) with it
    checkpoint_type: CheckpointType = CheckpointType.CHECKPOINT


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


def add(
    session: Session,
    job_id: str,
    checkpoint_id: int,
    token: str,
    metadata: CheckpointMetadata,
    info: FileInfo,
    retained: int,
    shared: shared_state.SharedDirs,
    *,
    checkpointed_size: int,
) -> tuple[int | None, list[Disposal]] | None:
    """Flink's ``CompletedCheckpointStore.addCheckpointAndSubsumeOldestOne``, after the
    ``_metadata`` was written: mark the claimed PENDING row COMPLETED, register the shared files
    it uses (``shared``: the job's shared directory and the checkpoint's own in it) and the bytes
    it wrote (``checkpointed_size``, :func:`shared_state.checkpointed_size`), record it as
    the job's latest completion, and (checkpoints only: a savepoint subsumes nothing) subsume
    beyond ``retained``. None when the row is no longer ours to complete (aborted meanwhile);
    else its request id, if a request triggered it, and what to delete after the commit.
    :class:`~checkpointing.errors.SharedStateError` when it reuses a shared file no retained
    checkpoint registered: the caller rolls back and aborts it."""
    now = metadata.completed_at
    checkpoint = CheckpointType(metadata.checkpoint_type) is CheckpointType.CHECKPOINT
    marked = session.execute(
        update(Checkpoint)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.checkpoint_id == checkpoint_id,
            Checkpoint.status == CheckpointStatus.PENDING,
            Checkpoint.completing_by == token,
        )
        .values(
            status=CheckpointStatus.COMPLETED,
            completed_at=now,
            metadata_path=info.url,
            metadata_checksum=info.checksum,
            state_size=metadata.state_size,
            checkpointed_size=checkpointed_size,
        )
        .returning(Checkpoint.request_id)
    ).one_or_none()
    if marked is None:
        return None
    # before subsuming: a file this checkpoint reuses must keep a reference
    shared_state.register(
        session, job_id, checkpoint_id, metadata, shared, savepoint=not checkpoint
    )
    # completions may commit out of id order: the job's latest is the highest id, on each dialect
    latest = (
        func.greatest(Job.last_completed_id, checkpoint_id)
        if session.get_bind().dialect.name == "postgresql"
        else func.max(func.coalesce(Job.last_completed_id, 0), checkpoint_id)
    )
    session.execute(
        update(Job)
        .where(Job.job_id == job_id)
        .values(last_completed_id=func.coalesce(latest, checkpoint_id), last_completion_at=now)
    )
    disposals = subsume(session, job_id, retained, now) if checkpoint else []
    return marked[0], disposals


def subsume(session: Session, job_id: str, retained: int, now: datetime) -> list[Disposal]:
    """Keep the newest ``retained`` completed checkpoints; subsume older ones, releasing their
    shared files."""
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
        if c.discard_on_subsumed:  # else its files are kept, and so are its references
            disposals.append(_released(session, c))
    return disposals


def shutdown(session: Session, job_id: str, job_status: JobStatus, now: datetime) -> list[Disposal]:
    """On a globally terminal job status, discard the checkpoints whose properties say so (the
    retention policy); a suspended job keeps everything, as Flink's store does.

    A FINISHED job keeps its newest checkpoint whatever the policy: it is the job's live state,
    recording the input consumed, from which its next run (new input) resumes; the next run's
    checkpoints subsume it as usual."""
    if not job_status.is_globally_terminal:
        return []
    disposals = []
    checkpoints = completed(session, job_id, savepoints=False)
    if job_status is JobStatus.FINISHED and checkpoints:
        live = max(checkpoints, key=lambda c: c.checkpoint_id)
        checkpoints = [c for c in checkpoints if c is not live]
    for c in checkpoints:
        discard = {
            JobStatus.FINISHED: c.discard_on_finished,
            JobStatus.CANCELED: c.discard_on_cancelled,
            JobStatus.FAILED: c.discard_on_failed,
        }[job_status]
        if discard:
            c.status = CheckpointStatus.DISCARDED
            c.ended_at = now
            c.failure_message = f"discarded on job {job_status.value.lower()} (retention policy)"
            disposals.append(_released(session, c))
    return disposals


def _released(session: Session, c: Checkpoint) -> Disposal:
    """The disposal of a completed checkpoint leaving the retained set: its directory, and the
    shared files that no checkpoint refers to once its references are dropped."""
    unused = shared_state.release(session, c.job_id, [c.checkpoint_id])
    return Disposal(
        c.checkpoint_id, c.storage_location, tuple(unused), CheckpointType(c.checkpoint_type)
    )


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
        .returning(Checkpoint.storage_location, Checkpoint.checkpoint_type)
    ).one_or_none()
    if result is None:
        return None
    return Disposal(checkpoint_id, result[0], (), CheckpointType(result[1]))
