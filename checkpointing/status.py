"""The status enums of jobs, checkpoints, requests and restores, and the checkpoint types.

``CheckpointProperties`` lives here too: it maps a job's terminal status to whether a checkpoint's
files are discarded (Flink's ``CheckpointProperties``: what is forced, and what is discarded when).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from checkpointing.config import RetentionPolicy


class CheckpointType(StrEnum):
    CHECKPOINT = "CHECKPOINT"
    SAVEPOINT = "SAVEPOINT"
    #: stop-with-savepoint: the job ends once this savepoint completes
    SAVEPOINT_THEN_STOP = "SAVEPOINT_THEN_STOP"

    @property
    def is_savepoint(self) -> bool:
        return self is not CheckpointType.CHECKPOINT


class CheckpointStatus(StrEnum):
    PENDING = "PENDING"
    COMPLETED = "COMPLETED"
    ABORTED = "ABORTED"
    #: removed from the completed store by a newer checkpoint (files discarded per properties)
    SUBSUMED = "SUBSUMED"
    #: discarded on job termination per the retention policy, or a savepoint discarded by a user
    DISCARDED = "DISCARDED"


class JobStatus(StrEnum):
    CREATED = "CREATED"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    CANCELED = "CANCELED"
    FAILED = "FAILED"
    SUSPENDED = "SUSPENDED"

    @property
    def is_globally_terminal(self) -> bool:
        return self in (JobStatus.FINISHED, JobStatus.CANCELED, JobStatus.FAILED)


class StatusWriter(StrEnum):
    """Who wrote a job row's status (its ``status_by``: ``<writer>:<coordinator id>``). A
    detached driver's watcher ends on a terminal status only when the driver's own run wrote
    it: a failure callback that runs late writes FAILED too, under the same coordinator id."""

    #: the job's own run (``ckpt run``: a Spark driver, detached or not)
    RUN = "run"
    #: a failed try's failover (the operator or its failure callback)
    FAILOVER = "failover"

    def of(self, coordinator_id: str) -> str:
        return f"{self.value}:{coordinator_id}"


@dataclass(frozen=True)
class CheckpointProperties:
    """Flink's presets: savepoints are forced and never discarded by the system."""

    checkpoint_type: CheckpointType
    forced: bool
    discard_on_subsumed: bool
    discard_on_finished: bool
    discard_on_cancelled: bool
    discard_on_failed: bool
    discard_on_suspended: bool

    @classmethod
    def for_checkpoint(
        cls, retention: RetentionPolicy, forced: bool = False
    ) -> CheckpointProperties:
        retain_failed = retention is not RetentionPolicy.NEVER_RETAIN
        retain_cancel = retention is RetentionPolicy.RETAIN_ON_CANCELLATION
        return cls(
            checkpoint_type=CheckpointType.CHECKPOINT,
            forced=forced,
            discard_on_subsumed=True,
            discard_on_finished=True,
            discard_on_cancelled=not retain_cancel,
            discard_on_failed=not retain_failed,
            discard_on_suspended=not retain_cancel,
        )

    @classmethod
    def for_savepoint(cls, stop: bool = False) -> CheckpointProperties:
        return cls(
            checkpoint_type=CheckpointType.SAVEPOINT_THEN_STOP
            if stop
            else CheckpointType.SAVEPOINT,
            forced=True,
            discard_on_subsumed=False,
            discard_on_finished=False,
            discard_on_cancelled=False,
            discard_on_failed=False,
            discard_on_suspended=False,
        )

    def discard_on(self, job_status: JobStatus) -> bool:
        return {
            JobStatus.FINISHED: self.discard_on_finished,
            JobStatus.CANCELED: self.discard_on_cancelled,
            JobStatus.FAILED: self.discard_on_failed,
            JobStatus.SUSPENDED: self.discard_on_suspended,
        }.get(job_status, False)


class RequestStatus(StrEnum):
    QUEUED = "QUEUED"
    TRIGGERED = "TRIGGERED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    #: dropped unprocessed (coordinator stopped, or the queue overflowed)
    DROPPED = "DROPPED"


class RestoreStatus(StrEnum):
    #: a restore plan recorded for an attempt (from a checkpoint or savepoint)
    PLANNED = "PLANNED"
    #: the attempt loaded that checkpoint's state and runs from it
    RESTORED = "RESTORED"
    #: no valid checkpoint: the attempt starts with empty state
    EMPTY = "EMPTY"
