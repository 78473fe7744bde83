"""Pending checkpoints in the metastore (Flink's ``PendingCheckpoint``): the task plan, the
PENDING row, ``finalize`` (the ``_metadata`` of a fully acknowledged checkpoint), the completion
claim, declines and aborts. Acks are validated in ``ack_validation`` and recorded in
``acknowledge``.

Everything here runs inside the caller's transaction. The rules that make concurrent ackers safe:

* An ack batch reads the checkpoint row ``FOR SHARE`` (PostgreSQL; SQLite serialises writers), so
  an abort cannot interleave with it: an abort waits for in-flight acks and then sees them all.
* Acks are inserted with ``ON CONFLICT DO NOTHING ... RETURNING``: the rows that come back are the
  SUCCESS ones, the rest of the planned attempts are DUPLICATE, whatever races with them.
* Whoever commits the last ack sees zero remaining *after* its commit, and exactly one caller wins
  the compare-and-set ``completing_by: NULL -> token`` that starts completion.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import (
    Table,
    and_,
    bindparam,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.orm import Session

from checkpointing.coordination.failure import CheckpointFailureReason
from checkpointing.ids import validate_id
from checkpointing.metastore.models import (
    Checkpoint,
    CheckpointAck,
    CheckpointRequest,
    CheckpointTask,
)
from checkpointing.metastore.views import acked_count
from checkpointing.state.metadata import (
    CheckpointMetadata,
    OperatorState,
    StateDescriptor,
    subtask_handle,
)
from checkpointing.status import (
    CheckpointProperties,
    CheckpointStatus,
    CheckpointType,
    RequestStatus,
)

#: the one batch size of the protocol's statements (here, ``acknowledge``, ``shared_state``):
#: values per ``IN (…)`` list, rows per executemany batch. An IN list binds a batch plus a few
#: parameters of its own, below 999, SQLite's limit of bound parameters per statement before
#: 3.32 (PostgreSQL's is 65,535); SQLAlchemy splits multi-row inserts further by its own limits.
CHUNK = 900


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
    #: JSON description of the state file (``{"key_groups": [start, end], "group_bytes":
    #: {group: bytes}}`` for keyed state, ``{"list_state": [items]}`` for operator list state)
    state_meta: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.state_meta is not None:  # refuse a bad descriptor now, not at completion
            StateDescriptor.model_validate(self.state_meta)


@dataclass(frozen=True)
class PendingCheckpoint:
    """A triggered checkpoint waiting for the acks of its planned tasks (Flink's
    ``PendingCheckpoint``); its row in ``ckpt_checkpoints`` is PENDING."""

    job_id: str
    checkpoint_id: int
    checkpoint_type: CheckpointType
    trigger_at: datetime
    deadline_at: datetime
    location: str
    tasks: tuple[TaskSpec, ...]

    @classmethod
    def load(cls, session: Session, job_id: str, checkpoint_id: int) -> PendingCheckpoint:
        """The checkpoint as its row and its task plan record it."""
        row = session.get(Checkpoint, (job_id, checkpoint_id))
        assert row is not None
        tasks = session.scalars(
            select(CheckpointTask).where(
                CheckpointTask.job_id == job_id, CheckpointTask.checkpoint_id == checkpoint_id
            )
        )
        return cls(
            job_id,
            checkpoint_id,
            CheckpointType(row.checkpoint_type),
            row.trigger_at,
            row.deadline_at,
            row.storage_location,
            tuple(
                TaskSpec(
                    t.operator_id, t.subtask_index, t.attempt_id, t.parallelism, t.max_parallelism
                )
                for t in tasks
            ),
        )

    def finalize(self, session: Session, now: datetime) -> CheckpointMetadata:
        """Flink's ``PendingCheckpoint.finalizeCheckpoint``: the ``_metadata`` of the fully
        acknowledged checkpoint, per operator (parallelism, max parallelism) and subtask, from
        the recorded acks."""
        acks = {
            a.attempt_id: a
            for a in session.scalars(
                select(CheckpointAck).where(
                    CheckpointAck.job_id == self.job_id,
                    CheckpointAck.checkpoint_id == self.checkpoint_id,
                )
            )
        }
        by_operator: dict[str, list[TaskSpec]] = {}
        for t in self.tasks:
            by_operator.setdefault(t.operator_id, []).append(t)
        operators = []
        for op_id in sorted(by_operator):
            subtasks = sorted(by_operator[op_id], key=lambda t: t.subtask_index)
            operators.append(
                OperatorState(
                    operator_id=op_id,
                    parallelism=subtasks[0].parallelism,
                    max_parallelism=subtasks[0].max_parallelism,
                    subtasks=[
                        subtask_handle(
                            t.subtask_index,
                            t.attempt_id,
                            acks[t.attempt_id].state_handle,
                            acks[t.attempt_id].state_size,
                            acks[t.attempt_id].checksum,
                            acks[t.attempt_id].state_meta,
                        )
                        for t in subtasks
                    ],
                )
            )
        return CheckpointMetadata(
            job_id=self.job_id,
            checkpoint_id=self.checkpoint_id,
            checkpoint_type=self.checkpoint_type.value,
            trigger_at=self.trigger_at,
            completed_at=now,
            operators=operators,
        )


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
    for i in range(0, len(rows), CHUNK):
        session.execute(insert(CheckpointTask), rows[i : i + CHUNK])
    if session.get_bind().dialect.name == "postgresql":
        _ensure_planner_statistics(session)


_checkpoints = cast(Table, Checkpoint.__table__)
_tasks = cast(Table, CheckpointTask.__table__)
_acks = cast(Table, CheckpointAck.__table__)


def _ensure_planner_statistics(session: Session) -> None:
    """Analyze the checkpoint, task and ack tables if PostgreSQL never has (autovacuum off, or
    not run yet on a new metastore).

    Without statistics the planner rates a key that only shares the (job, checkpoint) prefix as
    good as the primary key: the foreign-key check of every ack insert may then scan every task
    of its checkpoint through the (job, checkpoint, operator, subtask) key (a 1,024-task
    checkpoint acks ~10x slower, and worse as acks accumulate), and the checkpoint row lookup
    every job's checkpoints through (job, status). One ANALYZE, in the trigger transaction so
    that it sees the plan just inserted, fixes that for good.
    """
    tables = [t.name for t in (_checkpoints, _tasks, _acks)]
    never_analyzed = session.scalar(
        text(
            "SELECT coalesce(bool_or(reltuples < 0), false) FROM pg_class "
            "WHERE oid = ANY(CAST(ARRAY[:t0, :t1, :t2] AS regclass[]))"
        ),
        {"t0": tables[0], "t1": tables[1], "t2": tables[2]},
    )
    if never_analyzed:
        session.execute(text(f"ANALYZE {', '.join(tables)}"))


_REMAINING = select(
    select(_checkpoints.c.num_tasks)
    .where(
        _checkpoints.c.job_id == bindparam("job_id"),
        _checkpoints.c.checkpoint_id == bindparam("checkpoint_id"),
    )
    .scalar_subquery(),
    select(func.count())
    .select_from(_acks)
    .where(
        _acks.c.job_id == bindparam("job_id"),
        _acks.c.checkpoint_id == bindparam("checkpoint_id"),
    )
    .scalar_subquery(),
)


def remaining_tasks(session: Session, job_id: str, checkpoint_id: int) -> int:
    """Tasks not yet acknowledged (read after the ack's commit, see the module docstring).
    One statement: the plan size and the ack count come from the same snapshot."""
    num_tasks, acked = session.execute(
        _REMAINING, {"job_id": job_id, "checkpoint_id": checkpoint_id}
    ).one()
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


def awaiting_attempt(
    session: Session, job_id: str, attempt_id: str
) -> list[tuple[int, str, CheckpointType]]:
    """The barrier a task sees: the PENDING checkpoints whose task plan names ``attempt_id``,
    oldest first, as (id, storage location, type). The Spark driver asks at every epoch
    boundary which checkpoints its subtasks still have to snapshot."""
    rows = session.execute(
        select(Checkpoint.checkpoint_id, Checkpoint.storage_location, Checkpoint.checkpoint_type)
        .join(
            CheckpointTask,
            (CheckpointTask.job_id == Checkpoint.job_id)
            & (CheckpointTask.checkpoint_id == Checkpoint.checkpoint_id),
        )
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.status == CheckpointStatus.PENDING,
            CheckpointTask.attempt_id == attempt_id,
        )
        .order_by(Checkpoint.checkpoint_id)
    ).all()
    return [(r[0], r[1], CheckpointType(r[2])) for r in rows]


def count_pending(session: Session, job_id: str) -> int:
    """The job's PENDING checkpoints (the ``max_concurrent`` pre-check)."""
    where = (Checkpoint.job_id == job_id, Checkpoint.status == CheckpointStatus.PENDING)
    return session.scalar(select(func.count()).where(*where)) or 0


def fully_acknowledged(session: Session, job_id: str) -> Sequence[int]:
    """PENDING checkpoints with every ack but no completion claim (the last acker died)."""
    return session.scalars(
        select(Checkpoint.checkpoint_id)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.status == CheckpointStatus.PENDING,
            Checkpoint.completing_by.is_(None),
            Checkpoint.num_tasks == acked_count(),
        )
        .order_by(Checkpoint.checkpoint_id)
    ).all()


def decline(
    session: Session,
    job_id: str,
    checkpoint_id: int,
    messages: Mapping[str, str],
    reason: CheckpointFailureReason,
    now: datetime,
    *,
    may_abort: bool = True,
) -> tuple[dict[str, AckResult], list[AbortedCheckpoint]]:
    """Declines (attempt → why): the first planned attempt aborts the PENDING checkpoint with
    ``reason`` (unless ``may_abort`` is False: the caller's fence says no). Per attempt:
    DISCARDED when planned (nothing of it counts), UNKNOWN when not in the plan (ignored, as
    Flink ignores such declines)."""
    planned = {
        t.attempt_id: t
        for t in session.scalars(
            select(CheckpointTask).where(
                CheckpointTask.job_id == job_id,
                CheckpointTask.checkpoint_id == checkpoint_id,
                CheckpointTask.attempt_id.in_(list(messages)),
            )
        )
    }
    first = next((a for a in messages if a in planned), None)
    aborted: list[AbortedCheckpoint] = []
    if first is not None and may_abort:
        t = planned[first]
        aborted = abort(
            session,
            job_id,
            reason,
            f"declined by {t.operator_id}[{t.subtask_index}] ({first}): {messages[first]}",
            now,
            checkpoint_ids=[checkpoint_id],
        )
    results = {a: AckResult.DISCARDED if a in planned else AckResult.UNKNOWN for a in messages}
    return results, aborted


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
    not_by: str | None = None,
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
    if not_by is not None:  # only other coordinators' checkpoints
        conds.append((Checkpoint.coordinator_id != not_by) | Checkpoint.coordinator_id.is_(None))
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
