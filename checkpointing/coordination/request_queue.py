"""The queue of checkpoint and savepoint requests, and the decision whether one may be triggered
now (Flink's ``CheckpointRequestDecider``).

Requests live in the metastore so that the UI, a DAG or the CLI in another process can ask the
running job's coordinator for a savepoint. Order: savepoint > forced > manual > periodic, then by
time. At most one non-forced request waits at a time (Flink's ``ALREADY_QUEUED``); the queue is
bounded, and periodic requests are dropped first when it overflows.

:func:`queue_request` is the one way a caller queues a request, and owns the rule of who may:
the coordinator's own (``CheckpointCoordinator.request``) and another process's
(``savepoints.request_savepoint``) both go through it. The trigger's pre-check queues the
request it holds back itself (:func:`precheck`); the coordinator triggers the queue with
:func:`trigger_queued`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Protocol

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from checkpointing.coordination import pending
from checkpointing.coordination.failure import (
    CheckpointException,
    CheckpointFailureReason,
    CoordinatorSuperseded,
)
from checkpointing.errors import CheckpointingError
from checkpointing.metastore import jobs
from checkpointing.metastore.models import CheckpointRequest, Job
from checkpointing.state import storage_roots
from checkpointing.status import CheckpointProperties, CheckpointType, JobStatus, RequestStatus

if TYPE_CHECKING:
    from checkpointing.clock import Clock
    from checkpointing.coordination.fencing import CoordinatorFencing
    from checkpointing.coordination.pending import PendingCheckpoint
    from checkpointing.coordination.scheduler import PeriodicScheduler
    from checkpointing.metastore.engine import Metastore

log = logging.getLogger(__name__)

MAX_QUEUED_REQUESTS = 1000

PRIORITY_PERIODIC, PRIORITY_MANUAL, PRIORITY_FORCED, PRIORITY_SAVEPOINT = 0, 1, 2, 3


class JobNotRunningError(CheckpointingError):
    """A request from another process for a job that is not running: nobody would take it."""


def priority(checkpoint_type: CheckpointType, *, forced: bool, periodic: bool) -> int:
    if checkpoint_type.is_savepoint:
        return PRIORITY_SAVEPOINT
    if forced:
        return PRIORITY_FORCED
    return PRIORITY_PERIODIC if periodic else PRIORITY_MANUAL


def queued_non_forced(session: Session, job_id: str, exclude: int | None = None) -> int | None:
    query = select(CheckpointRequest.request_id).where(
        CheckpointRequest.job_id == job_id,
        CheckpointRequest.status == RequestStatus.QUEUED,
        CheckpointRequest.forced.is_(False),
    )
    if exclude is not None:
        query = query.where(CheckpointRequest.request_id != exclude)
    return session.scalars(query.limit(1)).first()


def enqueue(
    session: Session,
    job_id: str,
    checkpoint_type: CheckpointType,
    *,
    requested_by: str,
    now: datetime,
    forced: bool = False,
    periodic: bool = False,
    target: str | None = None,
) -> CheckpointRequest:
    forced = forced or checkpoint_type.is_savepoint
    if not forced and queued_non_forced(session, job_id) is not None:
        raise CheckpointException(
            CheckpointFailureReason.ALREADY_QUEUED, "a checkpoint request is already queued"
        )
    queued = session.scalar(
        select(func.count()).where(
            CheckpointRequest.job_id == job_id, CheckpointRequest.status == RequestStatus.QUEUED
        )
    )
    if queued and queued >= MAX_QUEUED_REQUESTS:
        victim = session.scalars(
            select(CheckpointRequest)
            .where(
                CheckpointRequest.job_id == job_id,
                CheckpointRequest.status == RequestStatus.QUEUED,
                CheckpointRequest.periodic.is_(True),
            )
            .order_by(CheckpointRequest.request_id)
            .limit(1)
        ).first()
        if victim is None or periodic:
            raise CheckpointException(
                CheckpointFailureReason.TOO_MANY_CHECKPOINT_REQUESTS,
                f"{queued} requests are queued already",
            )
        victim.status = RequestStatus.DROPPED
        victim.message = CheckpointFailureReason.TOO_MANY_CHECKPOINT_REQUESTS.value
        victim.finished_at = now
    request = CheckpointRequest(
        job_id=job_id,
        checkpoint_type=checkpoint_type.value,
        forced=forced,
        periodic=periodic,
        priority=priority(checkpoint_type, forced=forced, periodic=periodic),
        requested_by=requested_by,
        requested_at=now,
        target_location=target,
        status=RequestStatus.QUEUED,
    )
    session.add(request)
    session.flush()
    return request


def queue_request(
    session: Session,
    job_id: str,
    checkpoint_type: CheckpointType,
    *,
    requested_by: str,
    now: datetime,
    forced: bool = False,
    target: str | None = None,
    from_outside: bool,
) -> int:
    """Queue a request for the job's coordinator; its id. The rule of who may:

    * ``from_outside`` (another process: the CLI, the UI, a DAG): only while the job is RUNNING,
      checked on the locked job row, else :class:`JobNotRunningError`. A job that finished,
      failed or never started has no coordinator to take the request, which would wait forever.
    * the job's own coordinator: at any time. It triggers its queue itself (``process_requests``,
      also before the job reports RUNNING) and drops what is left when it stops
      (``stop_scheduler``, ``shutdown``), so its requests never wait for nobody.

    A ``target`` (a savepoint's directory) must lie in the configured storage roots
    (:func:`~checkpointing.state.storage_roots.require_allowed`), checked before anything is
    queued and again when the coordinator takes the request (:func:`trigger_queued`).

    Then :func:`enqueue`'s limits hold for both (one non-forced request, the queue's bound)."""
    if target is not None:
        storage_roots.require_allowed(target, job_id=job_id, field="target_location")
    if from_outside:
        job = jobs.job_row(session, job_id, lock=True)
        if job.status != JobStatus.RUNNING:
            kind = "savepoint" if checkpoint_type.is_savepoint else "checkpoint"
            raise JobNotRunningError(
                f"job {job_id!r} is not running (status {job.status}): a {kind} needs a "
                "running job; to start it from its latest checkpoint, run it again"
            )
    request = enqueue(
        session,
        job_id,
        checkpoint_type,
        requested_by=requested_by,
        now=now,
        forced=forced,
        target=target,
    )
    return request.request_id


def next_requests(session: Session, job_id: str) -> Sequence[CheckpointRequest]:
    return session.scalars(
        select(CheckpointRequest)
        .where(CheckpointRequest.job_id == job_id, CheckpointRequest.status == RequestStatus.QUEUED)
        .order_by(
            CheckpointRequest.priority.desc(),
            CheckpointRequest.requested_at,
            CheckpointRequest.request_id,
        )
    ).all()


def finish(
    session: Session,
    request_id: int,
    status: RequestStatus,
    now: datetime,
    *,
    checkpoint_id: int | None = None,
    message: str | None = None,
) -> None:
    values: dict[str, object] = {"status": status, "message": message}
    if checkpoint_id is not None:
        values["checkpoint_id"] = checkpoint_id
    if status is not RequestStatus.TRIGGERED:
        values["finished_at"] = now
    session.execute(
        update(CheckpointRequest).where(CheckpointRequest.request_id == request_id).values(**values)
    )


def drop_queued(session: Session, job_id: str, reason: str, now: datetime) -> int:
    result = session.execute(
        update(CheckpointRequest)
        .where(CheckpointRequest.job_id == job_id, CheckpointRequest.status == RequestStatus.QUEUED)
        .values(status=RequestStatus.DROPPED, message=reason, finished_at=now)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def precheck(
    s: Session,
    job_id: str,
    props: CheckpointProperties,
    *,
    periodic: bool,
    request_id: int | None,
    max_concurrent: int,
    min_pause: timedelta,
    now: datetime,
    requested_by: str,
    scheduler: PeriodicScheduler | None = None,
) -> CheckpointException | None:
    """Flink's ``preCheckBeforeTriggeringCheckpoint``: forced requests bypass the limits, and
    the min pause holds back periodic ones only (a manual checkpoint is triggered at once).

    Returns the refusal instead of raising it, so that the caller's transaction commits what
    the check recorded (a request queued behind the pending checkpoints). A periodic trigger
    held back by the min pause moves ``scheduler``'s next trigger to the end of the pause."""
    if props.forced:
        return None
    if queued_non_forced(s, job_id, exclude=request_id) is not None:
        return CheckpointException(
            CheckpointFailureReason.ALREADY_QUEUED, "another checkpoint request is queued already"
        )
    num_pending = pending.count_pending(s, job_id)
    if num_pending >= max_concurrent:
        if request_id is None:
            enqueue(
                s,
                job_id,
                props.checkpoint_type,
                requested_by=requested_by,
                now=now,
                periodic=periodic,
            )
        return CheckpointException(
            CheckpointFailureReason.TOO_MANY_CONCURRENT_CHECKPOINTS,
            f"{num_pending} pending, max_concurrent={max_concurrent}; request queued",
        )
    job = s.get(Job, job_id)
    if periodic and job is not None and job.last_completion_at is not None:
        earliest = job.last_completion_at + min_pause
        if now < earliest:
            if scheduler is not None:
                scheduler.reschedule_at(earliest)
            return CheckpointException(
                CheckpointFailureReason.MINIMUM_TIME_BETWEEN_CHECKPOINTS,
                f"min pause not over until {earliest.isoformat()}",
            )
    return None


class Trigger(Protocol):
    """The coordinator's ``trigger_checkpoint``, as :func:`trigger_queued` calls it."""

    def __call__(
        self,
        *,
        checkpoint_type: CheckpointType,
        forced: bool,
        target: str | None,
        request_id: int,
        periodic: bool,
    ) -> PendingCheckpoint: ...


#: refusals that leave a request queued: it is triggered once the limit allows
_KEEP_QUEUED = (
    CheckpointFailureReason.TOO_MANY_CONCURRENT_CHECKPOINTS,
    CheckpointFailureReason.MINIMUM_TIME_BETWEEN_CHECKPOINTS,
)


def trigger_queued(
    metastore: Metastore,
    job_id: str,
    fencing: CoordinatorFencing,
    clock: Clock,
    trigger: Trigger,
) -> list[PendingCheckpoint]:
    """Flink's ``triggerQueuedRequests``: trigger the queued requests in priority order; the
    ones a limit holds back stay queued (forced ones behind them may still go), the ones
    otherwise refused are FAILED. Nothing when ``fencing`` says another coordinator leads: the
    requests are its."""
    with metastore.transaction() as s:
        if fencing.fenced(s, "request handling"):
            return []
        queued = [
            (
                r.request_id,
                CheckpointType(r.checkpoint_type),
                r.forced,
                r.periodic,
                r.target_location,
            )
            for r in next_requests(s, job_id)
        ]
    triggered = []
    for request_id, ctype, forced, periodic, target in queued:
        # the row is anyone's to write: its target never chooses where a savepoint goes
        refused = _refused_target(job_id, target) if target is not None else None
        if refused is not None:
            with metastore.transaction() as s:
                if fencing.fenced(s, "request handling"):
                    break
                finish(s, request_id, RequestStatus.FAILED, clock.now(), message=refused)
            continue
        try:
            triggered.append(
                trigger(
                    checkpoint_type=ctype,
                    forced=forced,
                    target=target,
                    request_id=request_id,
                    periodic=periodic,  # a queued periodic request still waits the min pause
                )
            )
        except CoordinatorSuperseded:
            break  # the requests are the successor's
        except CheckpointException as exc:
            if exc.reason in _KEEP_QUEUED:
                continue  # stays queued; forced ones behind it may still go
            with metastore.transaction() as s:
                if fencing.fenced(s, "request handling"):
                    break
                finish(s, request_id, RequestStatus.FAILED, clock.now(), message=str(exc))
    return triggered


def _refused_target(job_id: str, target: str) -> str | None:
    """Why a queued request's ``target_location`` is refused (one line, logged), or None."""
    try:
        storage_roots.require_allowed(target, job_id=job_id, field="target_location")
    except storage_roots.DisallowedStorageError as exc:
        log.error("%s; the savepoint request is failed, nothing written", exc)
        return str(exc)
    return None
