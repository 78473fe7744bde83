"""The coordinator loop and Flink's ``CheckpointCoordinatorDeActivator``, in one class.

A coordinator does its periodic work (expiry, orphaned completions, queued requests, notification
retries, the periodic trigger) in
:meth:`~checkpointing.coordination.coordinator.CheckpointCoordinator.run_once`; this thread calls it
every ``poll``. Following the job status, it is also the de-activator: periodic checkpointing starts
when the job reports RUNNING and stops when it no longer does
(the Airflow operator's case, where the Spark application reports its status in the metastore).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

from checkpointing.coordination.failure import CoordinatorSuperseded
from checkpointing.metastore import jobs
from checkpointing.status import JobStatus

log = logging.getLogger(__name__)


class Coordinator(Protocol):
    """What the loop needs of a ``CheckpointCoordinator`` (no import of it: no cycle)."""

    job_id: str
    metastore: Any
    scheduler: Any

    def run_once(self) -> Any: ...
    def start_scheduler(self) -> Any: ...
    def stop_scheduler(self) -> None: ...


class CheckpointCoordinatorDeActivator:
    """A daemon thread running the coordinator's passes.

    :param follow_job_status: read the job's status each pass and start/stop periodic
        checkpointing on RUNNING/not RUNNING, passing only while RUNNING; the first pass comes
        after one ``poll``. Without it every pass runs at once and ``wake`` shortens the wait.
    :param after_pass: called after every pass, whatever the job's status (the attempt's
        :class:`~checkpointing.coordination.stats_tracker.CheckpointStatsTracker` polls there);
        an exception out of it is logged and the loop goes on.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        poll: timedelta | float,
        *,
        follow_job_status: bool = False,
        name: str | None = None,
        after_pass: Callable[[], object] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.after_pass = after_pass
        self.poll = poll.total_seconds() if isinstance(poll, timedelta) else float(poll)
        self.follow_job_status = follow_job_status
        self._stop = threading.Event()
        self._wakeup = threading.Event()
        self._scheduling = False
        self._thread = threading.Thread(
            target=self._loop, name=name or f"ckpt-coordinator-{coordinator.job_id}", daemon=True
        )

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Run the next pass now (a request was queued)."""
        self._wakeup.set()

    def stop(self, timeout: float = 30) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def _wait(self) -> None:
        self._wakeup.wait(self.poll)
        self._wakeup.clear()

    def _loop(self) -> None:
        if self.follow_job_status:
            self._wait()
        while not self._stop.is_set():
            try:
                self.run_pass()
            except CoordinatorSuperseded as exc:  # a newer try coordinates: nothing left to do
                log.warning("job %s: %s; coordinator loop stopped", self.coordinator.job_id, exc)
                return
            except Exception:  # a dying loop would silently stop checkpointing
                log.exception("job %s: coordinator pass failed", self.coordinator.job_id)
            if self.after_pass is not None:
                try:
                    self.after_pass()
                except Exception:  # watching the job never stops coordinating it
                    log.exception("job %s: after-pass hook failed", self.coordinator.job_id)
            self._wait()

    def run_pass(self) -> None:
        """One pass; following the job status, start or stop periodic checkpointing first."""
        if not self.follow_job_status:
            self.coordinator.run_once()
            return
        coordinator = self.coordinator
        status = jobs.job_status(coordinator.metastore, coordinator.job_id)
        running = status is JobStatus.RUNNING
        if coordinator.scheduler is not None and running and not self._scheduling:
            coordinator.start_scheduler()
            self._scheduling = True
        elif self._scheduling and not running:
            coordinator.stop_scheduler()
            self._scheduling = False
        if running:
            coordinator.run_once()
