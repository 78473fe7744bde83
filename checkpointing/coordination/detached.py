"""Coordinating an attempt whose driver runs detached, one pass at a time, from any process.

:func:`~checkpointing.coordination.attempt.coordinate_attempt` is the coordinator of an attempt
whose driver is the caller's child, for as long as the caller waits. A detached driver outlives
whoever submitted it, so its coordinator must be resumable: :class:`DetachedAttempt` keeps no
state that the metastore does not (the attempt id is the coordinator id, the job row holds the
configuration, status, heartbeat and the driver's identity), so a process that dies between two
passes (Airflow's triggerer, restarted) is replaced by a new one that carries on with the next
pass. It *joins* the coordination rather than activating, so a stale instance never takes the job
back from a newer attempt: superseded, it reports so and does nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta

from checkpointing.clock import Clock, SystemClock
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.coordinator_loop import CheckpointCoordinatorDeActivator
from checkpointing.coordination.drivers import (
    AttemptVerdict,
    Outcome,
    judge,
    process_alive,
    read_state,
)
from checkpointing.coordination.failure import CoordinatorSuperseded
from checkpointing.coordination.heartbeat import HEARTBEAT_TIMEOUT
from checkpointing.coordination.pending import TaskSpec
from checkpointing.coordination.stats_tracker import CheckpointStatsTracker
from checkpointing.errors import UnknownJobError
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import JobStatus

log = logging.getLogger(__name__)


class DetachedAttempt:
    """The coordinator of ``attempt`` of ``job_id`` while its detached driver runs.

    Each :meth:`poll` first judges the attempt from the job row
    (:func:`~checkpointing.coordination.drivers.judge`); while it runs, it then makes one pass of
    the coordinator loop following the job status (periodic triggers while RUNNING, expiry,
    orphaned completions, queued requests, notification retries) and polls the stats tracker.
    A driver found lost has its pending checkpoints aborted as job failover, as
    ``coordinate_attempt`` does when spark-submit fails.

    :param tasks: the attempt's subtasks, which a new checkpoint waits for.
    :param heartbeat_timeout: a driver silent this long (or never heard from this long after its
        submission) is lost.
    :param watcher: the attempt coordinating: ``attempt`` itself, or a retry that re-attached to
        its driver (:func:`~checkpointing.coordination.drivers.reattach`); superseded once the
        job row names another watcher.
    :param coordinates: False when the driver is its own coordinator (a script's
        ``checkpointed``, whose steps are its checkpoints): each pass then only judges the
        attempt and polls the stats tracker. No checkpoint is triggered, no request taken, and
        a lost driver's pending step is not aborted: the retry's driver salvages what its
        tasks acknowledged.
    """

    def __init__(
        self,
        job_id: str,
        metastore: Metastore,
        storage: CheckpointStorage | None,
        *,
        attempt: str,
        tasks: Sequence[TaskSpec],
        poll: timedelta | float,
        heartbeat_timeout: timedelta = HEARTBEAT_TIMEOUT,
        stats_tracker: CheckpointStatsTracker | None = None,
        clock: Clock | None = None,
        watcher: str | None = None,
        coordinates: bool = True,
    ) -> None:
        self.job_id = job_id
        self.metastore = metastore
        self.storage = storage
        self.attempt = attempt
        self.tasks = list(tasks)
        self.poll_interval = poll
        self.heartbeat_timeout = heartbeat_timeout
        self.stats_tracker = stats_tracker
        self.clock = clock or SystemClock()
        self.watcher = watcher or attempt
        self.coordinates = coordinates
        self._watching = False
        self.coordinator: CheckpointCoordinator | None = None
        self._loop: CheckpointCoordinatorDeActivator | None = None

    def _running_tasks(self) -> list[TaskSpec] | None:
        running = jobs.job_status(self.metastore, self.job_id) is JobStatus.RUNNING
        return self.tasks if running else None

    def _join(self) -> CheckpointCoordinator:
        """The coordinator under the attempt's id, with the job's registered configuration (no
        write to the job row before the fencing check); raises ``CoordinatorSuperseded``."""
        coordinator = CheckpointCoordinator(
            self.job_id,
            self.metastore,
            self.storage,
            None,
            coordinator_id=self.attempt,
            clock=self.clock,
            plan_provider=self._running_tasks,
            # fenced in each transaction once another try re-attached to the driver, not only
            # by the watcher check before each pass
            watcher=self.watcher,
        )
        coordinator.join()
        self._loop = CheckpointCoordinatorDeActivator(
            coordinator, self.poll_interval, follow_job_status=True
        )
        if self.stats_tracker is not None:
            self._watch(self.stats_tracker.start)
        self.coordinator = coordinator
        log.info("job %s: coordinating attempt %s (detached driver)", self.job_id, self.attempt)
        return coordinator

    def poll(self) -> AttemptVerdict | None:
        """One pass; the attempt's verdict once it ended, else None."""
        try:
            if not self.coordinates:
                self._start_watching()  # before the verdict: a short script's steps count too
            verdict = self._judge()
            if verdict is None and self.coordinates:
                if self.coordinator is None:
                    self._join()
                assert self._loop is not None
                self._loop.run_pass()
                verdict = self._judge()  # the pass may have taken a while
        except CoordinatorSuperseded as exc:
            verdict = AttemptVerdict(Outcome.SUPERSEDED, self.attempt, str(exc))
        except UnknownJobError as exc:
            verdict = AttemptVerdict(Outcome.ERROR, self.attempt, str(exc))
        if self.stats_tracker is not None and (self.coordinator is not None or self._watching):
            self._watch(self.stats_tracker.poll)
        if self.coordinates and verdict is not None and verdict.outcome is Outcome.DRIVER_LOST:
            self._failover(verdict.message)
        return verdict

    def _start_watching(self) -> None:
        """A driver coordinating itself: the stats tracker starts on the first pass, from the
        attempt's first checkpoint when it watches its own driver (the driver may have completed
        steps before this pass), else (a retry re-attached: its predecessor reported those)
        from now."""
        if not self._watching and self.stats_tracker is not None:
            own = self.watcher == self.attempt
            tracker = self.stats_tracker
            self._watch(tracker.start_at_attempt if own else tracker.start)
        self._watching = True

    def _judge(self) -> AttemptVerdict | None:
        state = read_state(self.metastore, self.job_id)
        alive = process_alive(state.driver)  # before re-reading: a driver that ended wrote first
        if alive is False:
            state = read_state(self.metastore, self.job_id)
        return judge(
            state,
            self.attempt,
            self.clock.now(),
            alive=alive,
            heartbeat_timeout=self.heartbeat_timeout,
            watcher=self.watcher,
        )

    def _failover(self, reason: str) -> None:
        """The driver is gone: abort its pending checkpoints (job failover, not counted; fenced:
        nothing when another attempt leads), so the retry need not wait for them to expire."""
        try:
            coordinator = self.coordinator or self._join()
            coordinator.failover(f"attempt {self.attempt}: {reason}")
        except CoordinatorSuperseded:
            pass
        except Exception:  # the verdict stands; the retry's activation aborts them anyway
            log.exception("job %s: failover of attempt %s failed", self.job_id, self.attempt)

    def _watch(self, step: Callable[[], object]) -> None:
        try:
            step()
        except Exception:  # watching never decides the attempt's outcome
            log.exception("job %s: checkpoint stats tracker failed", self.job_id)
