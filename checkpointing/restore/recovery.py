"""Failover reruns: the next attempt's restore, planned after a failed one.

Flink restarts a failed job from its latest completed checkpoint and reassigns the state to the
new tasks. Here Airflow retries the task: the failure callback (or, when Airflow skipped it, the
retry itself) aborts the failed attempt's pending checkpoints, finds the latest valid completed
checkpoint (falling back past a corrupt one), computes the state assignment for the retry's
parallelism and records it as a PLANNED restore. The retry then runs the job with exactly that
checkpoint and parallelism, so it redoes at most the epochs since that checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select

from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.pending import TaskSpec
from checkpointing.ids import validate_id
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Job, RestoreEvent
from checkpointing.pipeline.operator_ids import PIPELINE_OPERATORS
from checkpointing.restore import lookup as restore
from checkpointing.restore.assignment import plan_restore, snapshots_from_metadata
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import JobStatus, RestoreStatus, StatusWriter

log = logging.getLogger(__name__)


def pipeline_plan(
    attempt: str,
    parallelism: int,
    max_parallelism: int,
    operators: Sequence[str] = PIPELINE_OPERATORS,
) -> list[TaskSpec]:
    """The tasks of one execution attempt of a pipeline job, as the runtime acknowledges them:
    whoever triggers a checkpoint for that attempt (the driver or the Airflow operator) must
    expect exactly these. ``operators``: a Python API job's chain has more stages."""
    return [
        TaskSpec(op, i, f"{attempt}-{op}-{i}", parallelism, max_parallelism)
        for op in operators
        for i in range(parallelism)
    ]


@dataclass(frozen=True)
class RecoveryPlan:
    """What an attempt restores: ``restore`` is ``ckpt run --restore``'s value."""

    job_id: str
    attempt: str
    restore: str
    checkpoint_id: int | None
    parallelism: int
    restore_id: int | None = None
    skipped: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.checkpoint_id is None:
            return f"job {self.job_id}: attempt {self.attempt} starts empty (no valid checkpoint)"
        fallback = f", skipped corrupt {list(self.skipped)}" if self.skipped else ""
        return (
            f"job {self.job_id}: attempt {self.attempt} restores checkpoint "
            f"{self.checkpoint_id} with parallelism {self.parallelism}{fallback}"
        )


def plan_recovery(
    metastore: Metastore,
    storage: CheckpointStorage,
    job_id: str,
    *,
    attempt: str,
    parallelism: int,
    max_parallelism: int,
    operators: tuple[str, ...] = PIPELINE_OPERATORS,
    allow_non_restored_state: bool = False,
    completed_after: datetime | None = None,
    otherwise: str = "latest",
) -> RecoveryPlan:
    """Find the latest valid checkpoint, assign its state to ``parallelism`` subtasks and record
    the plan for ``attempt``. Raises :class:`~checkpointing.restore.assignment.StateAssignmentError`
    when the state cannot be assigned (e.g. a changed ``max_parallelism``).

    :param completed_after: consider only checkpoints of this run (completed since it started).
    :param otherwise: the restore when there is none, e.g. the savepoint the run started from.
    """
    validate_id(attempt, "attempt")
    decision = restore.find_latest_valid(
        metastore, storage, job_id, completed_after=completed_after
    )
    skipped = tuple(s.checkpoint_id for s in decision.skipped)
    if decision.metadata is None or decision.checkpoint_id is None:
        if otherwise != "latest":  # the run's own starting point, re-validated by the runtime
            return RecoveryPlan(job_id, attempt, otherwise, None, parallelism, None, skipped)
        restore_id = restore.record_restore(
            metastore, decision, attempt=attempt, parallelism=parallelism
        )
        return RecoveryPlan(job_id, attempt, "latest", None, parallelism, restore_id, skipped)
    assignment = plan_restore(
        snapshots_from_metadata(decision.metadata),
        list(operators),
        new_parallelism=parallelism,
        max_parallelism=max_parallelism,
        allow_non_restored_state=allow_non_restored_state,
    )
    restore_id = restore.record_restore(
        metastore,
        decision,
        attempt=attempt,
        parallelism=parallelism,
        assignment=assignment.to_dict(),
    )
    plan = RecoveryPlan(
        job_id,
        attempt,
        str(decision.checkpoint_id),
        decision.checkpoint_id,
        parallelism,
        restore_id,
        skipped,
    )
    log.info("%s", plan.describe())
    return plan


def planned_recovery(metastore: Metastore, job_id: str, attempt: str) -> RecoveryPlan | None:
    """The plan a failure callback recorded for ``attempt``, if it ran."""
    with metastore.transaction() as s:
        row = s.scalars(
            select(RestoreEvent)
            .where(
                RestoreEvent.job_id == validate_id(job_id, "job id"),
                RestoreEvent.attempt == validate_id(attempt, "attempt"),
                RestoreEvent.status.in_([RestoreStatus.PLANNED, RestoreStatus.EMPTY]),
            )
            .order_by(RestoreEvent.restore_id.desc())
            .limit(1)
        ).first()
        if row is None:
            return None
        skipped = tuple(
            int(s["checkpoint_id"]) for s in ((row.fallbacks or {}).get("skipped") or [])
        )
        return RecoveryPlan(
            job_id,
            attempt,
            str(row.checkpoint_id) if row.checkpoint_id is not None else "latest",
            row.checkpoint_id,
            row.parallelism or 1,
            row.restore_id,
            skipped,
        )


def fail_attempt(
    metastore: Metastore,
    job_id: str,
    reason: str,
    *,
    final: bool,
    coordinator_id: str | None = None,
    watcher: str | None = None,
    storage: CheckpointStorage | None = None,
) -> dict[str, Any]:
    """A task attempt failed: abort its pending checkpoints as job failover (not counted as
    checkpoint failures). On the final failure the job is FAILED and the retention policy is
    applied; the returned dict names the checkpoint to resume from.

    ``coordinator_id``: the failed attempt's coordinator, acted for. Once another coordinator
    leads the job (a later try took over), nothing is changed, checked in each transaction that
    would change something; ``superseded`` then names that coordinator. ``watcher``: the failed
    try, when it acted under its detached driver's coordinator id: nothing is changed either
    once another try re-attached to that driver. The job's status is recorded as a failover's
    (:class:`~checkpointing.status.StatusWriter`), which never ends a driver's watcher.
    ``storage``: the job's checkpoint storage as the caller's configuration says (the task's);
    else the job row's, which any driver can write, so callers that can should pass it."""
    if not jobs.job_exists(metastore, job_id):
        return {"job_id": job_id, "aborted": [], "resume_from": None, "superseded": None}
    coordinator = CheckpointCoordinator(
        job_id,
        metastore,
        storage,
        coordinator_id=coordinator_id,
        writer=StatusWriter.FAILOVER,
        watcher=watcher,
    )
    aborted = coordinator.failover(reason)
    latest = restore.find_latest_valid(metastore, coordinator.storage, job_id, deep=False)
    discarded: list[int] = []
    if final:
        discarded = coordinator.shutdown(JobStatus.FAILED)  # the retention policy applies
    else:
        coordinator.job_status_changed(JobStatus.FAILED)
    with metastore.reading() as s:
        successor = coordinator.fencing.successor(s.get(Job, job_id))
    kept = latest.checkpoint_id is not None and latest.checkpoint_id not in discarded
    return {
        "job_id": job_id,
        "aborted": aborted,
        "discarded": discarded,
        "resume_from": latest.checkpoint_id if kept else None,
        "resume_path": latest.metadata_path if kept else None,
        "superseded": successor if coordinator_id else None,
    }
