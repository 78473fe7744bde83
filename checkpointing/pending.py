"""Pending checkpoints in the metastore: the task plan, acknowledgements and aborts (Flink's
``PendingCheckpoint``).

Everything here runs inside the caller's transaction. The rules that make concurrent ackers safe:

* An ack batch reads the checkpoint row ``FOR SHARE`` (PostgreSQL; SQLite serialises writers), so
  an abort cannot interleave with it: an abort waits for in-flight acks and then sees them all.
* Acks are inserted with ``ON CONFLICT DO NOTHING ... RETURNING``: the rows that come back are the
  SUCCESS ones, the rest of the planned attempts are DUPLICATE, whatever races with them.
* Whoever commits the last ack sees zero remaining *after* its commit, and exactly one caller wins
  the compare-and-set ``completing_by: NULL -> token`` that starts completion.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from sqlalchemy import and_, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from checkpointing.failure import CheckpointFailureReason
from checkpointing.ids import validate_id
from checkpointing.models import Checkpoint, CheckpointAck, CheckpointRequest, CheckpointTask
from checkpointing.properties import (
    CheckpointProperties,
    CheckpointStatus,
    CheckpointType,
    RequestStatus,
)

_CHUNK = 900  # bound IN-lists and multi-row statements on every backend


@dataclass(frozen=True)
class TaskSpec:
    """A task a checkpoint waits for: one subtask of an operator, in one execution attempt."""

    operator_id: str
    subtask_index: int
    attempt_id: str
    parallelism: int
    max_parallelism: int = 128

    def __post_init__(self) -> None:
        validate_id(self.operator_id, "operator id")
        validate_id(self.attempt_id, "attempt id")
        if not 0 <= self.subtask_index < self.parallelism:
            raise ValueError(
                f"subtask_index {self.subtask_index} out of range "
                f"for parallelism {self.parallelism}"
            )
        if self.parallelism > self.max_parallelism:
            raise ValueError(
                f"operator {self.operator_id}: parallelism {self.parallelism} exceeds "
                f"max_parallelism {self.max_parallelism}"
            )


@dataclass(frozen=True)
class TaskAck:
    """What a task reports when its snapshot is written (Flink's ``AcknowledgeCheckpoint``)."""

    attempt_id: str
    state_handle: str | None = None
    state_size: int = 0
    checksum: str | None = None
    sync_ms: int = 0
    async_ms: int = 0


class AckResult(StrEnum):
    SUCCESS = "SUCCESS"
    DUPLICATE = "DUPLICATE"
    #: the attempt is not in the checkpoint's plan (e.g. an attempt from before a failover)
    UNKNOWN = "UNKNOWN"
    #: the checkpoint was already aborted or has expired
    DISCARDED = "DISCARDED"


def insert_pending(
    session: Session,
    *,
    job_id: str,
    checkpoint_id: int,
    props: CheckpointProperties,
    periodic: bool,
    trigger_at: datetime,
    deadline_at: datetime,
    location: str,
    tasks: Sequence[TaskSpec],
    coordinator_id: str,
    request_id: int | None,
) -> None:
    session.add(
        Checkpoint(
            job_id=job_id,
            checkpoint_id=checkpoint_id,
            checkpoint_type=props.checkpoint_type.value,
            status=CheckpointStatus.PENDING.value,
            periodic=periodic,
            forced=props.forced,
            discard_on_subsumed=props.discard_on_subsumed,
            discard_on_finished=props.discard_on_finished,
            discard_on_cancelled=props.discard_on_cancelled,
            discard_on_failed=props.discard_on_failed,
            discard_on_suspended=props.discard_on_suspended,
            trigger_at=trigger_at,
            deadline_at=deadline_at,
            num_tasks=len(tasks),
            storage_location=location,
            state_size=0,
            coordinator_id=coordinator_id,
            request_id=request_id,
        )
    )
    session.flush()
    rows = [
        {
            "job_id": job_id,
            "checkpoint_id": checkpoint_id,
            "attempt_id": t.attempt_id,
            "operator_id": t.operator_id,
            "subtask_index": t.subtask_index,
            "parallelism": t.parallelism,
            "max_parallelism": t.max_parallelism,
        }
        for t in tasks
    ]
    for i in range(0, len(rows), _CHUNK):
        session.execute(insert(CheckpointTask), rows[i : i + _CHUNK])


def acknowledge(
    session: Session, job_id: str, checkpoint_id: int, acks: Sequence[TaskAck], now: datetime
) -> dict[str, AckResult]:
    """Record a batch of acks in one transaction and classify each (Flink's ``acknowledgeTask``)."""
    results: dict[str, AckResult] = {}
    unique: dict[str, TaskAck] = {}
    for ack in acks:
        if ack.attempt_id in unique:
            results[ack.attempt_id] = AckResult.DUPLICATE
        unique[ack.attempt_id] = unique.get(ack.attempt_id, ack)
    attempts = list(unique)

    row = session.execute(
        select(Checkpoint.status, Checkpoint.deadline_at)
        .where(Checkpoint.job_id == job_id, Checkpoint.checkpoint_id == checkpoint_id)
        .with_for_update(read=True)
    ).one_or_none()
    if row is None:
        return {a: results.get(a, AckResult.UNKNOWN) for a in attempts}
    status, deadline = row
    planned = _existing(session, CheckpointTask, job_id, checkpoint_id, attempts)

    if status == CheckpointStatus.ABORTED or (
        status == CheckpointStatus.PENDING and deadline <= now
    ):
        return {a: AckResult.DISCARDED for a in attempts}
    if status != CheckpointStatus.PENDING:  # completed (or later): every planned task had acked
        return {a: AckResult.DUPLICATE if a in planned else AckResult.UNKNOWN for a in attempts}

    rows = [
        {
            "job_id": job_id,
            "checkpoint_id": checkpoint_id,
            "attempt_id": a.attempt_id,
            "state_handle": a.state_handle,
            "state_size": a.state_size,
            "checksum": a.checksum,
            "sync_ms": a.sync_ms,
            "async_ms": a.async_ms,
            "acked_at": now,
        }
        for a in unique.values()
        if a.attempt_id in planned
    ]
    inserted: set[str] = set()
    stmt_factory = (
        postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    )
    for i in range(0, len(rows), _CHUNK):
        stmt = (
            stmt_factory(CheckpointAck)
            .on_conflict_do_nothing(index_elements=["job_id", "checkpoint_id", "attempt_id"])
            .returning(CheckpointAck.attempt_id)
        )
        inserted.update(session.scalars(stmt, rows[i : i + _CHUNK]).all())
    for a in attempts:
        if a not in planned:
            results[a] = AckResult.UNKNOWN
        elif a in inserted and a not in results:
            results[a] = AckResult.SUCCESS
        else:
            results[a] = AckResult.DUPLICATE
    return results


def _existing(
    session: Session, model: type, job_id: str, checkpoint_id: int, attempts: list[str]
) -> set[str]:
    found: set[str] = set()
    for i in range(0, len(attempts), _CHUNK):
        found.update(
            session.scalars(
                select(model.attempt_id).where(  # type: ignore[attr-defined]
                    model.job_id == job_id,  # type: ignore[attr-defined]
                    model.checkpoint_id == checkpoint_id,  # type: ignore[attr-defined]
                    model.attempt_id.in_(attempts[i : i + _CHUNK]),  # type: ignore[attr-defined]
                )
            )
        )
    return found


def remaining_tasks(session: Session, job_id: str, checkpoint_id: int) -> int:
    """Tasks not yet acknowledged (read after the ack's commit, see the module docstring)."""
    num_tasks = session.scalar(
        select(Checkpoint.num_tasks).where(
            Checkpoint.job_id == job_id, Checkpoint.checkpoint_id == checkpoint_id
        )
    )
    acked = session.scalar(
        select(func.count()).where(
            CheckpointAck.job_id == job_id, CheckpointAck.checkpoint_id == checkpoint_id
        )
    )
    return int(num_tasks or 0) - int(acked or 0)


def claim_completion(session: Session, job_id: str, checkpoint_id: int, token: str) -> bool:
    """Compare-and-set: the one caller that gets True completes the checkpoint."""
    result = session.execute(
        update(Checkpoint)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.checkpoint_id == checkpoint_id,
            Checkpoint.status == CheckpointStatus.PENDING,
            Checkpoint.completing_by.is_(None),
        )
        .values(completing_by=token)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


@dataclass(frozen=True)
class AbortedCheckpoint:
    checkpoint_id: int
    checkpoint_type: CheckpointType
    storage_location: str
    request_id: int | None


def abort(
    session: Session,
    job_id: str,
    reason: CheckpointFailureReason,
    message: str,
    now: datetime,
    *,
    checkpoint_ids: Iterable[int] | None = None,
    below_id: int | None = None,
    overdue: bool = False,
    include_savepoints: bool = True,
) -> list[AbortedCheckpoint]:
    """Abort PENDING checkpoints matching the filters; return what was aborted (the caller
    disposes their locations after commit and fails their requests)."""
    conds = [Checkpoint.job_id == job_id, Checkpoint.status == CheckpointStatus.PENDING]
    if checkpoint_ids is not None:
        conds.append(Checkpoint.checkpoint_id.in_(list(checkpoint_ids)))
    if below_id is not None:
        conds.append(Checkpoint.checkpoint_id < below_id)
    if overdue:
        conds.append(Checkpoint.deadline_at <= now)
    if not include_savepoints:
        conds.append(Checkpoint.checkpoint_type == CheckpointType.CHECKPOINT)
    rows = session.execute(
        update(Checkpoint)
        .where(and_(*conds))
        .values(
            status=CheckpointStatus.ABORTED,
            failure_reason=reason.value,
            failure_message=message,
            ended_at=now,
        )
        .returning(
            Checkpoint.checkpoint_id,
            Checkpoint.checkpoint_type,
            Checkpoint.storage_location,
            Checkpoint.request_id,
        )
    ).all()
    aborted = [AbortedCheckpoint(r[0], CheckpointType(r[1]), r[2], r[3]) for r in rows]
    request_ids = [a.request_id for a in aborted if a.request_id is not None]
    if request_ids:
        session.execute(
            update(CheckpointRequest)
            .where(CheckpointRequest.request_id.in_(request_ids))
            .values(
                status=RequestStatus.FAILED, message=f"{reason.value}: {message}", finished_at=now
            )
        )
    return sorted(aborted, key=lambda a: a.checkpoint_id)
