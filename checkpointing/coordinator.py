"""The checkpoint coordinator (Flink's ``CheckpointCoordinator``), over the SQL metastore.

One coordinator is *active* per job at a time (the process that runs the job: later, the Airflow
operator). Other processes — Spark executors acking, a CLI asking for a savepoint — create a
``CheckpointCoordinator`` for the same job to use its ack/decline/request methods; the metastore
keeps them all consistent. Ordering rules follow Flink (see ``docs/architecture.md``):

* trigger: eager pre-checks → task plan → id → storage location → pre-checks again and insert
  the PENDING row in one transaction that locks the job row;
* ack: one transaction per batch; the committer of the last ack completes, exactly once;
* completion: write ``_metadata`` → mark COMPLETED → subsume → abort older pending → notify;
* fencing: the job row names the job's coordinator (Flink's fencing token of the leading
  JobMaster). Only it changes the job (trigger, status, stop, failover, shutdown, requests,
  notifications); a coordinator superseded by a newer one changes nothing of its successor's
  (acks, declines, expiry, completion), each checked in the transaction that makes the change.
  Processes that only ack, decline or request (executors, the CLI) never activate and are not
  fenced: what they touch is fenced by the checkpoint's owner instead.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import tenacity
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from checkpointing import decider, pending, store
from checkpointing.clock import Clock, SystemClock, ms
from checkpointing.config import CheckpointConfig, RetentionPolicy
from checkpointing.errors import OutcomeUnknownError, StorageError, UnknownJobError
from checkpointing.failure import (
    CheckpointException,
    CheckpointFailureManager,
    CheckpointFailureReason,
    CoordinatorSuperseded,
    TolerableFailuresExceeded,
    decline_reason,
)
from checkpointing.ids import validate_checkpoint_id, validate_id
from checkpointing.metadata import CheckpointMetadata
from checkpointing.metastore import Metastore
from checkpointing.models import Checkpoint, CheckpointAck, CheckpointTask, Job
from checkpointing.pending import AckResult, TaskAck, TaskSpec
from checkpointing.properties import (
    CheckpointProperties,
    CheckpointStatus,
    CheckpointType,
    JobStatus,
    RequestStatus,
)
from checkpointing.scheduler import PeriodicScheduler
from checkpointing.storage import CheckpointStorage, FileInfo, StorageLocation

log = logging.getLogger(__name__)

#: A completion notification: called with the completed checkpoint (Flink's
#: ``notifyCheckpointComplete``); this is where two-phase-commit sinks commit.
CompletionListener = Callable[["CompletedCheckpoint"], None]
PlanProvider = Callable[[], Sequence[TaskSpec] | None]

_REASONS_KEEP_QUEUED = (
    CheckpointFailureReason.TOO_MANY_CONCURRENT_CHECKPOINTS,
    CheckpointFailureReason.MINIMUM_TIME_BETWEEN_CHECKPOINTS,
)


@dataclass(frozen=True)
class PendingCheckpoint:
    job_id: str
    checkpoint_id: int
    checkpoint_type: CheckpointType
    trigger_at: datetime
    deadline_at: datetime
    location: str
    tasks: tuple[TaskSpec, ...]


@dataclass(frozen=True)
class CompletedCheckpoint:
    job_id: str
    checkpoint_id: int
    checkpoint_type: CheckpointType
    metadata_path: str
    location: str
    state_size: int
    metadata: CheckpointMetadata


@dataclass
class AckOutcome:
    results: dict[str, AckResult]
    completed: CompletedCheckpoint | None = None
    deleted_handles: list[str] = field(default_factory=list)
    #: acks never recorded, attempt → why (their checkpoint was declined)
    refused: dict[str, str] = field(default_factory=dict)


class CheckpointCoordinator:
    """Triggers, tracks and completes a job's checkpoints.

    :param job_id: the job (a path-safe id).
    :param metastore: the SQL metastore.
    :param storage: checkpoint storage; defaults to the job's registered storage URL.
    :param config: checkpoint configuration; given, it registers or updates the job; omitted, the
        job's stored configuration is used (the job must exist).
    :param plan_provider: returns the tasks a new checkpoint must wait for, or None when not all
        of them are running.
    :param completion_listeners: run after each completion (commit hooks), retried on failure.
    :param on_job_failure: called when failures exceed ``tolerable_failures``.
    """

    def __init__(
        self,
        job_id: str,
        metastore: Metastore,
        storage: CheckpointStorage | None = None,
        config: CheckpointConfig | None = None,
        *,
        coordinator_id: str | None = None,
        clock: Clock | None = None,
        plan_provider: PlanProvider | None = None,
        completion_listeners: Sequence[CompletionListener] = (),
        on_job_failure: Callable[[TolerableFailuresExceeded], None] | None = None,
        scheduler_rng: Any = None,
    ) -> None:
        self.job_id = validate_id(job_id, "job id")
        self.metastore = metastore
        self.clock = clock or SystemClock()
        self.coordinator_id = coordinator_id or f"coord-{uuid.uuid4().hex[:12]}"
        self.plan_provider = plan_provider
        self.completion_listeners = list(completion_listeners)
        self.on_job_failure = on_job_failure
        self.job_failure: TolerableFailuresExceeded | None = None
        self.config, storage_url = self._register(config, storage)
        self.storage = storage or CheckpointStorage.from_url(storage_url)
        self.failure_manager = CheckpointFailureManager(job_id, self.config.tolerable_failures)
        interval = self.config.periodic_interval
        self.scheduler = (
            PeriodicScheduler(interval, self.config.min_pause, scheduler_rng) if interval else None
        )
        self._lock = threading.RLock()
        self._notifying: set[int] = set()
        self._shutdown = False
        self._active = False
        self._thread: threading.Thread | None = None
        self._wakeup = threading.Event()
        self._stop_loop = threading.Event()
        #: set when a stop-with-savepoint completed: the job should now end
        self.stop_savepoint: CompletedCheckpoint | None = None

    # ================================================================ registration

    def _register(
        self, config: CheckpointConfig | None, storage: CheckpointStorage | None
    ) -> tuple[CheckpointConfig, str]:
        now = self.clock.now()
        with self.metastore.transaction() as s:
            job = s.get(Job, self.job_id, with_for_update=True)
            if config is None:
                if job is None:
                    raise UnknownJobError(f"unknown job {self.job_id!r}")
                return config_of(job), job.storage_url
            if storage is None and job is None:
                raise UnknownJobError(f"job {self.job_id!r} is new: give its checkpoint storage")
            url = storage.base_url if storage else job.storage_url  # type: ignore[union-attr]
            values = dict(
                storage_url=url,
                interval_ms=ms(config.interval) if config.interval is not None else None,
                timeout_ms=ms(config.timeout),
                min_pause_ms=ms(config.min_pause),
                max_concurrent=config.max_concurrent,
                tolerable_failures=config.tolerable_failures,
                retained=config.retained,
                retention=config.retention.value,
                prefer_checkpoint_for_recovery=config.prefer_checkpoint_for_recovery,
                updated_at=now,
            )
            if job is None:
                s.add(
                    Job(
                        job_id=self.job_id,
                        status=JobStatus.CREATED,
                        next_checkpoint_id=1,
                        periodic_scheduling=False,
                        consecutive_failures=0,
                        created_at=now,
                        **values,
                    )
                )
            else:
                for k, v in values.items():
                    setattr(job, k, v)
            return config, url

    # ================================================================ lifecycle

    def activate(self) -> list[int]:
        """Become the job's coordinator. Pending checkpoints of a previous coordinator (whose
        process died) are aborted as coordinator failover, which does not count as a failure."""
        now = self.clock.now()
        with self.metastore.transaction() as s:
            s.execute(
                update(Job)
                .where(Job.job_id == self.job_id)
                .values(coordinator_id=self.coordinator_id)
            )
            aborted = pending.abort(
                s,
                self.job_id,
                CheckpointFailureReason.CHECKPOINT_COORDINATOR_FAILOVER,
                "the previous coordinator is gone",
                now,
                not_by=self.coordinator_id,
            )
        self._active = True
        self._dispose([a.storage_location for a in aborted])
        if aborted:
            log.info(
                "job %s: took over coordination, aborted %s",
                self.job_id,
                [a.checkpoint_id for a in aborted],
            )
        return [a.checkpoint_id for a in aborted]

    def join(self) -> None:
        """Act as the coordinator the job row already names (the Spark driver of the Airflow
        operator that activated under this id). Unlike :meth:`activate` it never takes over: a
        driver that starts after a newer try took over is refused (``CoordinatorSuperseded``)
        instead of aborting the newer try's checkpoints. A job that names no coordinator yet
        is activated."""
        with self.metastore.transaction() as s:
            job = self._lock_job(s)
            successor = self._successor(job)
            named = job is not None and job.coordinator_id is not None
        if successor is not None:
            raise CoordinatorSuperseded(self.coordinator_id, self.job_id, successor)
        if not named:
            self.activate()
        self._active = True

    def job_status_changed(self, status: JobStatus) -> bool:
        """Flink's ``CheckpointCoordinatorDeActivator``: RUNNING starts periodic checkpointing,
        anything else stops it. False (nothing recorded) when another coordinator leads."""
        with self.metastore.transaction() as s:
            fenced = self._fenced(s, f"job status {status.value}")
            if not fenced:
                s.execute(
                    update(Job)
                    .where(Job.job_id == self.job_id)
                    .values(status=status, updated_at=self.clock.now())
                )
        if fenced:
            if self.scheduler is not None and status is not JobStatus.RUNNING:
                self.scheduler.stop()
            return False
        if status is JobStatus.RUNNING:
            if self.scheduler is not None:
                self.start_scheduler()
        else:
            self.stop_scheduler()
        return True

    def start_scheduler(self, *, background: bool = False) -> datetime:
        """Start periodic checkpointing; returns when the first trigger is due."""
        with self._lock:
            if self._shutdown:
                raise CheckpointException(CheckpointFailureReason.COORDINATOR_SHUTDOWN)
            if self.scheduler is None:
                raise CheckpointException(
                    CheckpointFailureReason.PERIODIC_SCHEDULER_SHUTDOWN,
                    "periodic checkpointing is not configured (interval off or below 10ms)",
                )
            if not self._active:
                self.activate()
            with self.metastore.transaction() as s:
                successor = self._successor(self._lock_job(s))
                if successor is None:
                    s.execute(
                        update(Job)
                        .where(Job.job_id == self.job_id)
                        .values(periodic_scheduling=True)
                    )
            if successor is not None:
                raise CoordinatorSuperseded(self.coordinator_id, self.job_id, successor)
            first = self.scheduler.start(self.clock.now())
        if background:
            self.run_in_background()
        return first

    def stop_scheduler(self) -> None:
        """Stop periodic triggers, abort pending checkpoints (coordinator suspended), drop queued
        requests and reset the failure count (Flink's ``stopCheckpointScheduler``)."""
        now = self.clock.now()
        with self._lock:
            if self.scheduler is not None:
                self.scheduler.stop()
            with self.metastore.transaction() as s:
                if self._fenced(s, "stopping the scheduler"):
                    return
                s.execute(
                    update(Job).where(Job.job_id == self.job_id).values(periodic_scheduling=False)
                )
                aborted = pending.abort(
                    s,
                    self.job_id,
                    CheckpointFailureReason.CHECKPOINT_COORDINATOR_SUSPEND,
                    "Checkpoint Coordinator is suspending.",
                    now,
                )
                decider.drop_queued(s, self.job_id, "checkpoint coordinator is suspending", now)
                self.failure_manager.reset(s)
        self._dispose([a.storage_location for a in aborted])

    def failover(self, message: str = "job failover") -> list[int]:
        """A task attempt failed: abort pending checkpoints (not counted as failures) so the next
        attempt need not wait for them to expire. Nothing when another coordinator leads."""
        with self.metastore.transaction() as s:
            if self._fenced(s, "failover"):
                return []
            aborted = pending.abort(
                s, self.job_id, CheckpointFailureReason.JOB_FAILOVER, message, self.clock.now()
            )
        self._dispose([a.storage_location for a in aborted])
        return [a.checkpoint_id for a in aborted]

    def shutdown(self, job_status: JobStatus) -> list[int]:
        """The job ended: stop, abort what is pending, apply the retention policy to completed
        checkpoints. Returns the ids of discarded checkpoints. A coordinator that another one
        superseded only stops itself: the job, its checkpoints and files are its successor's."""
        self.stop_background()
        now = self.clock.now()
        with self._lock:
            self._shutdown = True
            if self.scheduler is not None:
                self.scheduler.stop()
            with self.metastore.transaction() as s:
                if self._fenced(s, f"shutdown ({job_status.value})"):
                    return []
                aborted = pending.abort(
                    s,
                    self.job_id,
                    CheckpointFailureReason.JOB_TERMINATED,
                    f"job {job_status.value.lower()}",
                    now,
                )
                decider.drop_queued(s, self.job_id, f"job {job_status.value.lower()}", now)
                disposals = store.shutdown(s, self.job_id, job_status, now)
                s.execute(
                    update(Job)
                    .where(Job.job_id == self.job_id)
                    .values(status=job_status, periodic_scheduling=False, updated_at=now)
                )
        self._dispose(
            [a.storage_location for a in aborted] + [d.storage_location for d in disposals]
        )
        return [d.checkpoint_id for d in disposals]

    @property
    def is_shutdown(self) -> bool:
        return self._shutdown

    # ================================================================ background loop

    def run_once(self) -> PendingCheckpoint | None:
        """One pass of the coordinator loop: expire overdue checkpoints, trigger queued requests,
        retry unfinished notifications, and fire the periodic trigger when due. Never raises
        (a dying timer would silently stop checkpointing, as Flink's ``ScheduledTrigger`` notes)."""
        triggered = None
        try:
            self.expire_overdue()
            self.complete_fully_acknowledged()
            self.process_requests()
            self.notify_pending_completions()
            if self.scheduler is not None and self.scheduler.due(self.clock.now()):
                self.scheduler.fired(self.clock.now())
                triggered = self.trigger_checkpoint(periodic=True)
        except CheckpointException as exc:
            log.info("job %s: periodic checkpoint not triggered: %s", self.job_id, exc)
        except Exception:
            log.exception("job %s: error in the checkpoint coordinator loop", self.job_id)
        return triggered

    def run_in_background(self, poll: timedelta = timedelta(milliseconds=200)) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop_loop.clear()

        def loop() -> None:
            while not self._stop_loop.is_set():
                self.run_once()
                self._wakeup.wait(poll.total_seconds())
                self._wakeup.clear()

        self._thread = threading.Thread(
            target=loop, name=f"ckpt-coordinator-{self.job_id}", daemon=True
        )
        self._thread.start()

    def stop_background(self) -> None:
        self._stop_loop.set()
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._thread = None

    # ================================================================ trigger

    def trigger_checkpoint(
        self,
        *,
        periodic: bool = False,
        checkpoint_type: CheckpointType = CheckpointType.CHECKPOINT,
        forced: bool = False,
        target: str | None = None,
        tasks: Sequence[TaskSpec] | None = None,
        request_id: int | None = None,
    ) -> PendingCheckpoint:
        """Trigger a checkpoint or savepoint now; raises :class:`CheckpointException` when a
        pre-check refuses it. ``tasks`` overrides the plan provider."""
        props = (
            CheckpointProperties.for_savepoint(
                stop=checkpoint_type is CheckpointType.SAVEPOINT_THEN_STOP
            )
            if checkpoint_type.is_savepoint
            else CheckpointProperties.for_checkpoint(self.config.retention, forced=forced)
        )
        timer = periodic and request_id is None  # fired by this coordinator's timer
        with self._lock:
            self._precheck_local(timer)
        with self.metastore.transaction() as s:
            successor = self._successor(self._lock_job(s))  # may queue a request: fence first
            refusal = (
                CoordinatorSuperseded(self.coordinator_id, self.job_id, successor)
                if successor is not None
                else self._precheck(s, props, periodic, request_id)
            )
        if refusal is not None:
            raise refusal

        plan = tuple(tasks) if tasks is not None else self._plan()
        checkpoint_id = self._next_checkpoint_id()
        now = self.clock.now()
        location: StorageLocation | None = None
        try:
            location = (
                self.storage.initialize_location_for_savepoint(self.job_id, checkpoint_id, target)
                if checkpoint_type.is_savepoint
                else self.storage.initialize_location_for_checkpoint(self.job_id, checkpoint_id)
            )
            with self._lock:
                self._precheck_local(timer)
            with self.metastore.transaction() as s:
                job = self._lock_job(s)  # serialise triggers, and with a takeover
                successor = self._successor(job)
                refusal = (
                    CoordinatorSuperseded(self.coordinator_id, self.job_id, successor)
                    if successor is not None
                    else self._precheck(s, props, periodic, request_id)
                )
                deadline = now + self.config.timeout
                if refusal is None:
                    pending.insert_pending(
                        s,
                        job_id=self.job_id,
                        checkpoint_id=checkpoint_id,
                        props=props,
                        periodic=periodic,
                        trigger_at=now,
                        deadline_at=deadline,
                        location=location.reference,
                        tasks=plan,
                        coordinator_id=self.coordinator_id,
                        request_id=request_id,
                    )
                if refusal is None and request_id is not None:
                    decider.finish(
                        s, request_id, RequestStatus.TRIGGERED, now, checkpoint_id=checkpoint_id
                    )
            if refusal is not None:
                raise refusal
        except CheckpointException:
            if location is not None:
                location.dispose_on_failure()
            raise
        except Exception as exc:
            if location is not None:
                location.dispose_on_failure()
            self._count_failure(
                CheckpointFailureReason.TRIGGER_CHECKPOINT_FAILURE,
                None,
                props.checkpoint_type.is_savepoint,
            )
            raise CheckpointException(
                CheckpointFailureReason.TRIGGER_CHECKPOINT_FAILURE,
                f"checkpoint {checkpoint_id}: {exc}",
            ) from exc
        log.info(
            "job %s: triggered %s %d (%d tasks)",
            self.job_id,
            checkpoint_type.value.lower(),
            checkpoint_id,
            len(plan),
        )
        return PendingCheckpoint(
            self.job_id, checkpoint_id, checkpoint_type, now, deadline, location.reference, plan
        )

    def trigger_savepoint(
        self, target: str | None = None, *, stop: bool = False
    ) -> PendingCheckpoint:
        return self.trigger_checkpoint(
            checkpoint_type=CheckpointType.SAVEPOINT_THEN_STOP
            if stop
            else CheckpointType.SAVEPOINT,
            forced=True,
            target=target,
        )

    # ================================================================ fencing

    def _lock_job(self, s: Session) -> Job | None:
        """The job row, locked until commit: a takeover (``activate``) waits for the caller's
        transaction, so a check made on the row holds for the change made after it."""
        return s.get(Job, self.job_id, with_for_update=True)

    def _successor(self, job: Job | None) -> str | None:
        """The coordinator the job row names when it is not this one (an attempt that outlived
        its task, e.g. a Spark driver orphaned by a killed Airflow worker, was superseded by
        it), else None. A job that never had a coordinator fences nobody."""
        current = job.coordinator_id if job is not None else None
        return current if current is not None and current != self.coordinator_id else None

    def _fenced(self, s: Session, what: str, *, shared: bool = False) -> bool:
        """Lock the job row and tell whether this coordinator must leave the job alone.
        ``shared``: work any process may do for the current coordinator (expiry): refused only
        to a coordinator that activated and was superseded since."""
        successor = self._successor(self._lock_job(s))
        if successor is None or (shared and not self._active):
            return False
        log.warning(
            "job %s: %s refused: coordinator %s was superseded by %s",
            self.job_id,
            what,
            self.coordinator_id,
            successor,
        )
        return True

    def _foreign(self, job: Job | None, owner: str | None) -> str | None:
        """Why this coordinator must not touch a checkpoint owned by ``owner`` (acks, declines,
        completion), else None: its owner is no longer the job's coordinator, or this one
        activated and then was superseded (its listeners and config are not the job's)."""
        current = job.coordinator_id if job is not None else None
        if current is not None and owner != current:
            return f"its coordinator {owner} was superseded by {current}"
        if self._active and owner != self.coordinator_id:
            return f"coordinator {self.coordinator_id} was superseded by {current or owner}"
        return None

    def _precheck_local(self, periodic: bool) -> None:
        if self._shutdown:
            raise CheckpointException(CheckpointFailureReason.COORDINATOR_SHUTDOWN)
        if periodic and (self.scheduler is None or not self.scheduler.running):
            raise CheckpointException(CheckpointFailureReason.PERIODIC_SCHEDULER_SHUTDOWN)

    def _precheck(
        self, s: Session, props: CheckpointProperties, periodic: bool, request_id: int | None
    ) -> CheckpointException | None:
        """Flink's ``preCheckBeforeTriggeringCheckpoint``: forced requests bypass the limits, and
        the min pause holds back periodic ones only (Flink's ``CheckpointRequestDecider``: a
        manual checkpoint is triggered at once).

        Returns the refusal instead of raising it, so that the caller's transaction commits what
        the check recorded (a request queued behind the pending checkpoints)."""
        if props.forced:
            return None
        if decider.queued_non_forced(s, self.job_id, exclude=request_id) is not None:
            return CheckpointException(
                CheckpointFailureReason.ALREADY_QUEUED,
                "another checkpoint request is queued already",
            )
        num_pending = (
            s.scalar(
                select(func.count()).where(
                    Checkpoint.job_id == self.job_id, Checkpoint.status == CheckpointStatus.PENDING
                )
            )
            or 0
        )
        if num_pending >= self.config.max_concurrent:
            if request_id is None:
                decider.enqueue(
                    s,
                    self.job_id,
                    props.checkpoint_type,
                    requested_by=self.coordinator_id,
                    now=self.clock.now(),
                    periodic=periodic,
                )
            return CheckpointException(
                CheckpointFailureReason.TOO_MANY_CONCURRENT_CHECKPOINTS,
                f"{num_pending} pending, max_concurrent={self.config.max_concurrent}; "
                "request queued",
            )
        job = s.get(Job, self.job_id)
        if periodic and job is not None and job.last_completion_at is not None:
            earliest = job.last_completion_at + self.config.min_pause
            if self.clock.now() < earliest:
                if periodic and self.scheduler is not None:
                    self.scheduler.reschedule_at(earliest)
                return CheckpointException(
                    CheckpointFailureReason.MINIMUM_TIME_BETWEEN_CHECKPOINTS,
                    f"min pause not over until {earliest.isoformat()}",
                )
        return None

    def _plan(self) -> tuple[TaskSpec, ...]:
        plan = self.plan_provider() if self.plan_provider else None
        if not plan:
            raise CheckpointException(
                CheckpointFailureReason.NOT_ALL_REQUIRED_TASKS_RUNNING,
                "no running execution attempt to checkpoint",
            )
        return tuple(plan)

    def _next_checkpoint_id(self) -> int:
        """Strictly increasing per job, unique across racing coordinators (the job row is the
        counter; its update is atomic on every backend)."""
        with self.metastore.transaction() as s:
            new = s.execute(
                update(Job)
                .where(Job.job_id == self.job_id)
                .values(next_checkpoint_id=Job.next_checkpoint_id + 1)
                .returning(Job.next_checkpoint_id)
            ).scalar_one()
        return int(new) - 1

    # ================================================================ requests

    def request(
        self,
        checkpoint_type: CheckpointType = CheckpointType.SAVEPOINT,
        *,
        requested_by: str,
        forced: bool = False,
        target: str | None = None,
    ) -> int:
        """Queue a request for the active coordinator (any process may call this)."""
        if target:
            self.storage.check_target(target)
        with self.metastore.transaction() as s:
            req = decider.enqueue(
                s,
                self.job_id,
                checkpoint_type,
                requested_by=requested_by,
                now=self.clock.now(),
                forced=forced,
                target=target,
            )
            request_id = req.request_id
        self._wakeup.set()
        return request_id

    def process_requests(self) -> list[PendingCheckpoint]:
        """Trigger queued requests in priority order while the limits allow. A coordinator that
        another one leads leaves them queued for it."""
        if self._shutdown:
            return []
        with self.metastore.transaction() as s:
            if self._fenced(s, "request handling"):
                return []
            queued = [
                (
                    r.request_id,
                    CheckpointType(r.checkpoint_type),
                    r.forced,
                    r.periodic,
                    r.target_location,
                )
                for r in decider.next_requests(s, self.job_id)
            ]
        triggered = []
        for request_id, ctype, forced, periodic, target in queued:
            try:
                triggered.append(
                    self.trigger_checkpoint(
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
                if exc.reason in _REASONS_KEEP_QUEUED:
                    continue  # stays queued; forced ones behind it may still go
                with self.metastore.transaction() as s:
                    if self._fenced(s, "request handling"):
                        break
                    decider.finish(
                        s, request_id, RequestStatus.FAILED, self.clock.now(), message=str(exc)
                    )
        return triggered

    # ================================================================ acks and declines

    def receive_acknowledge(self, checkpoint_id: int, acks: Sequence[TaskAck]) -> AckOutcome:
        """Record a batch of task acks in one transaction; the caller whose ack is the last one
        completes the checkpoint. An ack that fails :func:`pending.ack_problem` is never
        recorded: it declines its checkpoint (``outcome.refused`` says why)."""
        checkpoint_id = validate_checkpoint_id(checkpoint_id)
        for a in acks:
            validate_id(a.attempt_id, "attempt id")
        with self.metastore.session(autocommit=True) as s, s.begin():
            row = s.execute(
                select(Checkpoint.coordinator_id, Checkpoint.storage_location).where(
                    Checkpoint.job_id == self.job_id, Checkpoint.checkpoint_id == checkpoint_id
                )
            ).one_or_none()
        if row is None:
            return AckOutcome({a.attempt_id: AckResult.UNKNOWN for a in acks})
        owner, location_url = row
        if self._active and owner != self.coordinator_id:  # the owner never changes
            raise CoordinatorSuperseded(self.coordinator_id, self.job_id, str(owner))
        location = self.storage.location_for(location_url)
        roots = (location.url, self.storage.shared_url(self.job_id))
        refused: dict[str, str] = {}
        for a in acks:
            problem = pending.ack_problem(a, location, roots, self.storage)
            if problem is not None:
                refused.setdefault(a.attempt_id, problem)
        declined: dict[str, AckResult] = {}
        if refused:  # decline first: the valid acks of the batch are then DISCARDED
            log.warning(
                "job %s: checkpoint %d: acks refused: %s", self.job_id, checkpoint_id, refused
            )
            self.expire_overdue()  # an overdue checkpoint expires rather than being declined
            declined, _ = self._decline(
                checkpoint_id,
                {a: f"ack refused: {p}" for a, p in refused.items()},
                CheckpointFailureReason.CHECKPOINT_DECLINED,
            )
        acks = [a for a in acks if a.attempt_id not in refused]
        now = self.clock.now()
        remaining = None
        results: dict[str, AckResult] = {}
        # on PostgreSQL both steps are single statements: run them as their own transactions
        with self.metastore.session(autocommit=True) as s:
            if acks:
                with s.begin():
                    results = pending.acknowledge(s, self.job_id, checkpoint_id, acks, now)
            # SUCCESS: maybe ours was the last ack. DUPLICATE: maybe the last acker died before
            # completing and this is the task's retry; either way, count after the commit.
            if {AckResult.SUCCESS, AckResult.DUPLICATE} & set(results.values()):
                with s.begin():
                    remaining = pending.remaining_tasks(s, self.job_id, checkpoint_id)
        outcome = AckOutcome({**results, **declined}, refused=refused)
        rejected = [
            a for a in acks if results.get(a.attempt_id) in (AckResult.UNKNOWN, AckResult.DISCARDED)
        ]
        if rejected:
            outcome.deleted_handles = self._discard_ack_state(checkpoint_id, rejected)
            if any(results[a.attempt_id] is AckResult.DISCARDED for a in rejected):
                self.expire_overdue()
        if remaining == 0:
            outcome.completed = self.complete_checkpoint(checkpoint_id)
        return outcome

    def acknowledge_task(self, checkpoint_id: int, ack: TaskAck) -> AckResult:
        return self.receive_acknowledge(checkpoint_id, [ack]).results[ack.attempt_id]

    def receive_decline(
        self,
        checkpoint_id: int,
        attempt_id: str,
        reason: CheckpointFailureReason | str = CheckpointFailureReason.CHECKPOINT_DECLINED,
        message: str | None = None,
    ) -> bool:
        """A task could not (or need not) snapshot: abort the checkpoint with the task's reason,
        one of :data:`failure.DECLINE_REASONS` (Flink's ``DeclineCheckpoint``). Only the counted
        ones (a failed snapshot) count towards ``tolerable_failures``; a task that is not ready
        or closing declines without failing the job. A ``reason`` that names no reason at all is
        the message of a ``CHECKPOINT_DECLINED`` (callers from before reasons)."""
        checkpoint_id = validate_checkpoint_id(checkpoint_id)
        validate_id(attempt_id, "attempt id")
        if reason not in CheckpointFailureReason.__members__.values() and message is None:
            reason, message = CheckpointFailureReason.CHECKPOINT_DECLINED, str(reason)
        cause = decline_reason(reason)
        results, aborted = self._decline(checkpoint_id, {attempt_id: message or cause.value}, cause)
        if results[attempt_id] is AckResult.UNKNOWN:
            log.info(
                "job %s: decline of checkpoint %d from unknown attempt %s ignored",
                self.job_id,
                checkpoint_id,
                attempt_id,
            )
        return aborted

    def _decline(
        self, checkpoint_id: int, messages: dict[str, str], reason: CheckpointFailureReason
    ) -> tuple[dict[str, AckResult], bool]:
        """Abort a PENDING checkpoint for the first planned attempt of ``messages`` (attempt →
        why); whether it did. Per attempt: DISCARDED when planned (nothing of it counts), UNKNOWN
        when not in the plan (ignored, as Flink ignores such declines)."""
        now = self.clock.now()
        with self.metastore.transaction() as s:
            job = self._lock_job(s)  # the owner check holds until commit
            row = s.get(Checkpoint, (self.job_id, checkpoint_id))
            if row is not None and self._active and row.coordinator_id != self.coordinator_id:
                current = job.coordinator_id if job is not None else None
                raise CoordinatorSuperseded(self.coordinator_id, self.job_id, str(current))
            foreign = row is None or self._foreign(job, row.coordinator_id) is not None
            results, aborted = pending.decline(
                s, self.job_id, checkpoint_id, messages, reason, now, may_abort=not foreign
            )
            failure = self._count_in(s, aborted, reason)
        self._after_abort(aborted, failure)
        return results, bool(aborted)

    def expire_overdue(self) -> list[int]:
        """Abort pending checkpoints past their deadline (Flink's canceller); counted. Any
        process may (an acker finding its checkpoint overdue), but not a superseded coordinator."""
        with self.metastore.transaction() as s:
            if self._fenced(s, "expiry", shared=True):
                return []
            aborted = pending.abort(
                s,
                self.job_id,
                CheckpointFailureReason.CHECKPOINT_EXPIRED,
                f"not completed within the timeout of {self.config.timeout}",
                self.clock.now(),
                overdue=True,
            )
            failure = self._count_in(s, aborted, CheckpointFailureReason.CHECKPOINT_EXPIRED)
        self._after_abort(aborted, failure)
        return [a.checkpoint_id for a in aborted]

    def _discard_ack_state(self, checkpoint_id: int, acks: Sequence[TaskAck]) -> list[str]:
        """Delete state files of UNKNOWN/DISCARDED acks — only inside the location of a checkpoint
        that is pending or was aborted (never completed, never after a metadata write of unknown
        outcome), never its ``_metadata``, and never a file a recorded ack references."""
        with self.metastore.transaction() as s:
            row = s.get(Checkpoint, (self.job_id, checkpoint_id))
            handles = [a.state_handle for a in acks if a.state_handle]
            # exclusive state lives in its own checkpoint's directory (shared state under
            # shared/ is never deleted here), so only this checkpoint's acks can reference it
            referenced = (
                set(
                    s.scalars(
                        select(CheckpointAck.state_handle).where(
                            CheckpointAck.job_id == self.job_id,
                            CheckpointAck.checkpoint_id == checkpoint_id,
                            CheckpointAck.state_handle.in_(handles),
                        )
                    )
                )
                if handles
                else set()
            )
        if row is None or row.status not in (CheckpointStatus.PENDING, CheckpointStatus.ABORTED):
            return []
        if row.failure_reason == CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE:
            return []  # the metadata may exist: delete nothing (see complete_checkpoint)
        location = self.storage.location_for(row.storage_location)
        deleted = []
        for handle in handles:
            if handle in referenced or handle == location.metadata_url or not location.owns(handle):
                log.warning(
                    "job %s: not deleting %s (referenced or outside %s)",
                    self.job_id,
                    handle,
                    location.url,
                )
                continue
            try:
                self.storage.delete(handle)
                deleted.append(handle)
            except Exception:
                log.exception("job %s: could not delete rejected state %s", self.job_id, handle)
        return deleted

    # ================================================================ completion

    def complete_checkpoint(self, checkpoint_id: int) -> CompletedCheckpoint | None:
        """Complete a fully acknowledged checkpoint; returns None if another caller does it (or
        it was aborted meanwhile). Order: ``_metadata`` → COMPLETED → subsume → abort older
        pending → notifications. Whatever fails after the completion claim aborts the
        checkpoint with ``FINALIZE_CHECKPOINT_FAILURE``: none is left PENDING and claimed."""
        token = f"{self.coordinator_id}/{uuid.uuid4().hex[:8]}"
        with self.metastore.transaction() as s:
            job = self._lock_job(s)  # with a takeover: the owner check holds for the claim
            owner = s.scalar(
                select(Checkpoint.coordinator_id).where(
                    Checkpoint.job_id == self.job_id, Checkpoint.checkpoint_id == checkpoint_id
                )
            )
            foreign = self._foreign(job, owner)
            if foreign is not None:
                log.warning(
                    "job %s: not completing checkpoint %d: %s", self.job_id, checkpoint_id, foreign
                )
                return None
            if pending.remaining_tasks(s, self.job_id, checkpoint_id) != 0:
                return None
            if not pending.claim_completion(s, self.job_id, checkpoint_id, token):
                return None
        now = self.clock.now()
        try:
            ctype, location_url, tasks, metadata = self._finalize(checkpoint_id, now)
            location = self.storage.location_for(location_url)
            data = metadata.to_bytes()
        except Exception as exc:  # e.g. a recorded ack that no _metadata can hold
            log.exception("job %s: checkpoint %d: no metadata", self.job_id, checkpoint_id)
            self._abort_finalize(
                checkpoint_id, f"could not build the metadata: {exc}", dispose=True
            )
            return None
        try:
            info = self.storage.write_bytes(location.metadata_url, data, overwrite=False)
        except OutcomeUnknownError as exc:
            # the metadata may exist: abort, but delete nothing (Flink's PossibleInconsistentState)
            self._abort_finalize(
                checkpoint_id, f"metadata write outcome unknown: {exc}", dispose=False
            )
            return None
        except (StorageError, OSError) as exc:
            self._abort_finalize(checkpoint_id, f"could not write metadata: {exc}", dispose=True)
            return None
        except Exception as exc:  # not a storage error: its outcome is unknown
            self._abort_finalize(checkpoint_id, f"metadata write failed: {exc}", dispose=False)
            return None
        try:
            marked = self._mark_completed(checkpoint_id, token, ctype, metadata, info)
        except Exception as exc:
            log.exception("job %s: checkpoint %d: completion failed", self.job_id, checkpoint_id)
            try:  # aborts nothing if the COMPLETED row did commit
                self._abort_finalize(
                    checkpoint_id, f"could not record completion: {exc}", dispose=True
                )
            except Exception:
                log.exception("job %s: checkpoint %d: abort failed too", self.job_id, checkpoint_id)
            raise
        if marked is None:
            log.warning(
                "job %s: checkpoint %d was aborted while completing", self.job_id, checkpoint_id
            )
            self.storage.delete(location.metadata_url)
            return None
        disposals, older = marked
        self._dispose([d.storage_location for d in disposals] + [a.storage_location for a in older])
        completed = CompletedCheckpoint(
            self.job_id, checkpoint_id, ctype, info.url, location_url, metadata.state_size, metadata
        )
        log.info(
            "job %s: completed %s %d (%d bytes, %d tasks)%s",
            self.job_id,
            ctype.value.lower(),
            checkpoint_id,
            metadata.state_size,
            len(tasks),
            f", subsumed {[d.checkpoint_id for d in disposals]}" if disposals else "",
        )
        if ctype is CheckpointType.SAVEPOINT_THEN_STOP:
            self.stop_savepoint = completed
        if self.completion_listeners:
            self._notify(completed)
        if self._active:
            self.process_requests()
        return completed

    def _finalize(
        self, checkpoint_id: int, now: datetime
    ) -> tuple[CheckpointType, str, Sequence[CheckpointTask], CheckpointMetadata]:
        """The claimed checkpoint's type, location, plan and ``_metadata``."""
        with self.metastore.transaction() as s:
            row = s.get(Checkpoint, (self.job_id, checkpoint_id))
            assert row is not None
            tasks = s.scalars(
                select(CheckpointTask).where(
                    CheckpointTask.job_id == self.job_id,
                    CheckpointTask.checkpoint_id == checkpoint_id,
                )
            ).all()
            acks = {
                a.attempt_id: a
                for a in s.scalars(
                    select(CheckpointAck).where(
                        CheckpointAck.job_id == self.job_id,
                        CheckpointAck.checkpoint_id == checkpoint_id,
                    )
                )
            }
            ctype = CheckpointType(row.checkpoint_type)
            metadata = pending.build_metadata(
                self.job_id, checkpoint_id, ctype, row.trigger_at, now, tasks, acks
            )
            return ctype, row.storage_location, tasks, metadata

    def _mark_completed(
        self,
        checkpoint_id: int,
        token: str,
        ctype: CheckpointType,
        metadata: CheckpointMetadata,
        info: FileInfo,
    ) -> tuple[list[store.Disposal], list[pending.AbortedCheckpoint]] | None:
        """Steps 2 to 4 of completion in one transaction: COMPLETED (None if no longer ours to
        complete), subsume, abort older pending; returns what to delete after the commit."""
        now = metadata.completed_at
        with self.metastore.transaction() as s:
            self._lock_job(s)  # the job row before the checkpoint rows, as a takeover does
            marked = s.execute(
                update(Checkpoint)
                .where(
                    Checkpoint.job_id == self.job_id,
                    Checkpoint.checkpoint_id == checkpoint_id,
                    Checkpoint.status == CheckpointStatus.PENDING,
                    Checkpoint.completing_by == token,
                )
                .values(
                    status=CheckpointStatus.COMPLETED,
                    completed_at=now,
                    metadata_path=info.url,
                    metadata_checksum=info.checksum,
                    state_size=metadata.state_size,
                )
                .returning(Checkpoint.request_id)
            ).one_or_none()
            if marked is None:
                return None
            s.execute(
                update(Job)
                .where(Job.job_id == self.job_id)
                .values(
                    last_completed_id=func.coalesce(
                        func.greatest(Job.last_completed_id, checkpoint_id)
                        if self.metastore.dialect == "postgresql"
                        else func.max(func.coalesce(Job.last_completed_id, 0), checkpoint_id),
                        checkpoint_id,
                    ),
                    last_completion_at=now,
                )
            )
            self.failure_manager.reset(s)
            if marked[0] is not None:
                decider.finish(
                    s, marked[0], RequestStatus.COMPLETED, now, checkpoint_id=checkpoint_id
                )
            disposals = (
                store.subsume(s, self.job_id, self.config.retained, now)
                if ctype is CheckpointType.CHECKPOINT
                else []
            )
            # Flink 1.15+: a savepoint subsumes nothing, a stop-with-savepoint does
            older = (
                pending.abort(
                    s,
                    self.job_id,
                    CheckpointFailureReason.CHECKPOINT_SUBSUMED,
                    f"subsumed by completed {ctype.value.lower()} {checkpoint_id}",
                    now,
                    below_id=checkpoint_id,
                    include_savepoints=False,
                )
                if ctype is not CheckpointType.SAVEPOINT
                else []
            )
        return disposals, older

    def complete_fully_acknowledged(self) -> list[int]:
        """Complete PENDING checkpoints that have every ack but were never completed (the
        process that committed the last ack died before claiming completion)."""
        acked = pending.acked_count()
        with self.metastore.transaction() as s:
            ids = s.scalars(
                select(Checkpoint.checkpoint_id)
                .where(
                    Checkpoint.job_id == self.job_id,
                    Checkpoint.status == CheckpointStatus.PENDING,
                    Checkpoint.completing_by.is_(None),
                    Checkpoint.num_tasks == acked,
                )
                .order_by(Checkpoint.checkpoint_id)
            ).all()
        return [i for i in ids if self.complete_checkpoint(i) is not None]

    def _abort_finalize(self, checkpoint_id: int, message: str, *, dispose: bool) -> None:
        with self.metastore.transaction() as s:
            aborted = pending.abort(
                s,
                self.job_id,
                CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE,
                message,
                self.clock.now(),
                checkpoint_ids=[checkpoint_id],
            )
            failure = self._count_in(
                s, aborted, CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE
            )
        log.error(
            "job %s: checkpoint %d failed to finalize: %s", self.job_id, checkpoint_id, message
        )
        self._after_abort(aborted, failure, dispose=dispose)

    # ================================================================ notifications

    def _notify(self, completed: CompletedCheckpoint, *, recheck: bool = False) -> bool:
        """Run every completion listener, each retried; success is recorded so it runs once.

        One notification per checkpoint at a time in this process (the completing thread and
        the loop's retry must not both commit); ``recheck``: skip it if it succeeded since the
        caller looked. Listeners must still be idempotent: a restore may commit again."""
        with self._lock:
            if completed.checkpoint_id in self._notifying:
                return False
            self._notifying.add(completed.checkpoint_id)
        try:
            if recheck:
                with self.metastore.transaction() as s:
                    row = s.get(Checkpoint, (self.job_id, completed.checkpoint_id))
                    if row is None or row.notified_at is not None:
                        return row is not None
            return self._run_listeners(completed)
        finally:
            with self._lock:
                self._notifying.discard(completed.checkpoint_id)

    def _run_listeners(self, completed: CompletedCheckpoint) -> bool:
        errors = []
        for listener in self.completion_listeners:
            try:
                for attempt in tenacity.Retrying(
                    stop=tenacity.stop_after_attempt(3),
                    wait=tenacity.wait_exponential(multiplier=0.05, max=1),
                    reraise=True,
                ):
                    with attempt:
                        listener(completed)
            except Exception as exc:
                log.exception(
                    "job %s: completion notification for checkpoint %d failed",
                    self.job_id,
                    completed.checkpoint_id,
                )
                errors.append(f"{getattr(listener, '__name__', listener)!s}: {exc}")
        with self.metastore.transaction() as s:
            s.execute(
                update(Checkpoint)
                .where(
                    Checkpoint.job_id == self.job_id,
                    Checkpoint.checkpoint_id == completed.checkpoint_id,
                )
                .values(
                    notified_at=None if errors else self.clock.now(),
                    notify_error="; ".join(errors) or None,
                )
            )
        return not errors

    def notify_pending_completions(self) -> list[int]:
        """Re-run notifications of completed checkpoints whose hooks have not all succeeded
        (failed earlier, or completed by a process without the hooks). Oldest first."""
        if not self.completion_listeners:
            return []
        from checkpointing.metadata import read_metadata

        with self.metastore.transaction() as s:
            if self._fenced(s, "notifications"):  # the successor's listeners commit them
                return []
            rows = s.scalars(
                select(Checkpoint)
                .where(
                    Checkpoint.job_id == self.job_id,
                    Checkpoint.status == CheckpointStatus.COMPLETED,
                    Checkpoint.notified_at.is_(None),
                )
                .order_by(Checkpoint.checkpoint_id)
            ).all()
        done = []
        for row in rows:
            assert row.metadata_path is not None
            metadata = read_metadata(self.storage, row.metadata_path, row.metadata_checksum)
            completed = CompletedCheckpoint(
                self.job_id,
                row.checkpoint_id,
                CheckpointType(row.checkpoint_type),
                row.metadata_path,
                row.storage_location,
                row.state_size,
                metadata,
            )
            if self._notify(completed, recheck=True):
                done.append(row.checkpoint_id)
        return done

    # ================================================================ helpers

    def _count_failure(
        self, reason: CheckpointFailureReason, checkpoint_id: int | None, is_savepoint: bool
    ) -> None:
        with self.metastore.transaction() as s:
            failure = self.failure_manager.record_failure(
                s, reason, checkpoint_id, is_savepoint=is_savepoint
            )
        if failure is not None:
            self._fail_job(failure)

    def _count_in(
        self,
        s: Session,
        aborted: Sequence[pending.AbortedCheckpoint],
        reason: CheckpointFailureReason,
    ) -> TolerableFailuresExceeded | None:
        failure = None
        for a in aborted:
            failure = (
                self.failure_manager.record_failure(
                    s, reason, a.checkpoint_id, is_savepoint=a.checkpoint_type.is_savepoint
                )
                or failure
            )
        return failure

    def _after_abort(
        self,
        aborted: Sequence[pending.AbortedCheckpoint],
        failure: TolerableFailuresExceeded | None,
        *,
        dispose: bool = True,
    ) -> None:
        if dispose:
            self._dispose([a.storage_location for a in aborted])
        for a in aborted:
            log.warning("job %s: checkpoint %d aborted", self.job_id, a.checkpoint_id)
        if failure is not None:
            self._fail_job(failure)

    def _fail_job(self, failure: TolerableFailuresExceeded) -> None:
        self.job_failure = failure
        with self.metastore.transaction() as s:
            s.execute(
                update(Job).where(Job.job_id == self.job_id).values(failure_cause=str(failure))
            )
        log.error("%s", failure)
        if self.on_job_failure is not None:
            self.on_job_failure(failure)

    def _dispose(self, locations: Sequence[str]) -> None:
        for url in locations:
            try:
                self.storage.location_for(url).dispose_on_failure()
            except Exception:
                log.exception("job %s: could not delete %s", self.job_id, url)


def config_of(job: Job) -> CheckpointConfig:
    return CheckpointConfig(
        interval=timedelta(milliseconds=job.interval_ms) if job.interval_ms is not None else None,
        timeout=timedelta(milliseconds=job.timeout_ms),
        min_pause=timedelta(milliseconds=job.min_pause_ms),
        max_concurrent=job.max_concurrent,
        tolerable_failures=job.tolerable_failures,
        retained=job.retained,
        retention=RetentionPolicy(job.retention),
        prefer_checkpoint_for_recovery=job.prefer_checkpoint_for_recovery,
    )
