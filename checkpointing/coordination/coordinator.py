"""The checkpoint coordinator (Flink's ``CheckpointCoordinator``), over the SQL metastore.

One coordinator is *active* per job at a time (the process that runs the job: the Airflow
operator, or ``ckpt run``'s driver). Other processes — Spark executors acking, a CLI asking for a
savepoint — create a ``CheckpointCoordinator`` for the same job to use its ack/decline/request
methods; the metastore keeps them all consistent. Ordering rules follow Flink (see
``docs/architecture.md``).

This class holds the job-facing half — registration, lifecycle (activate, join, status, stop,
failover, shutdown), the periodic scheduler and loop, trigger, requests — and is composed of its
collaborators, each the owner of one concern:

* trigger (here): eager pre-checks (``request_queue.precheck``) → task plan → id → storage
  location → pre-checks again and insert the PENDING row in one transaction that locks the job;
* acks, declines, expiry, completion, notification retries: ``completion``, a
  :class:`~checkpointing.coordination.completion.CompletionHandler`; this class implements the
  :class:`~checkpointing.coordination.gateway.CheckpointCoordinatorGateway` by delegating to it;
* deleting files: ``cleaner``, a :class:`~checkpointing.coordination.cleaner.CheckpointsCleaner`;
* failures and failing the job: ``failure_manager``, a
  :class:`~checkpointing.coordination.failure.CheckpointFailureManager`;
* fencing: ``fencing``, a :class:`~checkpointing.coordination.fencing.CoordinatorFencing`;
* the queue and who may queue: :mod:`checkpointing.coordination.request_queue`; the periodic
  loop: :mod:`checkpointing.coordination.coordinator_loop`.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from checkpointing.clock import Clock, SystemClock
from checkpointing.config import CheckpointConfig
from checkpointing.coordination import pending, request_queue, store
from checkpointing.coordination.cleaner import CheckpointsCleaner
from checkpointing.coordination.completion import CompletionHandler
from checkpointing.coordination.coordinator_loop import CheckpointCoordinatorDeActivator
from checkpointing.coordination.failure import (
    CheckpointException,
    CheckpointFailureManager,
    CheckpointFailureReason,
    CoordinatorSuperseded,
    TolerableFailuresExceeded,
)
from checkpointing.coordination.fencing import CoordinatorFencing
from checkpointing.coordination.gateway import AckOutcome
from checkpointing.coordination.notifications import CompletionListener
from checkpointing.coordination.pending import AckResult, PendingCheckpoint, TaskAck, TaskSpec
from checkpointing.coordination.scheduler import PeriodicScheduler
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.ids import validate_id
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import CheckpointStorage, StorageLocation
from checkpointing.status import (
    CheckpointProperties,
    CheckpointType,
    JobStatus,
    RequestStatus,
    StatusWriter,
)

log = logging.getLogger(__name__)

PlanProvider = Callable[[], Sequence[TaskSpec] | None]
#: at most this much of a shutdown's cause is kept on the job row
CAUSE_CHARS = 1000


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
        writer: StatusWriter = StatusWriter.RUN,
        watcher: str | None = None,
    ) -> None:
        """``writer``: who this coordinator's job status changes are recorded as written by (the
        job's own run, or a failed try's failover); ``watcher``: a failed try acting under its
        detached driver's coordinator id, fenced once another try re-attached to the driver."""
        self.job_id = job_id = validate_id(job_id, "job id")
        self.metastore = metastore
        self.clock = clock = clock or SystemClock()
        self.coordinator_id = coordinator_id or f"coord-{uuid.uuid4().hex[:12]}"
        config, storage_url = self._register(config, storage)
        self.config = config
        # none given: the one the job's row names, only inside the configured storage roots
        self.storage = storage = storage or CheckpointStorage.from_job_row(job_id, storage_url)
        self.fencing = CoordinatorFencing(job_id, self.coordinator_id, watcher)
        self.status_by = writer.of(self.coordinator_id)
        self.failure_manager = CheckpointFailureManager(
            job_id, config.tolerable_failures, metastore, on_job_failure
        )
        self.cleaner = CheckpointsCleaner(job_id, metastore, storage)
        self.completion = CompletionHandler(
            job_id,
            metastore,
            storage,
            config,
            coordinator_id=self.coordinator_id,
            clock=clock,
            fencing=self.fencing,
            failure_manager=self.failure_manager,
            cleaner=self.cleaner,
            completion_listeners=completion_listeners,
            on_completed=self._on_completed,
        )
        #: set when a stop-with-savepoint completed: the job should now end
        self.stop_savepoint: CompletedCheckpoint | None = None
        self.plan_provider = plan_provider
        interval = config.periodic_interval
        self.scheduler = (
            PeriodicScheduler(interval, config.min_pause, scheduler_rng) if interval else None
        )
        self._lock = threading.RLock()
        self._shutdown = False
        self._background: CheckpointCoordinatorDeActivator | None = None

    # ================================================================ registration

    def _register(
        self, config: CheckpointConfig | None, storage: CheckpointStorage | None
    ) -> tuple[CheckpointConfig, str]:
        with self.metastore.transaction() as s:
            url = storage.base_url if storage else None
            return jobs.register_job(s, self.job_id, config, url, self.clock.now())

    # ================================================================ lifecycle

    def activate(self, *, unless_superseded: bool = False) -> list[int]:
        """Become the job's coordinator. Pending checkpoints of a previous coordinator (whose
        process died) are aborted as coordinator failover, which does not count as a failure.
        ``unless_superseded``: a process the job row may already name a successor of (a try's
        driver whose task named its coordinator id,
        :func:`~checkpointing.coordination.attempt.name_successor`) is refused with
        ``CoordinatorSuperseded`` instead, in the same transaction."""
        now = self.clock.now()
        with self.metastore.transaction() as s:
            refusal = self.fencing.superseded(s) if unless_superseded else None
            if refusal is not None:
                raise refusal
            jobs.update_job(s, self.job_id, coordinator_id=self.coordinator_id)
            aborted = pending.abort(
                s,
                self.job_id,
                CheckpointFailureReason.CHECKPOINT_COORDINATOR_FAILOVER,
                "the previous coordinator is gone",
                now,
                not_by=self.coordinator_id,
            )
        self.fencing.active = True
        self.cleaner.dispose(aborted=aborted)
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
            job = self.fencing.lock_job(s)
            successor = self.fencing.successor(job)
            named = job is not None and job.coordinator_id is not None
        if successor is not None:
            raise CoordinatorSuperseded(self.coordinator_id, self.job_id, successor)
        if not named:
            self.activate()
        self.fencing.active = True

    def job_status_changed(self, status: JobStatus) -> bool:
        """Flink's ``CheckpointCoordinatorDeActivator``: RUNNING starts periodic checkpointing,
        anything else stops it. False (nothing recorded) when another coordinator leads."""
        with self.metastore.transaction() as s:
            fenced = self.fencing.fenced(s, f"job status {status.value}")
            if not fenced:
                jobs.update_job(
                    s,
                    self.job_id,
                    status=status,
                    status_by=self.status_by,
                    updated_at=self.clock.now(),
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
            if not self.fencing.active:
                self.activate()
            with self.metastore.transaction() as s:
                superseded = self.fencing.superseded(s)
                if superseded is None:
                    jobs.update_job(s, self.job_id, periodic_scheduling=True)
            if superseded is not None:
                raise superseded
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
                if self.fencing.fenced(s, "stopping the scheduler"):
                    return
                jobs.update_job(s, self.job_id, periodic_scheduling=False)
                aborted = pending.abort(
                    s,
                    self.job_id,
                    CheckpointFailureReason.CHECKPOINT_COORDINATOR_SUSPEND,
                    "Checkpoint Coordinator is suspending.",
                    now,
                )
                request_queue.drop_queued(
                    s, self.job_id, "checkpoint coordinator is suspending", now
                )
                self.failure_manager.reset(s)
        self.cleaner.dispose(aborted=aborted)

    def failover(self, message: str = "job failover") -> list[int]:
        """A task attempt failed: abort pending checkpoints (not counted as failures) so the next
        attempt need not wait for them to expire. Nothing when another coordinator leads."""
        with self.metastore.transaction() as s:
            if self.fencing.fenced(s, "failover"):
                return []
            aborted = pending.abort(
                s, self.job_id, CheckpointFailureReason.JOB_FAILOVER, message, self.clock.now()
            )
        self.cleaner.dispose(aborted=aborted)
        return [a.checkpoint_id for a in aborted]

    def shutdown(self, job_status: JobStatus, *, cause: str | None = None) -> list[int]:
        """The job ended: stop, abort what is pending, apply the retention policy to completed
        checkpoints (and the shared files only they used). Returns the ids of discarded
        checkpoints. A coordinator that another one superseded only stops itself: the job, its
        checkpoints and files are its successor's. ``cause``: the job row's failure cause."""
        self.stop_background()
        now = self.clock.now()
        with self._lock:
            self._shutdown = True
            if self.scheduler is not None:
                self.scheduler.stop()
            with self.metastore.transaction() as s:
                if self.fencing.fenced(s, f"shutdown ({job_status.value})"):
                    return []
                aborted = pending.abort(
                    s,
                    self.job_id,
                    CheckpointFailureReason.JOB_TERMINATED,
                    f"job {job_status.value.lower()}",
                    now,
                )
                request_queue.drop_queued(s, self.job_id, f"job {job_status.value.lower()}", now)
                disposals = store.shutdown(s, self.job_id, job_status, now)
                jobs.update_job(
                    s,
                    self.job_id,
                    status=job_status,
                    status_by=self.status_by,
                    periodic_scheduling=False,
                    updated_at=now,
                    **({"failure_cause": cause[:CAUSE_CHARS]} if cause else {}),
                )
        self.cleaner.dispose(disposals, aborted)
        return [d.checkpoint_id for d in disposals]

    @property
    def is_shutdown(self) -> bool:
        return self._shutdown

    # ================================================================ the gateway, delegated

    def receive_acknowledge(self, checkpoint_id: int, acks: Sequence[TaskAck]) -> AckOutcome:
        """Record a batch of task acks (:meth:`CompletionHandler.receive_acknowledge`)."""
        return self.completion.receive_acknowledge(checkpoint_id, acks)

    def acknowledge_task(self, checkpoint_id: int, ack: TaskAck) -> AckResult:
        return self.completion.acknowledge_task(checkpoint_id, ack)

    def receive_decline(
        self,
        checkpoint_id: int,
        attempt_id: str,
        reason: CheckpointFailureReason | str = CheckpointFailureReason.CHECKPOINT_DECLINED,
        message: str | None = None,
    ) -> bool:
        """A task declines a checkpoint (:meth:`CompletionHandler.receive_decline`)."""
        return self.completion.receive_decline(checkpoint_id, attempt_id, reason, message)

    def expire_overdue(self) -> list[int]:
        return self.completion.expire_overdue()

    def complete_checkpoint(self, checkpoint_id: int) -> CompletedCheckpoint | None:
        return self.completion.complete_checkpoint(checkpoint_id)

    def complete_fully_acknowledged(self) -> list[int]:
        return self.completion.complete_fully_acknowledged()

    def notify_pending_completions(self) -> list[int]:
        return self.completion.notify_pending_completions()

    @property
    def job_failure(self) -> TolerableFailuresExceeded | None:
        """Set once this process saw failures exceed ``tolerable_failures``."""
        return self.failure_manager.job_failure

    def _on_completed(self, completed: CompletedCheckpoint) -> None:
        """After each completion by this process: a stop-with-savepoint ends the job; the
        coordinator triggers queued requests (Flink's ``triggerQueuedRequests``)."""
        if completed.checkpoint_type is CheckpointType.SAVEPOINT_THEN_STOP:
            self.stop_savepoint = completed
        if self.fencing.active:
            self.process_requests()

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
        """Run :meth:`run_once` every ``poll`` in a daemon thread (until :meth:`shutdown`)."""
        if self._background is not None and self._background.alive:
            return
        self._background = CheckpointCoordinatorDeActivator(self, poll)
        self._background.start()

    def stop_background(self) -> None:
        if self._background is not None:
            self._background.stop()
        self._background = None

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
            # fence first: the pre-check may queue a request
            refusal = self.fencing.superseded(s) or self._precheck(s, props, periodic, request_id)
        if refusal is not None:
            raise refusal

        plan = tuple(tasks) if tasks is not None else self._plan()
        with self.metastore.transaction() as s:
            checkpoint_id = jobs.next_checkpoint_id(s, self.job_id)
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
                # locks the job row: serialise triggers, and with a takeover
                refusal = self.fencing.superseded(s) or self._precheck(
                    s, props, periodic, request_id
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
                    request_queue.finish(
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
            self.failure_manager.count_failure(
                CheckpointFailureReason.TRIGGER_CHECKPOINT_FAILURE,
                None,
                is_savepoint=props.checkpoint_type.is_savepoint,
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

    def _precheck_local(self, periodic: bool) -> None:
        if self._shutdown:
            raise CheckpointException(CheckpointFailureReason.COORDINATOR_SHUTDOWN)
        if periodic and (self.scheduler is None or not self.scheduler.running):
            raise CheckpointException(CheckpointFailureReason.PERIODIC_SCHEDULER_SHUTDOWN)

    def _precheck(
        self, s: Session, props: CheckpointProperties, periodic: bool, request_id: int | None
    ) -> CheckpointException | None:
        return request_queue.precheck(
            s,
            self.job_id,
            props,
            periodic=periodic,
            request_id=request_id,
            max_concurrent=self.config.max_concurrent,
            min_pause=self.config.min_pause,
            now=self.clock.now(),
            requested_by=self.coordinator_id,
            scheduler=self.scheduler if periodic else None,
        )

    def _plan(self) -> tuple[TaskSpec, ...]:
        plan = self.plan_provider() if self.plan_provider else None
        if not plan:
            raise CheckpointException(
                CheckpointFailureReason.NOT_ALL_REQUIRED_TASKS_RUNNING,
                "no running execution attempt to checkpoint",
            )
        return tuple(plan)

    # ================================================================ requests

    def request(
        self,
        checkpoint_type: CheckpointType = CheckpointType.SAVEPOINT,
        *,
        requested_by: str,
        forced: bool = False,
        target: str | None = None,
    ) -> int:
        """Queue a request as the job's coordinator, whatever the job's status (the rule is
        :func:`request_queue.queue_request`'s); another process asking a running job for a
        savepoint uses :func:`savepoints.request_savepoint`."""
        if target:
            self.storage.check_target(target)
        with self.metastore.transaction() as s:
            request_id = request_queue.queue_request(
                s,
                self.job_id,
                checkpoint_type,
                requested_by=requested_by,
                now=self.clock.now(),
                forced=forced,
                target=target,
                from_outside=False,
            )
        if self._background is not None:
            self._background.wake()
        return request_id

    def process_requests(self) -> list[PendingCheckpoint]:
        """Trigger queued requests in priority order while the limits allow
        (:func:`request_queue.trigger_queued`). A coordinator that another one leads leaves
        them queued for it."""
        if self._shutdown:
            return []
        return request_queue.trigger_queued(
            self.metastore, self.job_id, self.fencing, self.clock, self.trigger_checkpoint
        )
