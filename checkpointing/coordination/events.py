"""What happened to a job's checkpoints and restores, as plain events for whoever watches it
(metrics, alerts, lineage), and the listener protocol they are delivered through.

Flink reports checkpoint statistics through its ``CheckpointStatsTracker`` to metric reporters;
here :class:`~checkpointing.coordination.stats_tracker.CheckpointStatsTracker` derives these
events from the metastore (the driver completes checkpoints in another process) and hands them to
listeners. The core stays free of Airflow: the provider adapts the events to Airflow's ``Stats``,
notifiers and OpenLineage (``checkpointing_airflow.metrics``, ``.alerts``, ``.lineage``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class CheckpointCompleted:
    """A checkpoint or savepoint completed: Flink's ``lastCheckpointDuration`` and ``Size``."""

    job_id: str
    checkpoint_id: int
    checkpoint_type: str
    duration_s: float
    #: bytes of every file the state spans (shared files of earlier checkpoints included)
    state_size: int
    #: bytes this checkpoint wrote itself (Flink's checkpointed data size)
    checkpointed_size: int
    location: str
    #: epochs of the input the checkpoint covers; None when its acknowledgements do not say
    epochs_done: int | None = None
    #: epochs per second since the previous completed checkpoint of the same watch
    epoch_throughput: float | None = None

    @property
    def is_savepoint(self) -> bool:
        return self.checkpoint_type != "CHECKPOINT"


@dataclass(frozen=True)
class CheckpointFailed:
    """A checkpoint or savepoint was aborted (declined, expired, failed over ...)."""

    job_id: str
    checkpoint_id: int
    checkpoint_type: str
    reason: str
    message: str | None
    #: the job's consecutive counted failures after this one (Flink's tolerable-failure count)
    consecutive_failures: int

    @property
    def is_savepoint(self) -> bool:
        return self.checkpoint_type != "CHECKPOINT"


@dataclass(frozen=True)
class ConsecutiveCheckpointFailures:
    """The job's consecutive checkpoint failures reached the watch's alert threshold, before
    ``tolerable_failures`` fails the job: once per run of failures."""

    job_id: str
    count: int
    tolerable_failures: int
    checkpoint_id: int | None
    reason: str | None


@dataclass(frozen=True)
class TolerableFailuresExceeded:
    """More consecutive checkpoint failures than ``tolerable_failures``: the job fails."""

    job_id: str
    count: int
    tolerable_failures: int
    cause: str | None


@dataclass(frozen=True)
class Restored:
    """An attempt restored (or started empty): from which checkpoint, how it got there."""

    job_id: str
    attempt: str
    checkpoint_id: int | None
    external_path: str | None
    parallelism: int | None
    #: the parallelism the restored checkpoint was taken at (None: unknown or empty start)
    previous_parallelism: int | None
    #: checkpoints skipped as unusable (corrupt, missing files): (checkpoint id, reason)
    skipped: tuple[tuple[int, str], ...] = field(default_factory=tuple)
    #: seconds the driver spent restoring, as it recorded them (None: not recorded)
    duration_s: float | None = None
    #: epochs that newer completed checkpoints covered beyond the restored one, run again
    epochs_redone: int | None = None
    #: epochs the restored checkpoint covers
    epochs_done: int | None = None

    @property
    def rescaled(self) -> bool:
        return (
            self.parallelism is not None
            and self.previous_parallelism is not None
            and self.parallelism != self.previous_parallelism
        )


@dataclass(frozen=True)
class CheckpointingProgress:
    """Sampled on every pass: how old the last completed checkpoint is (a gauge that makes a
    stuck pipeline visible)."""

    job_id: str
    last_completed_id: int | None
    last_completed_age_s: float | None


CheckpointEvent = (
    CheckpointCompleted
    | CheckpointFailed
    | ConsecutiveCheckpointFailures
    | TolerableFailuresExceeded
    | Restored
    | CheckpointingProgress
)


class CheckpointEventListener(Protocol):
    """Receives a job's events. A listener that raises is logged and skipped: watching a job
    never changes its outcome."""

    def on_event(self, event: CheckpointEvent) -> None: ...
