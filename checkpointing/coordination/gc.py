"""Garbage collection of one job (``ckpt gc``): history rows, savepoints past their retention and
orphan files in the job's checkpoint storage.

What a restore needs is never touched: the COMPLETED checkpoints (the retained ones, the latest
among them) and savepoints, the shared files any checkpoint still registers
(:mod:`checkpointing.coordination.shared_state`), PENDING checkpoints and queued requests. What
goes:

* **history**: checkpoints that left the retained set (SUBSUMED, DISCARDED, ABORTED) with their
  task and ack rows, finished requests and restore decisions, ended before ``keep_history`` ago;
  a subsumed checkpoint whose files were kept (``discard_on_subsumed`` off) stays listed, and so
  does the job's latest restore decision and any request a remaining checkpoint names;
* **savepoints** beyond ``keep_savepoints`` (newest first) or completed before
  ``savepoint_max_age`` ago (options; by default the job's ``savepoint_retention``), through the
  user's discard path
  (:func:`checkpointing.coordination.savepoints.discard_savepoint`); never the one a restore would
  pick now;
* **orphan files**, by :mod:`checkpointing.coordination.orphans`;
* with ``vacuum_sink``, the Delta sink table's files no retained checkpoint can restore, by
  :mod:`checkpointing.coordination.sink_vacuum`.

A plan is made first (:func:`plan_gc`) and is all a dry run does; :func:`run_gc` then deletes it,
history rows under the job's row lock with the plan's conditions repeated in the ``DELETE``, so a
row that changed meanwhile is kept. A job whose coordinator is active (RUNNING, with a driver
heart-beating within :data:`~checkpointing.coordination.heartbeat.HEARTBEAT_TIMEOUT`, or one
that never beat; or a detached driver still starting) is refused unless forced: its
checkpoints change under the plan. A RUNNING job whose driver stopped beating is dead (a
SIGKILLed driver leaves the status) and is collected. The savepoint the job's latest restore
decision names is never expired (a driver told to restore it may not have read it yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, func, not_, select, true
from sqlalchemy.orm import Session

from checkpointing.clock import Clock, SystemClock
from checkpointing.coordination import orphans, savepoints, sink_vacuum, store
from checkpointing.coordination.heartbeat import driver_alive, driver_starting
from checkpointing.coordination.orphans import OrphanFile
from checkpointing.coordination.sink_vacuum import SinkFile
from checkpointing.errors import CheckpointingError, ConfigError
from checkpointing.ids import validate_id
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import (
    Checkpoint,
    CheckpointAck,
    CheckpointRequest,
    CheckpointTask,
    Job,
    RestoreEvent,
    SharedStateRef,
)
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import CheckpointStatus, CheckpointType, JobStatus, RequestStatus

DEFAULT_KEEP_HISTORY = timedelta(days=30)
DEFAULT_GRACE = timedelta(hours=1)
#: statuses of a checkpoint row that left the retained set for good
_ENDED = (CheckpointStatus.SUBSUMED, CheckpointStatus.DISCARDED, CheckpointStatus.ABORTED)
_FINISHED_REQUESTS = (RequestStatus.COMPLETED, RequestStatus.FAILED, RequestStatus.DROPPED)


class JobActiveError(CheckpointingError):
    """The job's coordinator is active: garbage collection would race it."""


@dataclass(frozen=True)
class GcOptions:
    """What to collect; every value is checked on construction (:class:`ConfigError`, one
    line), before anything is read or deleted."""

    keep_history: timedelta = DEFAULT_KEEP_HISTORY
    grace: timedelta = DEFAULT_GRACE
    keep_savepoints: int | None = None
    savepoint_max_age: timedelta | None = None
    orphans: bool = True
    force: bool = False
    #: the job's Delta sink table to vacuum (:mod:`checkpointing.coordination.sink_vacuum`)
    vacuum_sink: str | None = None

    def __post_init__(self) -> None:
        for name in ("keep_history", "grace", "savepoint_max_age"):
            value = getattr(self, name)
            if value is not None and value < timedelta(0):
                flag = name.replace("_", "-")
                raise ConfigError(f"--{flag} must not be negative, got {value}")
        if self.keep_savepoints is not None and (
            isinstance(self.keep_savepoints, bool) or self.keep_savepoints < 0
        ):
            raise ConfigError(f"--keep-savepoints must be 0 or more, got {self.keep_savepoints}")


@dataclass(frozen=True)
class SavepointInfo:
    """A completed savepoint, for ``ckpt savepoints`` and the savepoint retention."""

    checkpoint_id: int
    checkpoint_type: str
    location: str
    completed_at: datetime
    age: timedelta
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_type": self.checkpoint_type,
            "location": self.location,
            "completed_at": self.completed_at.isoformat(),
            "age_seconds": round(self.age.total_seconds(), 3),
            "size": self.size,
        }


@dataclass
class GcPlan:
    """What a collection deletes (all a dry run reports)."""

    job_id: str
    checkpoints: list[int] = field(default_factory=list)
    tasks: int = 0
    acks: int = 0
    requests: list[int] = field(default_factory=list)
    restores: list[int] = field(default_factory=list)
    savepoints: list[SavepointInfo] = field(default_factory=list)
    orphans: list[OrphanFile] = field(default_factory=list)
    sink_files: list[SinkFile] = field(default_factory=list)
    dry_run: bool = True
    #: what could not be deleted (the rest went)
    errors: list[str] = field(default_factory=list)

    @property
    def orphan_bytes(self) -> int:
        return sum(f.size for f in self.orphans)

    @property
    def sink_bytes(self) -> int:
        return sum(f.size for f in self.sink_files)

    @property
    def savepoint_bytes(self) -> int:
        return sum(s.size for s in self.savepoints)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "dry_run": self.dry_run,
            "history": {
                "checkpoints": len(self.checkpoints),
                "checkpoint_ids": self.checkpoints,
                "tasks": self.tasks,
                "acks": self.acks,
                "requests": len(self.requests),
                "restores": len(self.restores),
            },
            "savepoints": [s.to_dict() for s in self.savepoints],
            "savepoint_bytes": self.savepoint_bytes,
            "orphans": [f.to_dict() for f in self.orphans],
            "orphan_bytes": self.orphan_bytes,
            "sink_files": [f.to_dict() for f in self.sink_files],
            "sink_bytes": self.sink_bytes,
            "errors": self.errors,
        }


def list_savepoints(
    metastore: Metastore, job_id: str, *, clock: Clock | None = None
) -> list[SavepointInfo]:
    """The job's completed savepoints, newest first, with their age and size."""
    validate_id(job_id, "job id")
    now = (clock or SystemClock()).now()
    with metastore.transaction() as s:
        jobs.job_row(s, job_id)
        return _savepoints(s, job_id, now)


def _savepoints(s: Session, job_id: str, now: datetime) -> list[SavepointInfo]:
    return [
        SavepointInfo(
            c.checkpoint_id,
            c.checkpoint_type,
            c.storage_location,
            c.completed_at or c.trigger_at,
            now - (c.completed_at or c.trigger_at),
            c.state_size,
        )
        for c in store.completed(s, job_id)
        if c.checkpoint_type != CheckpointType.CHECKPOINT
    ]


def plan_gc(
    metastore: Metastore,
    storage: CheckpointStorage,
    job_id: str,
    options: GcOptions,
    *,
    clock: Clock | None = None,
) -> GcPlan:
    """What :func:`run_gc` would delete; deletes nothing. Refuses an unknown job and (unless
    ``options.force``) an active one."""
    validate_id(job_id, "job id")
    now = (clock or SystemClock()).now()
    plan = GcPlan(job_id)
    with metastore.transaction() as s:
        job = jobs.job_row(s, job_id)
        alive = driver_alive(job.heartbeat_at, now)
        running = JobStatus(job.status) is JobStatus.RUNNING and alive is not False
        if (running or _starting(job, now)) and not options.force:
            beat = "" if job.heartbeat_at is None else f", last heartbeat {job.heartbeat_at:%c} UTC"
            state = "RUNNING" if running else "starting its driver"
            raise JobActiveError(
                f"job {job_id!r} is {state} (coordinator {job.coordinator_id or 'unknown'}"
                f"{beat}): its checkpoints change under gc; run it when the job is not running, "
                "or --force if its coordinator is known dead"
            )
        cutoff = now - options.keep_history
        plan.checkpoints = list(
            s.scalars(
                select(Checkpoint.checkpoint_id)
                .where(_prunable_checkpoints(job_id, cutoff))
                .order_by(Checkpoint.checkpoint_id)
            )
        )
        plan.tasks, plan.acks = _count_children(s, job_id, plan.checkpoints)
        plan.requests = list(
            s.scalars(
                select(CheckpointRequest.request_id)
                .where(_prunable_requests(job_id, cutoff, plan.checkpoints))
                .order_by(CheckpointRequest.request_id)
            )
        )
        plan.restores = list(
            s.scalars(
                select(RestoreEvent.restore_id)
                .where(_prunable_restores(s, job_id, cutoff))
                .order_by(RestoreEvent.restore_id)
            )
        )
        plan.savepoints = _expired_savepoints(s, job, options, now)
    if options.orphans:
        plan.orphans = orphans.find_orphans(metastore, storage, job_id, now - options.grace)
    if options.vacuum_sink:
        plan.sink_files = sink_vacuum.plan_vacuum(metastore, job_id, options.vacuum_sink)
    return plan


def run_gc(
    metastore: Metastore,
    storage: CheckpointStorage,
    job_id: str,
    options: GcOptions,
    *,
    dry_run: bool = False,
    clock: Clock | None = None,
) -> GcPlan:
    """Collect the job's garbage (see the module doc); returns the plan carried out (with
    ``dry_run``, only made). A failed file deletion is reported in ``errors``, not raised:
    the rest still goes, and the next run tries again."""
    clock = clock or SystemClock()
    plan = plan_gc(metastore, storage, job_id, options, clock=clock)
    plan.dry_run = dry_run
    if dry_run:
        return plan
    for sp in plan.savepoints:
        try:
            savepoints.discard_savepoint(metastore, storage, job_id, sp.checkpoint_id, clock=clock)
        except CheckpointingError as exc:
            plan.errors.append(f"savepoint {sp.checkpoint_id}: {exc}")
    _delete_history(metastore, job_id, plan, clock.now() - options.keep_history)
    if plan.orphans:
        plan.errors += orphans.delete_orphans(metastore, storage, job_id, plan.orphans)
    if plan.sink_files:
        plan.errors += sink_vacuum.vacuum(job_id, plan.sink_files)
    return plan


# ---------------------------------------------------------------------------------- history


def _prunable_checkpoints(job_id: str, cutoff: datetime) -> Any:
    registered = select(SharedStateRef.checkpoint_id).where(SharedStateRef.job_id == job_id)
    ended = func.coalesce(Checkpoint.ended_at, Checkpoint.trigger_at)
    return and_(
        Checkpoint.job_id == job_id,
        Checkpoint.status.in_(_ENDED),
        ended < cutoff,
        # its files were kept on purpose: the row is how a user finds them
        not_(
            and_(
                Checkpoint.status == CheckpointStatus.SUBSUMED,
                Checkpoint.discard_on_subsumed.is_(False),
            )
        ),
        Checkpoint.checkpoint_id.not_in(registered),
    )


def _prunable_requests(job_id: str, cutoff: datetime, pruned: Sequence[int]) -> Any:
    named = select(Checkpoint.request_id).where(
        Checkpoint.job_id == job_id,
        Checkpoint.request_id.is_not(None),
        Checkpoint.checkpoint_id.not_in(pruned) if pruned else true(),
    )
    return and_(
        CheckpointRequest.job_id == job_id,
        CheckpointRequest.status.in_(_FINISHED_REQUESTS),
        func.coalesce(CheckpointRequest.finished_at, CheckpointRequest.requested_at) < cutoff,
        CheckpointRequest.request_id.not_in(named),
    )


def _prunable_restores(s: Session, job_id: str, cutoff: datetime) -> Any:
    latest = s.scalar(
        select(func.max(RestoreEvent.restore_id)).where(RestoreEvent.job_id == job_id)
    )
    return and_(
        RestoreEvent.job_id == job_id,
        RestoreEvent.created_at < cutoff,
        RestoreEvent.restore_id != (latest if latest is not None else -1),
    )


def _count_children(s: Session, job_id: str, ids: Sequence[int]) -> tuple[int, int]:
    if not ids:
        return 0, 0
    tasks = acks = 0
    for chunk in _chunks(ids):
        tasks += (
            s.scalar(
                select(func.count())
                .select_from(CheckpointTask)
                .where(CheckpointTask.job_id == job_id, CheckpointTask.checkpoint_id.in_(chunk))
            )
            or 0
        )
        acks += (
            s.scalar(
                select(func.count())
                .select_from(CheckpointAck)
                .where(CheckpointAck.job_id == job_id, CheckpointAck.checkpoint_id.in_(chunk))
            )
            or 0
        )
    return tasks, acks


def _delete_history(metastore: Metastore, job_id: str, plan: GcPlan, cutoff: datetime) -> None:
    """Delete the planned rows under the job's row lock, each ``DELETE`` repeating the plan's
    conditions: a row that changed since the plan stays."""
    with metastore.transaction() as s:
        jobs.job_row(s, job_id, lock=True)
        gone: list[int] = []
        for chunk in _chunks(plan.checkpoints):
            ids = list(
                s.scalars(
                    select(Checkpoint.checkpoint_id).where(
                        _prunable_checkpoints(job_id, cutoff), Checkpoint.checkpoint_id.in_(chunk)
                    )
                )
            )
            if not ids:
                continue
            gone += ids
            for model in (CheckpointAck, CheckpointTask):
                s.execute(delete(model).where(model.job_id == job_id, model.checkpoint_id.in_(ids)))
            s.execute(
                delete(Checkpoint).where(
                    Checkpoint.job_id == job_id, Checkpoint.checkpoint_id.in_(ids)
                )
            )
        plan.checkpoints = sorted(gone)
        for chunk in _chunks(plan.requests):
            s.execute(
                delete(CheckpointRequest).where(
                    _prunable_requests(job_id, cutoff, ()), CheckpointRequest.request_id.in_(chunk)
                )
            )
        for chunk in _chunks(plan.restores):
            s.execute(
                delete(RestoreEvent).where(
                    _prunable_restores(s, job_id, cutoff), RestoreEvent.restore_id.in_(chunk)
                )
            )


# ---------------------------------------------------------------------------------- savepoints


def _expired_savepoints(
    s: Session, job: Job, options: GcOptions, now: datetime
) -> list[SavepointInfo]:
    """The completed savepoints past the retention: the options' where given, else the job's
    ``savepoint_retention``."""
    configured = jobs.config_of(job).savepoint_retention
    keep = options.keep_savepoints
    max_age = options.savepoint_max_age
    if configured is not None:
        keep = configured.count if keep is None else keep
        max_age = configured.max_age if max_age is None else max_age
    if keep is None and max_age is None:
        return []
    candidates = store.restore_candidates(s, job.job_id, job.prefer_checkpoint_for_recovery)
    restoring = {candidates[0].checkpoint_id} if candidates else set()
    # and the one the job's latest restore decision names: a driver told to restore it may
    # not have read it yet
    latest = s.scalars(
        select(RestoreEvent.checkpoint_id)
        .where(RestoreEvent.job_id == job.job_id)
        .order_by(RestoreEvent.restore_id.desc())
        .limit(1)
    ).first()
    restoring |= {latest} if latest is not None else set()
    expired = []
    for rank, sp in enumerate(_savepoints(s, job.job_id, now)):
        beyond = keep is not None and rank >= keep
        old = max_age is not None and sp.age > max_age
        if (beyond or old) and sp.checkpoint_id not in restoring:
            expired.append(sp)
    return expired


def _starting(job: Job, now: datetime) -> bool:
    """A driver submitted (status CREATED until it reports RUNNING) that has not beaten yet,
    within the heartbeat timeout of its submission: it is starting, and about to restore
    (maybe a savepoint no restore decision names yet). A detached driver's submission is
    recorded; an attached one's is its attempt's activation, the row's last change."""
    submitted = job.driver_submitted_at or job.updated_at
    if JobStatus(job.status) is not JobStatus.CREATED or submitted is None:
        return False
    return driver_starting(submitted, job.heartbeat_at, now)


def _chunks(items: Sequence[int]) -> Any:
    from checkpointing.coordination.pending import CHUNK

    for start in range(0, len(items), CHUNK):
        yield list(items[start : start + CHUNK])
