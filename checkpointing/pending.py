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

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, cast

from pydantic import ValidationError
from sqlalchemy import (
    String,
    Table,
    and_,
    bindparam,
    column,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session
from sqlalchemy.sql.selectable import ScalarSelect

from checkpointing.failure import CheckpointFailureReason
from checkpointing.ids import validate_id
from checkpointing.metadata import (
    CheckpointMetadata,
    OperatorState,
    StateDescriptor,
    SubtaskStateHandle,
)
from checkpointing.models import Checkpoint, CheckpointAck, CheckpointRequest, CheckpointTask
from checkpointing.properties import (
    CheckpointProperties,
    CheckpointStatus,
    CheckpointType,
    RequestStatus,
)
from checkpointing.storage import CheckpointStorage, StorageLocation

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
    #: JSON description of the state file (``{"key_groups": [start, end], "group_bytes":
    #: {group: bytes}}`` for keyed state, ``{"list_state": [items]}`` for operator list state)
    state_meta: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.state_meta is not None:  # refuse a bad descriptor now, not at completion
            StateDescriptor.model_validate(self.state_meta)


#: bounds of what an ack may carry: the columns' limits (BIGINT, INTEGER, VARCHAR) and sanity; a
#: state file of a petabyte is a bug, and the bound keeps a checkpoint's total within BIGINT
MAX_STATE_SIZE = 1 << 50
MAX_MS = (1 << 31) - 1
MAX_HANDLE_LENGTH = 2048
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")


def subtask_handle(
    subtask_index: int,
    attempt_id: str,
    handle: str | None,
    size: int,
    checksum: str | None,
    state_meta: Mapping[str, Any] | None,
) -> SubtaskStateHandle:
    """The ``_metadata`` entry of one acked subtask: built once when the ack arrives (to refuse
    what would not fit) and again at completion from the recorded ack, the same way."""
    if state_meta is not None and not isinstance(state_meta, Mapping):
        raise ValueError("state_meta must be a JSON object")
    # a descriptor only: no key of its own may stand in for the handle, size or attempt
    descriptor = StateDescriptor.model_validate(state_meta or {})
    return SubtaskStateHandle.model_validate(
        {
            **descriptor.model_dump(exclude_unset=True),
            "subtask_index": subtask_index,
            "attempt_id": attempt_id,
            "handle": handle,
            "size": size,
            "checksum": checksum,
        }
    )


def ack_problem(
    ack: TaskAck, location: StorageLocation, roots: Sequence[str], storage: CheckpointStorage
) -> str | None:
    """Why ``ack`` must not count, or None. The restore lookup's rule applied at ack time: a
    handle lies inside its checkpoint's directory (or the job's shared state) and is not the
    ``_metadata``; sizes, times and the checksum are sane; the state descriptor is well formed.
    Anything accepted here can be written into ``_metadata`` at completion."""
    handle, size = ack.state_handle, ack.state_size
    if type(size) is not int or not 0 <= size <= MAX_STATE_SIZE:
        return f"state_size {size!r} is not a size in bytes (0 to {MAX_STATE_SIZE})"
    for name in ("sync_ms", "async_ms"):
        value = getattr(ack, name)
        if type(value) is not int or not 0 <= value <= MAX_MS:
            return f"{name} {value!r} is not a duration in ms (0 to {MAX_MS})"
    if ack.checksum is not None and (
        not isinstance(ack.checksum, str) or not _CHECKSUM.fullmatch(ack.checksum)
    ):
        return f"checksum {str(ack.checksum)[:80]!r} is not 'sha256:<64 hex digits>'"
    if handle is not None:
        if not isinstance(handle, str) or len(handle) > MAX_HANDLE_LENGTH:
            return f"state handle {str(handle)[:100]!r} is not a URL of at most 2048 characters"
        if not any(storage.contains(handle, root) for root in roots):
            return f"state handle {handle!r} is outside the checkpoint's directory {location.url}"
        if handle in (location.url, location.metadata_url):
            return f"state handle {handle!r} is the checkpoint's own directory or _metadata"
    elif size or ack.checksum is not None:
        return "state_size or checksum without a state handle"
    try:
        subtask_handle(0, ack.attempt_id, handle, size, ack.checksum, ack.state_meta)
        if "\\u0000" in json.dumps(ack.state_meta, allow_nan=False):  # PostgreSQL's JSON refuses
            raise ValueError("a NUL character")
    except (ValidationError, ValueError, TypeError, RecursionError) as exc:
        first = exc.errors()[0] if isinstance(exc, ValidationError) else None
        detail = f"{'.'.join(map(str, first['loc']))}: {first['msg']}" if first else str(exc)
        return f"state_meta is malformed ({detail})"
    return None


def build_metadata(
    job_id: str,
    checkpoint_id: int,
    ctype: CheckpointType,
    trigger_at: datetime,
    now: datetime,
    tasks: Sequence[CheckpointTask],
    acks: Mapping[str, CheckpointAck],
) -> CheckpointMetadata:
    """Flink's ``PendingCheckpoint.finalizeCheckpoint``: the ``_metadata`` of a fully
    acknowledged checkpoint, per operator (parallelism, max parallelism) and subtask."""
    by_operator: dict[str, list[CheckpointTask]] = {}
    for t in tasks:
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
        job_id=job_id,
        checkpoint_id=checkpoint_id,
        checkpoint_type=ctype.value,
        trigger_at=trigger_at,
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
    for i in range(0, len(rows), _CHUNK):
        session.execute(insert(CheckpointTask), rows[i : i + _CHUNK])
    if session.get_bind().dialect.name == "postgresql":
        _ensure_planner_statistics(session)


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


def acknowledge(
    session: Session, job_id: str, checkpoint_id: int, acks: Sequence[TaskAck], now: datetime
) -> dict[str, AckResult]:
    """Record a batch of acks in one transaction and classify each (Flink's ``acknowledgeTask``).

    An attempt whose ack row this call inserted is SUCCESS, also when the batch repeats it (the
    first of the repeated acks is recorded); a planned attempt whose row was already there, or
    is inserted by a racing caller, is DUPLICATE. On PostgreSQL this is one statement.
    """
    unique: dict[str, TaskAck] = {}
    for ack in acks:
        unique.setdefault(ack.attempt_id, ack)
    attempts = list(unique)
    # a fixed insertion order: two batches sharing attempts cannot deadlock on each other's
    # not-yet-committed rows
    ordered = [unique[a] for a in sorted(attempts)]
    record = _record_pg if session.get_bind().dialect.name == "postgresql" else _record
    row, planned, inserted = record(session, job_id, checkpoint_id, ordered, now)

    if row is None:
        return dict.fromkeys(attempts, AckResult.UNKNOWN)
    status, deadline = row
    if status == CheckpointStatus.ABORTED or (
        status == CheckpointStatus.PENDING and deadline <= now
    ):
        return dict.fromkeys(attempts, AckResult.DISCARDED)
    if status != CheckpointStatus.PENDING:  # completed (or later): every planned task had acked
        return {a: AckResult.DUPLICATE if a in planned else AckResult.UNKNOWN for a in attempts}
    results: dict[str, AckResult] = {}
    for a in attempts:
        if a not in planned:
            results[a] = AckResult.UNKNOWN
        elif a in inserted:
            results[a] = AckResult.SUCCESS
        else:
            results[a] = AckResult.DUPLICATE
    return results


_checkpoints = cast(Table, Checkpoint.__table__)
_tasks = cast(Table, CheckpointTask.__table__)
_acks = cast(Table, CheckpointAck.__table__)

_ACK_COLUMNS = ("state_handle", "state_size", "checksum", "sync_ms", "async_ms", "state_meta")

#: (status, deadline) of the checkpoint, or None; planned attempts; attempts whose ack was inserted
_Recorded = tuple[tuple[str, datetime] | None, set[str], set[str]]


def _record(
    session: Session, job_id: str, checkpoint_id: int, acks: list[TaskAck], now: datetime
) -> _Recorded:
    """Read the checkpoint row ``FOR SHARE`` (SQLite: the transaction already holds the write
    lock), look up which attempts it plans, and — if it is PENDING and not overdue — insert
    their acks with ``ON CONFLICT DO NOTHING ... RETURNING``."""
    row = session.execute(
        select(_checkpoints.c.status, _checkpoints.c.deadline_at)
        .where(_checkpoints.c.job_id == job_id, _checkpoints.c.checkpoint_id == checkpoint_id)
        .with_for_update(read=True)
    ).one_or_none()
    if row is None:
        return None, set(), set()
    attempts = [a.attempt_id for a in acks]
    planned: set[str] = set()
    for i in range(0, len(attempts), _CHUNK):
        planned.update(
            session.scalars(
                select(_tasks.c.attempt_id).where(
                    _tasks.c.job_id == job_id,
                    _tasks.c.checkpoint_id == checkpoint_id,
                    _tasks.c.attempt_id.in_(attempts[i : i + _CHUNK]),
                )
            )
        )
    status, deadline = row
    inserted: set[str] = set()
    rows = [
        {
            "job_id": job_id,
            "checkpoint_id": checkpoint_id,
            "attempt_id": a.attempt_id,
            **{c: getattr(a, c) for c in _ACK_COLUMNS},
            "acked_at": now,
        }
        for a in acks
        if a.attempt_id in planned
    ]
    if status == CheckpointStatus.PENDING and deadline > now and rows:
        stmt = (
            sqlite.insert(_acks)
            .on_conflict_do_nothing(index_elements=["job_id", "checkpoint_id", "attempt_id"])
            .returning(_acks.c.attempt_id)
        )
        for i in range(0, len(rows), _CHUNK):
            inserted.update(session.scalars(stmt, rows[i : i + _CHUNK]))
    return (status, deadline), planned, inserted


#: PostgreSQL: ``_record`` in one statement, the batch passed as arrays (a handful of parameters
#: however large the batch). ``cp`` takes the share lock: the insert's one-time filter on it runs
#: before any row is inserted, and under READ COMMITTED a concurrent abort or completion is
#: waited for and its committed row version is the one seen. Rows are inserted in array order.
#: The result is tagged rows, no join (whose plan would hinge on statistics): ``c`` the
#: checkpoint's status and deadline (absent: no such checkpoint), ``p`` each planned attempt of
#: the batch, ``i`` each attempt whose ack was inserted.
_PG_RECORD = (
    text(
        """
        WITH cp AS MATERIALIZED (
            SELECT status, deadline_at
            FROM ckpt_checkpoints
            WHERE job_id = :job_id AND checkpoint_id = :checkpoint_id
            FOR SHARE
        ),
        planned AS MATERIALIZED (
            SELECT attempt_id
            FROM ckpt_checkpoint_tasks
            WHERE job_id = :job_id AND checkpoint_id = :checkpoint_id
              AND attempt_id = ANY(CAST(:attempt_id AS varchar[]))
        ),
        ins AS (
            INSERT INTO ckpt_checkpoint_acks
                (job_id, checkpoint_id, attempt_id, state_handle, state_size, checksum,
                 sync_ms, async_ms, state_meta, acked_at)
            SELECT :job_id, :checkpoint_id, a.attempt_id, a.state_handle, a.state_size,
                   a.checksum, a.sync_ms, a.async_ms, CAST(a.state_meta AS jsonb), :now
            FROM unnest(
                CAST(:attempt_id AS varchar[]), CAST(:state_handle AS varchar[]),
                CAST(:state_size AS bigint[]), CAST(:checksum AS varchar[]),
                CAST(:sync_ms AS integer[]), CAST(:async_ms AS integer[]),
                CAST(:state_meta AS text[])
            ) WITH ORDINALITY
                AS a(attempt_id, state_handle, state_size, checksum, sync_ms, async_ms,
                     state_meta, n)
            WHERE a.attempt_id IN (SELECT attempt_id FROM planned)
              AND EXISTS (
                  SELECT FROM cp WHERE cp.status = :pending AND cp.deadline_at > :now
              )
            ORDER BY a.n
            ON CONFLICT (job_id, checkpoint_id, attempt_id) DO NOTHING
            RETURNING attempt_id
        )
        SELECT 'c' AS tag, CAST(status AS varchar) AS value, deadline_at FROM cp
        UNION ALL
        SELECT 'p', CAST(attempt_id AS varchar), NULL FROM planned
        UNION ALL
        SELECT 'i', CAST(attempt_id AS varchar), NULL FROM ins
        """
    )
    .bindparams(
        bindparam("job_id", type_=_checkpoints.c.job_id.type),
        bindparam("checkpoint_id", type_=_checkpoints.c.checkpoint_id.type),
        bindparam("now", type_=_checkpoints.c.deadline_at.type),
        bindparam("pending", type_=_checkpoints.c.status.type),
    )
    .columns(
        column("tag", String),
        column("value", String),
        column("deadline_at", _checkpoints.c.deadline_at.type),
    )
)


def _record_pg(
    session: Session, job_id: str, checkpoint_id: int, acks: list[TaskAck], now: datetime
) -> _Recorded:
    params: dict[str, object] = {
        "job_id": job_id,
        "checkpoint_id": checkpoint_id,
        "now": now,
        "pending": CheckpointStatus.PENDING.value,
        "attempt_id": [a.attempt_id for a in acks],
        **{c: [getattr(a, c) for a in acks] for c in _ACK_COLUMNS},
        "state_meta": [None if a.state_meta is None else json.dumps(a.state_meta) for a in acks],
    }
    row: tuple[str, datetime] | None = None
    planned: set[str] = set()
    inserted: set[str] = set()
    for tag, value, deadline in session.execute(_PG_RECORD, params):
        if tag == "c":
            row = (value, deadline)
        elif tag == "p":
            planned.add(value)
        else:
            inserted.add(value)
    return row, planned, inserted


#: built once: this runs after every successful ack call
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


def acked_count() -> ScalarSelect[int]:
    """Correlated subquery: the number of acks of the enclosing query's checkpoint row."""
    return (
        select(func.count())
        .where(
            CheckpointAck.job_id == Checkpoint.job_id,
            CheckpointAck.checkpoint_id == Checkpoint.checkpoint_id,
        )
        .scalar_subquery()
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
