"""What one attempt of a job achieved, read from the metastore alone.

The Airflow operator reports a try's outcome (its XCom, its last log line) from here rather than
from a file the driver writes: the driver may run on another machine (cluster deploy mode on YARN
or Kubernetes), but it records everything in the metastore as it goes: the restore it made, the
checkpoints it completed (under its coordinator id), the job's status, and in each checkpoint's
acknowledgements the operators' list state, which says how far the input was read.

Epochs are counted, never numbered, in outcomes: ``epochs_done`` is how many epochs of the input
the checkpoint covers (the next run resumes with the one after), ``epochs_run`` how many this
attempt ran and checkpointed. Spark's and the runtime's own lines name epochs by their 0-based
index ("after epoch 1" is the second epoch); a count never needs that caveat.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import select

from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import (
    Checkpoint,
    CheckpointAck,
    CheckpointTask,
    Job,
    RestoreEvent,
)
from checkpointing.pipeline.operator_ids import SINK, SOURCE
from checkpointing.status import CheckpointType, JobStatus, RestoreStatus


@dataclass(frozen=True)
class CheckpointPoint:
    """A completed checkpoint and how many epochs it covers (None when its acknowledgements do
    not say, e.g. a checkpoint taken by another runtime)."""

    checkpoint_id: int
    epochs_done: int | None
    location: str

    def describe(self) -> str:
        epochs = "" if self.epochs_done is None else f", {self.epochs_done} epochs done"
        return f"checkpoint {self.checkpoint_id} ({self.location}{epochs})"


@dataclass(frozen=True)
class AttemptOutcome:
    """One attempt's outcome: the Airflow operator's XCom (:meth:`to_dict`)."""

    job_id: str
    attempt: str
    status: str | None
    restored_from: int | None = None
    restored_path: str | None = None
    checkpoints: list[int] = field(default_factory=list)
    epochs_run: int | None = None
    epochs_done: int | None = None
    savepoint_path: str | None = None
    #: the job's latest completed checkpoint, whichever attempt took it: what a retry restores
    latest: CheckpointPoint | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["latest"] = None if self.latest is None else asdict(self.latest)
        return out


def attempt_outcome(metastore: Metastore, job_id: str, attempt: str) -> AttemptOutcome:
    """The outcome of ``attempt`` (the coordinator id it ran under, as the Airflow operator
    gives it) of job ``job_id``, from the metastore alone."""
    with metastore.transaction() as s:
        job = s.get(Job, job_id)
        if job is None:
            return AttemptOutcome(job_id, attempt, None)
        restore = s.scalars(
            select(RestoreEvent)
            .where(
                RestoreEvent.job_id == job_id,
                RestoreEvent.attempt == attempt,
                RestoreEvent.status.in_((RestoreStatus.RESTORED, RestoreStatus.EMPTY)),
            )
            .order_by(RestoreEvent.restore_id.desc())
            .limit(1)
        ).first()
        completed = list(
            s.scalars(
                select(Checkpoint)
                .where(Checkpoint.job_id == job_id, Checkpoint.completed_at.is_not(None))
                .order_by(Checkpoint.checkpoint_id)
            )
        )
        ours = [c for c in completed if c.coordinator_id == attempt]
        latest = completed[-1] if completed else None
        base = _restored_epochs(s, job_id, restore)
        last_ours = epochs_done(s, job_id, ours[-1].checkpoint_id) if ours else None
        stop = next(
            (c for c in reversed(ours) if c.checkpoint_type == CheckpointType.SAVEPOINT_THEN_STOP),
            None,
        )
        return AttemptOutcome(
            job_id=job_id,
            attempt=attempt,
            status=job.status,
            restored_from=None if restore is None else restore.checkpoint_id,
            restored_path=None if restore is None else restore.external_path,
            checkpoints=[c.checkpoint_id for c in ours],
            epochs_run=(
                0 if not ours else None if last_ours is None or base is None else last_ours - base
            ),
            epochs_done=last_ours if ours else base if restore is not None else None,
            savepoint_path=(
                stop.storage_location
                if stop is not None and job.status == JobStatus.FINISHED
                else None
            ),
            latest=None if latest is None else _point(s, latest),
        )


def latest_completed(metastore: Metastore, job_id: str) -> CheckpointPoint | None:
    """The job's latest completed checkpoint and the epochs it covers (what a retry restores,
    unless it is corrupt and an older one is used)."""
    with metastore.transaction() as s:
        row = s.scalars(
            select(Checkpoint)
            .where(Checkpoint.job_id == job_id, Checkpoint.completed_at.is_not(None))
            .order_by(Checkpoint.checkpoint_id.desc())
            .limit(1)
        ).first()
        return None if row is None else _point(s, row)


def acked_state_meta(
    s: Any, job_id: str, checkpoint_id: int, operators: tuple[str, ...]
) -> list[tuple[str, dict[str, Any] | None]]:
    """``(operator, state_meta)`` of every acknowledged task of ``operators`` in a checkpoint,
    by operator and subtask (list state is in ``state_meta["list_state"]``)."""
    rows = s.execute(
        select(CheckpointTask.operator_id, CheckpointAck.state_meta)
        .join(
            CheckpointAck,
            (CheckpointAck.job_id == CheckpointTask.job_id)
            & (CheckpointAck.checkpoint_id == CheckpointTask.checkpoint_id)
            & (CheckpointAck.attempt_id == CheckpointTask.attempt_id),
        )
        .where(
            CheckpointTask.job_id == job_id,
            CheckpointTask.checkpoint_id == checkpoint_id,
            CheckpointTask.operator_id.in_(operators),
        )
        .order_by(CheckpointTask.operator_id, CheckpointTask.subtask_index)
    ).all()
    return [(operator_id, meta) for operator_id, meta in rows]


def epochs_done(s: Any, job_id: str, checkpoint_id: int) -> int | None:
    """How many epochs checkpoint ``checkpoint_id`` covers, from its acknowledgements: the
    source's list state holds the splits still to read (each with its epoch), the sink's the
    epochs staged but not yet committed (the last one is the checkpoint's own)."""
    rows = acked_state_meta(s, job_id, checkpoint_id, (SOURCE, SINK))
    epochs: dict[str, list[int]] = {SOURCE: [], SINK: []}
    processed: list[int] = []
    seen = set()
    for operator_id, meta in rows:
        seen.add(operator_id)
        for item in (meta or {}).get("list_state") or []:
            compacted = item.get("consumed") if isinstance(item, dict) else None
            if operator_id == SOURCE and isinstance(compacted, dict):  # earlier runs' files
                if isinstance(compacted.get("epochs"), int) and compacted["epochs"] > 0:
                    processed.append(compacted["epochs"] - 1)
            elif isinstance(item, dict) and isinstance(item.get("epoch"), int):
                if operator_id == SOURCE and item.get("processed") is True:
                    processed.append(item["epoch"])
                else:
                    epochs[operator_id].append(item["epoch"])
    if SOURCE not in seen:
        return None
    if epochs[SOURCE]:
        return min(epochs[SOURCE])  # the first epoch still to read = the epochs done
    if processed:
        return max(processed) + 1
    if epochs[SINK]:
        return max(epochs[SINK]) + 1
    return None


def _point(s: Any, row: Checkpoint) -> CheckpointPoint:
    return CheckpointPoint(
        row.checkpoint_id, epochs_done(s, row.job_id, row.checkpoint_id), row.storage_location
    )


def _restored_epochs(s: Any, job_id: str, restore: RestoreEvent | None) -> int | None:
    """Epochs covered by what the attempt restored: 0 for an empty start, else its checkpoint's
    (an external savepoint is looked up by its location, in any job of this metastore)."""
    if restore is None or (restore.checkpoint_id is None and not restore.external_path):
        return 0
    if not restore.external_path:
        return epochs_done(s, job_id, int(restore.checkpoint_id))  # type: ignore[arg-type]
    path = restore.external_path.rstrip("/")
    row = s.scalars(
        select(Checkpoint).where(
            Checkpoint.storage_location.in_((path, path + "/")) | (Checkpoint.metadata_path == path)
        )
    ).first()
    return None if row is None else epochs_done(s, row.job_id, row.checkpoint_id)
