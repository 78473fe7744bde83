"""Flink's ``CheckpointStatsTracker`` for one attempt: what its checkpoints and restore did,
read from the metastore and handed to listeners as :mod:`~checkpointing.coordination.events`.

The metastore is the source, not the coordinator's calls: the Spark driver completes checkpoints
and records the restore in its own process (maybe on another machine), while this tracker runs
with the attempt's coordinator loop (the Airflow operator). Each :meth:`poll` reports what changed
since the last one, so every checkpoint is reported once, by the process that watches the
attempt; a listener that raises is logged and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from checkpointing.clock import Clock, SystemClock
from checkpointing.coordination.events import (
    CheckpointCompleted,
    CheckpointEvent,
    CheckpointEventListener,
    CheckpointFailed,
    CheckpointingProgress,
    ConsecutiveCheckpointFailures,
    Restored,
    TolerableFailuresExceeded,
)
from checkpointing.coordination.failure import TOLERABLE_FAILURES_EXCEEDED
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, CheckpointTask, Job, RestoreEvent
from checkpointing.metastore.outcome import epochs_done
from checkpointing.status import CheckpointStatus, RestoreStatus

log = logging.getLogger(__name__)


class CheckpointStatsTracker:
    """Watches one attempt of a job and reports its events to ``listeners``.

    :param attempt: the attempt id (its coordinator id): its restore is the one reported.
    :param failure_alert_threshold: consecutive checkpoint failures that raise a
        :class:`ConsecutiveCheckpointFailures` event (once per run of failures); None: never.
    """

    def __init__(
        self,
        job_id: str,
        metastore: Metastore,
        attempt: str,
        listeners: Sequence[CheckpointEventListener],
        *,
        failure_alert_threshold: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.job_id = job_id
        self.metastore = metastore
        self.attempt = attempt
        self.listeners = list(listeners)
        self.failure_alert_threshold = failure_alert_threshold
        self.clock = clock or SystemClock()
        #: the smallest checkpoint id not yet reported final (None: not started)
        self._floor: int | None = None
        self._reported: set[int] = set()
        self._restore_reported = False
        self._alerted_failures = False
        self._exceeded_reported = False
        #: the job's failure cause when the watch started: a new one is this attempt's
        self._initial_cause: str | None = None
        #: (time, epochs done) of the last progress point: the restore, then each completion
        self._progress: tuple[datetime, int] | None = None

    def start(self) -> None:
        """Report only what happens from now on: checkpoints the job has not yet triggered."""
        with self.metastore.transaction() as s:
            job = s.get(Job, self.job_id)
            self._floor = job.next_checkpoint_id if job is not None else 1
            self._initial_cause = job.failure_cause if job is not None else None
            self._alerted_failures = bool(
                job is not None
                and self.failure_alert_threshold is not None
                and job.consecutive_failures >= self.failure_alert_threshold
            )

    def replay(self) -> list[CheckpointEvent]:
        """Report the attempt's whole history at once, from its first checkpoint: for a watcher
        that comes after the fact (a deferred try's end, whose checkpoints the triggerer
        coordinated). The events reported."""
        self.start_at_attempt()
        return self.poll()

    def start_at_attempt(self) -> None:
        """Report from the attempt's first checkpoint (from now, when it has none yet): for a
        watcher that joins an attempt whose own process triggers its checkpoints (a script's
        driver may complete a step before the watcher's first pass)."""
        with self.metastore.reading() as s:
            first = s.scalar(
                select(func.min(Checkpoint.checkpoint_id)).where(
                    Checkpoint.job_id == self.job_id, Checkpoint.coordinator_id == self.attempt
                )
            )
        self.start()
        if first is not None:
            self._floor = first

    def poll(self) -> list[CheckpointEvent]:
        """Report what changed since the last poll; the events reported."""
        if self._floor is None:
            self.start()
        events = self._collect()
        for event in events:
            self.emit(event)
        return events

    def emit(self, event: CheckpointEvent) -> None:
        """Hand ``event`` to every listener; one that raises is logged, never propagated."""
        for listener in self.listeners:
            try:
                listener.on_event(event)
            except Exception:
                log.exception(
                    "job %s: checkpoint event listener %r failed on %s",
                    self.job_id,
                    listener,
                    type(event).__name__,
                )

    # ------------------------------------------------------------------ reading the metastore

    def _collect(self) -> list[CheckpointEvent]:
        now = self.clock.now()
        events: list[CheckpointEvent] = []
        with self.metastore.reading() as s:  # a watcher: never the write lock
            job = s.get(Job, self.job_id)
            if job is None:
                return []
            if not self._restore_reported:
                restored = self._restored(s)
                if restored is not None:
                    events.append(restored)
            rows = list(
                s.scalars(
                    select(Checkpoint)
                    .where(
                        Checkpoint.job_id == self.job_id,
                        Checkpoint.checkpoint_id >= (self._floor or 1),
                    )
                    .order_by(Checkpoint.checkpoint_id)
                )
            )
            for row in rows:
                if row.checkpoint_id in self._reported:
                    continue
                event = self._final(s, row, job.consecutive_failures)
                if event is not None:
                    self._reported.add(row.checkpoint_id)
                    events.append(event)
            pending = [r.checkpoint_id for r in rows if r.checkpoint_id not in self._reported]
            if rows:  # the first one still pending, else the one after the last seen
                self._floor = min(pending) if pending else rows[-1].checkpoint_id + 1
                self._reported = {c for c in self._reported if c >= self._floor}
            events += self._failure_alerts(s, job)
            age = (
                None
                if job.last_completion_at is None
                else max(0.0, (now - job.last_completion_at).total_seconds())
            )
            events.append(CheckpointingProgress(self.job_id, job.last_completed_id, age))
        return events

    def _final(self, s: Session, row: Checkpoint, consecutive: int) -> CheckpointEvent | None:
        """The event of a checkpoint that reached a final state; None while it is pending."""
        if row.completed_at is not None:
            done = epochs_done(s, self.job_id, row.checkpoint_id)
            throughput = None
            if done is not None and self._progress is not None:
                since, before = self._progress
                seconds = (row.completed_at - since).total_seconds()
                if seconds > 0 and done >= before:
                    throughput = (done - before) / seconds
            if done is not None:
                self._progress = (row.completed_at, done)
            return CheckpointCompleted(
                job_id=self.job_id,
                checkpoint_id=row.checkpoint_id,
                checkpoint_type=row.checkpoint_type,
                duration_s=max(0.0, (row.completed_at - row.trigger_at).total_seconds()),
                state_size=row.state_size or 0,
                checkpointed_size=row.checkpointed_size or 0,
                location=row.storage_location,
                epochs_done=done,
                epoch_throughput=throughput,
            )
        if row.status == CheckpointStatus.ABORTED:
            return CheckpointFailed(
                job_id=self.job_id,
                checkpoint_id=row.checkpoint_id,
                checkpoint_type=row.checkpoint_type,
                reason=row.failure_reason or "UNKNOWN",
                message=row.failure_message,
                consecutive_failures=consecutive,
            )
        return None

    def _failure_alerts(self, s: Session, job: Job) -> list[CheckpointEvent]:
        """The threshold alert (once per run of failures) and the exceeded ``tolerable_failures``
        (once): from the job's consecutive count, which the failure manager keeps."""
        events: list[CheckpointEvent] = []
        count = job.consecutive_failures or 0
        threshold = self.failure_alert_threshold
        if threshold is not None and count < threshold:
            self._alerted_failures = False
        last = self._last_failure(s) if threshold is not None and count >= threshold else None
        if threshold is not None and count >= threshold and not self._alerted_failures:
            self._alerted_failures = True
            events.append(
                ConsecutiveCheckpointFailures(
                    self.job_id,
                    count,
                    job.tolerable_failures,
                    last[0] if last else None,
                    last[1] if last else None,
                )
            )
        # the cause too: a coordinator stopping the failed job resets the count at once
        cause = job.failure_cause
        failed = bool(
            cause and cause != self._initial_cause and TOLERABLE_FAILURES_EXCEEDED in cause
        )
        if (count > job.tolerable_failures or failed) and not self._exceeded_reported:
            self._exceeded_reported = True
            events.append(
                TolerableFailuresExceeded(
                    self.job_id,
                    max(count, job.tolerable_failures + 1),
                    job.tolerable_failures,
                    cause,
                )
            )
        return events

    def _last_failure(self, s: Session) -> tuple[int, str] | None:
        row = s.execute(
            select(Checkpoint.checkpoint_id, Checkpoint.failure_reason)
            .where(
                Checkpoint.job_id == self.job_id,
                Checkpoint.status == CheckpointStatus.ABORTED,
            )
            .order_by(Checkpoint.checkpoint_id.desc())
            .limit(1)
        ).first()
        return None if row is None else (int(row[0]), str(row[1]))

    def _restored(self, s: Session) -> Restored | None:
        """The attempt's restore, once the driver recorded it (RESTORED, or EMPTY)."""
        row = s.scalars(
            select(RestoreEvent)
            .where(
                RestoreEvent.job_id == self.job_id,
                RestoreEvent.attempt == self.attempt,
                RestoreEvent.status.in_((RestoreStatus.RESTORED, RestoreStatus.EMPTY)),
            )
            .order_by(RestoreEvent.restore_id.desc())
            .limit(1)
        ).first()
        if row is None:
            return None
        self._restore_reported = True
        restored_id = row.checkpoint_id
        done = previous = redone = None
        if restored_id is not None:
            done = epochs_done(s, self.job_id, restored_id)
            previous = s.scalar(  # a pipeline's operators share one parallelism
                select(func.max(CheckpointTask.parallelism)).where(
                    CheckpointTask.job_id == self.job_id,
                    CheckpointTask.checkpoint_id == restored_id,
                )
            )
            newest = s.scalar(
                select(Checkpoint.checkpoint_id)
                .where(
                    Checkpoint.job_id == self.job_id,
                    Checkpoint.checkpoint_id > restored_id,
                    Checkpoint.completed_at.is_not(None),
                    Checkpoint.completed_at <= row.created_at,
                )
                .order_by(Checkpoint.checkpoint_id.desc())
                .limit(1)
            )
            newest_done = done if newest is None else epochs_done(s, self.job_id, newest)
            if done is not None and newest_done is not None:
                redone = max(0, newest_done - done)
        elif row.status == RestoreStatus.EMPTY:
            done = 0
        if done is not None:
            self._progress = (row.created_at, done)
        seconds = (row.assignment or {}).get("restore_s")
        return Restored(
            job_id=self.job_id,
            attempt=self.attempt,
            checkpoint_id=restored_id,
            external_path=row.external_path,
            parallelism=row.parallelism,
            previous_parallelism=previous,
            skipped=tuple(
                (int(f["checkpoint_id"]), str(f.get("reason", "")))
                for f in ((row.fallbacks or {}).get("skipped") or [])
            ),
            duration_s=float(seconds) if isinstance(seconds, int | float) else None,
            epochs_redone=redone,
            epochs_done=done,
        )
