"""Why checkpoints fail, which failures count towards failing the job, and failing it (Flink's
``CheckpointFailureReason``, and ``CheckpointFailureManager`` with its ``FailJobCallback``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from enum import StrEnum
from typing import Protocol

from sqlalchemy import update
from sqlalchemy.orm import Session

from checkpointing.errors import CheckpointingError
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Job
from checkpointing.status import CheckpointType

log = logging.getLogger(__name__)


class CheckpointFailureReason(StrEnum):
    COORDINATOR_SHUTDOWN = "COORDINATOR_SHUTDOWN"
    PERIODIC_SCHEDULER_SHUTDOWN = "PERIODIC_SCHEDULER_SHUTDOWN"
    ALREADY_QUEUED = "ALREADY_QUEUED"
    TOO_MANY_CONCURRENT_CHECKPOINTS = "TOO_MANY_CONCURRENT_CHECKPOINTS"
    TOO_MANY_CHECKPOINT_REQUESTS = "TOO_MANY_CHECKPOINT_REQUESTS"
    MINIMUM_TIME_BETWEEN_CHECKPOINTS = "MINIMUM_TIME_BETWEEN_CHECKPOINTS"
    NOT_ALL_REQUIRED_TASKS_RUNNING = "NOT_ALL_REQUIRED_TASKS_RUNNING"
    TRIGGER_CHECKPOINT_FAILURE = "TRIGGER_CHECKPOINT_FAILURE"
    CHECKPOINT_DECLINED = "CHECKPOINT_DECLINED"
    #: declines a task sends when it cannot take part, not a failed snapshot (not counted)
    CHECKPOINT_DECLINED_TASK_NOT_READY = "CHECKPOINT_DECLINED_TASK_NOT_READY"
    CHECKPOINT_DECLINED_TASK_CLOSING = "CHECKPOINT_DECLINED_TASK_CLOSING"
    CHECKPOINT_DECLINED_SUBSUMED = "CHECKPOINT_DECLINED_SUBSUMED"
    CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER = "CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER"
    CHECKPOINT_DECLINED_INPUT_END_OF_STREAM = "CHECKPOINT_DECLINED_INPUT_END_OF_STREAM"
    #: the task's snapshot failed (counted)
    CHECKPOINT_ASYNC_EXCEPTION = "CHECKPOINT_ASYNC_EXCEPTION"
    IO_EXCEPTION = "IO_EXCEPTION"
    CHECKPOINT_EXPIRED = "CHECKPOINT_EXPIRED"
    CHECKPOINT_SUBSUMED = "CHECKPOINT_SUBSUMED"
    CHECKPOINT_COORDINATOR_SUSPEND = "CHECKPOINT_COORDINATOR_SUSPEND"
    CHECKPOINT_COORDINATOR_FAILOVER = "CHECKPOINT_COORDINATOR_FAILOVER"
    JOB_FAILOVER = "JOB_FAILOVER"
    JOB_TERMINATED = "JOB_TERMINATED"
    FINALIZE_CHECKPOINT_FAILURE = "FINALIZE_CHECKPOINT_FAILURE"

    @property
    def counts_as_failure(self) -> bool:
        """Flink counts only real checkpoint failures; scheduling and failover reasons never."""
        return self in _COUNTED


_COUNTED = frozenset(
    {
        CheckpointFailureReason.TRIGGER_CHECKPOINT_FAILURE,
        CheckpointFailureReason.CHECKPOINT_DECLINED,
        CheckpointFailureReason.CHECKPOINT_EXPIRED,
        CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE,
        CheckpointFailureReason.CHECKPOINT_ASYNC_EXCEPTION,
        CheckpointFailureReason.IO_EXCEPTION,
    }
)

#: the reasons a task may decline a checkpoint with (Flink's ``DeclineCheckpoint``); the others
#: belong to the coordinator, so a task cannot dress a failure up as, say, a suspension
DECLINE_REASONS = frozenset(
    {
        CheckpointFailureReason.CHECKPOINT_DECLINED,
        CheckpointFailureReason.CHECKPOINT_DECLINED_TASK_NOT_READY,
        CheckpointFailureReason.CHECKPOINT_DECLINED_TASK_CLOSING,
        CheckpointFailureReason.CHECKPOINT_DECLINED_SUBSUMED,
        CheckpointFailureReason.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER,
        CheckpointFailureReason.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM,
        CheckpointFailureReason.CHECKPOINT_ASYNC_EXCEPTION,
        CheckpointFailureReason.IO_EXCEPTION,
    }
)


def decline_reason(reason: CheckpointFailureReason | str) -> CheckpointFailureReason:
    """The :data:`DECLINE_REASONS` member named ``reason``; a ValueError naming it otherwise."""
    try:
        parsed = CheckpointFailureReason(reason)
    except ValueError:
        parsed = None
    if parsed not in DECLINE_REASONS:
        allowed = ", ".join(sorted(r.value for r in DECLINE_REASONS))
        raise ValueError(f"decline reason {str(reason)!r} is not one of {allowed}")
    return parsed  # type: ignore[return-value]


class CheckpointException(CheckpointingError):
    """A checkpoint could not be triggered or was aborted, with Flink's reason code."""

    def __init__(self, reason: CheckpointFailureReason, message: str | None = None) -> None:
        self.reason = reason
        self.message = message or reason.value.replace("_", " ").lower()
        super().__init__(f"{reason.value}: {self.message}")


class CoordinatorSuperseded(CheckpointException):
    """A newer coordinator took over the job (the job row names it): this one may change nothing
    of the job's any more, like a JobMaster that lost leadership (Flink's fencing token)."""

    def __init__(self, coordinator_id: str, job_id: str, successor: str) -> None:
        super().__init__(
            CheckpointFailureReason.COORDINATOR_SHUTDOWN,
            f"coordinator {coordinator_id} of job {job_id} was superseded by {successor}",
        )
        self.successor = successor


#: what the job's ``failure_cause`` says when failures exceeded ``tolerable_failures``
TOLERABLE_FAILURES_EXCEEDED = "exceeded checkpoint tolerable failure threshold"


class TolerableFailuresExceeded(CheckpointingError):
    """More consecutive checkpoint failures than ``tolerable_failures``: the job must fail."""


class Aborted(Protocol):
    """What the failure count needs of an aborted checkpoint (``pending.AbortedCheckpoint``)."""

    @property
    def checkpoint_id(self) -> int: ...
    @property
    def checkpoint_type(self) -> CheckpointType: ...


class CheckpointFailureManager:
    """Counts consecutive failures per job in the metastore, so the count survives coordinator
    failover. Savepoint failures and failures of checkpoints older than the last completed one
    are not counted (Flink counts each checkpoint once, and only after the last success).

    One per coordinator, shared by the trigger path and the completion handler: past
    ``tolerable_failures`` :meth:`fail_job` records the cause and calls ``on_job_failure``
    (Flink's ``FailJobCallback``)."""

    def __init__(
        self,
        job_id: str,
        tolerable_failures: int,
        metastore: Metastore,
        on_job_failure: Callable[[TolerableFailuresExceeded], None] | None = None,
    ) -> None:
        self.job_id = job_id
        self.tolerable_failures = tolerable_failures
        self.metastore = metastore
        self.on_job_failure = on_job_failure
        #: the threshold this process saw exceeded, if any: the job must fail
        self.job_failure: TolerableFailuresExceeded | None = None

    def record_failure(
        self,
        session: Session,
        reason: CheckpointFailureReason,
        checkpoint_id: int | None,
        *,
        is_savepoint: bool = False,
    ) -> TolerableFailuresExceeded | None:
        """Count the failure inside the caller's transaction; return the job failure to raise
        (after commit) when the threshold is exceeded."""
        if not reason.counts_as_failure or is_savepoint:
            return None
        job = session.get(Job, self.job_id)
        if job is None:
            return None
        if (
            checkpoint_id is not None
            and job.last_completed_id
            and checkpoint_id < job.last_completed_id
        ):
            return None
        count = session.execute(
            update(Job)
            .where(Job.job_id == self.job_id)
            .values(consecutive_failures=Job.consecutive_failures + 1)
            .returning(Job.consecutive_failures)
        ).scalar_one()
        log.warning(
            "job %s: checkpoint %s failed (%s), %d consecutive failure(s), %d tolerated",
            self.job_id,
            checkpoint_id,
            reason.value,
            count,
            self.tolerable_failures,
        )
        if count > self.tolerable_failures:
            return TolerableFailuresExceeded(
                f"job {self.job_id}: {TOLERABLE_FAILURES_EXCEEDED} "
                f"({count} consecutive failures > tolerable_failures={self.tolerable_failures}); "
                f"last: {reason.value}"
            )
        return None

    def record_aborted(
        self,
        session: Session,
        aborted: Iterable[Aborted],
        reason: CheckpointFailureReason,
    ) -> TolerableFailuresExceeded | None:
        """Count each aborted checkpoint (savepoints are not counted); the last job failure."""
        failure = None
        for a in aborted:
            failure = (
                self.record_failure(
                    session, reason, a.checkpoint_id, is_savepoint=a.checkpoint_type.is_savepoint
                )
                or failure
            )
        return failure

    def reset(self, session: Session) -> None:
        session.execute(update(Job).where(Job.job_id == self.job_id).values(consecutive_failures=0))

    def count_failure(
        self, reason: CheckpointFailureReason, checkpoint_id: int | None, *, is_savepoint: bool
    ) -> None:
        """Count a failure outside any checkpoint's transaction (a failed trigger), in its own;
        fail the job past the threshold."""
        with self.metastore.transaction() as s:
            failure = self.record_failure(s, reason, checkpoint_id, is_savepoint=is_savepoint)
        if failure is not None:
            self.fail_job(failure)

    def fail_job(self, failure: TolerableFailuresExceeded) -> None:
        """After the commit that counted it: record the cause on the job row, then tell the
        process running the job (``on_job_failure``), which fails it."""
        self.job_failure = failure
        with self.metastore.transaction() as s:
            jobs.update_job(s, self.job_id, failure_cause=str(failure))
        log.error("%s", failure)
        if self.on_job_failure is not None:
            self.on_job_failure(failure)
