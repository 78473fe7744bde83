"""Read models of the metastore: what ``ckpt … --json``, the checkpoint API and its Checkpoints
page show.

Plain dicts with JSON-friendly values. They are the source of the API's response shapes
(``checkpointing_airflow.api.schemas``): a key added here needs its field there, and
``tests/test_checkpoint_api.py`` fails until it has one.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.sql.selectable import ScalarSelect

from checkpointing.errors import UnknownCheckpointError
from checkpointing.ids import validate_checkpoint_id, validate_id
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.input_views import FILE_LIMIT, input_section
from checkpointing.metastore.models import (
    Checkpoint,
    CheckpointAck,
    CheckpointRequest,
    CheckpointTask,
    Job,
    RestoreEvent,
)
from checkpointing.status import CheckpointStatus, CheckpointType


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


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _duration_ms(start: datetime | None, end: datetime | None) -> int | None:
    return None if not start or not end else int((end - start).total_seconds() * 1000)


def list_jobs(metastore: Metastore) -> list[dict[str, Any]]:
    with metastore.reading() as s:
        counts: dict[str, dict[str, int]] = {}
        for job_id, status, n in s.execute(
            select(Checkpoint.job_id, Checkpoint.status, func.count()).group_by(
                Checkpoint.job_id, Checkpoint.status
            )
        ):
            counts.setdefault(job_id, {})[status] = n
        return [
            {
                "job_id": j.job_id,
                "status": j.status,
                "storage_url": j.storage_url,
                "checkpoints": counts.get(j.job_id, {}),
                "last_completed_id": j.last_completed_id,
                "last_completion_at": _iso(j.last_completion_at),
                "consecutive_failures": j.consecutive_failures,
                "periodic_scheduling": j.periodic_scheduling,
                "failure_cause": j.failure_cause,
            }
            for j in s.scalars(select(Job).order_by(Job.job_id))
        ]


def checkpoint_summary(c: Checkpoint, acked: int) -> dict[str, Any]:
    return {
        "checkpoint_id": c.checkpoint_id,
        "type": c.checkpoint_type,
        "status": c.status,
        "trigger_at": _iso(c.trigger_at),
        "completed_at": _iso(c.completed_at),
        "ended_at": _iso(c.ended_at),
        "deadline_at": _iso(c.deadline_at),
        "duration_ms": _duration_ms(c.trigger_at, c.completed_at or c.ended_at),
        "acked_tasks": acked,
        "num_tasks": c.num_tasks,
        "state_size": c.state_size,
        #: bytes this checkpoint wrote itself (an incremental one reuses the rest)
        "checkpointed_size": c.checkpointed_size,
        "failure_reason": c.failure_reason,
        "failure_message": c.failure_message,
        "storage_location": c.storage_location,
        "metadata_path": c.metadata_path,
        "periodic": c.periodic,
        "forced": c.forced,
    }


def _checkpoint_filter(
    job_id: str, status: str | None, checkpoint_type: str | None
) -> list[ColumnElement[bool]]:
    """The WHERE clauses of a checkpoint listing, shared by the page and its count."""
    clauses = [Checkpoint.job_id == job_id]
    if status:
        clauses.append(Checkpoint.status == status.upper())
    if checkpoint_type:
        clauses.append(Checkpoint.checkpoint_type == checkpoint_type.upper())
    return clauses


def list_checkpoints(
    metastore: Metastore,
    job_id: str,
    *,
    status: str | None = None,
    checkpoint_type: str | None = None,
    limit: int | None = None,
    offset: int = 0,
) -> list[dict[str, Any]]:
    """Newest first."""
    with metastore.reading() as s:  # the check and the read see one snapshot
        jobs.job_row(s, validate_id(job_id, "job id"))
        query = select(Checkpoint, acked_count()).where(
            *_checkpoint_filter(job_id, status, checkpoint_type)
        )
        query = query.order_by(Checkpoint.checkpoint_id.desc()).offset(offset)
        if limit:
            query = query.limit(limit)
        return [checkpoint_summary(c, n) for c, n in s.execute(query)]


def count_checkpoints(
    metastore: Metastore,
    job_id: str,
    *,
    status: str | None = None,
    checkpoint_type: str | None = None,
) -> int:
    """How many checkpoints :func:`list_checkpoints` would list without a limit (for paging)."""
    with metastore.reading() as s:  # the check and the read see one snapshot
        jobs.job_row(s, validate_id(job_id, "job id"))
        query = select(func.count()).select_from(Checkpoint)
        return int(s.scalar(query.where(*_checkpoint_filter(job_id, status, checkpoint_type))) or 0)


def checkpoint_detail(metastore: Metastore, job_id: str, checkpoint_id: int) -> dict[str, Any]:
    """One checkpoint with its properties, per operator subtask its ack, and the ``input`` its
    runs consumed (:func:`consumed_input`; None when the source did not acknowledge it)."""
    checkpoint_id = validate_checkpoint_id(checkpoint_id)
    with metastore.reading() as s:  # the check and the read see one snapshot
        jobs.job_row(s, validate_id(job_id, "job id"))
        c = s.get(Checkpoint, (job_id, checkpoint_id))
        if c is None:
            raise UnknownCheckpointError(f"job {job_id} has no checkpoint {checkpoint_id}")
        rows = s.execute(
            select(CheckpointTask, CheckpointAck)
            .outerjoin(
                CheckpointAck,
                (CheckpointAck.job_id == CheckpointTask.job_id)
                & (CheckpointAck.checkpoint_id == CheckpointTask.checkpoint_id)
                & (CheckpointAck.attempt_id == CheckpointTask.attempt_id),
            )
            .where(CheckpointTask.job_id == job_id, CheckpointTask.checkpoint_id == checkpoint_id)
            .order_by(CheckpointTask.operator_id, CheckpointTask.subtask_index)
        ).all()
        tasks = [
            {
                "operator_id": t.operator_id,
                "subtask_index": t.subtask_index,
                "attempt_id": t.attempt_id,
                "parallelism": t.parallelism,
                "max_parallelism": t.max_parallelism,
                "acked": a is not None,
                "state_handle": a.state_handle if a else None,
                "state_size": a.state_size if a else None,
                "checksum": a.checksum if a else None,
                "sync_ms": a.sync_ms if a else None,
                "async_ms": a.async_ms if a else None,
                "acked_at": _iso(a.acked_at) if a else None,
            }
            for t, a in rows
        ]
        request = s.get(CheckpointRequest, c.request_id) if c.request_id else None
        detail = checkpoint_summary(c, sum(1 for t in tasks if t["acked"]))
        detail.update(
            job_id=job_id,
            properties={
                "forced": c.forced,
                "discard_on_subsumed": c.discard_on_subsumed,
                "discard_on_finished": c.discard_on_finished,
                "discard_on_cancelled": c.discard_on_cancelled,
                "discard_on_failed": c.discard_on_failed,
                "discard_on_suspended": c.discard_on_suspended,
            },
            metadata_checksum=c.metadata_checksum,
            notified_at=_iso(c.notified_at),
            notify_error=c.notify_error,
            request=None
            if request is None
            else {"request_id": request.request_id, "requested_by": request.requested_by},
            operators=operator_summaries(tasks),
            tasks=tasks,
            input=input_section(s, job_id, checkpoint_id),
        )
        return detail


def operator_summaries(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per operator of a checkpoint, as Flink's checkpoint details show each vertex: its
    subtasks, those acknowledged, their state's bytes and the latest ack. A step's operator
    (``step-<name>``, docs/steps.md) is the step: its bytes are the step output's."""
    out: dict[str, dict[str, Any]] = {}
    for t in tasks:
        o = out.setdefault(
            t["operator_id"],
            {
                "operator_id": t["operator_id"],
                "subtasks": 0,
                "acked": 0,
                "state_size": 0,
                "latest_ack": None,
            },
        )
        o["subtasks"] += 1
        if t["acked"]:
            o["acked"] += 1
            o["state_size"] += t["state_size"] or 0
            if t["acked_at"] and (o["latest_ack"] is None or t["acked_at"] > o["latest_ack"]):
                o["latest_ack"] = t["acked_at"]
    return list(out.values())


def consumed_input(
    metastore: Metastore, job_id: str, checkpoint_id: int, *, file_limit: int = FILE_LIMIT
) -> dict[str, Any] | None:
    """The input a checkpoint's runs consumed, from its source's acknowledgements (see
    :mod:`checkpointing.metastore.input_views`): per run (attempt) the epochs, files and bytes it
    read, the totals, and the files (at most ``file_limit``). None when the source did not
    acknowledge it."""
    checkpoint_id = validate_checkpoint_id(checkpoint_id)
    with metastore.reading() as s:  # the check and the read see one snapshot
        jobs.job_row(s, validate_id(job_id, "job id"))
        if s.get(Checkpoint, (job_id, checkpoint_id)) is None:
            raise UnknownCheckpointError(f"job {job_id} has no checkpoint {checkpoint_id}")
        return input_section(s, job_id, checkpoint_id, file_limit)


def list_restores(
    metastore: Metastore, job_id: str, *, limit: int | None = None, offset: int = 0
) -> list[dict[str, Any]]:
    """Restore decisions, newest first: which checkpoint each attempt restored (or planned to),
    at which parallelism, and the checkpoints it skipped as unusable (``fallbacks``)."""
    with metastore.reading() as s:  # the check and the read see one snapshot
        jobs.job_row(s, validate_id(job_id, "job id"))
        query = (
            select(RestoreEvent)
            .where(RestoreEvent.job_id == job_id)
            .order_by(RestoreEvent.restore_id.desc())
            .offset(offset)
        )
        if limit:
            query = query.limit(limit)
        return [
            {
                "restore_id": r.restore_id,
                "attempt": r.attempt,
                "checkpoint_id": r.checkpoint_id,
                "checkpoint_type": r.checkpoint_type,
                "external_path": r.external_path,
                "parallelism": r.parallelism,
                "status": r.status,
                "fallbacks": (r.fallbacks or {}).get("skipped", []),
                "assignment": r.assignment,
                "message": r.message,
                "created_at": _iso(r.created_at),
            }
            for r in s.scalars(query)
        ]


def count_restores(metastore: Metastore, job_id: str) -> int:
    """How many restores :func:`list_restores` would list without a limit (for paging)."""
    with metastore.reading() as s:  # the check and the read see one snapshot
        jobs.job_row(s, validate_id(job_id, "job id"))
        query = select(func.count()).select_from(RestoreEvent)
        return int(s.scalar(query.where(RestoreEvent.job_id == job_id)) or 0)


def list_requests(
    metastore: Metastore, job_id: str, *, limit: int | None = None
) -> list[dict[str, Any]]:
    """Checkpoint and savepoint requests, newest first (periodic triggers are not requests)."""
    with metastore.reading() as s:  # the check and the read see one snapshot
        jobs.job_row(s, validate_id(job_id, "job id"))
        query = (
            select(CheckpointRequest)
            .where(CheckpointRequest.job_id == job_id, CheckpointRequest.periodic.is_(False))
            .order_by(CheckpointRequest.request_id.desc())
        )
        if limit:
            query = query.limit(limit)
        return [
            {
                "request_id": r.request_id,
                "type": r.checkpoint_type,
                "status": r.status,
                "forced": r.forced,
                "checkpoint_id": r.checkpoint_id,
                "requested_by": r.requested_by,
                "requested_at": _iso(r.requested_at),
                "finished_at": _iso(r.finished_at),
                "message": r.message,
            }
            for r in s.scalars(query)
        ]


def _spread(values: list[int]) -> dict[str, float | int] | None:
    """min, avg and max of some numbers (None when there are none)."""
    if not values:
        return None
    return {"min": min(values), "avg": round(sum(values) / len(values), 1), "max": max(values)}


def checkpoint_stats(metastore: Metastore, job_id: str) -> dict[str, Any]:
    """A pipeline's checkpoints at a glance (Flink's checkpoint summary): counts by status,
    min/avg/max end-to-end duration and state size of the completed ones (subsumed included),
    and the latest completed, failed (aborted) and savepoint checkpoints and latest restore."""
    with metastore.reading() as s:  # the check and the read see one snapshot
        jobs.job_row(s, validate_id(job_id, "job id"))
        own = Checkpoint.job_id == job_id
        counts = {
            status: int(n)
            for status, n in s.execute(
                select(Checkpoint.status, func.count()).where(own).group_by(Checkpoint.status)
            )
        }
        done = s.execute(
            select(Checkpoint.trigger_at, Checkpoint.completed_at, Checkpoint.state_size).where(
                own, Checkpoint.completed_at.is_not(None)
            )
        ).all()
        durations = [d for t, c, _ in done if (d := _duration_ms(t, c)) is not None]
        sizes = [size for _, _, size in done if size is not None]

        def latest(*clauses: ColumnElement[bool]) -> dict[str, Any] | None:
            row = s.execute(
                select(Checkpoint, acked_count())
                .where(own, *clauses)
                .order_by(Checkpoint.checkpoint_id.desc())
                .limit(1)
            ).first()
            return checkpoint_summary(row[0], row[1]) if row else None

        summary = {
            "job_id": job_id,
            "counts": counts,
            "completed": len(done),
            "duration_ms": _spread(durations),
            "state_size": _spread(sizes),
            "latest_completed": latest(Checkpoint.completed_at.is_not(None)),
            "latest_failed": latest(Checkpoint.status == CheckpointStatus.ABORTED.value),
            "latest_savepoint": latest(
                Checkpoint.checkpoint_type != CheckpointType.CHECKPOINT.value,
                Checkpoint.completed_at.is_not(None),
            ),
        }
    restores = list_restores(metastore, job_id, limit=1)
    summary["latest_restore"] = restores[0] if restores else None
    return summary
